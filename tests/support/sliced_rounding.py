"""Stochastic rounding of sharded slices checked against the whole parameter (2-rank workers).

A rank's slice of a parameter starts at a flat offset into it; the update and the
accumulation round each element with the bits of its flat index there, so the ranks' slices
put together must hold, bit for bit, what the reference op stores for the whole parameter from
the same reduced gradients. The workers note the reduced slices the sharding hands the
optimizer (`noting_reduced_slices`), step each whole parameter with the reference op and
compare (`slices_against_whole`); the test side asserts the outcome (`assert_slices_as_whole`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def noting_reduced_slices(opt, model) -> list:
    """Makes `opt`'s sharding note every reduced slice it hands over, before the optimizer
    uses it: the list it fills with (parameter name, offset, reduced gradient, the slice's
    values then, the slice)."""
    names = {id(p): n for n, p in model.named_parameters()}
    noted: list = []

    def note(batches):
        for batch in batches:
            for shard, grad in batch:
                noted.append((names[id(shard.param)], shard.offset, grad.clone(),
                              shard.local.clone(), shard.local))  # fmt: skip
        return batches

    sharding = opt._sharding
    grad_ready, finish = sharding.grad_ready, sharding.finish
    sharding.grad_ready = lambda param, grad: note(grad_ready(param, grad))
    sharding.finish = lambda: note(list(finish()))
    return noted


def seeds_of(opt, model) -> dict[str, int]:
    """Each parameter's rounding seed, by name (its index among the trained ones)."""
    from lomo_kernels.optim.rounding import parameter_seed

    return {n: parameter_seed(opt._groups.index_of[id(p)]) for n, p in model.named_parameters()}


def slices_against_whole(model, entries: list, step: Callable[..., torch.Tensor]) -> dict:
    """Every rank's `entries`, (parameter name, offset, inputs, output) of each slice it
    holds, gathered: each whole parameter's output against ``step(name, whole inputs)``, the
    reference op on the slices' inputs put together (offset 0), bit for bit; and each slice
    not starting at a multiple of 32 against ``step`` on its own inputs, as if it began its
    parameter, which must differ somewhere (else the check could not fail)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, entries)
    parts: dict[str, list] = {}
    for name, offset, inputs, output in (e for rank_entries in everyone for e in rank_entries):
        if output.numel():
            parts.setdefault(name, []).append((offset, inputs, output))
    mismatched, differs_at_zero, unaligned = [], 0, 0
    for name, pieces in parts.items():
        pieces.sort(key=lambda piece: piece[0])
        inputs = [torch.cat([piece[1][k] for piece in pieces]) for k in range(len(pieces[0][1]))]
        output = torch.cat([piece[2] for piece in pieces])
        whole = step(name, *inputs).reshape(-1)
        if not torch.equal(whole.view(torch.int16), output.view(torch.int16)):
            mismatched.append(name)
        for offset, piece_inputs, piece_output in pieces:
            if offset % 32:
                unaligned += 1
                at_zero = step(name, *piece_inputs).reshape(-1).view(torch.int16)
                differs_at_zero += not torch.equal(at_zero, piece_output.view(torch.int16))
    return {
        "dtype": str(next(iter(parts.values()))[0][2].dtype),
        "compared": len(parts),
        "parameters": len(list(model.parameters())),
        "mismatched": mismatched,
        "unaligned": unaligned,
        "differs_at_zero": differs_at_zero,
    }


def stochastic_update_check(
    opt, model, loss_of: Callable[[], torch.Tensor], lr: float, weight_decay: float
) -> dict:
    """One update pass of `opt` (bf16 slices, stochastic rounding, built with `lr` and
    `weight_decay`) on `loss_of()` (the forward run here: FSDP2's parameters are its
    unsharded ones from a forward to its backward): every rank's slices against one reference
    update of each whole parameter from the same reduced gradients (`slices_against_whole`)."""
    from lomo_kernels import ops

    seeds = seeds_of(opt, model)
    noted = noting_reduced_slices(opt, model)
    opt.fused_backward(loss_of())
    seed_step = opt.rounding.seed_step(torch.device("cpu")).clone()

    def update(name, before, grad):
        out = before.clone()
        ops.fused_lomo_update_(out, grad, lr=lr, weight_decay=weight_decay,
                               stochastic_rounding=True, seed=seeds[name],
                               seed_step=seed_step, backend="torch")  # fmt: skip
        return out

    entries = [(name, offset, (before, grad), local.clone())
               for name, offset, grad, before, local in noted]  # fmt: skip
    return slices_against_whole(model, entries, update)


def stochastic_accumulation_check(opt, model, losses: Callable[[int], torch.Tensor]) -> dict:
    """Two micro-batches (`losses(0)`, `losses(1)`) of `opt`'s accumulation of three into
    bf16 buffers, stochastically rounded: every rank's buffer slices against the reference
    op's accumulation of each whole parameter's reduced gradients."""
    from lomo_kernels import ops

    seeds = seeds_of(opt, model)
    noted = noting_reduced_slices(opt, model)
    grads, seed_steps = [], []
    for micro_batch in range(2):
        opt.fused_backward(losses(micro_batch))
        grads.append({name: grad for name, _, grad, _, _ in noted})
        seed_steps.append(opt._accumulation._seed_steps[torch.device("cpu")].clone())
        noted.clear()

    def accumulate(name, first, second):
        out = first.clone()  # the first micro-batch's bf16 gradient, stored exactly
        ops.grad_accumulate_(out, second, stochastic_rounding=True, seed=seeds[name],
                             seed_step=seed_steps[1], backend="torch")  # fmt: skip
        return out

    names = {id(p): n for n, p in model.named_parameters()}
    entries = [(names[id(param)], shard.offset, (grads[0][names[id(param)]],
                grads[1][names[id(param)]]), buffer.clone())
               for param, buffer, shard in opt._accumulation.buffered()]  # fmt: skip
    return slices_against_whole(model, entries, accumulate)


def assert_slices_as_whole(result: dict) -> None:
    """`slices_against_whole`'s outcome on one rank: bf16 slices of every parameter, each
    whole parameter equal bit for bit, and unaligned slices that the check could tell from
    ones rounded as if they began their parameter (some: a small slice may draw the same by
    chance)."""
    assert result["dtype"] == "torch.bfloat16"
    assert result["compared"] == result["parameters"]
    assert result["mismatched"] == []
    assert result["unaligned"] > 0
    assert result["differs_at_zero"] > 0
