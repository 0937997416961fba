"""Lomo and AdaLomo in torch.compile training loops on a transformers LLaMA, with Inductor.

The four ways a user compiles a step, each compared with the same loop in eager mode:
  forward     torch.compile(model), eager backward
  forward_ca  compiled forward, fused_backward under compiled autograd (Inductor)
  whole       forward + fused_backward in one torch.compile, config.compiled_autograd
  eager_ca    eager forward, fused_backward under compiled autograd: refused (see
              lomo_kernels/optim/_compiled_autograd.py), before any parameter changes
Bounds, after 3 steps, per element: within 4 ulps of its eager value (Inductor fuses and
reassociates sums) or within 1e-3 of the tensor's largest update, whichever is larger.
  fp32: Inductor's default configuration. The bug this guards against moved elements by
        1-44% of the update; `test_check_detects_the_reordering_bug` shows the bound
        catches it.
  bf16: with `torch._inductor.config.emulate_precision_casts`, Inductor rounds each
        intermediate to bf16 where eager does, so compiled and eager round alike and the
        same bound applies (seen: equal to eager bit for bit). In the default configuration
        compiled code keeps fp32 intermediates where eager rounds each op, and gradients
        differ by bf16 roundings (seen: up to 14 ulps of an element with AdaLomo, for
        torch.compile of the forward alone); that run is checked by the rule of
        flash-attention's tests: against the same loop run in fp32 from the same weights,
        the compiled bf16 run may be at most twice as far as the eager bf16 run, per
        tensor, plus 1e-3 of the tensor's largest update.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from torch._dynamo import compiled_autograd

from lomo_kernels import AdaLomo, Lomo

pytestmark = pytest.mark.slow  # Inductor compiles on 2 cores: ~10-40 s per case
STEPS = 3
ULPS = 4
UPDATE_FRACTION = 1e-3
LR = {torch.float32: 1e-2, torch.bfloat16: 5e-2}  # bf16: updates span several ulps


def tiny_llama(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=72,
        num_hidden_layers=1,  # one layer: every op kind, a quarter of the compile time
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).train()


def batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def make_optimizer(
    name: str, model: torch.nn.Module, lr: float, **options: Any
) -> torch.optim.Optimizer:
    cls = Lomo if name == "lomo" else AdaLomo
    return cls(model, lr=lr, clip_grad_norm=1.0, weight_decay=0.01, **options)


def train(
    model: torch.nn.Module,
    opt_name: str,
    way: str,
    graphs: list[int],
    lr: float | None = None,
    **options: Any,
) -> None:
    """Three steps; the lr changes every step (a scheduler), graphs counted after each."""
    dtype = next(model.parameters()).dtype
    opt = make_optimizer(opt_name, model, LR[dtype] if lr is None else lr, **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    forward = torch.compile(model) if way in ("forward", "forward_ca") else model

    def whole_step(inputs: dict[str, torch.Tensor]) -> None:
        opt.fused_backward(model(**inputs).loss)

    # torch.compile reads config.compiled_autograd when it wraps the function.
    with torch._dynamo.config.patch(compiled_autograd=True):
        compiled_step = torch.compile(whole_step)
    for step in range(STEPS):
        if way == "whole":
            with torch._dynamo.config.patch(compiled_autograd=True):
                compiled_step(batch(step))
        elif way in ("forward_ca", "eager_ca"):
            loss = forward(**batch(step)).loss
            # fullgraph: a graph break in the hooks or the update ops would raise.
            with compiled_autograd._enable(torch.compile(backend="inductor", fullgraph=True)):
                opt.fused_backward(loss)
        else:
            opt.fused_backward(forward(**batch(step)).loss)
        sched.step()
        graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])


def assert_matches_eager(initial, eager, compiled, fp32_run=None) -> None:
    """The bounds of the module docstring; `fp32_run` (bf16 only): the loop run in fp32."""
    runs = [initial.parameters(), eager.parameters(), compiled.parameters()]
    runs.append(fp32_run.parameters() if fp32_run is not None else eager.parameters())
    for (name, p0), pe, pc, pr in zip(initial.named_parameters(), *runs[1:], strict=True):
        e, c, r = (t.detach().double() for t in (pe, pc, pr))
        largest_update = (e - p0.detach().double()).abs().max()
        if fp32_run is None:
            ulp = torch.finfo(pe.dtype).eps * torch.exp2(torch.floor(torch.log2(e.abs())))
            bound = torch.maximum(ULPS * ulp, UPDATE_FRACTION * largest_update)
            excess = ((e - c).abs() - bound).max().item()
        else:
            bound = 2 * (e - r).abs().max() + UPDATE_FRACTION * largest_update
            excess = ((c - r).abs().max() - bound).item()
        assert excess <= 0, (
            f"{name}: compiled run exceeds the bound by {excess:.3e} "
            f"(largest update {largest_update.item():.3e})"
        )


@pytest.fixture(scope="module")
def references() -> dict:
    """Initial and eager-trained models per (optimizer, dtype), computed once; for bf16
    also the loop run in fp32 from the same (bf16-valued) weights."""
    out = {}
    for opt_name in ("lomo", "adalomo"):
        for dtype in (torch.float32, torch.bfloat16):
            initial = tiny_llama(dtype)
            eager = copy.deepcopy(initial)
            train(eager, opt_name, "eager", [])
            fp32_run = None
            if dtype == torch.bfloat16:
                fp32_run = copy.deepcopy(initial).float()
                train(fp32_run, opt_name, "eager", [], lr=LR[dtype])
            out[opt_name, dtype] = (initial, eager, fp32_run)
    return out


def fresh_counters() -> None:
    torch._dynamo.reset()
    compiled_autograd.reset()
    dynamo_utils.counters.clear()


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def check_compiled_step(references, way: str, opt_name: str, dtype: torch.dtype, emulate: bool):
    initial, eager, fp32_run = references[opt_name, dtype]
    compiled = copy.deepcopy(initial)
    fresh_counters()
    graphs: list[int] = []
    with torch._inductor.config.patch(emulate_precision_casts=emulate):
        train(compiled, opt_name, way, graphs)
    per_element = dtype == torch.float32 or emulate
    assert_matches_eager(initial, eager, compiled, None if per_element else fp32_run)
    # The lr changes every step but lives in a device tensor: nothing compiles after step 0.
    assert graphs[0] == graphs[-1], f"graphs compiled per step: {graphs}"
    breaks = dict(dynamo_utils.counters["graph_break"])
    if way == "whole":
        # Dynamo breaks at Tensor.backward and inside torch's autograd machinery on the way
        # (and around the optimizer's host-side bookkeeping, disabled by design); the
        # backward with its hooks is a compiled-autograd graph, the same one forward_ca
        # compiles with fullgraph=True.
        assert dynamo_utils.counters["compiled_autograd"]["captures"] > 0
    else:
        assert not breaks, breaks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opt_name", ["lomo", "adalomo"])
@pytest.mark.parametrize("way", ["forward", "forward_ca", "whole"])
def test_compiled_step_matches_eager(references, way, opt_name, dtype):
    """Per element; bf16 with Inductor rounding intermediates as eager does."""
    check_compiled_step(references, way, opt_name, dtype, emulate=dtype == torch.bfloat16)


@pytest.mark.parametrize("opt_name", ["lomo", "adalomo"])
def test_bf16_compiled_autograd_default_rounding(references, opt_name):
    """Inductor's default bf16 code (fp32 intermediates): the looser bound against fp32."""
    check_compiled_step(references, "forward_ca", opt_name, torch.bfloat16, emulate=False)


# The refusal depends on the backward graph's structure (views of weights saved by an eager
# forward), not on the dtype; each case traces a failing compile (60-150 s on 2 cores), so
# each optimizer runs once and each dtype once.
@pytest.mark.parametrize(
    ("opt_name", "dtype"),
    [
        pytest.param("lomo", torch.bfloat16, id="lomo-bf16"),
        pytest.param("adalomo", torch.float32, id="adalomo-fp32"),
    ],
)
def test_eager_forward_with_compiled_autograd_is_refused_before_any_update(
    references, opt_name, dtype
):
    initial = references[opt_name, dtype][0]
    model = copy.deepcopy(initial)
    fresh_counters()
    with pytest.raises(RuntimeError, match="Compile the forward as well"):
        train(model, opt_name, "eager_ca", [])
    for p0, p in zip(initial.parameters(), model.parameters(), strict=True):
        assert torch.equal(p0, p)


def test_check_detects_the_reordering_bug(references, monkeypatch):
    """Without lomo_kernels' adjustment of compiled autograd the step is wrong, and caught."""
    owner = compiled_autograd.AutogradCompilerInstance
    monkeypatch.setattr(
        owner, "reorder_accumulate_grad_nodes", owner.reorder_accumulate_grad_nodes.__wrapped__
    )
    initial, eager, _ = references["lomo", torch.float32]
    compiled = copy.deepcopy(initial)
    fresh_counters()
    train(compiled, "lomo", "forward_ca", [])
    with pytest.raises(AssertionError, match="exceeds the bound"):
        assert_matches_eager(initial, eager, compiled)


def readme_compiled_loop() -> str:
    """The code block of README.md's torch.compile section."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text.split("### torch.compile", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_compiled_loop_matches_eager():
    initial = tiny_llama(torch.float32)
    loader = [batch(step) for step in range(STEPS)]
    eager = copy.deepcopy(initial)
    opt = Lomo(eager, lr=1e-3, clip_grad_norm=1.0, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    for inputs in loader:
        opt.fused_backward(eager(**inputs).loss)
        sched.step()
    compiled = copy.deepcopy(initial)
    fresh_counters()
    exec(readme_compiled_loop(), {"model": compiled, "loader": loader, "Lomo": Lomo})
    assert_matches_eager(initial, eager, compiled)
    assert not dynamo_utils.counters["graph_break"]


@pytest.fixture(scope="module")
def stochastic_rounding_runs() -> dict:
    """bf16 Lomo with stochastic rounding, eager and forward_ca (Inductor rounding as eager
    does), 3 steps with a changing lr: per way the trained model, the rounding seed of every
    update call as (seed, value of seed_step) and the graph counts after each step."""
    from lomo_kernels.ops import backends

    # Whatever picks the backend of each update call (the backends module, or its SGD
    # registry where kernels are registered per device); the backend's sgd_update_ takes
    # the op's arguments, by name or at their positions in the op's schema.
    owner = getattr(backends, "SGD", backends)
    resolve = owner.resolve
    schema = torch.ops.lomo_kernels.sgd_update_.default._schema
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

        def sgd_update_(self, *args: Any, **kwargs: Any) -> None:
            step = argument("seed_step", args, kwargs)
            step = None if step is None else int(step.reshape(-1)[0])
            seeds.append((argument("seed", args, kwargs), step))
            self._backend.sgd_update_(*args, **kwargs)

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


def test_stochastic_rounding_does_not_recompile(stochastic_rounding_runs):
    """The seed's per-step part is a device tensor: one backward for every step, and the
    compiled run within the per-element bound of the eager one (module docstring)."""
    eager, _, _ = stochastic_rounding_runs["eager"]
    compiled, _, graphs = stochastic_rounding_runs["forward_ca"]
    assert len(graphs) == STEPS >= 3
    assert graphs[0] == graphs[-1], f"graphs compiled per step: {graphs}"
    assert_matches_eager(tiny_llama(torch.bfloat16), eager, compiled)
