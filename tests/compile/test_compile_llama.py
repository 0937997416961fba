"""Lomo and AdaLomo in torch.compile training loops on a transformers LLaMA, with Inductor.

The four ways a user compiles a step, each compared with the same loop in eager mode:
  forward     torch.compile(model), eager backward
  forward_ca  compiled forward, fused_backward under compiled autograd (Inductor)
  whole       forward + fused_backward in one torch.compile, config.compiled_autograd
  eager_ca    eager forward, fused_backward under compiled autograd: refused (see
              lomo_kernels/compile/eager_forward.py), before any parameter changes
Bounds: support/compiled_runs.py (its module docstring).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from support.compiled_runs import (
    LR,
    STEPS,
    TWO_LAYER_GQA,
    assert_matches_eager,
    batches,
    check_compiled_run,
    eager_reference,
    fresh_counters,
    make_optimizer,
    measure_torch_rounding,
    tiny_llama,
    train,
)
from support.state import assert_refused
from torch._dynamo import compiled_autograd

from lomo_kernels import Lomo

pytestmark = pytest.mark.slow  # Inductor compiles on 2 cores: ~10-40 s per case


@pytest.fixture(scope="module")
def torch_rounding() -> Any:
    """measure(initial, lr): `measure_torch_rounding`, once per model (a few seconds)."""
    cache: dict[tuple, float] = {}

    def measure(initial: torch.nn.Module, lr: float | None = None) -> float:
        first = next(initial.parameters())
        lr = LR[first.dtype] if lr is None else lr
        key = (initial.config.to_json_string(), lr, str(first.device))
        if key not in cache:
            cache[key] = measure_torch_rounding(initial, lr)
        return cache[key]

    return measure


class _References(dict):
    """`eager_reference` of the tiny model per (optimizer, dtype, device), computed once."""

    def __missing__(self, key: tuple[str, torch.dtype, str]) -> tuple:
        opt_name, dtype, device = key
        self[key] = eager_reference(tiny_llama(dtype).to(device), opt_name)
        return self[key]


@pytest.fixture(scope="module")
def references() -> dict:
    return _References()


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def check_compiled_step(
    references,
    torch_rounding,
    way: str,
    opt_name: str,
    dtype: torch.dtype,
    emulate: bool,
    device: str = "cpu",
):
    reference = references[opt_name, dtype, device]
    check_compiled_run(reference, torch_rounding(reference[0]), way, opt_name, emulate)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opt_name", ["lomo", "adalomo"])
@pytest.mark.parametrize("way", ["forward", "forward_ca", "whole"])
def test_compiled_step_matches_eager(references, torch_rounding, way, opt_name, dtype, test_device):
    """Per element; bf16 with Inductor rounding intermediates as eager does."""
    emulate = dtype == torch.bfloat16
    check_compiled_step(references, torch_rounding, way, opt_name, dtype, emulate, test_device)


@pytest.mark.parametrize("opt_name", ["lomo", "adalomo"])
def test_bf16_compiled_autograd_default_rounding(references, torch_rounding, opt_name, test_device):
    """Inductor's default bf16 code (fp32 intermediates): the looser bound against fp32."""
    check_compiled_step(
        references, torch_rounding, "forward_ca", opt_name, torch.bfloat16, False, test_device
    )


# The refusal depends on the backward graph's structure (views of weights saved by an eager
# forward), not on the dtype; each backward traced costs 40-150 s on 2 cores, so each
# optimizer runs once, each dtype once, and each way a step begins once: Lomo unclipped
# (the refused update pass is the step's only backward), AdaLomo clipped (its norm pass
# compiles and runs, then the update pass is refused).
@pytest.mark.parametrize(
    ("opt_name", "dtype", "clip"),
    [
        pytest.param("lomo", torch.bfloat16, None, id="lomo-bf16-one_pass"),
        pytest.param("adalomo", torch.float32, 1.0, id="adalomo-fp32-norm_pass_first"),
    ],
)
def test_eager_forward_with_compiled_autograd_is_refused_before_any_update(
    references, opt_name, dtype, clip
):
    """The loop's first step with an eager forward (`train`'s "eager_ca"), given an lr: the
    refused update pass leaves everything as it was, the groups' lr included."""
    model = copy.deepcopy(references[opt_name, dtype, "cpu"][0])
    fresh_counters()
    opt = make_optimizer(opt_name, model, LR[dtype], clip_grad_norm=clip)
    loss = model(**next(iter(batches(model)))).loss

    def step() -> None:
        with compiled_autograd._enable(torch.compile(backend="inductor", fullgraph=True)):
            opt.fused_backward(loss, lr=2 * LR[dtype])

    assert_refused(model, opt, step, RuntimeError, "Compile the forward as well")


def test_check_detects_the_reordering_bug(references, torch_rounding, monkeypatch):
    """Without lomo_kernels' adjustment of compiled autograd the step is wrong, and caught."""
    from lomo_kernels.compile import install

    assert install()  # installed now, not at the first compiled backward: then undone below
    owner = compiled_autograd.AutogradCompilerInstance
    monkeypatch.setattr(
        owner, "reorder_accumulate_grad_nodes", owner.reorder_accumulate_grad_nodes.__wrapped__
    )
    initial, eager, _ = references["lomo", torch.float32, "cpu"]
    rounding = torch_rounding(initial)
    compiled = copy.deepcopy(initial)
    fresh_counters()
    train(compiled, "lomo", "forward_ca", [])
    with pytest.raises(AssertionError, match="exceeds the bound"):
        assert_matches_eager(initial, eager, compiled, rounding)


TWO_LAYER_GQA_LR = 0.05  # large updates: a read of an updated weight shows clearly


@pytest.fixture(scope="module")
def two_layer_gqa_reference() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The two-layer GQA model, initial and after the eager Lomo loop."""
    initial = tiny_llama(torch.float32, TWO_LAYER_GQA)
    eager = copy.deepcopy(initial)
    train(eager, "lomo", "eager", [], lr=TWO_LAYER_GQA_LR)
    return initial, eager


def test_two_layer_gqa_matches_eager(two_layer_gqa_reference, torch_rounding):
    """Two layers with grouped-query attention: every tensor within the bound (the
    shape on which the final norm's weight was read after its update, every gradient below
    it off)."""
    initial, eager = two_layer_gqa_reference
    rounding = torch_rounding(initial, lr=TWO_LAYER_GQA_LR)
    compiled = copy.deepcopy(initial)
    fresh_counters()
    train(compiled, "lomo", "forward_ca", [], lr=TWO_LAYER_GQA_LR)
    assert_matches_eager(initial, eager, compiled, rounding)


def test_fused_read_after_update_is_caught(two_layer_gqa_reference, torch_rounding, monkeypatch):
    """Inductor lowering as torch 2.13 does it (a fused read of a weight after its update):
    the bound fails. Caches are off, as the cache key does not see the lowering change.
    Should this fail on a newer torch, its lowering orders the reads itself and
    `realizing_reads_before_writes` can go."""
    from lomo_kernels.compile import realize_reads

    monkeypatch.setattr(realize_reads, "realizing_reads_before_writes", contextlib.nullcontext)
    initial, eager = two_layer_gqa_reference
    rounding = torch_rounding(initial, lr=TWO_LAYER_GQA_LR)
    compiled = copy.deepcopy(initial)
    fresh_counters()
    with torch._inductor.config.patch(force_disable_caches=True):
        train(compiled, "lomo", "forward_ca", [], lr=TWO_LAYER_GQA_LR)
    with pytest.raises(AssertionError, match="exceeds the bound"):
        assert_matches_eager(initial, eager, compiled, rounding)


def documented_compiled_loop() -> str:
    """The code block of docs/compile.md's "Compiled autograd" section."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "compile.md").read_text()
    section = text.split("\n## Compiled autograd\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_documented_compiled_loop_matches_eager(torch_rounding):
    initial = tiny_llama(torch.float32)
    loader = batches(initial)
    eager = copy.deepcopy(initial)
    opt = Lomo(eager, lr=1e-3, clip_grad_norm=1.0, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    for inputs in loader:
        opt.fused_backward(eager(**inputs).loss)
        sched.step()
    compiled = copy.deepcopy(initial)
    fresh_counters()
    exec(documented_compiled_loop(), {"model": compiled, "loader": loader, "Lomo": Lomo})
    assert_matches_eager(initial, eager, compiled, torch_rounding(initial))
    assert not dynamo_utils.counters["graph_break"]


@pytest.fixture(scope="module")
def stochastic_rounding_runs() -> dict:
    """bf16 Lomo with stochastic rounding, eager and forward_ca (Inductor rounding as eager
    does), 3 steps with a changing lr: per way the trained model, the rounding seed of every
    update call as (seed, value of seed_step) and the graph counts after each step."""
    from lomo_kernels.ops import backends

    # Whatever picks the backend of each update call (the backends module, or its LOMO
    # registry where kernels are registered per device); the backend's lomo_update_ takes
    # the op's arguments, by name or at their positions in the op's schema.
    owner = getattr(backends, "LOMO", backends)
    resolve = owner.resolve
    schema = torch.ops.lomo_kernels.lomo_update_.default._schema
    names = [a.name for a in schema.arguments]
    seeds: list[tuple[int, int | None]] = []

    def argument(name: str, args: tuple, kwargs: dict) -> Any:
        return kwargs[name] if name in kwargs else args[names.index(name)]

    class Recording:
        """The resolved backend, noting the seed of each update as the kernel sees it."""

        def __init__(self, backend: Any) -> None:
            self._backend = backend

        def __getattr__(self, name: str) -> Any:
            return getattr(self._backend, name)

        def lomo_update_(self, *args: Any, **kwargs: Any) -> None:
            step = argument("seed_step", args, kwargs)
            step = None if step is None else int(step.reshape(-1)[0])
            seeds.append((argument("seed", args, kwargs), step))
            self._backend.lomo_update_(*args, **kwargs)

    out: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(owner, "resolve", lambda *a, **k: Recording(resolve(*a, **k)))
        for way in ("eager", "forward_ca"):
            model = tiny_llama(torch.bfloat16)
            fresh_counters()
            graphs: list[int] = []
            seeds.clear()
            with torch._inductor.config.patch(emulate_precision_casts=True):
                train(model, "lomo", way, graphs, stochastic_rounding=True)
            out[way] = (model, sorted(seeds), graphs)
    return out


def test_stochastic_rounding_seeds_match_eager(stochastic_rounding_runs):
    """Each (step, parameter) gets the seed eager gives it, the step's part read when the
    update runs: none baked in from step 0."""
    _, eager_seeds, _ = stochastic_rounding_runs["eager"]
    _, compiled_seeds, _ = stochastic_rounding_runs["forward_ca"]
    assert len(set(eager_seeds)) == len(eager_seeds) > 0
    assert len({step for _, step in eager_seeds}) == STEPS
    assert compiled_seeds == eager_seeds


def test_stochastic_rounding_does_not_recompile(stochastic_rounding_runs, torch_rounding):
    """The seed's per-step part is a device tensor: one backward for every step, and the
    compiled run within the per-element bound of the eager one (module docstring)."""
    eager, _, _ = stochastic_rounding_runs["eager"]
    compiled, _, graphs = stochastic_rounding_runs["forward_ca"]
    assert len(graphs) == STEPS >= 3
    assert graphs[0] == graphs[-1], f"graphs compiled per step: {graphs}"
    initial = tiny_llama(torch.bfloat16)
    assert_matches_eager(initial, eager, compiled, torch_rounding(initial))
