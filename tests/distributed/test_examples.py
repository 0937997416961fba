"""The two sharded fine-tuning examples run as their docstrings say (torchrun, 2 ranks, gloo)
and write a consolidated checkpoint that one process loads into the same model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.sharded_checks import run_ranks
from transformers import LlamaConfig, LlamaForCausalLM

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 2
TINY = ["--steps", str(STEPS), "--hidden", "64", "--layers", "1", "--batch", "2", "--seq", "16"]


def tiny_model() -> LlamaForCausalLM:
    """The model TINY asks the examples for (`finetune_common.llama_config`), seeded as the
    FSDP2 example seeds its initial weights."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64 * 11 // 4,
        num_hidden_layers=1,
        num_attention_heads=1,
        max_position_embeddings=16,
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize(
    "example, options",
    [
        ("fsdp2_finetune.py", ["--precision", "fp32"]),
        ("zero3_finetune.py", ["--dtype", "fp32"]),
        ("zero3_finetune.py", ["--dtype", "fp32", "--optimizer", "adalomo", "--single-backward"]),
    ],
    ids=["fsdp2_lomo", "zero3_lomo", "zero3_adalomo_single_backward"],
)
def test_example_trains_and_one_process_loads_its_checkpoint(tmp_path, example, options):
    saved_path = tmp_path / "consolidated.pt"
    args = [*TINY, *options, "--save", str(saved_path)]
    run_ranks(EXAMPLES / example, tmp_path, example, args=args)
    saved = torch.load(saved_path, weights_only=True)
    model = tiny_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(saved["model"])  # strict: every parameter and buffer, whole
    assert all(torch.isfinite(v).all() for v in saved["model"].values())
    if example.startswith("zero3"):
        # zero.Init initialises the weights its own way: its seeded start, from a run of no
        # steps (the same seed, the same consolidated checkpoint).
        start_path = tmp_path / "start.pt"
        no_steps = [*TINY, *options, "--steps", "0", "--save", str(start_path)]
        run_ranks(EXAMPLES / example, tmp_path, example, args=no_steps)
        initial = torch.load(start_path, weights_only=True)["model"]
    # Training moved every weight matrix (the norm weights too: weight decay).
    unmoved = [k for k, v in model.state_dict().items() if torch.equal(v, initial[k])]
    assert unmoved == [], unmoved
    assert saved["optimizer"]["lomo"]["step_count"] == STEPS
