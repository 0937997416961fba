"""The optimizers that `bench.train` and the demo compare, each as one training step.

Every name builds its optimizer on a model and returns a `Trainer` whose
`step(ids, labels)` runs the forward, the backward and the update, and returns the loss.
All of them clip by global norm when `clip_grad_norm` is given (the usual fine-tuning
set-up), each the way its optimizer does it:

  adamw            torch.optim.AdamW, `fused=True` where torch has the fused kernel for the
                   device (CUDA and, since torch 2.4, CPU), else `foreach=True`; the notes
                   say which; `clip_grad_norm_` (foreach) before `step()`
  adamw_master     AdamW on fp32 master copies of bf16/fp16 weights (mixed-precision
                   training as frameworks run it: the model computes in its dtype, the
                   optimizer steps the fp32 copies and writes them back rounded); on fp32
                   weights the same as adamw
  sgd              torch.optim.SGD, the same clipping
  lomo_optim       lomo_optim.Lomo (the lomo-optim package): `grad_norm` + `fused_backward`
  lomo             lomo_kernels.Lomo, exact clipping: a norm pass and an update pass
  lomo_single      lomo_kernels.Lomo(single_backward=True): one backward per step
  adalomo          lomo_kernels.AdaLomo, exact clipping (two backward passes)
  adalomo_single   lomo_kernels.AdaLomo(single_backward=True)
  lomo_accumulate  lomo with accumulation_steps=4: each step's batch cut into 4 micro-batches
                   along the batch dimension, one fused_backward(loss / 4) each
  adalomo_accumulate  adalomo, the same
  lomo_accumulate_int8  lomo_accumulate with the 8-bit blockwise buffer
  lomo_compiled_autograd  lomo, with `torch.compile(model)` and the backward (hooks and
                   updates included) compiled by compiled autograd

`forward_backward` (not an optimizer) is the step without any update: forward, backward,
gradients dropped. The update's share of a step is measured against it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .dtypes import DTYPES

OPTIMIZERS: dict[str, str] = {
    "adamw": "torch.optim.AdamW",
    "adamw_master": "torch.optim.AdamW, fp32 master weights",
    "sgd": "torch.optim.SGD",
    "lomo_optim": "lomo_optim.Lomo (lomo-optim)",
    "lomo": "Lomo, exact clip (2 backward)",
    "lomo_single": "Lomo, single_backward",
    "adalomo": "AdaLomo, exact clip (2 backward)",
    "adalomo_single": "AdaLomo, single_backward",
    "lomo_accumulate": "Lomo, 4 micro-batches per step",
    "adalomo_accumulate": "AdaLomo, 4 micro-batches per step",
    "lomo_accumulate_int8": "Lomo, 4 micro-batches per step, 8-bit buffer",
    "lomo_compiled_autograd": "Lomo, compiled fwd + autograd",
}
# Learning rates that train the demo's character model well; `bench.train` uses them too
# (its figures do not depend on the value).
DEFAULT_LR = {
    "adamw": 2e-3,
    "adamw_master": 2e-3,
    "sgd": 0.3,
    "lomo_optim": 0.3,
    "lomo": 0.3,
    "lomo_single": 0.3,
    "adalomo": 0.02,
    "adalomo_single": 0.02,
    "lomo_accumulate": 0.3,
    "adalomo_accumulate": 0.02,
    "lomo_accumulate_int8": 0.3,
    "lomo_compiled_autograd": 0.3,
}
FORWARD_BACKWARD = "forward_backward"
# Micro-batches per step of the *_accumulate optimizers.
ACCUMULATION_STEPS = 4
# Optimizers that hold every gradient at once (and, AdamW, two fp32 states per parameter).
HOLDS_ALL_GRADIENTS = ("adamw", "adamw_master", "sgd")


def micro_batches(name: str) -> int:
    """Micro-batches per step of optimizer `name` (its batch is cut into as many)."""
    return ACCUMULATION_STEPS if "_accumulate" in name else 1


class Unavailable(RuntimeError):
    """The optimizer cannot run here (e.g. its package is not installed)."""


@dataclass
class Trainer:
    name: str
    optimizer: Any
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    notes: dict[str, Any] = field(default_factory=dict)


class _Run(NamedTuple):
    """What a trainer is built from."""

    name: str
    model: torch.nn.Module
    lr: float
    clip_grad_norm: float | None
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def unavailable_reason(name: str) -> str | None:
    """Why `name` cannot run in this environment, or None."""
    if name == "lomo_optim" and importlib.util.find_spec("lomo_optim") is None:
        return "the lomo-optim package is not installed (pip install lomo-optim)"
    return None


def adamw(params: list[torch.nn.Parameter], lr: float) -> tuple[torch.optim.AdamW, str]:
    """AdamW with torch's fused kernel where the device has one, else the foreach one."""
    try:
        return torch.optim.AdamW(params, lr=lr, fused=True), "fused"
    except RuntimeError:  # raised at construction for a device without the fused kernel
        return torch.optim.AdamW(params, lr=lr, foreach=True), "foreach"


def make_trainer(
    name: str,
    model: torch.nn.Module,
    lr: float,
    clip_grad_norm: float | None = 1.0,
    options: dict[str, Any] | None = None,
) -> Trainer:
    """The optimizer `name` on `model` and its training step (see the module docstring);
    `options`: further keyword arguments of a lomo_kernels optimizer's constructor (e.g.
    ``stochastic_rounding``)."""
    if options and (name == "lomo_optim" or not name.startswith(("lomo", "adalomo"))):
        raise ValueError(f"{name} takes no options, got {sorted(options)}")
    if name not in OPTIMIZERS and name != FORWARD_BACKWARD:
        raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
    reason = unavailable_reason(name)
    if reason:
        raise Unavailable(reason)

    def loss_of(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=labels).loss

    if name == FORWARD_BACKWARD:

        def no_update(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            loss = loss_of(ids, labels)
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss

        return Trainer(name, None, no_update)
    if name in ("adamw", "sgd"):
        return _torch_trainer(_Run(name, model, lr, clip_grad_norm, loss_of))
    if name == "adamw_master":
        return _master_weights_trainer(_Run(name, model, lr, clip_grad_norm, loss_of))
    if name == "lomo_optim":
        import lomo_optim

        opt = lomo_optim.Lomo(model, lr=lr, clip_grad_norm=clip_grad_norm)

        def official_step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            loss = loss_of(ids, labels)
            if clip_grad_norm is not None:
                opt.grad_norm(loss)
            opt.fused_backward(loss, opt.lr)
            return loss

        return Trainer(name, opt, official_step)
    return _lomo_kernels_trainer(_Run(name, model, lr, clip_grad_norm, loss_of), options or {})


def _torch_trainer(run: _Run) -> Trainer:
    name, model, lr, clip_grad_norm, loss_of = run
    params = [p for p in model.parameters() if p.requires_grad]
    notes: dict[str, Any] = {}
    if name == "adamw":
        opt, notes["implementation"] = adamw(params, lr)
    else:
        opt = torch.optim.SGD(params, lr=lr, foreach=True)

    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = loss_of(ids, labels)
        loss.backward()
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, clip_grad_norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return Trainer(name, opt, step, notes)


def _master_weights_trainer(run: _Run) -> Trainer:
    name, model, lr, clip_grad_norm, loss_of = run
    params = [p for p in model.parameters() if p.requires_grad]
    if all(p.dtype == torch.float32 for p in params):
        return _torch_trainer(_Run("adamw", model, lr, clip_grad_norm, loss_of))
    master = [p.detach().float().clone().requires_grad_() for p in params]
    opt, implementation = adamw(master, lr)

    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = loss_of(ids, labels)
        loss.backward()
        for p, m in zip(params, master, strict=True):
            m.grad = p.grad.float() if p.grad is not None else None
            p.grad = None
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(master, clip_grad_norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, master, strict=True):
                p.copy_(m)
        return loss

    return Trainer(name, opt, step, {"implementation": implementation, "master": "fp32"})


def _lomo_kernels_trainer(run: _Run, options: dict[str, Any]) -> Trainer:
    name, model, lr, clip_grad_norm, loss_of = run
    from lomo_kernels import AdaLomo, Lomo

    cls = AdaLomo if name.startswith("adalomo") else Lomo
    single = name.endswith("_single")
    options = dict(options)
    if isinstance(options.get("accumulation_dtype"), str):  # options travel as JSON
        options["accumulation_dtype"] = {**DTYPES, "int8": torch.int8}[
            options["accumulation_dtype"]
        ]
    if "_accumulate" in name:
        options = {"accumulation_steps": ACCUMULATION_STEPS, **options}
    if name.endswith("_int8"):
        options = {"accumulation_dtype": torch.int8, **options}
    opt = cls(model, lr=lr, clip_grad_norm=clip_grad_norm, single_backward=single, **options)
    notes = {"backend": _backend_name(opt, model)}
    k = opt.accumulation_steps
    if k > 1:
        notes["accumulation_steps"] = k

        def accumulating_step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            if ids.shape[0] % k:
                raise ValueError(f"a batch of {ids.shape[0]} does not cut into {k} micro-batches")
            total = torch.zeros((), device=ids.device)
            for part, part_labels in zip(ids.chunk(k), labels.chunk(k), strict=True):
                loss = loss_of(part, part_labels) / k
                opt.fused_backward(loss)
                total += loss.detach().float()
            return total

        return Trainer(name, opt, accumulating_step, notes)
    if name != "lomo_compiled_autograd":

        def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            loss = loss_of(ids, labels)
            opt.fused_backward(loss)
            return loss

        return Trainer(name, opt, step, notes)

    from lomo_kernels.core.torch_internals import enable_compiled_autograd

    forward = torch.compile(model)

    def compiled_step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = forward(input_ids=ids, labels=labels).loss
        with enable_compiled_autograd(torch.compile(backend="inductor")):
            opt.fused_backward(loss)
        return loss

    return Trainer(name, opt, compiled_step, notes)


def _backend_name(opt: Any, model: torch.nn.Module) -> str:
    """The kernel backend that serves the model's device (loading it now, before any step)."""
    from lomo_kernels.ops import backends

    family = backends.ADALOMO if type(opt).__name__ == "AdaLomo" else backends.LOMO
    device = next(model.parameters()).device
    return backends.backend_name(family.resolve(device, opt.backend))


def state_bytes(opt: Any) -> int:
    """Bytes of the tensors in an optimizer's state (0 for none / no state)."""
    state = getattr(opt, "state", None) or {}
    total = 0
    for per_param in state.values():
        values = per_param.values() if isinstance(per_param, dict) else [per_param]
        total += sum(v.numel() * v.element_size() for v in values if torch.is_tensor(v))
    return total
