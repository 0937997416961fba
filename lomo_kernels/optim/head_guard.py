"""A patched model's logits-free head that did not run: refused before the step changes anything.

`patch_causal_lm` marks the models it patches and registers them here. Before a Lomo/AdaLomo
step (its norm pass, or its update pass where none precedes it) the loss's autograd graph is
read from the loss towards the head weight of each patched model whose head the optimizer
trains. The weight may be reached only through

- the fused loss (`ops.cross_entropy`: the patched forward given labels, or asked for
  per-token log-probabilities with ``fused_lm_head=True``, as TRL's trainers ask);
- the input embedding's lookup (a head tied to the embedding);
- logits the patched forward returned because it was called without labels (tagged on their
  autograd node when formed).

Reached another way and never through the fused loss, the head's logits were formed the
ordinary way: something wrapped or replaced the patched forward (TRL's SFTTrainer installs
its own chunked head over the model's forward), or called the class's own forward with
labels. The memory the patch saves is then not saved, and the step is refused with the node
that read the weight. (A loss that also reads the weight elsewhere, a regularizer on it, is
a use, not a bypass: a Lomo stepping the head from its chunks refuses that second gradient
itself.)

The graph is read once per step (`loss_graph.py`, which also answers the whole-graph
refusals); this question does not go below the fused loss's node and tagged logits, so in
the usual case it reads a handful of nodes. A region compiled with torch.compile is one
opaque node: what runs inside it is not checked.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .loss_graph import LOGITS_ON_REQUEST, LossGraph

# The attribute `patch_causal_lm` sets on a model it patched.
PATCHED_ATTRIBUTE = "_lomo_kernels_fused_head"

_PATCHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_REQUEST = threading.local()


def register(model: nn.Module) -> None:
    _PATCHED.add(model)


def unregister(model: nn.Module) -> None:
    _PATCHED.discard(model)


def is_patched(model: Any) -> bool:
    return bool(getattr(model, PATCHED_ATTRIBUTE, False))


@contextmanager
def logits_requested() -> Iterator[None]:
    """While the patched forward runs the model's own forward for a call without labels:
    the head's logits are then what the caller asked for."""
    depth = getattr(_REQUEST, "depth", 0)
    _REQUEST.depth = depth + 1
    try:
        yield
    finally:
        _REQUEST.depth = depth


def tag_requested_logits(logits: torch.Tensor) -> torch.Tensor:
    """Marks `logits`, formed by a patched head, as asked for, when they are."""
    node = logits.grad_fn
    if getattr(_REQUEST, "depth", 0) and node is not None and not torch.compiler.is_compiling():
        node.metadata[LOGITS_ON_REQUEST] = True
    return logits


def _head_weights(root: nn.Module | None) -> Iterator[tuple[nn.Module, torch.Tensor]]:
    models = list(_PATCHED)
    if root is not None and is_patched(root) and all(m is not root for m in models):
        models.append(root)
    for model in models:
        if not is_patched(model):
            continue
        head = model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if isinstance(weight, torch.Tensor):
            yield model, weight


def tied_head_weights() -> set[int]:
    """ids of the head weights of patched models that are also their input embedding's."""
    tied = set()
    for model, weight in _head_weights(None):
        embedding = model.get_input_embeddings()
        if getattr(embedding, "weight", None) is weight:
            tied.add(id(weight))
    return tied


HeadWeights = dict[int, tuple[nn.Module, torch.Tensor]]


def trained_heads(trains: Callable[[torch.Tensor], bool], root: nn.Module | None) -> HeadWeights:
    """The head weights of patched models (`root` among them, if patched) that require a
    gradient and that `trains(weight)`, by id: what the graph's head question asks about."""
    return {id(w): (m, w) for m, w in _head_weights(root) if w.requires_grad and trains(w)}


def refuse_bypassed_head(graph: LossGraph, heads: HeadWeights) -> None:
    """Raises, naming the weight and the node that read it, when the loss whose graph was
    read reaches one of `heads` other than through the fused loss, the embedding lookup or
    requested logits (module docstring)."""
    for key, name in graph.heads_read_by.items():
        # Read besides the fused loss (a regularizer on the weight) is a use of the weight,
        # not a bypass; a Lomo stepping it from row blocks refuses that second gradient
        # itself (row_blocks.py).
        if key not in graph.heads_fused:
            model, weight = heads[key]
            raise RuntimeError(bypass_message(model, weight, name))


def bypass_message(model: nn.Module, weight: torch.Tensor, node: str) -> str:
    names = {id(p): n for n, p in model.named_parameters()}
    name = names.get(id(weight), "the output head's weight")
    return (
        f"lomo_kernels: {type(model).__name__} was patched by patch_causal_lm, but this loss "
        f"reads its head weight {name!r} through {node}, not through the fused loss: the "
        "head's logits were formed the ordinary way, so the memory the patch saves is not "
        "saved. Something wrapped or replaced the patched forward, or called the class's own "
        "forward with labels. TRL's SFTTrainer installs its own head over the model's forward: "
        "call lomo_kernels.enable_trl() before building the trainer, or "
        "lomo_kernels.patch_causal_lm(trainer.model) after building it. Otherwise call the "
        "patched model itself with labels=..., or lomo_kernels.unpatch_causal_lm(model) to "
        "train it unpatched. Nothing was changed."
    )
