"""The explorer: one offline HTML page showing what every head does and how W_Q, W_K, W_V, W_O produce it.

``headspace view "a sentence" -o page.html`` (see :mod:`.command`), or in Python::

    from headspace.viz.explorer import Explorer
    page = Explorer(headspace.load("minilm"), "The cat sat on the mat.")
    page.save("page.html")        # one self-contained file: no CDN, no request leaves the page
    page                          # in Jupyter: shown inline

The page's views: (1) heads (lines or heatmap of each token's attention), (2) the pipeline of one head
for one token (q, every k and v, scores, softmax, z, the heads' concatenation, W_O, the output),
(3) head x head subspace overlaps beside the random baseline, (4) each head's share of the output,
(5) with ``results=`` (or ``headspace view --result saved.json``), saved patching and attribution results
as layer x head (or layer x position) heatmaps (:mod:`.results`).
"""

from __future__ import annotations

from .data import (
    FORMAT,
    LayerCapture,
    build_page_data,
    capture_layers,
)
from .page import Explorer, render_page, serve_page, write_page
from .results import load_results, result_views

__all__ = [
    "FORMAT",
    "Explorer",
    "LayerCapture",
    "build_page_data",
    "capture_layers",
    "load_results",
    "render_page",
    "result_views",
    "serve_page",
    "write_page",
]
