"""`python -m extproc ...`: the same commands as `adapterctl` (see extproc/cli.py)."""

import sys

from extproc.cli import main

sys.exit(main())
