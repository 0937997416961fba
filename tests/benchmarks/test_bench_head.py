"""`python -m bench.head`: every variant does the same step, and the table says so.

The benchmark compares ways of computing the head's loss, backward and update; it is only
a comparison if each way makes the same update. Reference: the unfused step (fp32 logits,
F.cross_entropy, W.grad, the fused update). The fused loss sums the same products in
another order: each weight-gradient element is a sum over tokens of fp32 products of
logit-sized terms, so the two gradients differ by at most about (tokens + vocab + hidden)
units of fp32 rounding of the largest gradient element (the bound tests/
test_linear_cross_entropy.py states for the op); the update is lr times that, and each run
rounds its write-back into W once (half an ulp of the weight).
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.allocations import formed_gradients

from bench import head as bench_head

VOCAB, HIDDEN, TOKENS = 300, 24, 50


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator).requires_grad_(True)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    return hidden, labels


@pytest.mark.parametrize("variant", ["fused", "fused_lomo"])
def test_each_variant_updates_the_head_as_the_unfused_step(variant):
    torch.manual_seed(0)
    start = bench_head.Head(VOCAB, HIDDEN, torch.float32, "cpu")
    reference, head = copy.deepcopy(start), copy.deepcopy(start)
    hidden, labels = _inputs()
    bench_head._unfused(hidden, reference, labels)
    reference_d_hidden = hidden.grad.clone()
    hidden.grad = None
    # The fused loss's whole head gradient, or, with Lomo stepping the head from its
    # vocabulary chunks, none.
    formed = formed_gradients(head.weight)
    bench_head._build(variant, head, "cpu")(hidden, head, labels)
    assert formed == ([] if variant == "fused_lomo" else [(VOCAB, HIDDEN)])
    want = reference.weight.detach() - start.weight.detach()
    got = head.weight.detach() - start.weight.detach()
    assert want.abs().max() > 0
    eps = torch.finfo(torch.float32).eps
    # The gradients' difference times lr, plus each step's write-back into W (half an ulp of
    # the largest weight, in each of the two runs).
    bound = (TOKENS + VOCAB + HIDDEN) * eps * want.abs().max() + eps * start.weight.abs().max()
    assert (got - want).abs().max() <= bound
    torch.testing.assert_close(
        hidden.grad,
        reference_d_hidden,
        rtol=0,
        atol=(VOCAB + HIDDEN) * torch.finfo(torch.float32).eps * reference_d_hidden.abs().max(),
    )
    assert head.weight.grad is None


def test_table_has_every_variant_and_the_unfused_logits_in_its_peak():
    shape = bench_head.HeadShape(VOCAB, HIDDEN, TOKENS)
    rows, meta = bench_head.run(shape, list(bench_head.VARIANTS), dtype="fp32", steps=1, warmup=1)
    status = {r["variant"]: r["status"] for r in rows}
    assert status == {
        "unfused": "ok",
        "fused": "ok",
        "fused_lomo": "ok",
        "liger": "needs CUDA",
        "cce": "needs CUDA",
    }
    by_name = {r["variant"]: r for r in rows}
    # The unfused step holds its fp32 logits and their gradient at once at some point.
    logits_bytes = TOKENS * VOCAB * 4
    assert by_name["unfused"]["step_peak_bytes"] >= 2 * logits_bytes
    assert all(by_name[v]["median_step_s"] > 0 for v in ("unfused", "fused", "fused_lomo"))
    table = bench_head.format_table(rows, meta)
    for variant in bench_head.VARIANTS:
        assert f"| {variant} |" in table
    assert "| liger | needs CUDA |" in table


def test_cli_parses_the_shape_and_overrides(capsys):
    from support.bench_cli import build_parser

    args = build_parser("head").parse_args(
        ["--shape", "llama-3-8b", "--tokens", "128", "--variants", "fused,cce"]
    )
    assert args.shape == "llama-3-8b" and args.tokens == 128
    assert args.variants == ["fused", "cce"]
    with pytest.raises(SystemExit) as exc:
        build_parser("head").parse_args(["--variants", "fused,other"])
    assert exc.value.code == 2
    assert "--variants: unknown 'other'" in capsys.readouterr().err
