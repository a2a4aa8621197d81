"""``python -m transfer``: the daemon, exactly as the ``transferd`` command (flags, exit codes)."""

import sys

from .cli.transferd import main

if __name__ == "__main__":
    sys.exit(main())
