"""``python -m headspace``: the ``headspace`` command (with no command, a short tour of the bundled model)."""

from .cli import main

if __name__ == "__main__":
    main()
