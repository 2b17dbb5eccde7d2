"""The models around the attention layer: blocks, configurations, weight layouts, Encoder and Decoder.

The map:

* :mod:`~headspace.model.block`: :class:`TransformerBlock` (attention + MLP + residuals + norms);
* :mod:`~headspace.model.config`: :class:`ModelConfig`, every architecture's numbers in one place;
* :mod:`~headspace.model.models`: :class:`Encoder` (BERT family) and :class:`Decoder` (GPT, Llama);
* :mod:`~headspace.model.layouts`: converting weights to and from torch's and transformers' layouts;
* :mod:`~headspace.model.encdec`: :class:`EncoderDecoder` (T5, BART, Marian, Whisper: cross-attention);
* :mod:`~headspace.model.moe`: the mixture-of-experts MLP, its routings (``moe_routing``), the routed sum
  with tokens sorted by expert (``moe_kernels``) and its bfloat16 experts (``moe_precision``);
* ``gemma4_step`` / ``gemma3n_step``: Gemma 4's and 3n's one-token cached steps, the blocks' maths without
  module calls while no hook point has a function (the same bits as the module path);

Head-parallel layers over torch.distributed live in :mod:`headspace.distributed`
(``headspace.model.parallel`` is :mod:`headspace.distributed.head_parallel`).

Old paths (``headspace.block``, ``headspace.models``, ...) keep working.
"""
