"""The character-level LLaMA and the corpus that the demo and `bench.quality` fine-tune.

The corpus is generated and kept in the repository (bench/data/corpus.txt:
sentences about small numbers, `data/make_corpus.py`). Characters are the tokens (a
128-entry vocabulary), so nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from . import models
from .models import ModelShape

CORPUS = Path(__file__).parents[1] / "data" / "corpus.txt"
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


def char_shape(size: str) -> ModelShape:
    """The LLaMA shape of the named size, on the 128-character vocabulary."""
    hidden, inter, layers, heads = SIZES[size]
    return ModelShape(f"char-{size}", 128, hidden, inter, layers, heads, heads)


def build_model(size: str, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.nn.Module:
    """A LLaMA of the named size with random weights from `seed`, built in `dtype`."""
    return models.build_model(
        char_shape(size), dtype, device, seed=seed, max_position_embeddings=MAX_SEQ
    )


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
