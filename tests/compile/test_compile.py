"""Lomo in training loops that use torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from support.float64 import U32
from torch._dynamo import compiled_autograd

from lomo_kernels import Lomo


def mlp(device="cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.Linear(48, 5))
    return model.to(device=device, dtype=torch.bfloat16)


def loss_of(model, step):
    first = next(model.parameters())
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    x = x.to(device=first.device, dtype=first.dtype)
    return model(x).float().pow(2).mean()


def train(model, steps, compile_forward=False, compile_backward=False, graphs_seen=None, k=1,
          **options):  # fmt: skip
    """`steps` steps of Lomo, each of `k` micro-batches (accumulation_steps=k)."""
    if k > 1:
        options["accumulation_steps"] = k
    opt = Lomo(model, lr=0.1, clip_grad_norm=1.0, weight_decay=0.01, **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    forward = torch.compile(model, backend="aot_eager") if compile_forward else model
    for step in range(steps):
        for micro in range(k):
            loss = loss_of(forward, step * k + micro) / k
            if compile_backward:
                with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                    opt.fused_backward(loss)
            else:
                opt.fused_backward(loss)
        sched.step()
        if graphs_seen is not None:
            graphs_seen.append(dynamo_utils.counters["stats"]["unique_graphs"])
    return model


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("mode", ["forward", "forward_and_compiled_autograd"])
def test_compiled_training_matches_eager(mode, test_device):
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    eager = train(mlp(test_device), 6)
    graphs = []
    compiled = train(
        mlp(test_device),
        6,
        compile_forward=True,
        compile_backward=mode == "forward_and_compiled_autograd",
        graphs_seen=graphs,
    )
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not dynamo_utils.counters["graph_break"]
    # The backward (with the hooks' updates) ran under compiled autograd where asked.
    captures = dynamo_utils.counters["compiled_autograd"]["captures"]
    assert (captures > 0) == (mode == "forward_and_compiled_autograd")
    # The learning rate changes every step but lives in a tensor: after the first steps
    # (norm pass, update pass) nothing is compiled again.
    assert graphs[0] >= 1 and graphs[2] == graphs[-1]  # compiled, then never again


def test_accumulation_with_a_compiled_forward_matches_eager(test_device):
    """Gradient accumulation with a torch.compile'd forward and an eager backward (what the
    refusal under compiled autograd points to): the compiled region's backward hands each
    micro-batch's gradients to the buffers; aot_eager computes as eager does, so the steps
    are eager's bit for bit, and nothing compiles again once the first step has run."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    eager = train(mlp(test_device), 4, k=3)
    graphs = []
    compiled = train(mlp(test_device), 4, compile_forward=True, graphs_seen=graphs, k=3)
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(eager[0].weight, mlp(test_device)[0].weight)  # it trained
    assert not dynamo_utils.counters["graph_break"]
    assert graphs[0] >= 1 and graphs[0] == graphs[-1]  # compiled, then never again


def test_inductor_forward_with_fused_backward(test_device):
    torch._dynamo.reset()
    eager, compiled = mlp(test_device).float(), mlp(test_device).float()
    compiled_fwd = torch.compile(compiled)
    opt_e, opt_c = Lomo(eager, lr=0.1), Lomo(compiled, lr=0.1)
    for step in range(3):
        opt_e.fused_backward(loss_of(eager, step))
        opt_c.fused_backward(loss_of(compiled_fwd, step))
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        # Inductor may reassociate fp32 sums in the forward: the gradients differ by a few
        # U32 relative, which moves lr * g far less than an ulp of p; each of the 3 writes
        # rounds (<= 1/2 ulp each side). Within 1 ulp of the tensor's largest value per
        # step, held to 2 (U32 * max|b| is 1/2 to 1 ulp); seen on AVX2: 1/2 ulp.
        largest = b.detach().abs().max().item()
        torch.testing.assert_close(a, b, rtol=0, atol=3 * 4 * U32 * largest)


def test_single_backward_with_compiled_autograd_matches_eager(test_device):
    """single_backward clips each gradient by the norm of those before it: compiled
    autograd hands the gradients over in the eager order, so the steps are the eager ones,
    bit for bit (aot_eager computes as eager does)."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    eager = train(mlp(test_device), 4, single_backward=True)
    compiled = train(
        mlp(test_device), 4, compile_forward=True, compile_backward=True, single_backward=True
    )
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        assert torch.equal(a, b)
    assert dynamo_utils.counters["compiled_autograd"]["captures"] > 0


def test_single_backward_with_a_compiled_forward_and_eager_backward_is_refused():
    """A compiled region's backward run eagerly hands its gradients over in another order
    than the eager model's (measured on a LLaMA: the embedding first, the head midway),
    which changes single_backward's step: refused before any change, the call's lr not
    taken."""
    torch._dynamo.reset()
    model = mlp()
    opt = Lomo(model, lr=0.1, clip_grad_norm=1.0, single_backward=True)
    before = [p.detach().clone() for p in model.parameters()]
    loss = loss_of(torch.compile(model, backend="aot_eager"), 0)
    with pytest.raises(RuntimeError, match="depends on the order the gradients arrive in"):
        opt.fused_backward(loss, lr=0.5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    assert opt.param_groups[0]["lr"] == 0.1 and opt.step_count == 0
