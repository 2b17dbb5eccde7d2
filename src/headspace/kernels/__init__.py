"""The speed machinery beside the maths of :mod:`headspace.functional`.

* :mod:`.blocked`: the blocked CPU kernel (and its backward) behind the explicit backend;
* :mod:`.workspace`: scratch memory reused across calls and recycled attention patterns.
"""
