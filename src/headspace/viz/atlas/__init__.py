"""The head atlas page: one offline HTML file of every head's statistics over a corpus (:mod:`.page`)."""

from .page import RELATION_THRESHOLDS, atlas_page_data, relations, render_atlas_page, write_atlas_page

__all__ = ["RELATION_THRESHOLDS", "atlas_page_data", "relations", "render_atlas_page", "write_atlas_page"]
