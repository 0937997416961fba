"""What the optimizer refuses before any parameter changes: models, parameters and losses it
cannot serve, checked at construction and again before every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..core.checks import SUPPORTED_DTYPES
from ..core.ownership import updated_in_backward
from ..distributed import compute_dtypes, unwrap_engine
from .loss_graph import LossGraph
from .loss_scaler import LOSS_SCALE_KEYS

SERVED_DEVICE_TYPES = ("cpu", "cuda")


GRAD_ACCUMULATION_NOTE = (
    "To accumulate gradients over micro-batches, build the optimizer with "
    "accumulation_steps=k and call opt.fused_backward(loss / k) for each micro-batch."
)


# Where a stray backward may come from, as the layers above know it: each function returns a
# sentence for the refusal when its integration is active, else None (the transformers
# integration registers one), so that this layer never looks up the layers above.
_BACKWARD_ORIGIN_NOTES: list[Callable[[], str | None]] = []


def register_backward_origin_note(note: Callable[[], str | None]) -> None:
    """Adds `note` to what `plain_backward_error` asks; the same function twice is a no-op."""
    if note not in _BACKWARD_ORIGIN_NOTES:
        _BACKWARD_ORIGIN_NOTES.append(note)


def plain_backward_error() -> str:
    """The refusal of a backward that reached a hook outside `fused_backward`/`grad_norm`,
    worded for where the caller is: whether an integration (`enable_transformers()`) that
    already routes backwards through `fused_backward` is active."""
    head = (
        "a backward reached the hook of a parameter that a Lomo/AdaLomo updates, outside "
        "opt.fused_backward(loss) and opt.grad_norm(loss) (a plain loss.backward()); nothing "
        "was updated. " + GRAD_ACCUMULATION_NOTE
    )
    for note in _BACKWARD_ORIGIN_NOTES:
        sentence = note()
        if sentence is not None:
            return f"{head} {sentence}"
    return (
        f"{head} Call opt.fused_backward(loss) instead of loss.backward(), once per step. "
        "With transformers' Trainer (TRL's trainers too) or accelerate, call "
        "lomo_kernels.enable_transformers() first (TRL: lomo_kernels.enable_trl()), or use "
        "lomo_kernels.integrations.hf_trainer.LomoTrainer."
    )


def second_contribution_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"lomo_kernels: parameter {name!r} is stepped in backward from gradient blocks (the "
        "fused head's vocabulary chunks or the input embedding's used rows) and got a second "
        "gradient in the same backward: it is used elsewhere in the graph too, or its op "
        "ran twice for one loss. Use the head and the input embedding once per loss, or "
        "train this model unpatched (lomo_kernels.unpatch_causal_lm)."
    )


def gradient_in_parts_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"lomo_kernels: parameter {name!r} got a second gradient in the same backward: its "
        "gradient reached it in parts, as when it is used in two "
        "torch.utils.checkpoint(use_reentrant=True) segments (or in one and outside it), "
        "each of which runs a backward of its own. LOMO steps a parameter once, from its "
        "whole gradient: use use_reentrant=False (transformers: "
        "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
        "{'use_reentrant': False})). A step with a norm pass (clip_grad_norm, fp16) refuses "
        "this before any change; with accumulation_steps > 1 the parts are added into the "
        "parameter's buffer."
    )


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


def refuse_inference_mode(call: str) -> None:
    """Refuses `call` under ``torch.inference_mode()``, before any change: the tensors a step
    makes there (its device scalars, buffers, moments) could not be written outside it
    again, and a backward cannot run."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{call} under torch.inference_mode(): no backward runs there, and the tensors the "
            "optimizer makes there could never be updated outside it. Call it outside "
            "inference_mode (torch.no_grad() around it is fine). Nothing was changed."
        )


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


def refuse_graph(graph: LossGraph, takes_row_blocks: Any, model: nn.Module) -> None:
    """Refuses, before the backward, a loss (its whole graph read: `loss_graph.py`) whose
    gradients would reach a parameter in a way the in-backward step cannot take: a sparse
    gradient, or a second gradient of a parameter its owner steps from row blocks
    (`takes_row_blocks(param)`)."""
    if graph.sparse_gradient:
        raise ValueError(
            "the loss's backward holds an op that gives a sparse gradient (an embedding "
            "lookup with sparse=True, F.embedding(..., sparse=True), or torch.gather(..., "
            "sparse_grad=True)); LOMO updates dense parameters in place and nothing was "
            "updated: pass sparse=False (sparse_grad=False)"
        )
    for param in graph.reused_row_block_params:
        if takes_row_blocks(param):
            error = second_contribution_error(parameter_names(model).get(id(param), "?"))
            raise RuntimeError(f"{error} Nothing was updated.")


def sparse_gradient_error(name: str) -> TypeError:
    return TypeError(
        f"parameter {name!r} received a sparse gradient (F.embedding(..., sparse=True), "
        "torch.gather(..., sparse_grad=True) or another op with sparse gradients in the "
        "forward); LOMO updates dense parameters in place: pass sparse=False"
    )


def refuse_shared_memory(
    params: list[nn.Parameter], frozen: list[nn.Parameter], names: dict[int, str]
) -> None:
    """Refuses a trainable parameter whose memory overlaps another parameter's, trainable or
    frozen (``b.weight = nn.Parameter(a.weight)``): the hook of one updates it in place while
    the backward may still read the other's values for another gradient. Frozen parameters
    may share memory among themselves."""
    spans = sorted(  # by device and address, then trainable first, then in model order
        (p.device.type, p.device.index or 0, p.data_ptr(), not trainable, i, p)
        for trainable, group in ((True, params), (False, frozen))
        for i, p in enumerate(group)
        if p.numel()
    )
    # The span reaching furthest so far, among all and among trained ones: (device, end, p).
    reach_any: tuple[Any, int, Any] = (None, -1, None)
    reach_trained = reach_any
    for device_type, index, start, is_frozen, _, p in spans:
        device = (device_type, index)
        # A trained span may overlap no span; a frozen one no trained span.
        reach_device, reach, other = reach_trained if is_frozen else reach_any
        if reach_device == device and start < reach:
            order = {key: k for k, key in enumerate(names)}  # names: in model order
            pair = sorted((other, p), key=lambda q: order.get(id(q), len(order)))
            first, second = (names.get(id(q), "?") for q in pair)
            raise ValueError(
                f"parameters {first!r} and {second!r} share memory but are different "
                "Parameters, and one of them is trained: LOMO updates it in place while the "
                f"backward may still read the other. Tie them as one Parameter ({second} = "
                f"{first}) or give each its own memory (.clone())"
            )
        end = start + p.nbytes
        if reach_any[0] != device or end > reach_any[1]:
            reach_any = (device, end, p)
        if not is_frozen and (reach_trained[0] != device or end > reach_trained[1]):
            reach_trained = (device, end, p)


_NO_HOOK = "is trainable but has no hook (unfrozen or replaced)"


class ParameterLayout:
    """The trainable parameters the hooks, state and buffers were built for, with their
    dtype, device and shape then: a step on a model whose parameters changed since is
    refused."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], sharded: bool) -> None:
        self.model = model
        self.sharded = sharded
        self.entries = [(p, p.dtype, p.device, p.shape) for p in params]
        self.built_names = parameter_names(model)  # also names a parameter gone since
        self.embeddings = trained_embeddings(model)
        # Sharding engines swap the registered tensors (so identity tells nothing) but keep
        # their names: what a sharded step compares.
        self.trained_names = self._trained_names() if sharded else set()
        if not sharded:  # sharding engines keep parameters in buffers of their own
            frozen = [p for p in model.parameters() if not p.requires_grad]
            refuse_shared_memory(params, frozen, self.built_names)

    def _trained_names(self) -> set[str]:
        named = self.model.named_parameters(remove_duplicate=False)
        return {name for name, p in named if p.requires_grad}

    def check(self, owner: str) -> None:
        """Refuses a step when the model's parameters changed since construction.

        Without sharding the model is walked (parameters unfrozen or replaced); FSDP2 and
        ZeRO-3 swap the registered tensors themselves, so there freezing is checked and the
        trainable parameters' names (one unfrozen since would get no step, and its gradient
        would be kept). `owner` names the optimizer class in the error.
        """
        problem = None
        for p, dtype, device, shape in self.entries:
            if not p.requires_grad:
                problem = (p, "was frozen (requires_grad=False)")
            elif not self.sharded and (p.dtype != dtype or p.device != device):
                problem = (p, f"was {dtype} on {device} and is now {p.dtype} on {p.device}")
            elif not self.sharded and p.shape != shape:
                problem = (p, f"was of shape {tuple(shape)} and is now {tuple(p.shape)}")
            elif not self.sharded and not p.is_contiguous():
                problem = (p, "is no longer contiguous (its .data was replaced)")
            if problem:
                break
        if problem is None and not self.sharded:
            hooked = {id(p) for p, *_ in self.entries}
            current = {id(p): p for p in self.model.parameters() if p.requires_grad}
            if current.keys() != hooked:
                added = next((p for i, p in current.items() if i not in hooked), None)
                if added is None:
                    problem = (None, "is no longer in the model (replaced)")
                elif updated_in_backward(added):
                    name = parameter_names(self.model).get(id(added), "?")
                    raise RuntimeError(
                        f"parameter {name!r} is trainable in the model this {owner} steps, but "
                        "another live optimizer's hooks update it: one Lomo or AdaLomo steps "
                        "all of a model's trainable parameters. To give parts of the model "
                        "their own values, detach both and build one with param_groups=[...]"
                    )
                else:
                    problem = (added, _NO_HOOK)
        if problem is None and self.sharded:
            added = sorted(self._trained_names() - self.trained_names)
            if added:
                problem = (added[0], _NO_HOOK)
        if problem is not None:
            self._refuse_changed(*problem, owner)
        refuse_sparse_embeddings(self.embeddings)

    def _refuse_changed(self, param: torch.Tensor | str | None, what: str, owner: str) -> None:
        """Raises the refusal of a step on `param` (a parameter, its name, or None: the
        first one no longer in the model)."""
        names = parameter_names(self.model)
        if param is None:
            gone = {id(p) for p, *_ in self.entries} - set(names)
            param = next(p for p, *_ in self.entries if id(p) in gone)
        if isinstance(param, str):
            name = param
        else:
            name = names.get(id(param)) or self.built_names.get(id(param), "?")
        raise RuntimeError(
            f"parameter {name!r} {what} since the {owner} was built, so "
            "its hooks and state no longer match the model: call opt.detach() and build a new "
            "optimizer (load its state_dict() to keep the step count)"
        )
