"""Writes the pretrained checkpoint the demo and `bench.quality` start from, reproducibly.

    python -m bench.data.make_checkpoint

The character-level LLaMA of `bench.quality` ("tiny": hidden 128, 4 layers, 0.8M
parameters) pretrained in fp32 with AdamW on the corpus's comparison, succession and
counting sentences, from a fixed seed, on one thread (`quality.PRETRAIN`): the same bits on
a given machine and torch. Written here as ``pretrained-tiny-<digest>.pt`` (3.4 MB, a
state dict of tensors, loaded with ``torch.load(..., weights_only=True)``); the digest keys
the recipe, the model's shape and the corpus, so a change of any of them leaves the file
unused (the demo then pretrains and caches a new one) until this script is run again.
Older checkpoints here are removed.
"""

from __future__ import annotations

from pathlib import Path

from bench.quality import PRETRAIN, SHIPPED, SIZE, checkpoint_name, pretrain_into


def main() -> Path:
    path = SHIPPED / checkpoint_name(SIZE, PRETRAIN)
    pretrain_into(path, SIZE, PRETRAIN)
    for old in SHIPPED.glob(f"pretrained-{SIZE}-*.pt"):
        if old != path:
            old.unlink()
    print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
    return path


if __name__ == "__main__":
    main()
