"""Compiled kernels of the fused ops, one module per (backend, op family).

    cpp/lomo.py, cpp/adalomo.py          C++ CPU and CUDA C++ kernels (csrc/), JIT-built
    cpp/extension.py                     building and loading those extensions
    triton/lomo.py, triton/adalomo.py    Triton launchers (CUDA; CPU under TRITON_INTERPRET=1)
    triton/*_kernels.py                  the @triton.jit device code

Each backend module provides the functions of its family's reference
(`lomo_kernels.ops.lomo_reference`, `lomo_kernels.ops.adalomo_reference`) with the arguments
of the ops' specs (`lomo_kernels.core.spec`), called by keyword, and `is_available` /
`unavailable_reason`.
"""
