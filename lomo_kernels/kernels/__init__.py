"""Compiled device code and what builds, loads and launches it; no op logic.

    triton/*_kernels.py     the @triton.jit device code of each op family, and the shared
                            rounding and gradient-preparation functions (rounding_kernels.py)
    triton/runtime.py       availability, interpreter mode, launch on the tensor's device, the
                            one launcher and the argument builders every Triton backend shares
    cpp/extension.py        building and loading the C++ / CUDA extensions (sources: csrc/)

Each op family's backend modules (`lomo_kernels/ops/<family>/triton_backend.py`,
`cpp_backend.py`, `blocked_backend.py`) sit beside its reference in `lomo_kernels.ops`.
"""
