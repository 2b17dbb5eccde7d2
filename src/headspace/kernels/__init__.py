"""The speed machinery beside the maths of :mod:`headspace.functional`.

* :mod:`.cpu`: what this CPU's kernels can do (asked of torch and of the kernels), the fallbacks and
  ``HEADSPACE_FORCE_FALLBACK`` / :func:`.cpu.force_fallback` to force them;
* :mod:`.blocked`: the blocked CPU kernel (and its backward) behind the explicit backend;
* :mod:`.workspace`: scratch memory reused across calls and recycled attention patterns;
* :mod:`.int8`, :mod:`.bf16` (on :mod:`.carrier`): the reduced-precision products;
* :mod:`.prepack`: weights packed for MKL's GEMM;
* :mod:`.q8_0` (+ ``q8_0.cpp``): products from a matrix's exact Q8_0 blocks (the decoding step's
  unembedding);
* :mod:`.native` (+ ``decode_rows.cpp``, ``q8_0.cpp``): the native library: the decoding step, and
  ``q8_0_mm``.
"""
