"""The analytic memory model: the LOMO paper's Table 1, independent parameter counts, errors,
the activation model against the tensors alive at the peak of small LLaMA runs, and the
prediction against process peaks measured on CPU at small scale."""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import sys
from typing import Any

import pytest
import torch
from support.dependencies import require
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bench.common.machine import fast_dtype
from lomo_kernels.ops import cross_entropy as lce
from lomo_kernels.tools import estimate as est
from lomo_kernels.tools.models import PRESETS, resolve_model

# LOMO paper (arXiv 2306.09782), Table 1: LLaMA-7B, mixed precision, GiB.
PAPER = {
    "adamw": {"parameters": 12.55, "gradients": 12.55, "states": 75.31, "total": 102.20},
    "sgd": {"parameters": 12.55, "gradients": 12.55, "states": 25.10, "total": 51.99},
    "lomo": {"parameters": 12.55, "gradients": 0.24, "states": 0.0, "total": 14.58},
}
# The activations the paper's totals imply (total - states), the same in all three rows
# within the rounding of the printed figures: [1.785, 1.790) GiB.
PAPER_ACTIVATIONS = 1.787


@pytest.mark.parametrize("optimizer", list(PAPER))
def test_paper_table1_states_and_totals(optimizer: str) -> None:
    paper = PAPER[optimizer]
    e = est.estimate("llama-7b", optimizer, activations_gib=PAPER_ACTIVATIONS)
    assert e.parameters_gib == paper["parameters"]
    assert e.gradients_gib == paper["gradients"]
    assert e.optimizer_states_gib == paper["states"]
    assert e.total_gib == pytest.approx(paper["total"], abs=0.005)


# The defaults (checkpointing, batch 1 x 2048) with the activation model: every column but
# the activations is the paper's; the activations are the model's 1.418 GiB.
DEFAULT_TOTALS = {"adamw": 101.83, "sgd": 51.62, "lomo": 14.21}


@pytest.mark.parametrize("optimizer", list(PAPER))
def test_defaults_model_the_activations_no_natural_setting_gives_the_papers(optimizer: str) -> None:
    e = est.estimate("llama-7b", optimizer)
    assert (e.detail["batch_per_gpu"], e.detail["seq"]) == (1, 2048)  # LLaMA's context
    assert e.detail["activations"] == "modelled"
    assert e.activations_gib == 1.42
    assert e.total_gib == DEFAULT_TOTALS[optimizer]
    # No common checkpointed setting lands in the paper's implied interval (module
    # docstring), so its totals need --activations-gib.
    shape = PRESETS["llama-7b"]
    implied = (1.785, 1.790)
    for batch, seq in [(1, 2048), (1, 1024), (8, 512), (4, 512), (2, 1024)]:
        gib = est.activation_bytes(shape, batch, seq, checkpointing=True) / 2**30
        assert not implied[0] <= gib <= implied[1], (batch, seq, gib)


def test_llama_7b_activation_terms() -> None:
    """The per-token terms the module docstring quotes for LLaMA-7B at 1 x 2048."""
    shape, a = PRESETS["llama-7b"], 2
    assert est.layer_saved_bytes_per_token(shape, a) == 186504
    assert est.layer_backward_bytes_per_token(shape, a) == 52224
    assert est.loss_bytes_per_token(shape, a) == 416772
    assert est.rope_bytes_per_position(shape, a) == 512
    kept = shape.num_layers * a * shape.hidden_size + a * shape.vocab_size
    assert kept == 262144 + 64000
    total = est.activation_bytes(shape, 1, 2048, checkpointing=True)
    assert total == 2048 * (kept + 416772 + 512)
    assert total / 2**30 == pytest.approx(1.418, abs=5e-4)


@pytest.mark.parametrize("name", ["llama-7b", "llama-13b", "llama-30b", "llama-65b"])
def test_parameter_counts_match_transformers(name: str) -> None:
    transformers = require("transformers")
    shape = PRESETS[name]
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(shape.to_hf_config())
    numels = [p.numel() for p in model.parameters()]
    assert shape.num_parameters == sum(numels)
    assert shape.largest_tensor_numel == max(numels)


def _moments(states) -> list[torch.Tensor]:
    """The tensors an optimizer keeps per parameter in `states` (its moments; not the
    0-dim step counts)."""
    return [v for state in states for v in state.values() if torch.is_tensor(v) and v.dim() > 0]


def test_adalomo_state_matches_the_optimizer() -> None:
    from support.models import tiny_llama

    from lomo_kernels import AdaLomo

    model = tiny_llama()
    opt = AdaLomo(model, lr=1e-3)
    opt.fused_backward(model(**_batch()).loss)
    moments = _moments(opt.state.values())
    held = sum(v.numel() for v in moments)
    shape = resolve_model(model.config)
    assert est.adalomo_state_numel(shape) == held
    # and the workspaces it keeps from step to step, one per distinct parameter shape
    workspaces = sum(w.numel() for w in opt._workspaces.values())
    assert est.adalomo_workspace_numel(shape) == workspaces
    # In bytes: the moments as the optimizer holds them, fp32 whatever the weights are.
    held_bytes = sum(v.numel() * v.element_size() for v in moments)
    for precision in ("mixed", "bf16", "fp32"):
        assert est.optimizer_state_bytes(shape, "adalomo", precision) == held_bytes


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "lomo"])
def test_pure_precision_states_are_what_the_optimizers_hold(optimizer: str, precision: str):
    """Without a master copy, the states the estimate counts are the bytes the optimizers
    hold after a step of a tiny LLaMA in that dtype: torch's AdamW its two moments in the
    weights' dtype, torch's SGD (momentum 0) and Lomo nothing."""
    from support.models import tiny_llama

    from lomo_kernels import Lomo

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    model = tiny_llama().to(dtype)
    if optimizer == "lomo":
        opt = Lomo(model, lr=1e-3)
        opt.fused_backward(model(**_batch()).loss)
    else:
        cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
        opt = cls(model.parameters(), lr=1e-3)
        model(**_batch()).loss.backward()
        opt.step()
    held = sum(v.numel() * v.element_size() for v in _moments(opt.state.values()))
    shape = resolve_model(model.config)
    assert est.optimizer_state_bytes(shape, optimizer, precision) == held


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def test_zero3_shards_states_gradients_and_parameters() -> None:
    one = est.estimate("llama-65b", "adamw")
    eight = est.estimate("llama-65b", "adamw", gpus=8, zero3=True)
    # Both figures are rounded to 0.01 GiB: one eighth of one's rounding plus eight's.
    rounding = 0.005 * (1 + 1 / 8)
    assert eight.optimizer_states_gib == pytest.approx(one.optimizer_states_gib / 8, abs=rounding)
    # AdamW's bf16 gradients, counted from the parameter count: an eighth on each rank.
    numel = PRESETS["llama-65b"].num_parameters
    assert one.gradients_gib == pytest.approx(numel * 2 / 2**30, abs=0.005)
    assert eight.gradients_gib == pytest.approx(numel * 2 / 8 / 2**30, abs=0.005)
    largest = PRESETS["llama-65b"].largest_tensor_numel * 2 / 2**30
    assert eight.parameters_gib == pytest.approx(one.parameters_gib / 8 + largest, abs=rounding)
    lomo = est.estimate("llama-65b", "lomo", gpus=8, gpu_mem_gib=24, zero3=True)
    assert lomo.fits and not eight.fits  # the paper's 65B on 8 x RTX 3090 runs LOMO


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "llama-3b", "optimizer": "lomo"}, "preset .*llama-7b"),
        ({"model": "llama-7b", "optimizer": "adam"}, "choose one of adamw, sgd"),
        ({"model": "llama-7b", "optimizer": "lomo", "gpus": 0}, "gpus must be >= 1"),
        ({"model": "llama-7b", "optimizer": "lomo", "batch": 0}, "must be positive"),
        ({"model": "llama-7b", "optimizer": "lomo", "gpu_mem_gib": -5}, "gpu_mem_gib must be"),
        ({"model": "llama-7b", "optimizer": "lomo", "gpu_mem_gib": float("nan")}, "finite"),
        ({"model": "llama-7b", "optimizer": "lomo", "activations_gib": -3}, "activations_gib"),
    ],
)
def test_bad_input_names_what_to_do(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        est.estimate(**kwargs)


def test_hf_config_file(tmp_path) -> None:
    cfg = PRESETS["llama-13b"].to_hf_config().to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert resolve_model(str(tmp_path)).num_parameters == PRESETS["llama-13b"].num_parameters
    path.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="missing vocab_size"):
        resolve_model(str(path))


def test_cli_json(capsys) -> None:
    from lomo_kernels.tools.cli import main

    assert main(["estimate", "--model", "llama-7b", "--optimizer", "lomo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {"parameters_gib", "gradients_gib", "optimizer_states_gib", "activations_gib"}
    assert keys | {"total_gib", "fits"} <= set(out)
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--model", "nope", "--optimizer", "lomo"])
    assert exc.value.code == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


# (flags, estimate's arguments): every option off its default but --activations-gib, then it.
CLI_OPTION_SETS = [
    (["--optimizer", "lomo", "--gpus", "4", "--gpu-mem", "24", "--batch", "3", "--seq", "512",
      "--no-checkpointing", "--zero3", "--precision", "bf16", "--fused-head",
      "--accumulation-steps", "4", "--accumulation-dtype", "int8", "--generation-batch", "2",
      "--generation-tokens", "64", "--reference-model"],
     dict(optimizer="lomo", gpus=4, gpu_mem_gib=24.0, batch=3, seq=512, checkpointing=False,
          zero3=True, precision="bf16", fused_head=True, accumulation_steps=4,
          accumulation_dtype="int8", generation_batch=2, generation_tokens=64,
          reference_model=True)),
    (["--optimizer", "adamw", "--activations-gib", "3.5"],
     dict(optimizer="adamw", activations_gib=3.5)),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "arguments"), CLI_OPTION_SETS, ids=["every_option", "acts"])
def test_cli_passes_every_option_on(capsys, flags: list[str], arguments: dict) -> None:
    """The command's JSON is `estimate`'s own for the same options, each given by its flag."""
    from lomo_kernels.tools.cli import main

    assert main(["estimate", "--model", "llama-7b", *flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == json.loads(json.dumps(est.estimate("llama-7b", **arguments).to_json()))


def test_every_cli_option_is_an_estimate_argument() -> None:
    """A parsed value the estimate does not take would be dropped without a word."""
    parser = argparse.ArgumentParser()
    est.add_arguments(parser)
    destinations = {action.dest for action in parser._actions} - {"help", "json"}
    assert destinations <= set(inspect.signature(est.estimate).parameters)


# -- against measured CPU peaks -------------------------------------------------------------
SMALL = "llama-20m"
BATCH, SEQ = 2, 128
MIB = 2**20


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("optimizer", ["adamw", "lomo"])
def test_prediction_bounds_measured_cpu_peak(optimizer: str) -> None:
    """The measured peak above the model (fresh process, MALLOC_MMAP_THRESHOLD_) lies within
    the model's stated error, without checkpointing, in bf16 where the CPU multiplies bf16
    natively and in fp32 elsewhere (torch's fallback bf16 GEMM holds fp32 copies of its
    operands, which no model of the training step's tensors should include):

      lower: gradients + states must all be alive at once (at the optimizer step), and
             the activations at least once (in the loss's backward): max of the two, with
             activations allowed 25% below the model (views, freed saved tensors);
      upper: the paper's sum (gradients + states + activations), activations allowed 25%
             above the model, plus up to two temporaries the size of the largest parameter
             (torch's AdamW step; the fp32 upcast of a gradient) and 16 MiB of runtime.
    """
    require("transformers")
    from bench.memory import measure_isolated

    shape = PRESETS[SMALL]
    precision = fast_dtype()
    e = est.estimate(
        SMALL, optimizer, batch=BATCH, seq=SEQ, checkpointing=False, precision=precision
    )
    grads_states = (e.gradients_gib + e.optimizer_states_gib) * 2**30 / MIB
    acts = e.activations_gib * 2**30 / MIB
    temporaries = 2 * shape.largest_tensor_numel * est.PRECISIONS[precision] / MIB
    lower = max(grads_states, 0.75 * acts)
    upper = grads_states + 1.25 * acts + temporaries + 16
    r = measure_isolated(optimizer, BATCH, SEQ, steps=3, model=SMALL, dtype=precision)
    measured = r["peak_above_model_mb"]
    assert lower <= measured <= upper, (
        f"{optimizer}: measured {measured:.1f} MiB outside [{lower:.1f}, {upper:.1f}] "
        f"(gradients + states {grads_states:.1f}, activations {acts:.1f})"
    )


# -- against the tensors alive at the peak ---------------------------------------------------
_OPENED_OPS = {
    torch.ops.lomo_kernels.linear_cross_entropy_forward.default: lce.forward_impl,
    torch.ops.lomo_kernels.linear_cross_entropy_backward.default: lce.backward_impl,
}


class LiveStorages(TorchDispatchMode):
    """Every storage an op creates (parameters' excluded) and, after each op, which are alive.

    A storage is alive until its last tensor, saved ones included, is gone (a weak reference
    to the storage itself), so the count is what the allocator holds, views counted once.
    """

    def __init__(self, excluded: set[int]) -> None:
        super().__init__()
        self.excluded = excluded
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # id -> (reference, data_ptr)
        self.nbytes: dict[int, int] = {}
        self.gradients: set[int] = set()
        self.timeline: list[frozenset[int]] = []
        self._ids = itertools.count()

    def mark_gradient(self, grad: torch.Tensor) -> None:
        ptr = grad.untyped_storage().data_ptr()
        self.gradients |= {k for k, (ref, p) in self.live.items() if p == ptr and not ref.expired()}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        implementation = _OPENED_OPS.get(func)
        if implementation is not None:
            # The fused loss's ops run their implementation under this mode, so the
            # tensors they create inside are counted too.
            with self:
                return implementation(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for k in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[k]
        alive = {p for _, p in self.live.values()}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            # Views and in-place results share a storage already counted.
            if storage.nbytes() and ptr not in self.excluded and ptr not in alive:
                k = next(self._ids)
                self.live[k] = (StorageWeakRef(storage), ptr)
                self.nbytes[k] = storage.nbytes()
                alive.add(ptr)
        self.timeline.append(frozenset(self.live))
        return out

    def peak_activation_bytes(self) -> int:
        """The largest sum, over the ops, of the alive storages that are not gradients."""
        return max(
            sum(self.nbytes[k] for k in alive if k not in self.gradients) for alive in self.timeline
        )


def tracked_activation_peak(model: torch.nn.Module, batch: int, seq: int) -> int:
    """Peak activation bytes of one forward and backward, each parameter's gradient dropped
    as soon as it is accumulated (as LOMO frees it), so weight gradients never pile up."""
    params = list(model.parameters())
    tracker = LiveStorages({p.untyped_storage().data_ptr() for p in params})

    def drop(p: torch.Tensor) -> None:
        tracker.mark_gradient(p.grad)
        p.grad = None

    handles = [p.register_post_accumulate_grad_hook(drop) for p in params]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)
    try:
        with tracker:
            out = model(input_ids=ids, labels=ids)  # `out` keeps the logits, as modelled
            out.loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return tracker.peak_activation_bytes()


# (name, precision, checkpointing, shape overrides, batch, seq): the loss's part is the larger
# with a 2000-token vocabulary, one recomputed layer's with 256; grouped-query attention.
TRACKED = [
    ("bf16-ckpt-loss", "bf16", True, {}, 2, 48),
    ("bf16-ckpt-layer", "bf16", True, {"vocab_size": 256}, 2, 48),
    ("bf16-nockpt", "bf16", False, {}, 2, 48),
    ("fp32-ckpt-layer", "fp32", True, {"vocab_size": 256}, 2, 48),
    ("fp32-nockpt", "fp32", False, {"vocab_size": 256}, 2, 48),
    ("bf16-ckpt-gqa", "bf16", True, {"vocab_size": 256, "num_key_value_heads": 2}, 1, 80),
]


def _small_llama(
    precision: str, checkpointing: bool, overrides: dict, fused_head: bool = False
) -> tuple[torch.nn.Module, Any]:
    """A small transformers LLaMA (sdpa attention) in `precision`, with per-layer
    checkpointing and the logits-free loss as asked; (model, config)."""
    transformers = require("transformers")
    config = transformers.LlamaConfig(
        **{
            "vocab_size": 2000,
            "hidden_size": 64,
            "intermediate_size": 172,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "max_position_embeddings": 128,
            "attn_implementation": "sdpa",
            **overrides,
        }
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = transformers.LlamaForCausalLM(config).to(dtype).train()
    if fused_head:
        from lomo_kernels import patch_causal_lm

        patch_causal_lm(model)
    if checkpointing:
        # The newer name where transformers has it (the older one warns there).
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    return model, config


@pytest.mark.parametrize(
    ("precision", "checkpointing", "overrides", "batch", "seq"),
    [case[1:] for case in TRACKED],
    ids=[case[0] for case in TRACKED],
)
def test_activation_model_matches_the_tensors_alive_at_the_peak(
    precision: str, checkpointing: bool, overrides: dict, batch: int, seq: int
) -> None:
    """The model against the tracked peak of a small transformers LLaMA (sdpa attention,
    per-layer non-reentrant checkpointing): within 0.5%. What it leaves out at this scale are
    the integer inputs, labels and positions (under 0.2%)."""
    model, config = _small_llama(precision, checkpointing, overrides)
    measured = tracked_activation_peak(model, batch, seq)
    modelled = est.activation_bytes(resolve_model(config), batch, seq, checkpointing, precision)
    assert modelled == pytest.approx(measured, rel=0.005), (modelled, measured)


@pytest.mark.parametrize(
    ("precision", "checkpointing", "overrides", "batch", "seq"),
    [("bf16", True, {}, 2, 48), ("fp32", False, {"vocab_size": 3001}, 2, 40)],
    ids=["bf16-ckpt", "fp32-nockpt"],
)
def test_fused_head_activation_model_bounds_the_tracked_peak(
    precision: str, checkpointing: bool, overrides: dict, batch: int, seq: int
) -> None:
    """patch_causal_lm's loss: the model (the GPU kernels' buffers) against the tracked peak
    of the CPU kernels, which add their block temporaries: an fp32 copy of a token block and
    of a vocabulary chunk in 16-bit models, and one block of logits, at most
    4 (T_b h + C h + T_b max(V_b, C)) bytes (T_b, V_b the CPU blocks, C the chunk rows).
    The tracked peak must lie between the model and the model plus that."""
    from lomo_kernels.ops.cross_entropy import blocked_backend as blocked

    model, config = _small_llama(precision, checkpointing, overrides, fused_head=True)
    measured = tracked_activation_peak(model, batch, seq)
    shape = resolve_model(config)
    modelled = est.activation_bytes(shape, batch, seq, checkpointing, precision, fused_head=True)
    h, tokens = shape.hidden_size, batch * seq
    block_t = min(blocked.BLOCK_TOKENS, tokens)
    block_v = min(blocked.BLOCK_VOCAB, shape.vocab_size)
    chunk = lce.chunk_rows(shape.vocab_size, h)
    cpu_extra = 4 * (block_t * h + chunk * h + block_t * max(block_v, chunk))
    assert modelled <= measured <= modelled + cpu_extra, (modelled, measured, cpu_extra)
    unfused = est.activation_bytes(shape, batch, seq, checkpointing, precision)
    assert measured < unfused


def test_fused_head_lomo_counts_no_vocab_by_hidden_gradient() -> None:
    """Llama-3-8B (vocab 128,256 x 4096, untied), bf16, 8 x 2048, checkpointing: with the
    fused head a Lomo's largest whole gradient is the MLP's 14,336 x 4096 (the head and the
    embedding are stepped from blocks); AdaLomo, a tied model (Llama-3.2-1B) and ZeRO-3 keep
    the 128,256-row gradient."""
    run = dict(precision="bf16", batch=8, seq=2048, fused_head=True)
    lomo = est.estimate("llama-3-8b", "lomo", **run)
    assert lomo.gradients_gib == round(14336 * 4096 * 2 / 2**30, 2)
    assert lomo.total_gib == 23.13
    vocab_rows = round(128256 * 4096 * 2 / 2**30, 2)
    assert est.estimate("llama-3-8b", "adalomo", **run).gradients_gib == vocab_rows
    zero3 = est.estimate("llama-3-8b", "lomo", gpus=2, zero3=True, **run)
    assert zero3.gradients_gib == vocab_rows
    tied = est.estimate("llama-3-1b", "lomo", **run)
    assert tied.gradients_gib == round(128256 * 2048 * 2 / 2**30, 2)


@pytest.mark.parametrize(("dtype", "width"), [("param", 2), ("fp32", 4), ("bf16", 2), ("fp16", 2)])
@pytest.mark.parametrize("optimizer", ["lomo", "adalomo"])
@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_buffer_one_per_parameter(optimizer: str, dtype: str, width: int, k) -> None:
    # The buffer is one element per trainable parameter (LLaMA-7B: 6,738,415,616), of the
    # parameter's bf16 or fp32, counted with the gradients, from the second micro-batch per
    # step on and whatever their number; sharded over the ranks by ZeRO-3.
    n = resolve_model("llama-7b").num_parameters
    one = est.estimate("llama-7b", optimizer, precision="bf16", activations_gib=0.0)
    four = est.estimate("llama-7b", optimizer, precision="bf16", activations_gib=0.0,
                        accumulation_steps=k, accumulation_dtype=dtype)  # fmt: skip
    buffer_gib = round(n * width / 2**30, 2)
    assert four.detail["accumulation_buffer_gib"] == buffer_gib
    assert four.gradients_gib == pytest.approx(one.gradients_gib + buffer_gib, abs=0.011)
    sharded = est.estimate("llama-7b", optimizer, precision="bf16", activations_gib=0.0, gpus=8,
                           zero3=True, accumulation_steps=k, accumulation_dtype=dtype)  # fmt: skip
    assert sharded.detail["accumulation_buffer_gib"] == round(n * width / 8 / 2**30, 2)


def test_the_8_bit_buffer_counts_its_scales() -> None:
    # int8 codes for every parameter and one fp32 scale per started 256 elements of each
    # tensor: exactly the bytes a tiny LLaMA's buffers hold (measured on the optimizer; its
    # 1-D tensors end in partial blocks), and LLaMA-7B's 6,738,415,616 parameters at
    # 1 + 4/256 bytes each.
    from support.accumulating import micro_batches
    from support.models import tiny_llama

    from lomo_kernels import Lomo

    model = tiny_llama()
    opt = Lomo(model, lr=0.01, accumulation_steps=2, accumulation_dtype=torch.int8,
               backend="torch")  # fmt: skip
    opt.fused_backward(model(**micro_batches(0)[0]).loss)
    shape = resolve_model(model.config.to_dict())
    assert shape.num_parameters == sum(p.numel() for p in model.parameters())
    assert any(p.numel() % 256 for p in model.parameters())
    assert est.int8_buffer_bytes_of(shape) == opt._accumulation.buffer_bytes()
    n = resolve_model("llama-7b").num_parameters
    buffer = est.estimate("llama-7b", "lomo", precision="bf16", activations_gib=0.0,
                          accumulation_steps=4, accumulation_dtype="int8")  # fmt: skip
    expected = n * (1 + 4 / 256) / 2**30
    assert buffer.detail["accumulation_buffer_gib"] == pytest.approx(expected, abs=0.011)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "int8"])
def test_cli_accumulation_flags_count_the_buffer(capsys, dtype: str) -> None:
    # The command line's --accumulation-steps/--accumulation-dtype give the estimate the same
    # buffer as the function's arguments (LLaMA-7B, bf16 weights), in its JSON and its table.
    from lomo_kernels.tools.cli import main

    args = ["estimate", "--model", "llama-7b", "--optimizer", "lomo", "--precision", "bf16"]
    args += ["--accumulation-steps", "4", "--accumulation-dtype", dtype]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = est.estimate("llama-7b", "lomo", precision="bf16", accumulation_steps=4,
                        accumulation_dtype=dtype)  # fmt: skip
    assert want.detail["accumulation_buffer_gib"] > 0
    assert out["detail"]["accumulation_buffer_gib"] == want.detail["accumulation_buffer_gib"]
    assert out["gradients_gib"] == want.gradients_gib and out["total_gib"] == want.total_gib
    assert main(args) == 0
    gib = want.detail["accumulation_buffer_gib"]
    assert f"+ buffer {gib:.2f}, k=4" in capsys.readouterr().out


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_accumulation_costs_optimizers_that_keep_gradients_nothing(optimizer: str) -> None:
    one = est.estimate("llama-7b", optimizer, activations_gib=0.0)
    four = est.estimate("llama-7b", optimizer, activations_gib=0.0, accumulation_steps=4)
    assert four.total_gib == one.total_gib and four.detail["accumulation_buffer_gib"] == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"accumulation_steps": 0}, "accumulation_steps"), ({"accumulation_dtype": "int4"}, "dtype")],
)
def test_bad_accumulation_arguments_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        est.estimate("llama-7b", "lomo", **kwargs)


def test_adalomo_zero3_state_is_what_each_rank_keeps() -> None:
    """Sharded, each rank keeps a matrix's row and column moments whole and its slice of a
    1-D parameter's moment (the optimizer's own slice state, built here for rank 0 of 2):
    only the 1-D moments divide by the ranks."""
    from support.models import tiny_llama

    from lomo_kernels.distributed import Shard
    from lomo_kernels.optim.adalomo_slices import init_slice_state

    model, ranks = tiny_llama(), 2
    held = 0
    for param in model.parameters():
        local = param.detach().view(-1)[: param.numel() // ranks]
        state = init_slice_state(Shard(param, local, 0, param.shape, None))
        held += sum(v.numel() for v in _moments([state]))
    shape = resolve_model(model.config)
    assert est.adalomo_state_numel(shape, ranks) == held
    assert held > est.adalomo_state_numel(shape) / ranks  # more than an even share


def _config(**changes) -> dict:
    """A tiny LLaMA config.json's fields, with `changes`."""
    return {**PRESETS["tiny"].to_hf_config().to_dict(), **changes}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"num_key_value_heads": -1}, "num_key_value_heads must be a whole number > 0, got -1"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a whole number > 0, got 0"),
        ({"hidden_size": 64.7}, "hidden_size must be a whole number > 0, got 64.7"),
        ({"hidden_size": True}, "hidden_size must be a whole number > 0, got True"),
        ({"vocab_size": None}, "vocab_size must be a whole number > 0, got None"),
        ({"vocab_size": "abc"}, "vocab_size must be a whole number > 0, got 'abc'"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
        # What the LLaMA layout does not count (their numbers would come out low).
        ({"model_type": "mixtral"}, "model_type 'mixtral': estimate counts the LLaMA layout"),
        ({"model_type": "qwen2"}, "model_type 'qwen2'"),
        ({"num_local_experts": 8}, "num_local_experts=8 \\(a mixture of experts\\)"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"head_dim": 64}, "head_dim=64 \\(not hidden_size / num_attention_heads = 32\\)"),
    ],
)
def test_config_values_estimate_cannot_count_are_refused(tmp_path, changes, match) -> None:
    """A config.json's bad numbers, and layouts other than LLaMA's, refused naming the field,
    instead of counted as something else (a truncated size, a default, too few parameters)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config(**changes)))
    with pytest.raises(ValueError, match=match):
        resolve_model(str(path))


@pytest.mark.parametrize(
    ("content", "match"),
    [(b"42", "a config is a JSON object, got a int"), (b"{bad", "is not a JSON config"),
     (b"\xff\xfe", "is not a JSON config")],
)  # fmt: skip
def test_a_file_that_is_no_json_config_is_refused_naming_it(tmp_path, content, match) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        resolve_model(str(path))
    assert resolve_model(_config()).num_parameters == PRESETS["tiny"].num_parameters


@pytest.mark.parametrize(("dtype", "width"), [("param", 4), ("bf16", 2), ("fp16", 2)])
def test_accumulation_buffer_of_another_dtype_than_fp32_weights(dtype: str, width: int) -> None:
    """fp32 weights with a 16-bit buffer (accumulation_dtype=torch.bfloat16 / float16, which
    the optimizers take): 2 bytes per parameter, not the weights' 4."""
    n = resolve_model("llama-7b").num_parameters
    run = dict(precision="fp32", activations_gib=0.0, accumulation_steps=4)
    result = est.estimate("llama-7b", "lomo", accumulation_dtype=dtype, **run)
    assert result.detail["accumulation_buffer_gib"] == round(n * width / 2**30, 2)
