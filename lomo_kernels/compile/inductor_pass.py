"""Inductor post-grad pass keeping each functionalized update after every read of its input."""

from __future__ import annotations

from typing import Any

import torch

from ..core import torch_internals

_HOP = torch.ops.higher_order
# Ops Inductor runs as a kernel of their own, writing a realized buffer: a read of a weight
# by one of them happens where the op is scheduled, never later inside a fused consumer.
_EXTERN_ATEN = frozenset(
    {
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "convolution",
        "convolution_backward",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
    }
)


def _reads_in_place(node: torch.fx.Node) -> bool:
    """Whether `node` reads its inputs where it runs (an extern kernel); other ops may be
    inlined by Inductor into whichever consumer it schedules, possibly much later."""
    target = node.target
    if target in (_HOP.auto_functionalized_v2, _HOP.auto_functionalized):
        return True
    if torch_internals.is_op_overload(target):
        if target.namespace not in ("aten", "prims"):
            return True  # custom ops: fallback kernels
        return torch_internals.op_schema(target).name.split("::")[-1] in _EXTERN_ATEN
    return False


def delay_updates_past_reads(graph: torch.fx.Graph) -> int:
    """Inductor post-grad pass: moves each functionalized update of a graph input after every
    computation that may still read the input's old value. Returns the number moved.

    The graph is functional here, so the order changes nothing that is computed, only what
    Inductor makes of it. Where a read of a weight W comes after the update of W:
    - the re-inplacing pass cannot update W in place: Inductor clones W for the update and
      copies it back at the end of the graph, holding that weight twice;
    - where the read is an elementwise op that Inductor inlines into a consumer scheduled
      after the update (RMSNorm's ``dy * weight`` feeding a later reduction), the consumer
      reads the updated W: on torch 2.13 the realization meant to prevent it registers the
      read after the mutating kernel. Seen as AdaLomo steps 1% off once the clones are gone.
    So the reads are followed through every op that may be inlined, up to ops that read
    where they run (matmuls, attention, custom ops), and the update, with whatever depends
    on it up to there, is placed after the last of them. Where a read depends on the update
    nothing moves: the updates are chained through their shared found_inf flag, so a read
    that reaches a later update (the residual stream's gradient, elementwise down to the
    embedding's) cannot be passed. Such an update stays where it is, in place, and
    `realizing_reads_before_writes` keeps its inlined reads ahead of it.
    """
    copy_ = torch.ops.aten.copy_.default
    order = {node: i for i, node in enumerate(graph.nodes)}
    moved = 0
    for update in list(graph.find_nodes(op="call_function", target=_HOP.auto_functionalized_v2)):
        bases = [
            b
            for b in torch_internals.auto_functionalized_bases(update)
            if isinstance(b, torch.fx.Node) and b.op == "placeholder"
        ]
        if not bases:
            continue
        reads: set[torch.fx.Node] = set()
        stack = list(bases)
        while stack:
            for user in stack.pop().users:
                if user in reads or user is update or user.op == "output" or user.target is copy_:
                    continue
                reads.add(user)
                if not _reads_in_place(user):
                    stack.append(user)
        if not reads:
            continue
        last = max(reads, key=order.__getitem__)
        if order[last] < order[update]:
            continue
        # What depends on the update up to `last` moves with it, in its order: the updates
        # chained through a shared found_inf flag, for one.
        cone = {update}
        for node in nodes_between(update, last):
            if any(a in cone for a in node.all_input_nodes):
                cone.add(node)
        if cone & reads:
            continue  # a read of the old value depends on the update: Inductor clones
        anchor = last
        for node in sorted(cone, key=order.__getitem__):
            anchor.append(node)
            anchor = node
        moved += 1
        order = {node: i for i, node in enumerate(graph.nodes)}
    return moved


def nodes_between(first: torch.fx.Node, last: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes after `first` up to and including `last`, in graph order."""
    out = []
    node = first.next
    while node is not last:
        out.append(node)
        node = node.next
    out.append(last)
    return out


def _delay_updates_pass() -> Any:
    graph_pass, get_hash_for_files = torch_internals.inductor_custom_graph_pass()

    class DelayUpdatesPastReads(graph_pass):  # type: ignore[misc,valid-type]
        def __call__(self, graph: torch.fx.Graph) -> None:
            delay_updates_past_reads(graph)

        def uuid(self) -> bytes:
            # Inductor's FX graph cache keys on this: the pass's source.
            return get_hash_for_files((__file__,))

    return DelayUpdatesPastReads()


class _LazyPass:
    """Builds the Inductor pass object on first use (importing Inductor only then)."""

    def __init__(self) -> None:
        self._pass: Any = None

    def get(self) -> Any:
        if self._pass is None:
            self._pass = _delay_updates_pass()
        return self._pass


DELAY_UPDATES = _LazyPass()
