"""What every part of headspace uses, and nothing of it uses anything else of headspace.

The map:

* :mod:`~headspace.core.checks`: argument checks whose errors name what was expected and what came;
* :mod:`~headspace.core.errors`: the one-line error messages the command prints;
* :mod:`~headspace.core.fileio`: sealed, atomically written JSON and safetensors files, read as untrusted;
* :mod:`~headspace.core.progress`: progress bars (rate and ETA; plain lines when not a terminal);
* :mod:`~headspace.core.process_group`: torch.distributed helpers;
* :mod:`~headspace.core.threads`: the command line's threads and OpenMP wait policy, from the machine's load;
* :mod:`~headspace.core.html`, :mod:`~headspace.core.defaults`: escaped HTML pieces, the default prompt.

Old paths (``headspace.checks``, ``headspace.fileio``, ...) keep working.
"""
