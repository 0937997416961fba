"""One read of a loss's graph answers both of the step's graph questions (optim/loss_graph.py):
the whole graph's (sparse lookups, row-block parameters fed twice) and the head's readers,
which stop below the fused loss and requested logits. Checked against graphs built by hand,
whose answers are known from how they were built."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from support.graphs import diamonds

from lomo_kernels.optim.loss_graph import LOGITS_ON_REQUEST, read_loss_graph


def tagged(t: torch.Tensor) -> torch.Tensor:
    """`t` marked as logits a patched forward returned on request."""
    t.grad_fn.metadata[LOGITS_ON_REQUEST] = True
    return t


@pytest.mark.parametrize("sparse", [True, False])
def test_the_whole_graph_read_finds_sparse_lookups_and_gathers(sparse):
    weight = torch.randn(10, 4, requires_grad=True)
    ids = torch.tensor([1, 2, 3])
    dense = (weight * 2).sum()  # a branch without any lookup
    lookup = F.embedding(ids, weight, sparse=sparse).sum()
    bag = F.embedding_bag(ids, weight, torch.tensor([0]), sparse=sparse).sum()
    gathered = torch.gather(weight, 0, ids[:, None].expand(-1, 4), sparse_grad=sparse).sum()
    assert not read_loss_graph(dense, whole=True).sparse_gradient
    assert read_loss_graph(dense + lookup, whole=True).sparse_gradient is sparse
    assert read_loss_graph(bag * 3 + dense, whole=True).sparse_gradient is sparse
    assert read_loss_graph(dense + gathered.exp(), whole=True).sparse_gradient is sparse
    # The head question alone does not read the whole graph.
    assert not read_loss_graph(dense + lookup, whole=False, heads=[id(weight)]).sparse_gradient


def test_the_head_question_does_not_count_requested_logits_as_a_reader():
    head = torch.randn(6, 4, requires_grad=True)
    hidden = torch.randn(3, 4)
    logits = tagged(hidden @ head.t())
    for whole in (False, True):
        graph = read_loss_graph(logits.sum(), whole, heads=[id(head)])
        assert graph.heads_read_by == {} and graph.heads_fused == set()
    regularised = logits.sum() + (head * 2).sum()
    graph = read_loss_graph(regularised, whole=False, heads=[id(head)])
    assert graph.heads_read_by == {id(head): "MulBackward0"}


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("tagged_first", [False, True])
def test_a_node_met_out_of_the_head_questions_reach_is_read_again_from_within(whole, tagged_first):
    """`scaled` reads the head and is reached twice: below requested logits (out of the head
    question's reach) and directly. Whichever path the walk takes first, the direct one
    names it as the head's reader."""
    head = torch.randn(6, 4, requires_grad=True)
    scaled = head * 3  # MulBackward0 reads the head
    logits = tagged(scaled + 1)
    parts = [logits.sum(), scaled.sum()]
    loss = parts[0] + parts[1] if tagged_first else parts[1] + parts[0]
    graph = read_loss_graph(loss, whole, heads=[id(head)])
    assert graph.heads_read_by == {id(head): "MulBackward0"}


def test_no_question_reads_nothing():
    weight = torch.randn(3, requires_grad=True)
    graph = read_loss_graph((weight * 2).sum(), whole=False, heads=[])
    assert graph.heads_read_by == {} and not graph.sparse_gradient
    assert read_loss_graph(torch.tensor(1.0), whole=True).reused_row_block_params == []


def fused_loss(head: torch.Tensor) -> torch.Tensor:
    """The fused linear + cross-entropy of `head`: the op that hands its weight's gradient
    over in row blocks."""
    from lomo_kernels.ops.cross_entropy import linear_cross_entropy

    hidden = torch.randn(3, head.shape[1], generator=torch.Generator().manual_seed(0))
    return linear_cross_entropy(hidden, head, torch.tensor([1, 5, 7]))


def test_only_a_row_block_op_makes_a_second_use_a_row_block_reuse():
    # A weight the fused loss reads and something else reads too gets two gradients, one in
    # row blocks; a weight two ordinary ops read gets one (autograd sums it before its hook).
    head = torch.randn(8, 4, requires_grad=True)
    assert read_loss_graph(fused_loss(head), whole=True).reused_row_block_params == []
    reused = read_loss_graph(fused_loss(head) + (head * 2).sum(), whole=True)
    assert [id(p) for p in reused.reused_row_block_params] == [id(head)]
    twice = (head * 2).sum() + (head * 3).sum()
    assert read_loss_graph(twice, whole=True).reused_row_block_params == []


@pytest.mark.parametrize("tagged_first", [False, True])
def test_a_node_read_twice_counts_its_uses_once(tagged_first):
    """The fused loss reached both below requested logits (out of the head question's reach)
    and directly is read twice when the first path is the former: its weight still has one
    use (counted twice, the step would refuse it as a second gradient)."""
    head = torch.randn(8, 4, requires_grad=True)
    fused = fused_loss(head)
    parts = [tagged(fused * 2), fused]
    loss = parts[0] + parts[1] if tagged_first else parts[1] + parts[0]
    graph = read_loss_graph(loss, whole=True, heads=[id(head)])
    assert graph.reused_row_block_params == []
    assert graph.heads_fused == {id(head)} and graph.heads_read_by == {}


def test_each_node_is_read_at_most_twice(monkeypatch):
    """A graph of 2^16 paths (each level reached twice from the one above) is read node by
    node, not path by path."""
    from lomo_kernels.optim import loss_graph

    reads = []
    leaf_inputs = loss_graph.leaf_inputs
    monkeypatch.setattr(
        loss_graph, "leaf_inputs", lambda node: reads.append(node) or leaf_inputs(node)
    )
    weight = torch.randn(3, requires_grad=True)
    read_loss_graph(diamonds(weight, 16), whole=True, heads=[id(weight)])
    # At most twice per node, each read asking once per question.
    assert 0 < len(reads) <= 4 * len({id(node) for node in reads})


class RecordedNode:
    """An autograd node as the walk reads it (its name, metadata and inputs), recording each
    read of its name in `reads`."""

    def __init__(self, reads: list, name: str, inputs=(), metadata=None) -> None:
        self.reads, self._name, self.inputs = reads, name, inputs
        self.metadata = {} if metadata is None else metadata

    def name(self) -> str:
        self.reads.append(self)
        return self._name

    @property
    def next_functions(self) -> tuple:
        return tuple((node, 0) for node in self.inputs)


def test_the_head_question_alone_stops_at_requested_logits():
    """Asked alone (a step with a norm pass), the head question reads the nodes above the
    requested logits, not the decoder below them; the whole graph's question reads all."""
    reads: list = []
    below = RecordedNode(reads, "AddBackward0")
    for _ in range(10):
        below = RecordedNode(reads, "MulBackward0", (below,))
    logits = RecordedNode(reads, "MmBackward0", (below,), {LOGITS_ON_REQUEST: True})
    root = RecordedNode(reads, "SumBackward0", (logits,))
    loss = SimpleNamespace(grad_fn=root)
    read_loss_graph(loss, whole=False, heads=[1])
    assert {id(node) for node in reads} == {id(root), id(logits)}
    reads.clear()
    read_loss_graph(loss, whole=True, heads=[1])
    assert len({id(node) for node in reads}) == 13


def test_a_compiled_region_is_one_opaque_node():
    # What runs inside a torch.compile'd region is not read: its node is found (the
    # single-backward order refusal asks) and the head it reads is not named as read.
    head = torch.randn(6, 4, requires_grad=True)
    scale = torch.randn(4, requires_grad=True)
    compiled = torch.compile(lambda h, s: (h * s).sum(), backend="aot_eager", fullgraph=True)
    graph = read_loss_graph(compiled(head, scale), whole=True, heads=[id(head)])
    assert graph.compiled_region and graph.heads_read_by == {}
    plain = read_loss_graph((head * scale).sum(), whole=True, heads=[id(head)])
    assert not plain.compiled_region and plain.heads_read_by == {id(head): "MulBackward0"}
