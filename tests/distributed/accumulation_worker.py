"""One rank of the gradient accumulation checks on sharded parameters (run by
test_sharded_accumulation.py under torchrun, gloo, CPU): ZeRO-3 and FSDP2, Lomo and AdaLomo
with accumulation_steps=4 and a short step applied by opt.step(), each rank accumulating
its reduced slices; Lomo with the 8-bit buffer too; AdaLomo's damaged moments refused before
any change, with and without accumulation; an inf in one micro-batch's gradient on one rank
only (the whole step skipped on every rank, then a clean step); FSDP2's refused micro-batch
(gradient sync off) between pending ones.

Writes, on rank 0, to the directory in argv[1]: each run's consolidated initial and final
parameters for the one-process reference, and `checks.json` with what every rank saw.
"""

from __future__ import annotations

import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fsdp2_worker  # noqa: E402
import zero3_worker  # noqa: E402
from support.sharded_checks import run_worker  # noqa: E402
from support.sharded_models import (  # noqa: E402
    ACCUMULATING,
    ACCUMULATING_INT8,
    LR,
    OVERFLOW_RUNS,
    POISONED_MICRO_BATCH,
    STEPS,
    ScaledLlama,
    rank_batch,
    train_accumulating,
)
from support.state import (  # noqa: E402
    assert_same_state,
    changes_since,
    optimizer_snapshot,
    same_bits,
    snapshot,
    unchanged,
)

from lomo_kernels import AdaLomo, Lomo  # noqa: E402
from lomo_kernels.distributed import consolidated_state_dict  # noqa: E402

torch.set_num_threads(1)
OUT = Path(sys.argv[1])
OPTIMIZERS = {
    "lomo": Lomo,
    "adalomo": AdaLomo,
    "lomo_int8": Lomo,
    "adalomo_int8": AdaLomo,
    # bucket_numel=1: the step from the buffers dequantises one parameter's at a time.
    "adalomo_int8_batched": AdaLomo,
}


def build(engine: str, model_class: type = ScaledLlama):
    """The sharded `model_class` (what the optimizer is built on, the module that runs
    forward)."""
    if engine == "zero3":
        built = zero3_worker.build(model_class=model_class)
        return built, built.module
    model = fsdp2_worker.build(model_class=model_class)
    return model, model


def shards(model, rank: int) -> dict[str, list[int]]:
    """[flat offset, elements] of this rank's part of each parameter, as the engine holds it:
    ZeRO-3's partition of ceil(n / W) elements less its padding, FSDP2's local rows (dim 0
    cut as torch.chunk does)."""
    parts = {}
    for name, param in model.named_parameters():
        if hasattr(param, "ds_tensor"):
            size, numel = param.ds_tensor.numel(), int(param.ds_numel)
            start = min(rank * size, numel)
            parts[name] = [start, min(size, numel - start)]
        else:
            rows = param.shape[0]
            first = min(rank * -(-rows // dist.get_world_size()), rows)
            parts[name] = [first * (param.numel() // rows), param.to_local().numel()]
    return parts


def run(engine: str, name: str, rank: int, checks: dict) -> None:
    target, model = build(engine)
    initial = consolidated_state_dict(model)
    options = ACCUMULATING_INT8 if "_int8" in name else ACCUMULATING
    if name.endswith("_batched"):
        options = {**options, "bucket_numel": 1}
    opt = OPTIMIZERS[name](target, lr=LR[name.split("_")[0]], **options)
    # The pieces of each batch the step from the buffers hands the update.
    batch_sizes: list[int] = []
    update_shards = opt._update_shards
    opt._update_shards = lambda batch: (batch_sizes.append(len(batch.pieces)), update_shards(batch))
    batch_of = lambda index: rank_batch(index, rank)  # noqa: E731
    norms = []  # every step's, noted as it is applied (by the k-th micro-batch or step())

    def note(micro_batch: bool, step: int) -> None:
        if opt.step_count > step:
            norms.append(float(opt.last_grad_norm))

    train_accumulating(model, opt, batch_of, STEPS, after_call=note)
    # This rank's buffers (kept after the step): its slices of the parameters.
    buffer_bytes = opt._accumulation.buffer_bytes()
    names = {id(p): n for n, p in model.named_parameters()}
    buffers = {names[id(param)]: [shard.offset, getattr(buffer, "codes", buffer).numel()]
               for param, buffer, shard in opt._accumulation._buffers.values()}  # fmt: skip
    # A step's first micro-batch, then a checkpoint: refused on every rank, nothing changed.
    opt.fused_backward(model(batch_of(1000)) / opt.accumulation_steps)
    before = optimizer_snapshot(model, opt)  # the buffers included
    try:
        opt.state_dict()
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    changed_by_refusal = changes_since(before, model, opt)
    pending_after_refusal = opt.pending_micro_batches
    opt.zero_grad()
    checks[f"{engine}_{name}"] = {
        "step_count": opt.step_count,
        "norms": norms,
        "refused_mid_step": refused,
        "changed_by_refusal": changed_by_refusal,
        "pending_after_refusal": pending_after_refusal,
        "pending_after_zero_grad": opt.pending_micro_batches,
        "buffer_bytes": buffer_bytes,
        "buffers": buffers,
        "shards": shards(model, rank),
        "batch_sizes": batch_sizes,
    }
    final = consolidated_state_dict(model)
    if rank == 0:
        torch.save({"initial": initial, "final": final}, OUT / f"{engine}_{name}.pt")


def changes_but_accumulation(before: dict, model, opt) -> str | None:
    """What differs from `before` (`optimizer_snapshot`) but the accumulated micro-batches."""
    after = optimizer_snapshot(model, opt)
    try:
        assert_same_state(
            {k: v for k, v in before.items() if k != "accumulation"},
            {k: v for k, v in after.items() if k != "accumulation"},
            "snapshot",
        )
    except AssertionError as exc:
        return str(exc)
    return None


def run_damaged_moments(engine: str, rank: int, checks: dict) -> None:
    """AdaLomo's moments damaged on every rank after a step (a matrix's row factor, whose
    R spans the whole matrix, then a 1-D parameter's sliced v), accumulation_steps 1 and 2:
    the call that would apply the next step is refused before any change."""
    target, model = build(engine)
    llama = model.llama
    victims = {"exp_avg_sq_row": llama.lm_head.weight, "exp_avg_sq": llama.model.norm.weight}
    for steps in (1, 2):
        opt = AdaLomo(target, lr=LR["adalomo"], accumulation_steps=steps)
        for index in range(steps):  # a step first: moments that are not zero
            opt.fused_backward(model(rank_batch(index, rank)) / steps)
        for entry, victim in victims.items():
            for index in range(steps - 1):  # the step's micro-batches but its last
                opt.fused_backward(model(rank_batch(10 + index, rank)) / steps)
            # Compared with the entry put back: a damaged slice has no state_dict.
            before = optimizer_snapshot(model, opt)
            kept, opt.state[victim][entry] = opt.state[victim][entry], torch.zeros(2)
            try:  # the call's lr differs from the group's: refused, the group keeps its own
                opt.fused_backward(model(rank_batch(20, rank)) / steps, lr=0.5)
                error = None
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            opt.state[victim][entry] = kept
            if engine == "fsdp2":
                model.reshard()  # the root keeps its gathered parameters after its forward
            checks[f"damaged_{engine}_{steps}_{entry}"] = {
                "error": error,
                "changed": changes_but_accumulation(before, model, opt),
                "pending": opt.pending_micro_batches,
                "lr": [group["lr"] for group in opt.param_groups],
            }
        opt.detach()


def build_in(engine: str, dtype: torch.dtype):
    """`build(engine)` with parameters (and compute) in `dtype`."""
    if engine == "zero3":
        built = zero3_worker.build(dtype)
        return built, built.module
    model = fsdp2_worker.build(dtype, mp_policy=MixedPrecisionPolicy())
    return model, model


def state_tensors(opt) -> list[torch.Tensor]:
    """Copies of the optimizer's per-parameter state tensors (AdaLomo's moments)."""
    return [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


def run_overflow(engine: str, label: str, rank: int, checks: dict) -> None:
    """A step of k micro-batches whose POISONED_MICRO_BATCH-th gets an inf in one element of
    lm_head's gradient on rank 1 only, written before the optimizer sees it: under ZeRO-3 in
    the whole gradient's flat element 0, which the reduce-scatter hands to rank 0's slice;
    under FSDP2 in a row of rank 1's reduced shard. So one rank's buffers alone hold the inf.
    Every rank must skip the whole step (no shard, no moment changed), report it skipped at
    the next call, lower an fp16 scale once; the next k clean micro-batches then make the
    step one process makes after the same skipped step."""
    name, dtype, options = OVERFLOW_RUNS[label]
    target, model = build_in(engine, dtype)
    poisoned = model.llama.lm_head.weight  # 3001 rows: both ranks hold a part
    inject = {"on": False}

    def poison(p):  # runs before the optimizer's hook (registered first)
        if inject["on"] and rank == 1:
            grad = p.grad.to_local() if engine == "fsdp2" else p.grad
            grad.view(-1)[0 if engine == "zero3" else 5] = float("inf")

    poisoned.register_post_accumulate_grad_hook(poison)
    initial = consolidated_state_dict(model)
    opt = OPTIMIZERS[name](target, lr=LR[name], **options)
    scaler = opt.loss_scaler if dtype == torch.float16 else None
    scale = lambda: None if scaler is None else scaler.scale.item()  # noqa: E731
    k = opt.accumulation_steps
    result: dict = {"scale_initial": scale()}
    # A clean step first (AdaLomo: moments that are not zero, so a moment the skipped
    # step changed shows); the poisoned step is the second.
    for i in range(k):
        opt.fused_backward(model(rank_batch(100 + i, rank)) / k)
    opt.flush_report()
    result["first_skipped"] = opt.last_step_skipped
    result["scale_before"] = scale()
    before, moments = snapshot(model), state_tensors(opt)
    for i in range(k):
        inject["on"] = i == POISONED_MICRO_BATCH
        opt.fused_backward(model(rank_batch(i, rank)) / k)
        inject["on"] = False
    # The buffers keep the step's sums after it: the inf is in this rank's slice or not.
    buffer = next(b for p, b, _ in opt._accumulation._buffers.values() if p is poisoned)
    result.update(
        {
            "inf_in_buffer": not bool(torch.isfinite(buffer).all()),
            "unchanged": unchanged(model, before),
            "moments": len(moments),
            "moments_unchanged": same_bits(moments, state_tensors(opt)),
            "step_count": opt.step_count,
            "pending": opt.pending_micro_batches,
            "scale_after_skip": scale(),
        }
    )
    # The next call reports the skipped step (before its own backward); the clean step.
    opt.fused_backward(model(rank_batch(k, rank)) / k)
    result["reported_skipped"] = opt.last_step_skipped
    for i in range(1, k):
        opt.fused_backward(model(rank_batch(k + i, rank)) / k)
    opt.flush_report()
    result.update(
        {
            "clean_skipped": opt.last_step_skipped,
            "clean_updates": not unchanged(model, before),
            "clean_step_count": opt.step_count,
            "scale_after_clean": scale(),
        }
    )
    checks[f"overflow_{engine}_{label}"] = result
    final = consolidated_state_dict(model)
    if rank == 0:
        torch.save({"initial": initial, "final": final}, OUT / f"overflow_{engine}_{label}.pt")


def run_refused_between_pending(name: str, rank: int, checks: dict) -> None:
    """FSDP2, accumulation_steps=4: two micro-batches pending, then a micro-batch with
    FSDP2's gradient sync off (refused before its backward: no gradient reaches a buffer),
    then the step's last two micro-batches with sync back on. The refusal must leave
    everything as it was (the pending count and buffers included), and the step equal one
    process's from the same four micro-batches."""
    model = fsdp2_worker.build()
    initial = consolidated_state_dict(model)
    opt = OPTIMIZERS[name](model, lr=LR[name], **ACCUMULATING)
    k = opt.accumulation_steps
    for i in range(2):
        opt.fused_backward(model(rank_batch(i, rank)) / k)
    pending = opt.pending_micro_batches
    before = optimizer_snapshot(model, opt)
    model.set_requires_gradient_sync(False)
    error, notes = None, ""
    try:
        opt.fused_backward(model(rank_batch(50, rank)) / k)
    except RuntimeError as exc:
        error, notes = str(exc), "".join(getattr(exc, "__notes__", []))
    model.reshard()  # the root keeps its gathered parameters after its forward
    model.set_requires_gradient_sync(True)
    result = {
        "pending_before": pending,
        "error": error,
        "notes": notes,
        "pending_after": opt.pending_micro_batches,
        "changed": changes_since(before, model, opt),
        "step_count": opt.step_count,
    }
    for i in range(2, k):
        opt.fused_backward(model(rank_batch(i, rank)) / k)
    opt.flush_report()
    result["final_step_count"] = opt.step_count
    result["final_pending"] = opt.pending_micro_batches
    checks[f"refused_between_pending_{name}"] = result
    final = consolidated_state_dict(model)
    if rank == 0:
        torch.save({"initial": initial, "final": final}, OUT / f"refused_between_{name}.pt")


def main(rank: int, checks: dict) -> None:
    for engine in ("zero3", "fsdp2"):
        for name in OPTIMIZERS:
            run(engine, name, rank, checks)
        run_damaged_moments(engine, rank, checks)
        for label in OVERFLOW_RUNS:
            run_overflow(engine, label, rank, checks)
    for name in ("lomo", "adalomo"):
        run_refused_between_pending(name, rank, checks)


if __name__ == "__main__":
    run_worker(lambda: deepspeed.init_distributed(dist_backend="gloo"), main, OUT)
