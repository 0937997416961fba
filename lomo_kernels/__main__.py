"""`python -m lomo_kernels ...`: the command line (see lomo_kernels/tools/cli.py)."""

import sys

from .tools.cli import main

sys.exit(main())
