"""Input validation for the fused ops: every problem is reported before anything is written."""

from __future__ import annotations

import math

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_pair(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param/grad must be dense, same device, same shape, supported dtypes, param contiguous."""
    if grad.is_sparse or grad.layout != torch.strided:
        raise TypeError(
            "lomo_kernels: sparse gradients are not supported (LOMO updates dense parameters "
            "in place); use nn.Embedding(sparse=False)"
        )
    if param.layout != torch.strided:
        raise TypeError("lomo_kernels: the parameter must be a dense (strided) tensor")
    for name, t in (("param", param), ("grad", grad)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"lomo_kernels: {name} dtype {t.dtype} is not supported; "
                "use float32, float16 or bfloat16"
            )
    if param.device != grad.device:
        raise ValueError(
            f"lomo_kernels: param is on {param.device} but its gradient is on {grad.device}"
        )
    if param.shape != grad.shape:
        # Same size is not enough: a (4, 6) gradient for a (6, 4) parameter would be applied
        # in memory order, to the wrong elements.
        raise ValueError(
            f"lomo_kernels: param has shape {tuple(param.shape)} but grad has shape "
            f"{tuple(grad.shape)}; pass the gradient of this very parameter"
        )
    if not param.is_contiguous():
        raise ValueError(
            "lomo_kernels: the parameter must be contiguous to be updated in place; "
            "make the module's weight contiguous (param.data = param.data.contiguous())"
        )


def check_scalar_tensor(
    name: str, t: torch.Tensor | None, device: torch.device, dtype: torch.dtype = torch.float32
) -> None:
    """Optional runtime scalars live in 1-element tensors (fp32 unless said otherwise) on the
    parameter's device."""
    if t is None:
        return
    # The common case in one test (a host-time path: an optimizer passes several per call).
    if type(t) is torch.Tensor and t.dtype is dtype and t.device == device and t.numel() == 1:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"lomo_kernels: {name} must be a torch.Tensor or None, got {type(t)}")
    if t.numel() != 1 or t.dtype != dtype:
        raise ValueError(
            f"lomo_kernels: {name} must be a 1-element {str(dtype).removeprefix('torch.')} "
            f"tensor, got shape {tuple(t.shape)} dtype {t.dtype}"
        )
    if t.device != device:
        raise ValueError(
            f"lomo_kernels: {name} is on {t.device} but the parameter is on {device}; "
            "keep optimizer scalars on the parameter's device (no host sync)"
        )


def check_finite(
    name: str, value: float, *, positive: bool = False, non_negative: bool = False
) -> None:
    """Python-float hyper-parameters: finite, and with the sign the math needs."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"lomo_kernels: {name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"lomo_kernels: {name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"lomo_kernels: {name} must be > 0, got {value}")
    if non_negative and value < 0:
        raise ValueError(f"lomo_kernels: {name} must be >= 0, got {value}")
