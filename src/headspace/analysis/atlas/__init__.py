"""The head atlas: every head's statistics over a whole corpus, streamed, resumable, sharded over ranks.

* :mod:`.run`: :func:`atlas` and its result :class:`Atlas`: the run in phases, shards sealed and merged.
* :mod:`.corpus`: a corpus read from untrusted files, tokenised and cut into windows.
* :mod:`.state`: the running sums, counts and top-k candidates, merged exactly in any order.
* :mod:`.measure`: one batch's statistics from one forward pass, block by block.
* :mod:`.ablation`: the corpus loss with each head mean-ablated, a layer's heads at once.
* :mod:`.guard`: the weights fingerprint, one run per folder, and the checks of a shard read back.

``headspace.analysis.atlas`` was the module :mod:`.run` before it became this package: it re-exports that
module's public names (``headspace.analysis.atlas_state`` and the other old paths are the modules here).
"""

from .run import CHECK_TOP_K, CONTEXT, Atlas, atlas

__all__ = ["CHECK_TOP_K", "CONTEXT", "Atlas", "atlas"]
