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
    With the fused head (``--fused-head``) a Lomo steps an untied, unsharded head from its
    vocabulary chunks and the input embedding from the rows the batch used, so neither
    ``vocab x hidden`` gradient is counted (the head's fp32 chunk is, with the loss's
    activations; the used rows' fp32 sums, at most 4 h bytes a token, come after the
    loss's and the layers' backward, below their peak); AdaLomo, tied weights and ZeRO-3
    keep both.
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
    The peak of the tensors that are neither parameters nor weight gradients, per
    T = batch * seq tokens, for `transformers.LlamaForCausalLM` with sdpa attention and
    `gradient_checkpointing_enable()` / `activation_checkpointing_enable()` (per decoder
    layer, non-reentrant, the transformers default), counted tensor by tensor from runs that
    record every storage an op creates and when it dies (a = activation bytes, 2 in 16-bit
    training, i = intermediate size, V = vocabulary):
      one layer's saved tensors: per RMSNorm the fp32 input copy, the normalised tensor cast
      back and the weighted output ((4 + 2a) h, + 4 for the fp32 rsqrt; in fp32 training the
      "copy" is the input itself, which for a recomputed layer's first norm is the kept
      input, so the recompute counts 4 h less), q and k after rotary
      and v (a (h + 2 kv)), the attention output (a h; sdpa returns it already in the layout
      o_proj reads, no contiguous copy) and its fp32 log-sum-exp (4 per head), the MLP's
      gate, SiLU, up and their product (4 a i);
      while a layer back-propagates, on top of those: the gradient of its output (a h), alive
      until both residual branches have added to it, and the MLP's three [T, i] gradients
      (of down_proj's input, of SiLU and of up) while gate, SiLU and up are still saved and
      the product already freed: a net 2 a i;
      the loss: the logits (a V, alive through the backward while the caller holds the
      model's output, as `out = model(...); out.loss.backward()` does; a loop that keeps
      only `.loss` frees them after the forward, a V less) and the final norm
      ((4 + 2a) h + 4); `logits.float()` is not saved (log-softmax keeps its own fp32
      output, 4 V), and in its backward nll_loss and log-softmax each make one more fp32
      [T, V] tensor (8 V);
      rotary cos and sin: 2 a head_dim per position, once per forward, shared by the batch.
    With checkpointing only each layer's input stays (a h per layer, the embedding output
    being the first) and one layer is recomputed at a time, inside the backward, after the
    loss's [T, V] tensors are freed: the peak is the kept inputs and the logits plus the
    larger of the loss's part and one recomputed layer's saved and backward tensors. Without
    checkpointing every layer's saved tensors stay instead. LLaMA-7B at 1 x 2048: kept
    inputs 262144 + logits 64000 + loss 416772 (> a layer's 186504 + 52224) + rotary 512
    bytes per token, 1.418 GiB (LLaMA-65B's wider layers make the layer's part the larger).
    Not counted: kernels' internal workspaces (e.g. a GPU flash-attention backward's
    buffers), integer inputs and labels, and allocator rounding and caching (a GPU's caching
    allocator can reserve more than this). The CPU tests compare the model with the
    tracked peak of small LLaMA configurations (within 0.5%, with and without checkpointing,
    16- and 32-bit, head-bound and layer-bound) and with measured process peaks.

The LOMO paper's Table 1 (LLaMA-7B, mixed precision): parameters 12.55, gradients 12.55 /
12.55 / 0.24, optimizer states 75.31 / 25.10 / 0 for AdamW / SGD / LOMO, totals 102.20 /
51.99 / 14.58. The formulas above reproduce the three state columns to the printed digit.
Each total minus its states leaves the activations: 102.20 - 100.410, 51.99 - 50.205 and
14.58 - 12.795, i.e. one figure between 1.785 and 1.790 GiB (the overlap of the three
rounding intervals) in all three rows: one activation setting, with activation
checkpointing (without it this model gives 12.3 GiB for a single 2048-token sequence).
The activation model does not reach that figure at a natural setting: 1.418 GiB at batch
1 x 2048 (the defaults: the LLaMA context), 0.709 at 1 x 1024, 2.834 at 8 x 512; 1.787 GiB
would be 2581 tokens of one sequence. The paper's figure thus matches no natural batch and
sequence length of this model; it depends on the implementation it was measured with
(attention kernel, loss code, allocator), which the model does not know. The defaults
print the modelled figure (totals 101.83 / 51.62 / 14.21), and ``activations_gib=1.787``
(``--activations-gib 1.787``) prints the paper's three totals.

Preference and RL fine-tuning (TRL's DPO, GRPO, RLOO) add two terms, each its own line:
KV cache
    The key and value tensors generation keeps for every token of every sequence it
    generates at once (``generation_batch`` sequences of ``generation_tokens`` tokens,
    prompt and completion): 2 * layers * kv_heads * head_dim * p bytes per token (Llama-3-8B
    in bf16: 2 * 32 * 8 * 128 * 2 = 128 KiB). Added to the total, an upper bound: in TRL's
    generate-then-train loop the cache is freed before the training step's backward, so the
    training peak alone is the total less this line; a generation engine of its own (vLLM)
    holds its memory outside this model.
Reference model
    ``reference_model=True``: a frozen second copy of the weights in their dtype, N * p (DPO,
    and GRPO/RLOO with ``beta > 0``; GRPO's default ``beta=0`` loads none), sharded like the
    weights under ZeRO-3.

ZeRO-3 (``zero3=True``) shards parameters, gradients and optimizer states over the GPUs
(AdaLomo's row and column moments of a matrix stay whole on every rank; its 1-D moments are
sharded) and adds the gathered full copy of the largest parameter being computed with; with
LOMO/AdaLomo the gradient of the largest tensor exists in full before it is reduce-scattered,
so it is not divided. Activations are per GPU (each GPU runs its own batch).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..core.int8_blocks import int8_buffer_bytes
from .argtypes import (
    add_fused_head_argument,
    add_model_argument,
    is_finite_non_negative,
    is_finite_positive,
    keyword_arguments,
    non_negative_float,
    positive_float,
    positive_int,
    whole_number,
)
from .models import ModelShape, resolve_model

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
    kv_cache_gib: float = 0.0
    reference_model_gib: float = 0.0

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


def in_backward_gradient_numels(
    model: ModelShape, optimizer: str, fused_head: bool = False
) -> list[int]:
    """numel of each gradient an in-backward optimizer receives whole: every parameter's,
    but, with the fused head (patch_causal_lm), a Lomo steps an untied head from its
    vocabulary chunks and the input embedding from the rows the batch used (AdaLomo and
    tied weights keep both)."""
    numels = model.tensor_numels()
    if fused_head and optimizer == "lomo" and not model.tie_word_embeddings:
        numels = numels[1:-1]  # the embedding, first in module order, and the head, last
    return numels


def gradient_bytes(
    model: ModelShape, optimizer: str, precision: str = "mixed", fused_head: bool = False
) -> int:
    """Gradients alive at the peak: all of them, or (LOMO, AdaLomo) the largest one the
    optimizer receives whole (`in_backward_gradient_numels`)."""
    opt = _check_choice(optimizer, OPTIMIZERS, "optimizer")
    p = PRECISIONS[_check_choice(precision, tuple(PRECISIONS), "precision")]
    if opt in ("lomo", "adalomo"):
        return max(in_backward_gradient_numels(model, opt, fused_head)) * p
    return model.num_parameters * p


# The buffer's dtype as `accumulation_dtype` takes it: the parameter's, or one of these.
ACCUMULATION_DTYPES = ("param", "fp32", "bf16", "fp16", "int8")
_ACCUMULATION_WIDTHS = {"fp32": FP32, "bf16": 2, "fp16": 2}


def accumulation_buffer_bytes(
    model: ModelShape,
    optimizer: str,
    precision: str = "mixed",
    accumulation_steps: int = 1,
    accumulation_dtype: str = "param",
) -> int:
    """The gradient accumulation buffer of a LOMO optimizer (one per trainable parameter,
    unsharded), 0 for one micro-batch per step and for optimizers that keep gradients."""
    opt = _check_choice(optimizer, OPTIMIZERS, "optimizer")
    if accumulation_steps <= 1 or opt not in ("lomo", "adalomo"):
        return 0
    p = PRECISIONS[_check_choice(precision, tuple(PRECISIONS), "precision")]
    if accumulation_dtype == "int8":
        return int8_buffer_bytes_of(model)
    return model.num_parameters * _ACCUMULATION_WIDTHS.get(accumulation_dtype, p)


def int8_buffer_bytes_of(model: ModelShape) -> int:
    """The 8-bit blockwise buffers' bytes (`core/int8_blocks.py`): one byte per element and
    one fp32 scale per started 256 elements of each parameter tensor."""
    return sum(int8_buffer_bytes(0, n) for n in model.tensor_numels())


def adalomo_state_numel(model: ModelShape, shards: int = 1) -> float:
    """fp32 elements of AdaLomo's factored second moments (rows + cols, or numel for 1-D)
    on one of `shards` ranks: sharded, each rank keeps every matrix's row and column moments
    whole and its slice of the 1-D ones (optim/adalomo_slices.py)."""
    return sum(r + c if c else r / shards for r, c in model.matrix_shapes())


def adalomo_workspace_numel(model: ModelShape) -> int:
    """fp32 elements of the workspaces an unsharded AdaLomo keeps, one per distinct parameter
    shape (`ops/adalomo/workspace.py`)."""
    import torch

    from ..ops.adalomo.workspace import workspace_numel

    shapes = {(r, c) if c else (r,) for r, c in model.matrix_shapes()}
    return sum(workspace_numel(torch.Size(shape)) for shape in shapes)


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


def kv_cache_bytes_per_token(model: ModelShape, precision: str = "mixed") -> int:
    """Generation's key and value cache per token: 2 x layers x kv_heads x head_dim x p."""
    p = PRECISIONS[_check_choice(precision, tuple(PRECISIONS), "precision")]
    head_dim = model.hidden_size // model.num_heads
    return 2 * model.num_layers * model.num_kv_heads * head_dim * p


def kv_cache_bytes(
    model: ModelShape, generation_batch: int, generation_tokens: int, precision: str = "mixed"
) -> int:
    """The KV cache of `generation_batch` sequences of `generation_tokens` tokens each."""
    return kv_cache_bytes_per_token(model, precision) * generation_batch * generation_tokens


def layer_saved_bytes_per_token(model: ModelShape, act_bytes: int) -> int:
    """Bytes one decoder layer's forward keeps for its backward, per token (module docstring)."""
    h, i, a = model.hidden_size, model.intermediate_size, act_bytes
    norm = (FP32 + 2 * a) * h + FP32  # fp32 input copy, normalised, output; fp32 rsqrt
    attention = a * (2 * h + 2 * model.kv_size) + FP32 * model.num_heads  # q k v, out; lse
    mlp = 4 * a * i  # gate, SiLU, up, product
    return 2 * norm + attention + mlp


def layer_backward_bytes_per_token(model: ModelShape, act_bytes: int) -> int:
    """Alive on top of a layer's saved tensors while it back-propagates, per token.

    The gradient of the layer's output (a h) lives until the residual branches have added to
    it, and the MLP's backward holds three [T, i] gradients (of the down projection's input,
    of the SiLU output and of up) while gate, SiLU and up are still saved: the product freed
    before them, a net 2 a i.
    """
    return act_bytes * model.hidden_size + 2 * act_bytes * model.intermediate_size


def loss_bytes_per_token(model: ModelShape, act_bytes: int) -> int:
    """The final norm's saved tensors and the loss's fp32 [T, V] tensors in its backward."""
    final_norm = (FP32 + 2 * act_bytes) * model.hidden_size + FP32
    return final_norm + 3 * FP32 * model.vocab_size


def fused_loss_bytes_per_token(model: ModelShape, act_bytes: int) -> int:
    """The logits-free loss (patch_causal_lm): the final norm's saved tensors, the fp32 loss
    and log-sum-exp kept for the backward, and in the backward the per-token gradient (and
    its ignore-masked copy), the fp32 accumulator of the hidden states' gradient and, for a
    16-bit model, that gradient cast back."""
    h = model.hidden_size
    final_norm = (FP32 + 2 * act_bytes) * h + FP32
    cast = act_bytes * h if act_bytes != FP32 else 0
    return final_norm + 4 * FP32 + FP32 * h + cast


def fused_loss_constant_bytes(model: ModelShape) -> int:
    """The logits-free loss's backward: one vocabulary chunk of the head's gradient in fp32."""
    from ..ops.cross_entropy import chunk_rows

    return chunk_rows(model.vocab_size, model.hidden_size) * model.hidden_size * FP32


def rope_bytes_per_position(model: ModelShape, act_bytes: int) -> int:
    """cos and sin, [seq, head_dim] each, computed once per forward and shared by the batch."""
    return 2 * act_bytes * (model.hidden_size // model.num_heads)


def activation_bytes(
    model: ModelShape,
    batch: int,
    seq: int,
    checkpointing: bool,
    precision: str = "mixed",
    fused_head: bool = False,
) -> int:
    """Peak bytes of activations (module docstring): what is kept across the whole backward
    plus the larger of the loss's backward and one decoder layer's backward. `fused_head`:
    the loss is the logits-free one (no logits kept, no [T, V] tensor in its backward)."""
    if batch <= 0 or seq <= 0:
        raise ValueError(f"batch and seq must be positive, got {batch} and {seq}")
    a = PRECISIONS[_check_choice(precision, tuple(PRECISIONS), "precision")]
    saved = layer_saved_bytes_per_token(model, a)
    if checkpointing:
        kept = model.num_layers * a * model.hidden_size  # each layer's input
        layer_phase = saved + layer_backward_bytes_per_token(model, a)
        if a == FP32:  # the first norm's fp32 "copy" is then the kept input itself
            layer_phase -= FP32 * model.hidden_size
    else:
        kept = model.num_layers * saved
        layer_phase = layer_backward_bytes_per_token(model, a)
    tokens = batch * seq
    if fused_head:
        per_token = fused_loss_bytes_per_token(model, a)
        loss_phase = tokens * per_token + fused_loss_constant_bytes(model)
    else:
        kept += a * model.vocab_size  # the logits, while the caller holds the model's output
        loss_phase = tokens * loss_bytes_per_token(model, a)
    peak = tokens * kept + max(loss_phase, tokens * layer_phase)
    return peak + seq * rope_bytes_per_position(model, a)


def generation_mismatch(generation_batch: int, generation_tokens: int) -> str | None:
    """What is wrong when one of the KV cache's two sizes is given without the other."""
    if (generation_batch > 0) == (generation_tokens > 0):
        return None
    return (
        "the KV cache needs both --generation-batch (sequences generated at once) and "
        f"--generation-tokens (prompt + completion tokens each), got {generation_batch} and "
        f"{generation_tokens}: give both, or neither for no generation"
    )


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
    fused_head: bool = False,
    accumulation_steps: int = 1,
    accumulation_dtype: str = "param",
    generation_batch: int = 0,
    generation_tokens: int = 0,
    reference_model: bool = False,
) -> Estimate:
    """Peak memory per GPU of fine-tuning `model` with `optimizer` (see the module docstring).

    model: a preset name (llama-7b, ...), a config.json path, a dict or an HF config.
    batch: sequences per GPU. activations_gib: use this figure instead of the model's.
    fused_head: the loss is patch_causal_lm's logits-free one (and with Lomo the untied head
    and input embedding get no whole gradient).
    accumulation_steps: micro-batches per step; above 1 a LOMO optimizer holds one buffer per
    parameter (of its shard under ZeRO-3), in the parameter's dtype ("param") or "fp32",
    counted with the gradients (AdamW and SGD accumulate into the gradients they hold anyway).
    generation_batch, generation_tokens: sequences generated at once per GPU and tokens per
    sequence (prompt + completion), for the generation's KV cache (both or neither).
    reference_model: a frozen copy of the weights (DPO; GRPO and RLOO with beta > 0).
    """
    shape = resolve_model(model)
    opt = _check_choice(optimizer, OPTIMIZERS, "optimizer")
    precision = _check_choice(precision, tuple(PRECISIONS), "precision")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    if not is_finite_positive(gpu_mem_gib):
        raise ValueError(f"gpu_mem_gib must be a finite number > 0, got {gpu_mem_gib}")
    if (
        isinstance(accumulation_steps, bool)
        or not isinstance(accumulation_steps, int)
        or (accumulation_steps < 1)
    ):
        raise ValueError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
    if accumulation_dtype not in ACCUMULATION_DTYPES:
        raise ValueError(
            f"accumulation_dtype must be one of {', '.join(ACCUMULATION_DTYPES)}, "
            f"got {accumulation_dtype!r}"
        )
    for name, value in (("generation_batch", generation_batch),
                        ("generation_tokens", generation_tokens)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if mismatch := generation_mismatch(generation_batch, generation_tokens):
        raise ValueError(mismatch)
    if activations_gib is not None and not is_finite_non_negative(activations_gib):
        raise ValueError(f"activations_gib must be a finite number >= 0, got {activations_gib}")
    p = PRECISIONS[precision]
    params = parameter_bytes(shape, precision)
    # Sharded heads keep their gradient (gathered, then reduce-scattered).
    grads = gradient_bytes(shape, opt, precision, fused_head and not (zero3 and gpus > 1))
    states = optimizer_state_bytes(shape, opt, precision)
    if zero3 and gpus > 1:
        params = params / gpus + shape.largest_tensor_numel * p  # + the gathered tensor
        if opt in ("adamw", "sgd"):
            grads = grads / gpus
        # AdaLomo's factored moments stay whole on every rank.
        states = adalomo_state_numel(shape, gpus) * FP32 if opt == "adalomo" else states / gpus
    elif opt == "adalomo":
        states += adalomo_workspace_numel(shape) * FP32
    buffer = accumulation_buffer_bytes(shape, opt, precision, accumulation_steps,
                                       accumulation_dtype) / (gpus if zero3 else 1)  # fmt: skip
    grads += buffer
    if activations_gib is None:
        acts = activation_bytes(shape, batch, seq, checkpointing, precision, fused_head) / GIB
    else:
        acts = float(activations_gib)
    parts = [params / GIB, grads / GIB, states / GIB, acts]
    kv_cache = kv_cache_bytes(shape, generation_batch, generation_tokens, precision) / GIB
    reference = parameter_bytes(shape, precision) if reference_model else 0
    reference = reference / (gpus if zero3 else 1) / GIB  # sharded like the weights
    total = sum(parts) + kv_cache + reference
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
        "fused_head": fused_head,
        "accumulation_steps": accumulation_steps,
        "accumulation_buffer_gib": round(buffer / GIB, 2),
        "activations": "given" if activations_gib is not None else "modelled",
        "generation_batch": generation_batch,
        "generation_tokens": generation_tokens,
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(shape, precision),
        "reference_model": reference_model,
    }
    return Estimate(
        *(round(x, 2) for x in parts),
        total_gib=round(total, 2),
        fits=total <= gpu_mem_gib,
        gpu_mem_gib=gpu_mem_gib,
        detail=detail,
        kv_cache_gib=round(kv_cache, 2),
        reference_model_gib=round(reference, 2),
    )


def format_estimate(est: Estimate) -> str:
    d = est.detail
    setup = (
        f"{d['model']} ({d['num_parameters'] / 1e9:.2f}B parameters), {d['optimizer']}, "
        f"{d['precision']} precision, {d['gpus']} GPU(s)"
        + (" with ZeRO-3" if d["zero3"] else "")
        + f", batch {d['batch_per_gpu']} x {d['seq']} per GPU, activation checkpointing "
        + ("on" if d["checkpointing"] else "off")
        + (", logits-free loss (fused head)" if d["fused_head"] else "")
    )
    gradients = "gradients"
    if d["accumulation_buffer_gib"]:
        gradients += f" (+ buffer {d['accumulation_buffer_gib']:.2f}, k={d['accumulation_steps']})"
    rows = [
        ("parameters", est.parameters_gib),
        (gradients, est.gradients_gib),
        ("optimizer states", est.optimizer_states_gib),
        (f"activations ({d['activations']})", est.activations_gib),
    ]
    if d["reference_model"]:
        rows.append(("reference model (frozen copy)", est.reference_model_gib))
    if d["generation_batch"]:
        per_token = d["kv_cache_bytes_per_token"] / 1024
        tokens = f"{d['generation_batch']} x {d['generation_tokens']}"
        rows.append((f"KV cache ({tokens}, {per_token:g} KiB/token)", est.kv_cache_gib))
    rows.append(("total per GPU", est.total_gib))
    width = max(32, *(len(name) for name, _ in rows))
    lines = [setup] + [f"  {name:<{width}} {value:9.2f} GiB" for name, value in rows]
    verdict = "fits" if est.fits else "does NOT fit"
    lines.append(f"  {verdict} in {est.gpu_mem_gib:g} GiB per GPU")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, None)
    parser.add_argument("--optimizer", required=True, choices=OPTIMIZERS)
    parser.add_argument("--gpus", type=positive_int, default=1)
    parser.add_argument(
        "--gpu-mem",
        dest="gpu_mem_gib",
        type=positive_float,
        default=80.0,
        help="GiB per GPU (default 80)",
    )
    parser.add_argument(
        "--batch", type=positive_int, default=DEFAULT_BATCH, help="sequences per GPU"
    )
    parser.add_argument("--seq", type=positive_int, default=DEFAULT_SEQ, help="tokens per sequence")
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
        type=non_negative_float,
        default=None,
        help="use this activation figure (e.g. a measured one) instead of the model's",
    )
    add_fused_head_argument(parser)
    parser.add_argument(
        "--accumulation-steps",
        type=positive_int,
        default=1,
        help="micro-batches per step (LOMO optimizers hold one buffer per parameter)",
    )
    parser.add_argument(
        "--accumulation-dtype",
        choices=ACCUMULATION_DTYPES,
        default="param",
        help="the accumulation buffer's dtype: the parameter's (default), fp32, bf16, fp16, "
        "or int8 (8-bit blockwise: about 1 byte per parameter)",
    )
    parser.add_argument(
        "--generation-batch",
        type=whole_number(0),
        default=0,
        help="RL: sequences generated at once per GPU, for the KV cache (with --generation-tokens)",
    )
    parser.add_argument(
        "--generation-tokens",
        type=whole_number(0),
        default=0,
        help="RL: tokens per generated sequence, prompt + completion (with --generation-batch)",
    )
    parser.add_argument(
        "--reference-model",
        action="store_true",
        help="a frozen copy of the weights: DPO, and GRPO/RLOO with beta > 0",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def command(args: argparse.Namespace) -> int:
    if mismatch := generation_mismatch(args.generation_batch, args.generation_tokens):
        # Refused as a parse error would be: one line on stderr, exit status 2.
        print(f"lomo-kernels estimate: error: {mismatch}", file=sys.stderr)
        return 2
    est = estimate(**keyword_arguments(args, estimate))
    print(json.dumps(est.to_json()) if args.json else format_estimate(est))
    return 0
