"""The speed machinery beside the maths of :mod:`headspace.functional`.

* :mod:`.cpu`: what this CPU's kernels can do (asked of torch and of the kernels), the fallbacks and
  ``HEADSPACE_FORCE_FALLBACK`` / :func:`.cpu.force_fallback` to force them;
* :mod:`.blocked`: the blocked CPU kernel (and its backward) behind the explicit backend;
* :mod:`.workspace`: scratch memory reused across calls and recycled attention patterns;
* :mod:`.int8`, :mod:`.bf16` (on :mod:`.carrier`): the reduced-precision products;
* :mod:`.prepack`: weights packed for MKL's GEMM;
* :mod:`.native` (+ ``decode_rows.cpp``): the native decoding step.
"""
