"""``python -m kvplugin``: the ``kvplugin`` command."""

import sys

from kvplugin.cli import main

if __name__ == "__main__":
    sys.exit(main())
