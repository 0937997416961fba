"""The estimate's preference and RL terms: generation's KV cache against Llama-3-8B by hand
and against the cache transformers fills, the reference model's copy of the weights, and
their options refused before any work when only half given."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from support.dependencies import require
from support.models import causal_lm

from lomo_kernels.tools import estimate as est
from lomo_kernels.tools.argtypes import keyword_arguments
from lomo_kernels.tools.cli import build_parser, main
from lomo_kernels.tools.models import PRESETS, resolve_model

GIB = 2**30
ROUNDING = 0.005  # every GiB figure is printed to 0.01
# Llama-3-8B: 32 layers, 8 KV heads of 128 dimensions (its config.json).
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128


def test_llama_3_8b_kv_cache_by_hand() -> None:
    """2 (k and v) x 32 layers x 8 heads x 128 x 2 bytes = 128 KiB a token in bf16; 16
    completions of 256 + 1,024 tokens hold 20,480 tokens = 2.5 GiB; fp32 twice that."""
    shape = PRESETS["llama-3-8b"]
    per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
    assert per_token == 128 * 1024
    assert est.kv_cache_bytes_per_token(shape, "bf16") == per_token
    assert est.kv_cache_bytes_per_token(shape, "fp32") == 2 * per_token
    assert est.kv_cache_bytes(shape, 16, 256 + 1024, "bf16") == 20480 * per_token
    plain = est.estimate("llama-3-8b", "lomo", precision="bf16", batch=2, seq=1024)
    rl = est.estimate(
        "llama-3-8b",
        "lomo",
        precision="bf16",
        batch=2,
        seq=1024,
        generation_batch=16,
        generation_tokens=1280,
    )
    assert rl.kv_cache_gib == 2.5
    assert rl.detail["kv_cache_bytes_per_token"] == per_token
    # The training side is unchanged; the cache is added to the total.
    assert rl.activations_gib == plain.activations_gib
    assert rl.total_gib == pytest.approx(plain.total_gib + 2.5, abs=2 * ROUNDING)
    assert plain.kv_cache_gib == 0 and plain.reference_model_gib == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_cache_is_what_transformers_fills(dtype: torch.dtype) -> None:
    """An awkward grouped-query LLaMA (5 layers, 6 heads over 2 KV heads of 12) run on 3 x 7
    tokens with the cache on: the bytes of every key and value tensor it keeps."""
    require("transformers")
    model = causal_lm(
        "llama", dtype, num_hidden_layers=5, hidden_size=72, num_attention_heads=6,
        num_key_value_heads=2, intermediate_size=100, vocab_size=50,
    ).eval()  # fmt: skip
    batch, tokens = 3, 7
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 50, (batch, tokens)), use_cache=True)
    cache = out.past_key_values
    held = sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    assert est.kv_cache_bytes(resolve_model(model.config), batch, tokens, precision) == held


@pytest.mark.parametrize(("gpus", "zero3"), [(1, False), (8, True)])
def test_reference_model_is_a_copy_of_the_weights(gpus: int, zero3: bool) -> None:
    """N x 2 bytes in bf16, sharded over the GPUs under ZeRO-3, added to the total."""
    shape = PRESETS["llama-3-8b"]
    kwargs = dict(precision="bf16", gpus=gpus, zero3=zero3, gpu_mem_gib=24)
    plain = est.estimate("llama-3-8b", "lomo", **kwargs)
    dpo = est.estimate("llama-3-8b", "lomo", reference_model=True, **kwargs)
    expected = shape.num_parameters * 2 / gpus / GIB
    assert dpo.reference_model_gib == pytest.approx(expected, abs=ROUNDING)
    assert dpo.total_gib == pytest.approx(plain.total_gib + expected, abs=2 * ROUNDING)
    assert plain.fits and not dpo.fits if gpus == 1 else dpo.fits


def test_cli_prints_each_term_on_its_own_line(capsys) -> None:
    args = ["estimate", "--model", "llama-3-8b", "--optimizer", "lomo", "--precision", "bf16"]
    rl = ["--generation-batch", "16", "--generation-tokens", "1280", "--reference-model"]
    assert main([*args, *rl]) == 0
    lines = capsys.readouterr().out.splitlines()
    kv = [line for line in lines if "KV cache (16 x 1280, 128 KiB/token)" in line]
    assert len(kv) == 1 and kv[0].split()[-2] == "2.50"
    reference = [line for line in lines if "reference model" in line]
    assert len(reference) == 1 and float(reference[0].split()[-2]) > 14
    assert main([*args, *rl, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_cache_gib"] == 2.5 and out["detail"]["reference_model"] is True
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert "KV cache" not in plain and "reference model" not in plain


@pytest.mark.parametrize(
    "given",
    [["--generation-batch", "16"], ["--generation-tokens", "1280"]],
    ids=["batch", "tokens"],
)
def test_half_a_kv_cache_is_refused_naming_both_options(capsys, given: list[str]) -> None:
    args = ["estimate", "--model", "llama-3-8b", "--optimizer", "lomo", *given]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--generation-batch" in captured.err and "--generation-tokens" in captured.err
    with pytest.raises(ValueError, match="give both"):
        est.estimate("llama-3-8b", "lomo", generation_batch=16)
    with pytest.raises(ValueError, match="generation_tokens must be an int >= 0"):
        est.estimate("llama-3-8b", "lomo", generation_batch=1, generation_tokens=-1)
    with pytest.raises(SystemExit) as exc:
        main(
            ["estimate", "--model", "llama-3-8b", "--optimizer", "lomo", "--generation-batch", "-1"]
        )
    assert exc.value.code == 2


# -- docs/preference_rl.md quotes the estimate: its command, its output and its table --------
PAGE = Path(__file__).resolve().parents[2] / "docs" / "preference_rl.md"


def memory_section() -> str:
    text = PAGE.read_text()
    return text[text.index("## Memory: full-parameter GRPO") :]


def test_the_documented_command_prints_the_documented_output(capsys) -> None:
    section = memory_section()
    command = re.search(r"```bash\n(lomo-kernels estimate [^\n]+)\n```", section).group(1)
    quoted = re.search(r"```text\n(.*?)\n```", section, re.S).group(1)
    assert main(shlex.split(command)[1:]) == 0
    assert capsys.readouterr().out.rstrip("\n") == quoted


def test_the_documented_table_is_the_estimates() -> None:
    """Each row: the command plus the row's options, its total and its verdicts at 24 and 80
    GiB as the estimate gives them."""
    section = memory_section()
    command = re.search(r"```bash\n(lomo-kernels estimate [^\n]+)\n```", section).group(1)
    base = shlex.split(command)[2:]
    rows = re.findall(r"^\| (\(none[^|]*\)|`[^`|]+`) \|(.*)\|$", section, re.M)
    assert len(rows) == 6
    parser = build_parser()
    for options, cells in rows:
        added = [] if options.startswith("(none") else shlex.split(options.strip("`"))
        *_, total, at24, at80 = (c.strip() for c in cells.split("|"))
        args = parser.parse_args(["estimate", *base, *added])
        kwargs = keyword_arguments(args, est.estimate)
        for gib, verdict in ((24, at24), (80, at80)):
            e = est.estimate(**{**kwargs, "gpu_mem_gib": gib})
            assert f"{e.total_gib:.2f}" == total, options
            assert e.fits == verdict.startswith("fits"), (options, gib)
