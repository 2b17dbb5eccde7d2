"""Pictures of heads: :mod:`headspace.viz.explorer` writes the offline HTML explorer.

Submodules are imported on demand, so ``import headspace.viz`` pulls in nothing heavy.
"""

from __future__ import annotations
