"""Analytic peak-memory model of full-parameter fine-tuning, per GPU, and whether it fits.

    python -m lomo_kernels estimate --model llama-65b --optimizer lomo --gpus 8 --gpu-mem 24 --zero3

Four parts, as in the LOMO paper (arXiv 2306.09782, Table 1 and Figure 2). GiB = 2**30 bytes
(the paper's "GB" figures are GiB). N = parameters, p = bytes per element of the weights.

Parameters
    N * p. Mixed precision (the paper's setting): fp16 weights, p = 2.
Gradients
    AdamW, SGD: one gradient per parameter, N * p. LOMO and AdaLomo update each parameter
    inside backward and free its gradient at once: only the largest tensor's gradient,
    numel_max * p (LLaMA-7B: the 32000 x 4096 embedding / lm_head, 0.24 GiB in fp16).
Optimizer states
    Mixed precision keeps an fp32 master copy of the weights for AdamW and SGD (4 bytes per
    parameter) and AdamW adds its fp32 first and second moments (8 more): AdamW 12 N bytes
    (LLaMA-7B: 75.31 GiB), SGD 4 N (25.10 GiB: the master copy only; SGD without momentum has
    no state of its own, so the paper's SGD row is plain SGD, momentum 0). LOMO: none (the
    fp16 weights are updated directly, all math in fp32 registers). AdaLomo: factored fp32
    second moments, rows + cols per matrix and numel per vector.
    With pure bf16/fp16/fp32 training (no master copy, what torch.optim does on a bf16 model):
    AdamW 2 N p (m and v in the parameters' dtype), SGD 0, LOMO 0, AdaLomo as above.
Activations
    What the autograd graph keeps for backward plus the loss's backward workspace, per
    T = batch * seq tokens, for the LLaMA layer of transformers with fused (sdpa/flash)
    attention, counted tensor by tensor (a = activation bytes, 2 in 16-bit training):
      per layer: two RMSNorms (fp32 input copy + normalised output: (4 + a) h each),
      q, k, v after rotary, attention output and its contiguous copy (a h (3 + 2 kv/heads)),
      the MLP's gate, up, SiLU and product (4 a i);
      head: final RMSNorm ((4 + a) h), the logits (a V), the fp32 log-softmax the loss keeps
      (4 V) and, in its backward, two more fp32 [T, V] tensors (8 V).
    With activation checkpointing (per decoder layer, as `gradient_checkpointing_enable()`)
    only each layer's input is kept (a h per layer) and one layer is recomputed at a time.
    This is an estimate: tensors that are views, thread-local buffers and allocator rounding
    are not counted; the CPU test bounds its error at small scale.

The LOMO paper's Table 1 (LLaMA-7B, mixed precision): parameters 12.55, gradients 12.55 /
12.55 / 0.24, optimizer states 75.31 / 25.10 / 0 for AdamW / SGD / LOMO, totals 102.20 /
51.99 / 14.58. The formulas above reproduce the three state columns to the printed digit.
Each total minus its states leaves the activations: 102.20 - 100.410, 51.99 - 50.205 and
14.58 - 12.795, i.e. one figure between 1.785 and 1.790 GiB (the overlap of the three
rounding intervals) in all three rows. The rows share one activation setting, and only
activation checkpointing keeps a 7B model's activations that small (without it a single
2048-token sequence already needs 11.8 GiB in this model). In this model 1.787 GiB is the
checkpointed activation memory of 2102 tokens. The defaults (checkpointing on, batch 1 x
2048 tokens, the LLaMA context) give 1.74 GiB, 2.6% below the paper; totals 102.15 / 51.95 /
14.54. ``activations_gib=1.787`` (``--activations-gib 1.787``) prints the paper's three
totals exactly.

ZeRO-3 (``zero3=True``) shards parameters, gradients and optimizer states over the GPUs and
adds the gathered full copy of the largest parameter being computed with; with LOMO/AdaLomo
the gradient of the largest tensor exists in full before it is reduce-scattered, so it is not
divided. Activations are per GPU (each GPU runs its own batch).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .models import PRESETS, ModelShape, resolve_model

GIB = 2**30
OPTIMIZERS = ("adamw", "sgd", "lomo", "adalomo")
PRECISIONS = {"mixed": 2, "bf16": 2, "fp16": 2, "fp32": 4}
FP32 = 4
DEFAULT_BATCH = 1
DEFAULT_SEQ = 2048


@dataclass(frozen=True)
class Estimate:
    """Peak memory per GPU, in GiB, split as in the LOMO paper's Table 1."""

    parameters_gib: float
    gradients_gib: float
    optimizer_states_gib: float
    activations_gib: float
    total_gib: float
    fits: bool
    gpu_mem_gib: float
    detail: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _check_choice(value: str, choices: Sequence[str], what: str) -> str:
    key = value.lower()
    if key not in choices:
        raise ValueError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")
    return key


def parameter_bytes(model: ModelShape, precision: str = "mixed") -> int:
    return (
        model.num_parameters * PRECISIONS[_check_choice(precision, tuple(PRECISIONS), "precision")]
    )


def gradient_bytes(model: ModelShape, optimizer: str, precision: str = "mixed") -> int:
    """Gradients alive at the peak: all of them, or (LOMO, AdaLomo) the largest one."""
    opt = _check_choice(optimizer, OPTIMIZERS, "optimizer")
    p = PRECISIONS[_check_choice(precision, tuple(PRECISIONS), "precision")]
    if opt in ("lomo", "adalomo"):
        return model.largest_tensor_numel * p
    return model.num_parameters * p


def adalomo_state_numel(model: ModelShape) -> int:
    """fp32 elements of AdaLomo's factored second moments (rows + cols, or numel for 1-D)."""
    return sum(r + c for r, c in model.matrix_shapes())


def optimizer_state_bytes(model: ModelShape, optimizer: str, precision: str = "mixed") -> int:
    opt = _check_choice(optimizer, OPTIMIZERS, "optimizer")
    p = PRECISIONS[_check_choice(precision, tuple(PRECISIONS), "precision")]
    n = model.num_parameters
    mixed = precision == "mixed"
    if opt == "adamw":
        return n * (FP32 + 2 * FP32) if mixed else n * 2 * p
    if opt == "sgd":
        return n * FP32 if mixed else 0
    if opt == "lomo":
        return 0
    return adalomo_state_numel(model) * FP32


def layer_activation_bytes_per_token(model: ModelShape, act_bytes: int) -> int:
    """Bytes one decoder layer keeps for backward per token (see the module docstring)."""
    h, i, a = model.hidden_size, model.intermediate_size, act_bytes
    norms = 2 * (FP32 + a) * h
    attention = a * (3 * h + 2 * model.kv_size)
    mlp = 4 * a * i
    return norms + attention + mlp


def head_activation_bytes_per_token(model: ModelShape, act_bytes: int) -> int:
    """Final norm, logits, the loss's fp32 log-softmax and its backward workspace, per token."""
    return (FP32 + act_bytes) * model.hidden_size + (act_bytes + 3 * FP32) * model.vocab_size


def activation_bytes(
    model: ModelShape, batch: int, seq: int, checkpointing: bool, precision: str = "mixed"
) -> int:
    if batch <= 0 or seq <= 0:
        raise ValueError(f"batch and seq must be positive, got {batch} and {seq}")
    a = PRECISIONS[_check_choice(precision, tuple(PRECISIONS), "precision")]
    tokens = batch * seq
    layer = layer_activation_bytes_per_token(model, a)
    if checkpointing:
        per_token = model.num_layers * a * model.hidden_size + layer
    else:
        per_token = model.num_layers * layer
    return tokens * (per_token + head_activation_bytes_per_token(model, a))


def estimate(
    model: str | ModelShape | Any,
    optimizer: str,
    *,
    gpus: int = 1,
    gpu_mem_gib: float = 80.0,
    batch: int = DEFAULT_BATCH,
    seq: int = DEFAULT_SEQ,
    checkpointing: bool = True,
    zero3: bool = False,
    precision: str = "mixed",
    activations_gib: float | None = None,
) -> Estimate:
    """Peak memory per GPU of fine-tuning `model` with `optimizer` (see the module docstring).

    model: a preset name (llama-7b, ...), a config.json path, a dict or an HF config.
    batch: sequences per GPU. activations_gib: use this figure instead of the model's.
    """
    shape = resolve_model(model)
    opt = _check_choice(optimizer, OPTIMIZERS, "optimizer")
    precision = _check_choice(precision, tuple(PRECISIONS), "precision")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    p = PRECISIONS[precision]
    params = parameter_bytes(shape, precision)
    grads = gradient_bytes(shape, opt, precision)
    states = optimizer_state_bytes(shape, opt, precision)
    if zero3 and gpus > 1:
        params = params / gpus + shape.largest_tensor_numel * p  # + the gathered tensor
        if opt in ("adamw", "sgd"):
            grads = grads / gpus
        states = states / gpus
    if activations_gib is None:
        acts = activation_bytes(shape, batch, seq, checkpointing, precision) / GIB
    else:
        acts = float(activations_gib)
    parts = [params / GIB, grads / GIB, states / GIB, acts]
    total = sum(parts)
    detail = {
        "model": shape.name,
        "optimizer": opt,
        "num_parameters": shape.num_parameters,
        "largest_tensor_numel": shape.largest_tensor_numel,
        "precision": precision,
        "gpus": gpus,
        "zero3": zero3,
        "batch_per_gpu": batch,
        "seq": seq,
        "checkpointing": checkpointing,
        "activations": "given" if activations_gib is not None else "modelled",
    }
    return Estimate(
        *(round(x, 2) for x in parts),
        total_gib=round(total, 2),
        fits=total <= gpu_mem_gib,
        gpu_mem_gib=gpu_mem_gib,
        detail=detail,
    )


def format_estimate(est: Estimate) -> str:
    d = est.detail
    setup = (
        f"{d['model']} ({d['num_parameters'] / 1e9:.2f}B parameters), {d['optimizer']}, "
        f"{d['precision']} precision, {d['gpus']} GPU(s)"
        + (" with ZeRO-3" if d["zero3"] else "")
        + f", batch {d['batch_per_gpu']} x {d['seq']} per GPU, activation checkpointing "
        + ("on" if d["checkpointing"] else "off")
    )
    rows = [
        ("parameters", est.parameters_gib),
        ("gradients", est.gradients_gib),
        ("optimizer states", est.optimizer_states_gib),
        (f"activations ({d['activations']})", est.activations_gib),
        ("total per GPU", est.total_gib),
    ]
    lines = [setup] + [f"  {name:<24} {value:9.2f} GiB" for name, value in rows]
    verdict = "fits" if est.fits else "does NOT fit"
    lines.append(f"  {verdict} in {est.gpu_mem_gib:g} GiB per GPU")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help=f"{', '.join(PRESETS)} or a HF config.json path"
    )
    parser.add_argument("--optimizer", required=True, choices=OPTIMIZERS)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU (default 80)")
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="sequences per GPU")
    parser.add_argument("--seq", type=int, default=DEFAULT_SEQ, help="tokens per sequence")
    parser.add_argument(
        "--checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="activation checkpointing per decoder layer (default on)",
    )
    parser.add_argument("--zero3", action="store_true", help="shard over --gpus with ZeRO-3")
    parser.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        default="mixed",
        help="mixed: fp16 weights + fp32 master copy (the paper); bf16/fp16/fp32: pure",
    )
    parser.add_argument(
        "--activations-gib",
        type=float,
        default=None,
        help="use this activation figure (e.g. a measured one) instead of the model's",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def command(args: argparse.Namespace) -> int:
    est = estimate(
        args.model,
        args.optimizer,
        gpus=args.gpus,
        gpu_mem_gib=args.gpu_mem,
        batch=args.batch,
        seq=args.seq,
        checkpointing=args.checkpointing,
        zero3=args.zero3,
        precision=args.precision,
        activations_gib=args.activations_gib,
    )
    print(json.dumps(est.to_json()) if args.json else format_estimate(est))
    return 0
