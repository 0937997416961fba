"""One rank of the FSDP2 checks (run by test_fsdp2.py under torchrun, gloo, CPU).

Writes, on rank 0, to the directory in argv[1]: for each scenario the consolidated initial
and final parameters (and optimizer state) for the reference to compare with, and
`checks.json` with what was observed on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.models import LayerInTwoCheckpoints  # noqa: E402
from support.sharded_checks import count_phases, record_order, reported_warnings, run_worker  # noqa: E402
from support.sharded_models import (  # noqa: E402
    GRADIENT_IN_PARTS,
    LR,
    NO_CLIP,
    OPTIONS,
    PATTERNS,
    SINGLE,
    ScaledLlama,
    parts_batch,
    rank_batch,
    train_single,
    unfrozen_after_construction,
)
from support.sliced_rounding import (  # noqa: E402
    stochastic_accumulation_check,
    stochastic_update_check,
)
from support.state import (  # noqa: E402
    changes_since,
    optimizer_snapshot,
    owned,
    same_bits,
    snapshot,
    unchanged,
)

from lomo_kernels import AdaLomo, Lomo  # noqa: E402
from lomo_kernels.distributed import consolidated_state_dict  # noqa: E402
from lomo_kernels.ops import clip_coef_from_sumsq  # noqa: E402

torch.set_num_threads(1)
OUT = Path(sys.argv[1])
OPTIMIZERS = {"lomo": Lomo, "adalomo": AdaLomo}


def build(
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    model_class: type = ScaledLlama,
    **fsdp_kwargs,
) -> ScaledLlama:
    """`model_class` (a ScaledLlama) with fully_shard on each decoder layer and on the root
    (same on all ranks)."""
    torch.manual_seed(seed)
    model = model_class().to(dtype)
    for layer in model.llama.model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return model


def run_training(
    name: str, pattern: str, rank: int, keep_unsharded: bool = False, clip: bool = True
) -> None:
    model = build()
    if keep_unsharded:  # the updated shards must still reach the next forward
        for module in model.modules():
            if hasattr(module, "set_reshard_after_backward"):
                module.set_reshard_after_backward(False)
    initial = consolidated_state_dict(model)
    opt = OPTIMIZERS[name](model, lr=LR[name], **(OPTIONS if clip else NO_CLIP))
    PATTERNS[pattern](model, opt, lambda step: rank_batch(step, rank))
    final = consolidated_state_dict(model)
    opt_state = opt.consolidated_state_dict()
    if rank == 0:
        label = f"{name}_{pattern}" + ("_unsharded" if keep_unsharded else "")
        label += "" if clip else "_no_clip"
        saved = {"initial": initial, "final": final, "opt": opt_state}
        torch.save({**saved, "grad_norms": opt.grad_norms}, OUT / f"{label}.pt")


def run_single(name: str, rank: int, checks: dict) -> None:
    """single_backward=True (clip, weight decay): one forward and one backward per step."""
    model = build()
    initial = consolidated_state_dict(model)
    opt = OPTIMIZERS[name](model, lr=LR[name], **SINGLE)
    order, phases = record_order(opt, model), count_phases(opt)
    norms = train_single(model, opt, lambda step: rank_batch(step, rank))
    final = consolidated_state_dict(model)
    checks[f"single_{name}"] = {
        "order": order,
        "norms": norms,
        "norm_history": opt._single_backward_clip.norm_history.tolist(),
        "phases": phases,
    }
    if rank == 0:
        torch.save({"initial": initial, "final": final}, OUT / f"single_{name}.pt")


MIXED = {
    # (shard dtype, policy, stochastic rounding of the write-back)
    # fp32 shards, bf16 forward/backward, gradients reduced in fp32
    "bf16_compute": (torch.float32, MixedPrecisionPolicy(torch.bfloat16, torch.float32), False),
    # bf16 throughout: rounded to nearest (lomo-optim's), and stochastically (the default)
    "bf16_params": (torch.bfloat16, MixedPrecisionPolicy(), False),
    "bf16_params_stochastic": (torch.bfloat16, MixedPrecisionPolicy(), True),
}


def _flat_offset(param: torch.Tensor, rank: int, world: int) -> int:
    """Where this rank's Shard(0) rows start in the whole parameter, flat (torch.chunk)."""
    rows = param.shape[0]
    per_rank = -(-rows // world)
    return min(rank * per_rank, rows) * (param.numel() // rows)


def _stochastic(new: torch.Tensor, dtype: torch.dtype, index: int, step: int, first: int):
    """`new` rounded as the optimizer documents it: the bits of element `first + j` under the
    key of parameter `index`'s seed (`parameter_seed`) and the step's value (`optim.rounding`)."""
    from lomo_kernels.core.rounding import random_bits16, round_to_dtype, rounding_key
    from lomo_kernels.optim.rounding import parameter_seed, step_value

    seed_step = torch.tensor([step_value(0, step)])  # the optimizer's default seed 0
    flat_index = torch.arange(first, first + new.numel(), dtype=torch.int64)
    bits = random_bits16(flat_index, rounding_key(parameter_seed(index), seed_step))
    return round_to_dtype(new.reshape(-1), dtype, bits).view(new.shape)


def run_mixed_precision(label: str, rank: int, steps: int = 2) -> None:
    """Lomo against the same FSDP2 set-up with a plain backward and the update in torch ops,
    rounded to nearest or stochastically as the optimizer documents it."""
    dtype, policy, stochastic = MIXED[label]
    lr, wd, max_norm = LR["lomo"], OPTIONS["weight_decay"], OPTIONS["clip_grad_norm"]
    world = dist.get_world_size()
    results = {}
    for who in ("lomo", "manual"):
        model = build(dtype, mp_policy=policy)
        initial = consolidated_state_dict(model)
        opt = None
        if who == "lomo":
            opt = Lomo(model, lr=lr, stochastic_rounding=stochastic, **OPTIONS)
        for step in range(steps):
            x = rank_batch(step, rank)
            if opt is not None:
                opt.grad_norm(model(x))
                opt.fused_backward(model(x))
                continue
            model(x).backward()
            params = list(model.parameters())
            sumsq = sum(p.grad.to_local().float().pow(2).sum() for p in params).reshape(1)
            dist.all_reduce(sumsq)
            coef = clip_coef_from_sumsq(sumsq, max_norm)
            with torch.no_grad():
                for index, p in enumerate(params):
                    local = p.to_local()
                    g = p.grad.to_local().float() * coef
                    new = local.float() * (1 - lr * wd) - lr * g
                    if stochastic:
                        first = _flat_offset(p, rank, world)
                        new = _stochastic(new, local.dtype, index, step, first)
                    local.copy_(new)
                    p.grad = None
        results[who] = consolidated_state_dict(model)
    if rank == 0:
        torch.save({"initial": initial, **results}, OUT / f"mixed_{label}.pt")


def run_stochastic_slices(rank: int, checks: dict) -> None:
    """bf16 shards throughout, stochastic rounding (the default), weight decay: every rank's
    rows, each updated at its flat offset, must hold what one update of the whole parameter
    from the same reduced gradient stores (the reference op, the bits of flat index
    offset + j)."""
    model = build(torch.bfloat16, mp_policy=MixedPrecisionPolicy())
    opt = Lomo(model, lr=0.05, weight_decay=0.01)
    loss_of = lambda: model(rank_batch(0, rank))  # noqa: E731
    checks["stochastic_slices"] = stochastic_update_check(opt, model, loss_of, 0.05, 0.01)


def run_stochastic_accumulation(rank: int, checks: dict) -> None:
    """bf16 shards accumulating into bf16 buffers, stochastically rounded (the default):
    after two micro-batches of three, every rank's buffer rows must hold what the reference
    op's accumulation of the whole parameter's reduced gradients stores."""
    model = build(torch.bfloat16, mp_policy=MixedPrecisionPolicy())
    opt = Lomo(model, lr=0.05, accumulation_steps=3)
    checks["stochastic_accumulation"] = stochastic_accumulation_check(
        opt, model, lambda micro_batch: model(rank_batch(micro_batch, rank)) / 3
    )


FP16 = {
    "lomo_fp16_params": (Lomo, torch.float16, MixedPrecisionPolicy()),
    "lomo_fp16_compute": (Lomo, torch.float32, MixedPrecisionPolicy(torch.float16)),
    "adalomo_fp16_params": (AdaLomo, torch.float16, MixedPrecisionPolicy()),
}


# The gradient element `poisoned_model` makes inf: row 3 of rank 1's rows, column 5.
POISONED = (3, 5)


def poisoned_model(
    rank: int, dtype: torch.dtype, policy: MixedPrecisionPolicy
) -> tuple[ScaledLlama, torch.Tensor, dict]:
    """A model with an inf written into a gradient row only rank 1 holds (`POISONED`) while
    `inject["on"]`: (model, the poisoned parameter, inject)."""
    model = build(dtype, mp_policy=policy)
    target = model.llama.lm_head.weight  # 3001 rows: both ranks hold some
    inject = {"on": True}

    def poison(p):  # runs before the optimizer's hook (registered first)
        if inject["on"] and rank == 1:
            p.grad.to_local()[POISONED] = float("inf")

    target.register_post_accumulate_grad_hook(poison)
    return model, target, inject


def poisoned_fp16_model(label: str, rank: int) -> tuple[type, ScaledLlama, torch.Tensor, dict]:
    """The FP16[label] model poisoned as `poisoned_model`: (optimizer class, model, the
    poisoned parameter, inject)."""
    cls, dtype, policy = FP16[label]
    return cls, *poisoned_model(rank, dtype, policy)


def run_partial_without_norm_pass(rank: int, checks: dict) -> None:
    """fp32 Lomo without clipping (no norm pass): an inf in a gradient element only rank 1
    holds leaves that element alone unchanged, and every rank reports the step partial."""
    model, target, _ = poisoned_model(rank, torch.float32, MixedPrecisionPolicy())
    opt = Lomo(model, lr=LR["lomo"])
    before, element = snapshot(model), owned(target)[POISONED].clone()
    phases = count_phases(opt)
    opt.fused_backward(model(rank_batch(0, rank)))
    reported = reported_warnings(opt)
    checks["partial_without_norm_pass"] = {
        "phases": list(phases),
        "unchanged": unchanged_names(before, model),
        "element_unchanged": same_bits([owned(target)[POISONED]], [element]),
        "finite": finite_everywhere(model, opt),
        "partial": opt.last_step_partial,
        "skipped": opt.last_step_skipped,
        "warned": any("elements were left unchanged" in m for m in reported),
    }


def state_tensors(opt) -> list[torch.Tensor]:
    """Copies of the optimizer's per-parameter state tensors (AdaLomo's moments)."""
    return [v.clone() for s in opt.state.values() for v in s.values()]


def run_fp16_overflow(label: str, rank: int, checks: dict) -> None:
    """An inf in a gradient row only rank 1 holds: no rank may change anything."""
    cls, model, target, inject = poisoned_fp16_model(label, rank)
    opt = cls(model, lr=LR["lomo"] if cls is Lomo else LR["adalomo"])
    scale_before = opt.loss_scaler.scale.item() if cls is Lomo else None
    before, moments = snapshot(model), state_tensors(opt)
    x = rank_batch(0, rank)
    opt.grad_norm(model(x))
    opt.fused_backward(model(x))
    opt.flush_report()
    result = {
        "loss_scaling": opt._needs_detection_pass(),
        "unchanged": unchanged(model, before),
        "skipped": opt.last_step_skipped,
        "scale_before": scale_before,
        "scale_after": opt.loss_scaler.scale.item() if cls is Lomo else None,
        # AdaLomo's moments (Lomo keeps none: the count tells which), bit for bit.
        "moments": len(moments),
        "moments_unchanged": same_bits(moments, state_tensors(opt)),
    }
    inject["on"] = False
    opt.grad_norm(model(x))
    opt.fused_backward(model(x))
    opt.flush_report()
    result["next_step_updates"] = not unchanged(model, before)
    checks[label] = result


# Lomo at lr 0.5: fp16 updates of tens of ulps, so rounding alone cannot hide a wrong one.
SINGLE_FP16_LR = {Lomo: 0.5, AdaLomo: LR["adalomo"]}


def unchanged_names(before: list[torch.Tensor], model) -> list[str]:
    """The parameters of which this rank holds rows that all equal `before`'s."""
    return [
        name
        for (name, p), b in zip(model.named_parameters(), before, strict=True)
        if b.numel() and same_bits([owned(p)], [b])
    ]


def finite_everywhere(model, opt) -> bool:
    """No inf/nan in any local shard, optimizer state or loss scale of this rank."""
    tensors = [p.to_local() for p in model.parameters()]
    tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    if getattr(opt, "loss_scaler", None) is not None:
        tensors.append(opt.loss_scaler.scale)
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def run_single_fp16_partial(label: str, rank: int, checks: dict) -> None:
    """single_backward=True in fp16: an inf in a gradient row only rank 1 holds, one step.

    Every rank must leave that tensor (both ranks' rows, and its moments) unchanged, update
    the others, lower the scale and report the step partial; the following clean steps update
    everything again.
    """
    cls, model, target, inject = poisoned_fp16_model(label, rank)
    opt = cls(model, lr=SINGLE_FP16_LR[cls], single_backward=True, **OPTIONS)
    names = {id(p): n for n, p in model.named_parameters()}
    held = [names[id(p)] for p in model.parameters() if p.to_local().numel()]
    scaler = getattr(opt, "loss_scaler", None)
    scale_before = None if scaler is None else scaler.scale.item()
    before = snapshot(model)
    moments = {k: v.clone() for k, v in opt.state[target].items()}
    phases = count_phases(opt)
    opt.fused_backward(model(rank_batch(0, rank)))
    reported = reported_warnings(opt)
    result = {
        "phases": list(phases),
        "held": held,
        "unchanged": unchanged_names(before, model),
        "target": names[id(target)],
        "moments_unchanged": same_bits(list(moments.values()), list(opt.state[target].values())),
        "finite": finite_everywhere(model, opt),
        "scale_before": scale_before,
        "scale_after": None if scaler is None else scaler.scale.item(),
        "partial": opt.last_step_partial,
        "skipped": opt.last_step_skipped,
        "warned": any("partial" in m for m in reported),
        "norm": float(opt.last_grad_norm),
        "norm_history": opt._single_backward_clip.norm_history.tolist(),
        "later": [],
    }
    inject["on"] = False
    for step in (1, 2):
        before = snapshot(model)
        opt.fused_backward(model(rank_batch(step, rank)))
        opt.flush_report()
        result["later"].append(
            {
                "partial": opt.last_step_partial,
                "unchanged": unchanged_names(before, model),
                "finite": finite_everywhere(model, opt),
            }
        )
    result["norm_history_after"] = opt._single_backward_clip.norm_history.tolist()
    checks[f"single_partial_{label}"] = result


def run_single_fp16(rank: int, checks: dict) -> None:
    """single_backward=True, Lomo, fp16 shards and compute, loss scaling, no overflow."""
    model = build(torch.float16, mp_policy=MixedPrecisionPolicy())
    initial = consolidated_state_dict(model)
    opt = Lomo(model, lr=SINGLE_FP16_LR[Lomo], **SINGLE)
    order, phases = record_order(opt, model), count_phases(opt)
    scales = []
    partial = []

    def batch_of(step):
        scales.append(opt.loss_scaler.scale.item())
        if step:
            opt.flush_report()
            partial.append(opt.last_step_partial or opt.last_step_skipped)
        return rank_batch(step, rank)

    norms = train_single(model, opt, batch_of)
    partial.append(opt.last_step_partial or opt.last_step_skipped)
    scales.append(opt.loss_scaler.scale.item())
    checks["single_fp16_lomo"] = {
        "order": order,
        "norms": norms,
        "norm_history": opt._single_backward_clip.norm_history.tolist(),
        "phases": phases,
        "scales": scales,
        "partial": partial,
    }
    final = consolidated_state_dict(model)
    if rank == 0:
        torch.save(
            {"initial": initial, "final": final, "lr": SINGLE_FP16_LR[Lomo]},
            OUT / "single_fp16_lomo.pt",
        )


def expect_refusal(build_model, checks: dict, label: str) -> None:
    try:
        model = build_model()
    except Exception as exc:  # FSDP2 itself refused the set-up
        checks[label] = f"fsdp2: {exc}"
        return
    try:
        Lomo(model)
        checks[label] = None
    except ValueError as exc:
        checks[label] = str(exc)


def run_refusals(checks: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    refused: dict = {}
    expect_refusal(ScaledLlama, refused, "replicated")

    def layers_only():
        model = ScaledLlama()
        for layer in model.llama.model.layers:
            fully_shard(layer)
        return model

    expect_refusal(layers_only, refused, "root_not_sharded")

    def columns():
        def placement(p):
            return Shard(1) if p.ndim == 2 and p.shape[1] % 2 == 0 else None

        return build(shard_placement_fn=placement)

    expect_refusal(columns, refused, "shard_dim_1")

    def hsdp():
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
        return build(mesh=mesh)

    expect_refusal(hsdp, refused, "hsdp")

    def own_rank_only():  # a 1-D mesh of this rank alone: each rank's gradients its own
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        return build(mesh=mesh["shard"])

    expect_refusal(own_rank_only, refused, "partial_world")
    checks["refusals"] = refused

    model = build()  # gradient accumulation: refused at the step, before any change
    opt = Lomo(model)
    model.set_requires_gradient_sync(False)
    before = optimizer_snapshot(model, opt)
    try:
        opt.fused_backward(model(rank_batch(0, dist.get_rank())))
        checks["no_sync"] = None
    except RuntimeError as exc:
        checks["no_sync"] = str(exc)
    model.reshard()  # the root keeps its gathered parameters after its forward
    checks["no_sync_changed"] = changes_since(before, model, opt)


def run_gradient_in_parts(rank: int) -> None:
    """A layer in two reentrant checkpoint segments: FSDP2 sums the parts of its gradient
    before its reduce, so the step is the whole gradient's (saved for the one-process
    reference, whose segments are non-reentrant)."""
    for label, (name, options) in GRADIENT_IN_PARTS.items():
        model = LayerInTwoCheckpoints()
        fully_shard(model)
        initial = consolidated_state_dict(model)
        opt = OPTIMIZERS[name](model, lr=0.05, **options)
        for _ in range(2):
            x = parts_batch(rank).requires_grad_()
            if opt.clip_grad_norm is not None:
                opt.grad_norm(model(x))
            opt.fused_backward(model(x))
        final = consolidated_state_dict(model)
        if rank == 0:
            torch.save({"initial": initial, "final": final}, OUT / f"parts_{label}.pt")


def run_unfrozen(rank: int, checks: dict) -> None:
    """A parameter unfrozen after the optimizer was built: refused before any change."""
    model = LayerInTwoCheckpoints(reentrant=False)
    fully_shard(model)
    before = snapshot(model)
    error = unfrozen_after_construction(model, lambda: Lomo(model, lr=0.05), rank)
    model.reshard()  # the root keeps its gathered parameters after its forward
    checks["unfrozen"] = {"error": error, "unchanged": unchanged(model, before)}


def main(rank: int, checks: dict) -> None:
    for name in OPTIMIZERS:
        for pattern in PATTERNS:
            run_training(name, pattern, rank)
    for name in OPTIMIZERS:
        run_single(name, rank, checks)
    run_training("lomo", "per_pass", rank, keep_unsharded=True)
    run_training("lomo", "per_pass", rank, clip=False)
    for label in MIXED:
        run_mixed_precision(label, rank)
    for label in FP16:
        run_fp16_overflow(label, rank, checks)
        run_single_fp16_partial(label, rank, checks)
    run_partial_without_norm_pass(rank, checks)
    run_single_fp16(rank, checks)
    run_stochastic_slices(rank, checks)
    run_stochastic_accumulation(rank, checks)
    run_gradient_in_parts(rank)
    run_unfrozen(rank, checks)
    run_refusals(checks)


if __name__ == "__main__":
    run_worker(lambda: dist.init_process_group("gloo"), main, OUT)
