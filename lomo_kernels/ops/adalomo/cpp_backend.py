"""C++ (CPU) and CUDA backend of the AdaLomo passes: torch extensions built on first use.

Same arguments (the ops' specs, `lomo_kernels.ops.adalomo`) and semantics as
`lomo_kernels.ops.adalomo.reference`: each function is the extension's binding of that name
on the tensors' device, one kernel launch (CUDA) or one parallel loop (CPU). Nothing is
built at import time; a failed build is recorded and reported by `unavailable_reason`, never
raised, so the dispatcher can warn once and fall back. torch.utils.cpp_extension caches the
build (keyed by the sources), so later processes only load it.

CPU: `csrc/adalomo_cpu.cpp`. CUDA: `csrc/adalomo_cuda.cu` (kernels and `extern "C"`
launchers, buildable by nvcc alone) plus `csrc/adalomo_cuda_binding.cpp`, which needs a
CUDA build of torch.
"""

from __future__ import annotations

from ...kernels.cpp.extension import ExtensionLoader

_loader = ExtensionLoader(
    "AdaLomo C++ backend", cpu="lomo_kernels_adalomo_cpu", cuda="lomo_kernels_adalomo_cuda"
)
is_available = _loader.is_available
unavailable_reason = _loader.unavailable_reason

factored_stats_ = _loader.function("factored_stats_")  # pass A
factored_moments_ = _loader.function("factored_moments_")  # row/column moments, sum(R)
factored_norm_ = _loader.function("factored_norm_")  # pass B: sum of update^2
# The write-backs round to nearest even, or stochastically (bf16 and fp16 parameters) from
# `seed`, the value of `seed_step` and each element's flat index, as `fused_lomo_update_`.
factored_apply_ = _loader.function("factored_apply_")  # pass C: the write-back
vector_stats_ = _loader.function("vector_stats_")  # pass A1 of a 1-D tensor
vector_apply_ = _loader.function("vector_apply_")  # pass C1: write-back and moment
