"""The character-level LLaMA and the corpus that the demo and `bench quality` fine-tune.

The corpus is generated and shipped with the package (lomo_kernels/data/corpus.txt:
sentences about small numbers, `data/make_corpus.py`). Characters are the tokens (a
128-entry vocabulary), so nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

CORPUS = Path(__file__).parent.parent / "data" / "corpus.txt"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (hidden, intermediate, layers, heads): parameter counts with the 128-character vocabulary.
SIZES = {
    "tiny": (128, 352, 4, 4),
    "small": (256, 688, 4, 4),
    "base": (384, 1024, 6, 6),
    "wide": (512, 1408, 2, 8),
}
# Longest window: the model's position limit. Shortest: 2 characters, one next-character target.
MAX_SEQ = 512
MIN_SEQ = 2


def build_model(size: str, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.nn.Module:
    """A LLaMA of the named size with random weights from `seed`, built in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads = SIZES[size]
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=MAX_SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: no fp32 copy left in the heap
    try:
        with torch.device(device):
            return LlamaForCausalLM(config).train()
    finally:
        torch.set_default_dtype(previous)


def is_task(sentence: str) -> bool:
    """The fine-tuning task's sentences: arithmetic ("seven plus five is twelve.")."""
    return " plus " in sentence or " minus " in sentence


def corpus_parts() -> tuple[list[str], list[str], list[str]]:
    """(pretraining, fine-tuning, held-out) sentences: the arithmetic sentences are the
    fine-tuning task (the last 10% of them held out); the comparison, succession and
    counting sentences are for pretraining."""
    lines = CORPUS.read_text().splitlines()
    task = [s for s in lines if is_task(s)]
    cut = len(task) * 9 // 10
    return [s for s in lines if not is_task(s)], task[:cut], task[cut:]


def char_ids(sentences: list[str]) -> torch.Tensor:
    """The character ids of `sentences`, one per line."""
    return torch.tensor([min(ord(c), 127) for c in "\n".join(sentences) + "\n"])


def windows(data: torch.Tensor, seq: int, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless batches of random windows of `data`."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        yield torch.stack([data[s : s + seq] for s in starts.tolist()])


def held_out_windows(data: torch.Tensor, seq: int) -> torch.Tensor:
    """Consecutive windows covering the whole held-out text, one batch."""
    n = (data.numel() - 1) // seq
    return data[: n * seq].view(n, seq)


def held_out_loss(model: torch.nn.Module, data: torch.Tensor, seq: int, device: str) -> float:
    """Mean loss over consecutive windows covering the whole held-out text."""
    ids = held_out_windows(data, seq).to(device)
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)
