"""`python -m bench`: the studies, one line each, and how to run one."""

from . import STUDIES

width = max(map(len, STUDIES))
print("python -m bench.<study> [--help]; studies:")
for study, help_text in STUDIES.items():
    print(f"  {study:<{width}}  {help_text}")
print("also: python -m bench.gpu_check (make gpu-check), python -m bench.demo (make demo)")
