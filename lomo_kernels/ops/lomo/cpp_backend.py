"""C++ CPU and CUDA C++ kernels of the LOMO update ops: torch extensions built on first use.

Same arguments (the ops' specs, `lomo_kernels.ops.lomo`) and semantics as
`lomo_kernels.ops.lomo.reference`: each function is the extension's binding of that name
(csrc/lomo_cpu.cpp, csrc/lomo_cuda_binding.cpp), on the tensors' device. Nothing is built at
import time; a failed build is recorded (see `unavailable_reason`) and never raises from
`is_available`, so the dispatcher can warn once and fall back. ``LOMO_KERNELS_PREBUILT=1``
imports the extensions `setup.py` built ahead of time instead (`extension.py`).
"""

from __future__ import annotations

from ...kernels.cpp.extension import ExtensionLoader

_loader = ExtensionLoader("C++ backend", cpu="lomo_kernels_cpu", cuda="lomo_kernels_cuda")
is_available = _loader.is_available
unavailable_reason = _loader.unavailable_reason

# One fused LOMO step on one contiguous parameter, in place. Stochastic rounding applies to
# bf16 and fp16 parameters; the binding finishes its key from `seed` and the value of
# `seed_step`.
lomo_update_ = _loader.function("lomo_update_")
# sumsq += sum((fp32(grad) * inv_scale) ** 2); found_inf = 1 on inf/nan (in place).
grad_sumsq_ = _loader.function("grad_sumsq_")
# buffer = round(buffer + grad) (first: round(grad)), the stored values' scaled sum of squares
# and inf/nan flag (in place).
grad_accumulate_ = _loader.function("grad_accumulate_")
# The 8-bit blockwise buffer (core/int8_blocks.py), each at flat `offset` of its parameter:
# codes, scales = the buffer of (codes * scales + grad) (first: of grad), the stored values'
# scaled sum of squares and inf/nan flag (in place).
grad_accumulate_int8_ = _loader.function("grad_accumulate_int8_")
# One fused LOMO step whose gradient is codes * scales (in place).
lomo_update_int8_ = _loader.function("lomo_update_int8_")
# out = codes * scales in out's dtype (in place).
int8_dequantize_ = _loader.function("int8_dequantize_")
