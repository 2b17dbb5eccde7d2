"""The small pieces attention layers are built from, below the layer itself.

The map:

* :mod:`~headspace.nn.masks`: boolean and additive masks, True = may attend (:class:`CanonicalMask`);
* :mod:`~headspace.nn.positions`: rotary positions (:class:`Rotary`, its tables, and the one rotation
  :func:`~headspace.nn.positions.rotate_fused` every path uses);
* :mod:`~headspace.nn.norms`: :class:`RMSNorm`, the one :func:`~headspace.nn.norms.rms_norm` and its one
  statistic :func:`~headspace.nn.norms.rms_inverse` (which every analysis freezing an RMS norm calls);
* :mod:`~headspace.nn.rotate_inplace`: the same rotation written over q and k where nothing else reads them;
* :mod:`~headspace.nn.softcap`: ``cap * tanh(x / cap)``, in place by blocks of rows where no graph needs it;
* :mod:`~headspace.nn.hooks`: named hook points (:class:`HookPoint`);
* :mod:`~headspace.nn.inputs`: checks of what a model is given (token ids, positions, prompt masks);
* :mod:`~headspace.nn.kv_cache`: :class:`KVCache`, each layer's keys and values of the positions decoded
  so far (``headspace.decode.kv_cache`` is this module).

Old paths (``headspace.masks``, ``headspace.positions``, ...) keep working.
"""
