"""The step's transitions: a measured norm serves only the loss it measured, with the
clip threshold of then (or any loss of the batch where each pass has its own forward; the
loss scale is compared by the optimizer: test_step_attempts.py), and closing the update
pass forgets it. End to end in test_lomo_optimizer.py and
test_single_backward.py; here the rules alone."""

from __future__ import annotations

import torch

from lomo_kernels.optim.step import Phase, Plan, Step

SCALE = 1024.0  # the loss scale's setting at the norm pass (`LossScaling.setting`)


def measured(loss: torch.Tensor, max_norm: float | None = 1.0, graph: bool = False) -> Step:
    mode = Step()
    mode.begin_pass(Phase.NORM)
    mode.end_pass()
    mode.norm_measured(loss, max_norm, keep_graph=graph, scale_setting=lambda: SCALE)
    return mode


def a_loss() -> torch.Tensor:
    return (torch.ones(2, requires_grad=True) * 2).sum()


def test_norm_serves_only_its_loss_and_threshold():
    loss, other = a_loss(), a_loss()
    cases = [(loss, 1.0, False, True), (other, 1.0, False, False), (loss, 2.0, False, False)]
    cases.append((other, 1.0, True, True))  # a forward per pass: any loss of the batch
    for candidate, max_norm, same_batch, serves in cases:
        mode = measured(loss)
        assert mode.norm_serves(candidate, max_norm, same_batch=same_batch) is serves
        assert mode.norm_ready and mode.norm_scale_setting == SCALE  # asking changes nothing
    mode = measured(loss)
    mode.forget_norm()
    assert not mode.norm_serves(loss, 1.0, same_batch=True)
    # The scale's setting stays for the next call to compare, unless dropped with the norm.
    assert mode.norm_scale_setting == SCALE
    mode.forget_norm(scale_setting_too=True)
    assert mode.norm_scale_setting is None


def test_end_update_reports_the_norm_pass_and_forgets_it():
    loss = a_loss()
    mode = measured(loss, graph=True)
    assert mode.phase is Phase.IDLE and mode.same_graph_as_norm(loss)
    assert not mode.same_graph_as_norm(a_loss())  # another forward's graph
    mode.begin(Plan.NORM_THEN_UPDATE)
    assert mode.begin_update() is False
    assert mode.end_update() is True
    assert not mode.norm_ready and not mode.same_graph_as_norm(loss)
    mode.begin(Plan.SINGLE_BACKWARD)
    assert mode.begin_update() is True
    assert mode.single_backward
    assert mode.end_update() is False and not mode.single_backward


def test_a_pass_starts_and_ends_with_nothing_seen():
    """What a pass has seen (updated parameters, row-block and whole gradients) is the pass's
    own: the next pass, and the idle optimizer, start from nothing."""
    step = Step()
    weight = torch.ones(2)
    step.begin_pass(Phase.UPDATE)
    step.note_updated(weight)
    step.row_block_params.add(id(weight))
    step.whole_params.add(id(weight))
    assert step.updated == [weight]
    step.end_pass()
    assert step.phase is Phase.IDLE
    assert (step.updated, step.row_block_params, step.whole_params) == ([], set(), set())
    # Left over by a pass that was not closed (an exception in its backward).
    step.updated.append(weight)
    step.row_block_params.add(id(weight))
    step.whole_params.add(id(weight))
    step.begin_pass(Phase.NORM)
    assert step.phase is Phase.NORM
    assert (step.updated, step.row_block_params, step.whole_params) == ([], set(), set())


def test_a_new_step_has_no_norm():
    """Before its first norm pass the optimizer has measured nothing: no loss, no threshold
    (None, as without clipping) and no batch is served, and no graph is the norm's."""
    step = Step()
    loss = a_loss()
    assert step.phase is Phase.IDLE and step.plan is None and not step.norm_ready
    assert not step.norm_serves(loss, None, same_batch=True)
    assert not step.same_graph_as_norm(torch.ones(2).sum())  # a loss without a graph
