"""The one record of which parameters a live optimizer updates (core/ownership.py): what the
optimizer's own indices, a second optimizer's refusal, compiled autograd's capture and the
row-block hand-over all read."""

from __future__ import annotations

import gc

import pytest
import torch

from lomo_kernels import AdaLomo, Lomo
from lomo_kernels.compile import scope
from lomo_kernels.core.ownership import claim_of, owner_of, updated_in_backward


def model() -> torch.nn.Module:
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    net[0].bias.requires_grad_(False)  # frozen: never claimed
    return net


@pytest.mark.parametrize("cls", [Lomo, AdaLomo], ids=["Lomo", "AdaLomo"])
def test_the_record_holds_each_trained_parameter_at_its_model_index(cls):
    net = model()
    opt = cls(net, lr=0.1)
    trained = [p for p in net.parameters() if p.requires_grad]
    record = claim_of(trained[0])
    assert record is not None and record.optimizer() is opt
    assert [record.index_of[id(p)] for p in trained] == list(range(len(trained)))
    assert all(owner_of(p) is opt and record.updates(p) for p in trained)
    assert not updated_in_backward(net[0].bias) and owner_of(net[0].bias) is None
    # Compiled autograd's capture reads the same record (a graph's inputs by index).
    inputs = [*trained, net[0].bias, torch.ones(2)]
    assert scope._our_inputs(inputs) == set(range(len(trained)))
    opt.detach()
    assert not any(updated_in_backward(p) for p in trained)
    assert scope._our_inputs(inputs) == set()


def test_the_record_goes_with_the_optimizer_and_a_second_one_is_refused_while_it_lives():
    net = model()
    first = Lomo(net, lr=0.1)
    with pytest.raises(ValueError, match=r"already updated in backward by a live Lomo"):
        AdaLomo(net, lr=0.1)
    # The refused optimizer left no claim and no hook: the first still owns every parameter.
    assert all(owner_of(p) is first for p in net.parameters() if p.requires_grad)
    del first
    gc.collect()
    assert not any(updated_in_backward(p) for p in net.parameters())
    second = AdaLomo(net, lr=0.1)
    assert all(owner_of(p) is second for p in net.parameters() if p.requires_grad)
    second.detach()


def test_a_released_claim_leaves_the_next_optimizers_claim_alone():
    """An optimizer detached (its record given back then, once), then collected after a
    second one claimed the same parameters: the second keeps every claim, and a third is
    still refused."""
    net = model()
    first = Lomo(net, lr=0.1)
    first.detach()
    second = AdaLomo(net, lr=0.1)
    del first
    gc.collect()
    trained = [p for p in net.parameters() if p.requires_grad]
    assert all(owner_of(p) is second for p in trained)
    with pytest.raises(ValueError, match=r"already updated in backward by a live AdaLomo"):
        Lomo(net, lr=0.1)
    second.detach()
