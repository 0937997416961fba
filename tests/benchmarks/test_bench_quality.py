"""`python -m bench.quality`: the corpus split, the pretrained checkpoint's cache, the
upcast forward, the emulated compensated write-back, the kept shares, and one short run
end to end through the command line."""

from __future__ import annotations

import json

import pytest
import torch
from support.bench_cli import main
from support.models import tiny_llama

from bench import quality as bq
from bench.common.char_model import char_ids, corpus_parts, is_task
from lomo_kernels import Lomo


def test_corpus_split_pretrains_and_fine_tunes_on_disjoint_sentences():
    pre, task, held = corpus_parts()
    assert pre and task and held
    assert not any(is_task(s) for s in pre)
    assert all(is_task(s) for s in task + held)
    assert not set(task) & set(held)
    assert len(held) == len(task + held) - len(task + held) * 9 // 10


def test_pretrained_checkpoint_is_made_once_and_keyed_by_its_recipe(monkeypatch, tmp_path):
    monkeypatch.setenv("LOMO_KERNELS_CACHE", str(tmp_path))
    recipe = {**bq.PRETRAIN, "steps": 2}
    logged: list[str] = []
    path = bq.pretrained("tiny", recipe, logged.append)
    assert path.exists() and any("pretraining" in line for line in logged)
    mtime = path.stat().st_mtime_ns
    logged.clear()
    assert bq.pretrained("tiny", recipe, logged.append) == path
    assert path.stat().st_mtime_ns == mtime and not logged  # cached: not trained again
    assert bq.checkpoint_name("tiny", {**recipe, "steps": 3}) != path.name
    # The default recipe's checkpoint is the one shipped in bench/data/: nothing to pretrain.
    logged.clear()
    assert bq.pretrained("tiny", bq.PRETRAIN, logged.append).parent == bq.SHIPPED
    assert not logged


def test_the_sweep_table_marks_each_best_rate():
    found = {
        "optimizers": {
            "lomo": {"lr": 0.1, "held_out_loss": {"0.01": 1.2, "0.1": 0.45}},
            "adamw_master": {"lr": 0.001, "held_out_loss": {"0.001": 0.38, "0.01": 0.41}},
        }
    }
    assert bq.sweep_table(found).splitlines()[2:] == [
        "| lomo | 0.01: 1.200, **0.1: 0.450** | 0.1 |",
        "| adamw_master | **0.001: 0.380**, 0.01: 0.410 | 0.001 |",
    ]


def test_upcast_forward_computes_in_fp32_and_steps_the_bf16_weights():
    """The fp32 forward of bf16 weights: the loss of an fp32 copy of the same weights, and the
    gradients reach the bf16 parameters' hooks (Lomo steps them)."""
    model = tiny_llama(torch.bfloat16)
    reference = tiny_llama(torch.float32)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.no_grad():  # non-persistent buffers too (RoPE's inv_freq went through bf16)
        for (_, ours), (_, theirs) in zip(
            model.named_buffers(), reference.named_buffers(), strict=True
        ):
            theirs.copy_(ours.float())
    ids = char_ids(["one plus one is two."])[None, :16] % 64
    upcast = bq.UpcastForward(model)
    loss = upcast(input_ids=ids, labels=ids).loss
    assert loss.dtype == torch.float32
    assert torch.equal(loss, reference(input_ids=ids, labels=ids).loss)
    before = [p.detach().clone() for p in model.parameters()]
    Lomo(upcast, lr=0.1).fused_backward(loss)
    # Every matrix moves (a norm weight's update can be far below a bf16 spacing).
    params = list(model.parameters())
    changed = [not torch.equal(a, p) for a, p in zip(before, params, strict=True) if p.dim() > 1]
    assert all(p.dtype == torch.bfloat16 for p in params) and all(changed)


def test_compensated_write_back_carries_the_rounding_error():
    """After each step the weights sit on the bf16 grid and the buffer holds what they lost
    (rounded to bf16): weights + buffer track the fp32 sum of the updates far closer than
    the rounded weights alone."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64)
    compensate = bq.CompensatedBf16(layer)
    exact = layer.weight.detach().double().clone()
    for _ in range(50):
        delta = torch.randn_like(layer.weight) * 1e-4  # far below half a bf16 spacing
        with torch.no_grad():
            layer.weight += delta
        exact += delta.double()
        compensate()
        assert torch.equal(layer.weight, layer.weight.bfloat16().float())
    error = compensate.errors[0].double()
    with_buffer = float((layer.weight.double() + error - exact).abs().max())
    without = float((layer.weight.double() - exact).abs().max())
    # A buffer value is at most half a weight's spacing (2^-8 |w|), stored with an error of
    # at most half its own spacing (2^-8 of it): each step loses at most 2^-16 |w|.
    bound = 50 * 2**-16 * float(exact.abs().max())
    assert with_buffer <= bound < without


def test_kept_shares_and_memory_columns():
    rows = [
        {"optimizer": "lomo", "lr": 0.01, "dtype": "fp32", "rounding": "exact"},
        {"optimizer": "lomo", "lr": 0.01, "dtype": "bf16", "rounding": "nearest"},
        {"optimizer": "lomo", "lr": 0.01, "dtype": "bf16", "rounding": "compensated"},
        {"optimizer": "adamw_master", "lr": 0.001, "dtype": "bf16", "rounding": "master"},
    ]
    for r, after in zip(rows, (1.0, 2.0, 1.2, 0.5), strict=True):
        r.update(loss_before=3.0, loss_after=after, num_parameters=2**20)
    bq.kept_shares(rows)
    assert [r["kept"] for r in rows] == [1.0, 0.5, pytest.approx(0.9), None]
    peaks = {
        ("lomo", "fp32", ""): 30.0,
        ("lomo", "bf16", ""): 20.0,
        ("adamw_master", "bf16", ""): 40.0,
    }
    bq.memory_columns(rows, peaks)
    assert [r["memory_mib"] for r in rows] == [30.0, 20.0, 22.0, 40.0]  # + 2 MiB buffer
    chosen = bq.rows("all")
    metered = bq.memory_rows(chosen)
    assert {bq.memory_key(r) for r in metered} == {
        bq.memory_key(r) for r in chosen if r.rounding != "compensated"
    }
    assert len(metered) == len({bq.memory_key(r) for r in metered})


def test_bench_quality_end_to_end(monkeypatch, tmp_path, capsys):
    """Two fine-tuning steps per row from a two-step checkpoint: every row runs, the table and
    the JSON hold every column (the figures themselves: BENCHMARKS.md)."""
    monkeypatch.setenv("LOMO_KERNELS_CACHE", str(tmp_path))
    out = tmp_path / "quality.json"
    argv = ["quality", "--rows", "paper", "--steps", "2", "--pretrain-steps", "2"]
    assert main(argv + ["--optimizers", "adalomo", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| adalomo | 0.001 | bf16, stochastic (default) |" in printed
    assert "| adalomo | 0.001 | bf16, round to nearest |" in printed
    result = json.loads(out.read_text())
    assert len(result["rows"]) == len(bq.rows("paper", ["adalomo"])) == len(bq.STORAGES)
    for r in result["rows"]:
        assert {"loss_before", "loss_after", "kept", "memory_mib", "label"} <= set(r)
        assert r["memory_mib"] > 0


def test_accumulation_rows_and_their_memory():
    """Accumulation rows at the papers' rates, their gain against the fp32 weights + fp32
    buffer row, the fp32 and the 8-bit buffers measured apart."""
    chosen = bq.rows("paper", ["lomo_accumulate"])
    assert [(r.dtype, r.rounding) for r in chosen] == list(bq.ACCUMULATION)
    assert {r.lr for r in chosen} == {bq.LRS["lomo"][0]}
    metered = bq.memory_rows(chosen)
    assert [r.rounding for r in metered] == ["exact", "stochastic", "fp32 buffer", "int8 buffer"]
    results = [
        {**bq.asdict(r), "loss_before": 3.0, "loss_after": a, "num_parameters": 2**20}
        for r, a in zip(chosen, (1.0, 1.1, 1.05, 1.2), strict=True)
    ]
    bq.kept_shares(results)
    assert [r["kept"] for r in results] == pytest.approx([1.0, 0.95, 0.975, 0.9])
    peaks = {bq.memory_key(r): p for r, p in zip(metered, (10.0, 8.0, 12.0, 7.0), strict=True)}
    bq.memory_columns(results, peaks)
    assert [r["memory_mib"] for r in results] == [10.0, 8.0, 12.0, 7.0]
