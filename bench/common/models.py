"""Random-weight models of a shape, for the benchmarks; the shapes themselves (presets and
Hugging Face configs) are the package's (lomo_kernels/tools/models.py), importable from here.
"""

from __future__ import annotations

from typing import Any

from lomo_kernels.tools.models import PRESETS, ModelShape, resolve_model

from .dtypes import DTYPES

__all__ = ["PRESETS", "ModelShape", "build_model", "resolve_model"]


def build_model(
    model: str | ModelShape,
    dtype: str | Any = "bf16",
    device: str = "cpu",
    *,
    seed: int | None = None,
    fused_head: bool = False,
    **settings: Any,
) -> Any:
    """A `transformers.LlamaForCausalLM` of `model`'s shape (a preset name, a config path or a
    ModelShape) with random weights, from `seed` where given, in training mode.

    Created directly in `dtype` (a name of `dtypes.DTYPES` or a torch dtype) on `device`: an
    fp32 model cast afterwards would leave its freed fp32 pages in the process's memory.
    `fused_head`: its loss made logits-free (`lomo_kernels.patch_causal_lm`). `settings`:
    further LlamaConfig fields.
    """
    import torch
    from transformers import LlamaForCausalLM

    torch_dtype = DTYPES.get(dtype, dtype)
    config = resolve_model(model).to_hf_config(**settings)
    if seed is not None:
        torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            net = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    assert all(p.dtype == torch_dtype for p in net.parameters())
    if fused_head:
        from lomo_kernels.integrations.causal_lm import patch_causal_lm

        patch_causal_lm(net)
    return net.train()
