"""How an optimizer rounds its write-back into low-precision parameters.

At fine-tuning learning rates most per-element updates are below half a bf16 (or fp16) ulp,
so round-to-nearest returns the old weight and the update is lost. Stochastic rounding
rounds up with probability equal to the distance from the lower neighbour over the spacing:
unbiased, so the expected weight follows the fp32 trajectory (docs/benchmarks/quality.md). It is on
by default for bf16 and fp16 parameters; fp32 parameters are stored
exactly and never rounded.

The bits are counter-based: a per-parameter seed (the parameter's index, fixed for a run),
a per-step value kept in a device tensor (so a compiled backward does not depend on the
step) and the element's flat index in the whole parameter. A slice (a row block, a ZeRO-3 or
FSDP2 shard) is passed to the ops with its flat offset in the parameter, so it rounds
exactly as the whole tensor would, in one call.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..core.rounding import mix32_int, rounds_stochastically


def step_value(seed: int, step_count: int) -> int:
    """The per-step part of the rounding key for `seed` at `step_count` completed steps:
    distinct per (seed, step); 31 bits, so each (seed, step, parameter) keeps the stream of
    the 63-bit seed ``step_value << 32 | index``. A seed's high half is folded in too
    (`mix32_int` reads 32 bits): seeds that differ only there round differently."""
    value = mix32_int(seed ^ mix32_int(step_count))
    if seed >> 32:
        value = mix32_int(value ^ mix32_int(seed >> 32))
    return value & 0x7FFFFFFF


# Salt of the seeds of a gradient's later parts (`parameter_seed`).
_PART_SALT = 0x2F6B_1C57


def parameter_seed(index: int, part: int = 0) -> int:
    """The seed keying the bits of trained parameter `index` (`part` > 0: a later part of a
    gradient that comes in parts, with bits of its own). In the seed's high half, which the
    kernels mix with the step's value: through the low half two parameters' keys would differ
    by one constant at every step, so some element of each would draw the same bits at every
    step."""
    high = mix32_int(index ^ mix32_int(part ^ _PART_SALT)) & 0x7FFFFFFF if part else index
    return high << 32


def check_seed(seed: object) -> int:
    """`seed` as an int in [0, 2**63), or a clear refusal."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return seed


def fill_per_device(
    store: dict[torch.device, torch.Tensor], devices: Iterable[torch.device], value: int
) -> None:
    """Fills each device's 1-element int64 tensor of `store` (made at first use) with
    `value` in place: the kernels read a tensor, so a new value is no new input (no sync)."""
    for device in devices:
        if device not in store:
            store[device] = torch.zeros(1, dtype=torch.int64, device=device)
        store[device].fill_(value)


class WriteBackRounding:
    """The rounding of one optimizer's write-back: whether it is stochastic, its seed, and
    per device the per-step part of the key the kernels read."""

    def __init__(self, stochastic: bool, seed: int) -> None:
        self.stochastic = bool(stochastic)
        self.seed = check_seed(seed)
        self._seed_steps: dict[torch.device, torch.Tensor] = {}

    def applies_to(self, dtype: torch.dtype) -> bool:
        """Whether parameters of `dtype` are rounded stochastically (bf16, fp16)."""
        return self.stochastic and rounds_stochastically(dtype)

    def begin_step(self, step_count: int, devices: Iterable[torch.device]) -> None:
        """Refreshes the per-step value on each device, in place (host-side, no sync)."""
        if not self.stochastic:
            return
        fill_per_device(self._seed_steps, devices, step_value(self.seed, step_count))

    def seed_step(self, device: torch.device) -> torch.Tensor | None:
        """This step's per-step value on `device` (None before the first step or when off)."""
        return self._seed_steps.get(device)
