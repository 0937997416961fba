"""`python -m bench.gpu_check`: see bench/gpu_check/__init__.py."""

import sys

from bench.common.cli import main

sys.exit(main("bench.gpu_check"))
