"""One read of a loss's graph answers both of the step's graph questions (optim/loss_graph.py):
the whole graph's (sparse lookups, row-block parameters fed twice) and the head's readers,
which stop below the fused loss and requested logits. Checked against graphs built by hand,
whose answers are known from how they were built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
