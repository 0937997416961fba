"""What the optimizer refuses before any parameter changes: models, parameters and losses it
cannot serve, checked at construction and again before every step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..distributed import compute_dtypes, unwrap_engine
from ..ops.checks import SUPPORTED_DTYPES
from .loss_scaler import LOSS_SCALE_KEYS

SERVED_DEVICE_TYPES = ("cpu", "cuda")


def parameter_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters (tied ones once), after checking every one can be served.

    A DeepSpeed engine is accepted in place of its module.
    """
    model = unwrap_engine(model)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"pass the model (an nn.Module), not {type(model).__name__}: LOMO registers a hook "
            "on each of its trainable parameters"
        )
    refuse_sparse_embeddings(trained_embeddings(model))
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            "the model has no trainable parameters (requires_grad=True): "
            "nothing for the optimizer to update"
        )
    names = parameter_names(model)
    for p in params:
        name = names.get(id(p), "?")
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"parameter {name!r} has dtype {p.dtype}; the fused kernels update "
                "float32, float16 and bfloat16 parameters: cast the model first"
            )
        if p.device.type not in SERVED_DEVICE_TYPES:
            raise ValueError(
                f"parameter {name!r} is on {p.device}, which no lomo_kernels "
                f"backend serves ({', '.join(SERVED_DEVICE_TYPES)}); move the "
                "model (a meta-device model must be materialised first)"
            )
        if p.layout != torch.strided or not p.is_contiguous():
            raise ValueError(
                f"parameter {name!r} is not a contiguous dense tensor; "
                "make it contiguous before building the optimizer"
            )
    return params


def computes_in_fp16(model: nn.Module) -> bool:
    """Whether a trainable parameter's forward and backward run in fp16 (loss scaling needed).

    Its dtype, or under FSDP2 the MixedPrecisionPolicy's param_dtype (fp32 shards computed
    in fp16 get fp16 gradients)."""
    model = unwrap_engine(model)
    return torch.float16 in compute_dtypes(model, trainable_parameters(model))


def split_loss_scale_args(args: dict[str, Any]) -> dict[str, Any]:
    """lomo-optim's `loss_scale_args` without its 'dtype' key, after refusing unknown keys."""
    unknown = set(args) - set(LOSS_SCALE_KEYS) - {"dtype"}
    if unknown:
        raise ValueError(
            f"unknown loss_scale_args {sorted(unknown)}; accepted: {', '.join(LOSS_SCALE_KEYS)}"
        )
    return {k: v for k, v in args.items() if k != "dtype"}


def check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("the loss must be a scalar tensor")
    if not loss.requires_grad:
        raise ValueError("the loss does not require grad: nothing to back-propagate")


# -- sparse gradients: a sparse gradient would reach the hooks only after other tensors were
# updated, so it is refused before the step wherever it can be seen.


def trained_embeddings(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The embedding modules whose weight is trainable, with their names: their `sparse`
    flag is read again before each step (it may be set after construction)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.weight.requires_grad
    ]


def refuse_sparse_embeddings(embeddings: list[tuple[str, nn.Module]]) -> None:
    for name, module in embeddings:
        if module.sparse:
            raise ValueError(
                f"module {name!r} produces sparse gradients (sparse=True); LOMO updates dense "
                f"parameters in place: set {name or 'the module'}.sparse = False (or construct "
                "it with sparse=False)"
            )


_SPARSE_GRADIENT_NODES = ("EmbeddingBackward0", "EmbeddingBagBackward0")


def sparse_embedding_in_graph(loss: torch.Tensor) -> bool:
    """Whether the backward of `loss` holds an embedding lookup with sparse=True (the
    functional form, F.embedding(..., sparse=True), that no module flag shows).

    A walk of the autograd graph on the host, about 1.3 us per node (seen: 0.13 ms for a
    2-layer LLaMA, 3.3 ms for a 32-layer one); run only for steps without a norm pass, where
    the sparse gradient would otherwise arrive after other tensors were updated.
    """
    stack = [loss.grad_fn]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.name() in _SPARSE_GRADIENT_NODES and getattr(node, "_saved_sparse", False):
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def refuse_sparse_graph(loss: torch.Tensor) -> None:
    if sparse_embedding_in_graph(loss):
        raise ValueError(
            "the loss's backward holds an embedding lookup with sparse=True "
            "(F.embedding(..., sparse=True)); LOMO updates dense parameters in place and "
            "nothing was updated: pass sparse=False"
        )


def sparse_gradient_error(name: str) -> TypeError:
    return TypeError(
        f"parameter {name!r} received a sparse gradient (F.embedding(..., sparse=True) or "
        "another op with sparse gradients in the forward); LOMO updates dense parameters in "
        "place: pass sparse=False"
    )


class ParameterLayout:
    """The trainable parameters the hooks and state were built for, with their dtype and
    device then: a step on a model whose parameters changed since is refused."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], sharded: bool) -> None:
        self.model = model
        self.sharded = sharded
        self.entries = [(p, p.dtype, p.device) for p in params]
        self.embeddings = trained_embeddings(model)

    def check(self, owner: str) -> None:
        """Refuses a step when the model's parameters changed since construction.

        Without sharding the model is walked (parameters unfrozen or replaced); FSDP2 and
        ZeRO-3 swap the registered tensors themselves, so there only freezing is checked.
        `owner` names the optimizer class in the error.
        """
        problem = None
        for p, dtype, device in self.entries:
            if not p.requires_grad:
                problem = (p, "was frozen (requires_grad=False)")
            elif not self.sharded and (p.dtype != dtype or p.device != device):
                problem = (p, f"was {dtype} on {device} and is now {p.dtype} on {p.device}")
            elif not self.sharded and not p.is_contiguous():
                problem = (p, "is no longer contiguous (its .data was replaced)")
            if problem:
                break
        if problem is None and not self.sharded:
            hooked = {id(p) for p, _, _ in self.entries}
            current = {id(p) for p in self.model.parameters() if p.requires_grad}
            if current != hooked:
                added = next(iter(current - hooked), None)
                problem = (
                    added,
                    "is trainable but has no hook (unfrozen or replaced)"
                    if added is not None
                    else "is no longer in the model (replaced)",
                )
        if problem is not None:
            self._refuse_changed(*problem, owner)
        refuse_sparse_embeddings(self.embeddings)

    def _refuse_changed(self, param: torch.Tensor | None, what: str, owner: str) -> None:
        names = parameter_names(self.model)
        if param is None:
            gone = {id(p) for p, _, _ in self.entries} - set(names)
            param = next(p for p, _, _ in self.entries if id(p) in gone)
        raise RuntimeError(
            f"parameter {names.get(id(param), '?')!r} {what} since the {owner} was built, so "
            "its hooks and state no longer match the model: call opt.detach() and build a new "
            "optimizer (load its state_dict() to keep the step count)"
        )
