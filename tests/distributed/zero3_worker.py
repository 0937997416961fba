"""One rank of the ZeRO-3 checks (run by test_zero3.py under torchrun, gloo, CPU).

Writes, on rank 0, to the directory in argv[1]: for each scenario the consolidated initial
and final parameters (and optimizer state) for the one-process reference to compare with,
and `checks.json` with what was observed on every rank.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.models import LayerInTwoCheckpoints  # noqa: E402
from support.sharded_checks import (  # noqa: E402
    OPTIMIZERS,
    count_phases,
    record_order,
    reported_warnings,
    run_worker,
)
from support.sharded_models import (  # noqa: E402
    GRADIENT_IN_PARTS,
    LR,
    OPTIONS,
    SINGLE,
    ScaledLlama,
    parts_batch,
    rank_batch,
    train,
    train_single,
    unfrozen_after_construction,
)
from support.sliced_rounding import (  # noqa: E402
    stochastic_accumulation_check,
    stochastic_update_check,
)
from support.state import (  # noqa: E402
    bits,
    changes_since,
    optimizer_snapshot,
    owned,
    snapshot,
    unchanged,
)

from lomo_kernels import AdaLomo, Lomo  # noqa: E402
from lomo_kernels.distributed import consolidated_state_dict  # noqa: E402

torch.set_num_threads(1)
OUT = Path(sys.argv[1])
CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}


def build(dtype: torch.dtype = torch.float32, seed: int = 0, model_class: type = ScaledLlama):
    torch.manual_seed(seed)
    config = dict(CONFIG)
    if dtype != torch.float32:
        # zero.Init takes the partitions' dtype from the config; DeepSpeed's engine refuses
        # fp16 on CPU, so only the partitioning sees it (the engine keeps the dtype).
        config["fp16" if dtype == torch.float16 else "bf16"] = {"enabled": True}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = model_class()
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG)
    return engine


def nan_padding(model) -> int:
    """Writes a NaN into every padding element of this rank's partitions, as DeepSpeed's
    uninitialised padding may hold (it allocates with torch.empty and copies only the real
    elements in); returns how many. A check of "unchanged" must still say so."""
    written = 0
    for p in model.parameters():
        flat = p.ds_tensor.data.view(-1)
        flat[owned(p).numel() :] = float("nan")
        written += flat.numel() - owned(p).numel()
    return written


def whole_partitions(model) -> list[torch.Tensor]:
    """Copies of this rank's whole partitions, padding included."""
    return [p.ds_tensor.detach().clone() for p in model.parameters()]


def whole_equal(model, before: list[torch.Tensor]) -> bool:
    """torch.equal over whole partitions, padding included (a NaN there never equals)."""
    return all(torch.equal(a, b) for a, b in zip(before, whole_partitions(model), strict=True))


SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")
GATHERS = ("all_gather_single", "all_gather_into_tensor")


class CollectiveLog:
    """Counts the tensors handed to torch.distributed collectives while active."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self._saved = {}

    def __enter__(self):
        for name in GATHERS + SCATTERS + ("all_reduce",):
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def wrapper(*args, _name=name, _original=original, **kwargs):
                # The tensor handed over: the input (2nd) of scatters and gathers.
                tensor = args[0] if _name == "all_reduce" else args[1]
                kind = "reduce_scatter" if _name in SCATTERS else _name
                kind = "all_gather" if _name in GATHERS else kind
                self.calls.append((kind, tensor.numel() * tensor.element_size()))
                return _original(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)


def run_training(name: str, cls, rank: int, checks: dict) -> None:
    engine = build()
    model = engine.module
    initial = consolidated_state_dict(model)
    opt = cls(engine, lr=LR[name], bucket_numel=3000, **OPTIONS)
    train(model, opt, lambda step: rank_batch(step, rank))
    final = consolidated_state_dict(model)
    opt_state = opt.consolidated_state_dict()
    # Persistent parameters keep a full copy: it must equal the updated partitions.
    stale = [
        n
        for n, p in model.named_parameters()
        if p.ds_persist
        and p.ds_status.name == "AVAILABLE"
        and not torch.equal(p.data.reshape(-1), final[n].reshape(-1))
    ]
    # The persistent parameters the check above compared (held whole on every rank).
    persistent = sum(p.ds_persist and p.ds_status.name == "AVAILABLE" for p in model.parameters())
    checks[name] = {"stale_persistent": stale, "persistent": int(persistent)}
    if rank == 0:
        saved = {"initial": initial, "final": final, "opt": opt_state}
        torch.save({**saved, "grad_norms": opt.grad_norms}, OUT / f"{name}.pt")


def run_single(name: str, cls, rank: int, checks: dict) -> None:
    """single_backward=True: one forward and one backward per step, no norm pass."""
    engine = build()
    model = engine.module
    initial = consolidated_state_dict(model)
    opt = cls(engine, lr=LR[name], bucket_numel=3000, **SINGLE)
    order, phases = record_order(opt, model), count_phases(opt)
    norms = train_single(model, opt, lambda step: rank_batch(step, rank))
    final = consolidated_state_dict(model)
    history = opt._single_backward_clip.norm_history.tolist()
    checks[f"single_{name}"] = {
        "order": order,
        "norms": norms,
        "norm_history": history,
        "phases": phases,
    }
    if rank == 0:
        torch.save({"initial": initial, "final": final}, OUT / f"single_{name}.pt")


def run_single_fp16_partial(rank: int, checks: dict) -> None:
    """single_backward=True in fp16, an inf in a gradient element rank 0 owns, put there by
    rank 1 only: that tensor stays unchanged everywhere, the others are updated."""
    engine = build(torch.float16)
    model = engine.module
    target = model.llama.lm_head.weight  # partitioned; flat element 0 is in rank 0's slice

    def poison(p):  # runs before the optimizer's hook (registered first)
        if rank == 1:
            p.grad.view(-1)[0] = float("inf")

    target.register_post_accumulate_grad_hook(poison)
    opt = Lomo(engine, lr=0.05, single_backward=True, **OPTIONS)
    names = {id(p): n for n, p in model.named_parameters()}
    scale_before = opt.loss_scaler.scale.item()
    before = snapshot(model)
    phases = count_phases(opt)
    opt.fused_backward(model(rank_batch(0, rank)))
    reported = reported_warnings(opt)
    nan_padding(model)  # no change: the comparison below reads the owned elements only
    unchanged = [
        names[id(p)]
        for p, b in zip(model.parameters(), before, strict=True)
        if b.numel() and torch.equal(bits(owned(p)), bits(b))
    ]
    checks["single_fp16_partial"] = {
        "phases": phases,
        "unchanged": unchanged,
        "target": names[id(target)],
        "owned": sum(bool(b.numel()) for b in before),
        "scale_before": scale_before,
        "scale_after": opt.loss_scaler.scale.item(),
        "partial": opt.last_step_partial,
        "skipped": opt.last_step_skipped,
        "warned": any("partial" in m for m in reported),
        "norm": float(opt.last_grad_norm),
        "norm_history": opt._single_backward_clip.norm_history.tolist(),
    }


def run_one_loss_pattern(rank: int, checks: dict) -> None:
    """The refusals of the one-loss pattern, each before any change: the parameters' owned
    elements (the padding NaN-filled: a NaN there is no change), everything
    `optimizer_snapshot` holds and the measured norm, on every rank. After grad_norm: its
    loss again, the clip threshold changed (the update pass's own forward cannot measure
    again), and turned off (no norm pass needed, but the loss is grad_norm's). Then the
    pattern's own update pass, which the refusals left its measured norm."""
    engine = build()
    model = engine.module
    opt = Lomo(engine, lr=0.05, clip_grad_norm=0.3)
    errors = []

    def refused(loss) -> None:
        try:
            opt.fused_backward(loss)
        except RuntimeError as exc:
            errors.append(str(exc))

    before = optimizer_snapshot(model, opt)
    refused(model(rank_batch(0, rank)))  # clip set, no norm pass
    changed = [changes_since(before, model, opt)]
    loss = model(rank_batch(1, rank))
    opt.grad_norm(loss)
    before, whole = optimizer_snapshot(model, opt), whole_partitions(model)
    norm = opt.last_grad_norm
    refused(loss)
    opt.clip_grad_norm = 0.5  # grad_norm's pass clipped at 0.3
    refused(model(rank_batch(1, rank)))
    opt.clip_grad_norm = None
    refused(loss)
    opt.clip_grad_norm = 0.3
    padding = nan_padding(model)
    changed.append(changes_since(before, model, opt))
    if opt.last_grad_norm is not norm:
        changed.append("last_grad_norm")
    checks["one_loss"] = {
        "errors": errors,
        "changed": [c for c in changed if c is not None] or None,
        "padding": padding,
        "whole_equal": whole_equal(model, whole),
    }
    owned = snapshot(model)
    opt.fused_backward(model(rank_batch(1, rank)))
    checks["one_loss"]["pattern_steps"] = not unchanged(model, owned)


def run_gradient_in_parts(rank: int, checks: dict) -> None:
    """A gradient in parts is refused as in one process: each part reduced and stepped on
    its own would decay, clip and (AdaLomo) normalise the layer per part. With a norm pass
    nothing changes; without one the report names every parameter that changed."""
    results = {}
    for label, (name, options) in GRADIENT_IN_PARTS.items():
        with deepspeed.zero.Init(config_dict_or_path=CONFIG):
            model = LayerInTwoCheckpoints()
        engine, *_ = deepspeed.initialize(model=model, config=CONFIG)
        opt = OPTIMIZERS[name](engine, lr=0.05, **options)
        x = parts_batch(rank).requires_grad_()
        before, owned_before = optimizer_snapshot(model, opt), snapshot(model)
        error = None
        try:
            if opt.clip_grad_norm is not None:
                opt.grad_norm(model(x))
            opt.fused_backward(model(x))
        except RuntimeError as exc:
            error = str(exc)
        names = [n for n, _ in model.named_parameters()]
        results[label] = {
            "error": error,
            "changed": changes_since(before, model, opt),
            "changed_names": [
                n
                for n, a, p in zip(names, owned_before, model.parameters(), strict=True)
                if not torch.equal(a, owned(p))
            ],
            "reported_names": list(opt.last_step_partial_names or []),
        }
    checks["gradient_in_parts"] = results


def run_unfrozen(rank: int, checks: dict) -> None:
    """A parameter unfrozen after the optimizer was built: refused before any change."""
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = LayerInTwoCheckpoints(reentrant=False)
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG)
    before = snapshot(model)
    error = unfrozen_after_construction(model, lambda: Lomo(engine, lr=0.05), rank)
    checks["unfrozen"] = {"error": error, "unchanged": unchanged(model, before)}


def run_fp16_overflow(rank: int, checks: dict) -> None:
    engine = build(torch.float16)
    model = engine.module
    opt = Lomo(engine, lr=0.05)
    scale_before = opt.loss_scaler.scale.item()
    before, whole = snapshot(model), whole_partitions(model)
    x = rank_batch(0, rank)
    blow_up = float("inf") if rank == 1 else 1.0  # overflow on one rank only
    opt.grad_norm(model(x) * blow_up)
    opt.fused_backward(model(x) * blow_up)
    opt.flush_report()
    padding = nan_padding(model)
    checks["fp16_overflow"] = {
        "unchanged": unchanged(model, before),
        "padding": padding,
        "whole_equal": whole_equal(model, whole),
        "scale_before": scale_before,
        "scale_after": opt.loss_scaler.scale.item(),
        "skipped": opt.last_step_skipped,
    }
    # The next clean step does update (owned elements: the NaN padding is no update).
    opt.grad_norm(model(x))
    opt.fused_backward(model(x))
    opt.flush_report()
    checks["fp16_overflow"]["next_step_updates"] = not unchanged(model, before)


def run_stochastic_slices(rank: int, checks: dict) -> None:
    """bf16 partitions, stochastic rounding (the default), weight decay: every rank's slices,
    each updated at its flat offset, must hold what one update of the whole parameter from
    the same reduced gradient stores (the reference op, the bits of flat index offset + j)."""
    engine = build(torch.bfloat16)
    opt = Lomo(engine, lr=0.05, weight_decay=0.01, bucket_numel=3000)
    model = engine.module
    loss_of = lambda: model(rank_batch(0, rank))  # noqa: E731
    checks["stochastic_slices"] = stochastic_update_check(opt, model, loss_of, 0.05, 0.01)


def run_stochastic_accumulation(rank: int, checks: dict) -> None:
    """bf16 partitions accumulating into bf16 buffers, stochastically rounded (the default):
    after two micro-batches of three, every rank's buffer slices must hold what the
    reference op's accumulation of the whole parameter's reduced gradients stores."""
    engine = build(torch.bfloat16)
    model = engine.module
    opt = Lomo(engine, lr=0.05, bucket_numel=3000, accumulation_steps=3)
    checks["stochastic_accumulation"] = stochastic_accumulation_check(
        opt, model, lambda micro_batch: model(rank_batch(micro_batch, rank)) / 3
    )


def run_traffic(rank: int, checks: dict) -> None:
    engine = build()
    model = engine.module
    bucket = 3000
    opt = Lomo(engine, lr=0.05, bucket_numel=bucket)
    world = dist.get_world_size()
    loss = model(rank_batch(0, rank))
    with CollectiveLog() as log:
        opt.fused_backward(loss)
    params = list(model.parameters())
    padded = [world * p.ds_tensor.ds_numel for p in params]
    checks["traffic"] = {
        "calls": log.calls,
        "numels": [int(p.ds_numel) for p in params],
        "padded": padded,
        "element_size": params[0].ds_tensor.element_size(),
        "bucket_numel": bucket,
        "world": world,
    }


def run_refusals(checks: dict) -> None:
    refused = {}
    plain = ScaledLlama()  # whole on every rank: replicated data parallelism
    try:
        Lomo(plain)
    except ValueError as exc:
        refused["replicated"] = str(exc)
    model = ScaledLlama()
    with_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {**CONFIG, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=with_opt, config=config)
    for label, target in (("engine_with_optimizer", engine), ("module_with_optimizer", model)):
        try:
            Lomo(target)
        except ValueError as exc:
            refused[label] = str(exc)
    checks["refusals"] = refused
    checks["unreplicated"] = run_unreplicated(dist.get_rank())


def run_unreplicated(rank: int) -> dict:
    """replicated=False: each rank trains its own whole model on its own batch, nothing
    reduced; against torch.optim.SGD on the same model and batches in this process."""
    torch.manual_seed(0)
    own = ScaledLlama()
    reference = copy.deepcopy(own)
    opt = Lomo(own, lr=0.1, replicated=False)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        opt.fused_backward(own(rank_batch(step, rank)))
        reference(rank_batch(step, rank)).backward()
        sgd.step()
        sgd.zero_grad()
    worst = max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
        for a, b in zip(own.parameters(), reference.parameters(), strict=True)
    )
    return {
        "rel_diff_to_sgd": worst,
        "checksum": sum(p.double().sum().item() for p in own.parameters()),
    }


def main(rank: int, checks: dict) -> None:
    run_training("lomo", Lomo, rank, checks)
    run_training("adalomo", AdaLomo, rank, checks)
    run_single("lomo", Lomo, rank, checks)
    run_single("adalomo", AdaLomo, rank, checks)
    run_single_fp16_partial(rank, checks)
    run_one_loss_pattern(rank, checks)
    run_gradient_in_parts(rank, checks)
    run_unfrozen(rank, checks)
    run_fp16_overflow(rank, checks)
    run_traffic(rank, checks)
    run_stochastic_slices(rank, checks)
    run_stochastic_accumulation(rank, checks)
    run_refusals(checks)


if __name__ == "__main__":
    run_worker(lambda: deepspeed.init_distributed(dist_backend="gloo"), main, OUT)
