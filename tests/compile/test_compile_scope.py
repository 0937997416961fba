"""What lomo_kernels' compiled-autograd patches leave alone: other users' in-backward hooks,
torch versions on which they are not tested, and torch's classes until compiled autograd
runs a backward of ours.

Run as a script (``PYTHONPATH=tests python tests/compile/test_compile_scope.py MODE OUT``),
this file trains a user's own in-backward optimizer under a compiled forward and compiled
autograd (Inductor) and saves the parameters and the compiled code; MODE says what else the
process holds: nothing (``plain``: lomo_kernels not even imported), a Lomo on another model
(``with_lomo``), or the patches applied to every parameter, as if every hook were ours
(``patch_all``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.models import tiny_llama
from torch._dynamo import compiled_autograd

USER_LR = 0.05


def user_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def user_loss(forward: torch.nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
    return forward(x).pow(2).mean()


def sgd_in_backward(param: torch.Tensor) -> None:
    """A user's own in-backward optimizer: plain SGD in a post-accumulate-grad hook."""
    param.add_(param.grad, alpha=-USER_LR)
    param.grad = None


def without_aot_ids(code: str) -> str:
    """`code` without AOTAutograd's graph numbers, which count every compile in the process."""
    return re.sub(r"\baot\d+_", "aot_", re.sub(r"# AOT ID: .*", "# AOT ID", code))


def train_user_model(graph_code: list[str]) -> tuple[torch.nn.Module, list[str]]:
    """Two steps, forward and backward compiled by Inductor; the compiled-autograd graphs'
    code is appended to `graph_code`; returns the model and Inductor's output code."""
    from torch._inductor.utils import run_and_get_code

    model = user_model()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(sgd_in_backward)
    forward = torch.compile(model)

    def compiler(graph: torch.fx.GraphModule) -> object:
        graph_code.append(without_aot_ids(graph.code))
        return torch.compile(graph, backend="inductor", fullgraph=True)

    def steps() -> None:
        for step in range(2):
            loss = user_loss(forward, step)
            with compiled_autograd._enable(compiler):
                loss.backward()

    _, inductor_code = run_and_get_code(steps)
    return model, [without_aot_ids(code) for code in inductor_code]


def lomo_on_another_model() -> object:
    """A Lomo (on a model of another shape) that has taken a compiled-autograd step."""
    from lomo_kernels import Lomo

    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
    opt = Lomo(other, lr=0.1)
    loss = torch.compile(other, backend="aot_eager")(torch.randn(5, 8)).pow(2).mean()
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        opt.fused_backward(loss)
    return opt


def run_mode(mode: str, out: Path) -> None:
    if mode == "patch_all":  # the patches taking every parameter for ours
        from lomo_kernels.compile import install, scope

        install()
        scope.updated_in_backward = lambda t: isinstance(t, torch.nn.Parameter)
    keep = lomo_on_another_model() if mode != "plain" else None
    graph_code: list[str] = []
    model, inductor_code = train_user_model(graph_code)
    imported = "lomo_kernels" in sys.modules
    torch.save(
        {
            "params": dict(model.state_dict()),
            "graphs": graph_code,
            "inductor": inductor_code,
            "imported": imported,
        },
        out,
    )
    del keep


def run_modes(modes: list[str], tmp_path: Path) -> dict[str, dict]:
    """Runs each mode in its own process (side by side), each compiling its graphs afresh
    (compiled kernels may come from the cache)."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
        # The repository (the package) and tests/ (support) first, then this process's path.
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[2]), str(Path(__file__).parents[1]), *sys.path]
        ),
    }
    procs = {
        mode: subprocess.Popen(
            [sys.executable, __file__, mode, str(tmp_path / f"{mode}.pt")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for mode in modes
    }
    for mode, proc in procs.items():
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{mode}:\n{output[-4000:]}"
    return {mode: torch.load(tmp_path / f"{mode}.pt") for mode in modes}


@pytest.mark.slow
def test_users_in_backward_optimizer_compiles_as_without_lomo_kernels(tmp_path):
    runs = run_modes(["plain", "with_lomo", "patch_all"], tmp_path)
    plain, with_lomo, patch_all = runs["plain"], runs["with_lomo"], runs["patch_all"]
    assert not plain["imported"] and with_lomo["imported"]
    assert with_lomo["graphs"] == plain["graphs"]
    assert with_lomo["inductor"] == plain["inductor"]
    for name, value in plain["params"].items():
        assert torch.equal(with_lomo["params"][name], value), name
    # The comparison can fail: the patches, applied to the user's hooks, change the code.
    assert patch_all["inductor"] != plain["inductor"]


# Whether the capture is adjusted: after the constructor, an eager step, a compiled one.
ADJUSTED_WHEN = """
import torch
from torch._dynamo import compiled_autograd
from lomo_kernels import Lomo
from lomo_kernels.compile import scope

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
opt = Lomo(model, lr=0.1)
seen = [scope.installed()]
opt.fused_backward(model(torch.randn(5, 8)).pow(2).mean())
seen.append(scope.installed())
loss = torch.compile(model, backend="aot_eager")(torch.randn(5, 8)).pow(2).mean()
with compiled_autograd._enable(torch.compile(backend="aot_eager")):
    opt.fused_backward(loss)
seen.append(scope.installed())
print("adjusted:", *seen)
"""


def test_capture_is_adjusted_at_the_first_compiled_backward_not_by_the_constructor():
    """torch's classes stay as they are until a backward of ours runs under compiled
    autograd (in a new process: another test may have run one here)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", ADJUSTED_WHEN], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split("adjusted:")[-1].split() == ["False", "False", "True"]


def test_tested_versions_are_matched_by_major_minor():
    from lomo_kernels.compile import torch_version_tested

    assert torch_version_tested("2.13.0+cpu")
    assert torch_version_tested("2.13.1")
    assert torch_version_tested("2.11.0+cu128")
    assert not torch_version_tested("2.12.0")
    assert not torch_version_tested("2.14.0.dev20260101+cpu")
    assert not torch_version_tested("3.13.0")


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 5))


def lomo_loss(forward: torch.nn.Module) -> torch.Tensor:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    return forward(x).pow(2).mean()


@pytest.mark.parametrize("enable", ["compiled_autograd_enable", "config_compiled_autograd"])
def test_untested_torch_refuses_compiled_autograd_before_any_change(monkeypatch, enable):
    from lomo_kernels import Lomo
    from lomo_kernels.compile import version_gate

    monkeypatch.setattr(version_gate, "TORCH_VERSION", "2.99.0")
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = Lomo(model, lr=0.1, clip_grad_norm=1.0)
    loss = lomo_loss(torch.compile(model, backend="aot_eager"))
    if enable == "compiled_autograd_enable":
        context = compiled_autograd._enable(torch.compile(backend="aot_eager"))
    else:
        context = torch._dynamo.config.patch(compiled_autograd=True)
    with context, pytest.raises(RuntimeError) as refused:
        opt.fused_backward(loss)
    message = str(refused.value)
    assert "2.99.0" in message and all(v in message for v in version_gate.TESTED_TORCH_VERSIONS)
    assert "torch.compile of the forward alone keep working" in message
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_torch_lacking_a_patched_internal_refuses_compiled_autograd_by_its_name(monkeypatch):
    from lomo_kernels import Lomo
    from lomo_kernels.compile import scope
    from lomo_kernels.core import torch_internals

    lacking = torch_internals.MissingInternalError("torch._dynamo.external_utils.call_hook", "")
    monkeypatch.setattr(torch_internals, "capture_internals_missing", lambda: lacking)
    monkeypatch.setattr(scope, "_installed", None)  # as in a process that has not tried
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = Lomo(model, lr=0.1, clip_grad_norm=1.0)
    loss = lomo_loss(model)
    compiled = compiled_autograd._enable(torch.compile(backend="aot_eager"))
    with compiled, pytest.raises(RuntimeError) as refused:
        opt.fused_backward(loss)
    message = str(refused.value)
    lacks = "lacks torch._dynamo.external_utils.call_hook"
    assert f"this torch ({torch.__version__}) {lacks}" in message
    assert "Run the backward without compiled autograd" in message
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_untested_torch_still_runs_a_compiled_forward_step(monkeypatch):
    from lomo_kernels import Lomo
    from lomo_kernels.compile import version_gate

    monkeypatch.setattr(version_gate, "TORCH_VERSION", "2.99.0")
    eager, compiled = mlp(), mlp()
    Lomo(eager, lr=0.1, clip_grad_norm=1.0).fused_backward(lomo_loss(eager))
    opt = Lomo(compiled, lr=0.1, clip_grad_norm=1.0)
    opt.fused_backward(lomo_loss(torch.compile(compiled, backend="aot_eager")))
    starts = mlp().parameters()
    for a, b, start in zip(eager.parameters(), compiled.parameters(), starts, strict=True):
        assert not torch.equal(b, start)
        assert torch.equal(a, b)


def train_llama(model: torch.nn.Module, steps: int = 2) -> None:
    from lomo_kernels import Lomo

    opt = Lomo(model, lr=1e-2, clip_grad_norm=1.0, weight_decay=0.01)
    device = next(model.parameters()).device
    for step in range(steps):
        ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(step))
        ids = ids.to(device)
        opt.fused_backward(model(input_ids=ids, labels=ids).loss)


# Bound per element on |per-layer compiled - eager|: 4 eps of the element (the rounding of the
# update into the weight) or PER_LAYER_BOUND x the tensor's largest update, whichever is larger.
# Inductor reorders fp32 sums in each layer's forward and backward; torch's own
# compiled-vs-eager difference for backward + SGD on such models is 3e-5 to 7e-5 of the update
# (test_compile_llama.py), while a weight read after its in-backward update moves it by
# 1e-3 of the update or more.
PER_LAYER_BOUND = 1e-4
ROUNDING_EPS = 4


@pytest.mark.slow
def test_compiling_each_decoder_layer_matches_eager_on_any_torch(monkeypatch, test_device):
    from lomo_kernels.compile import version_gate

    monkeypatch.setattr(version_gate, "TORCH_VERSION", "2.99.0")  # untested: no matter
    torch._dynamo.reset()
    start, eager, compiled = (tiny_llama().to(test_device) for _ in range(3))
    for layer in compiled.model.layers:
        layer.compile()  # Inductor per layer; autograd runs eagerly between layers
    train_llama(eager)
    train_llama(compiled)
    for (name, a), b, s in zip(
        eager.named_parameters(), compiled.parameters(), start.parameters(), strict=True
    ):
        update = (a - s).abs().max()
        assert update > 0, name
        eps = torch.finfo(a.dtype).eps
        bound = torch.clamp(ROUNDING_EPS * eps * a.abs(), min=PER_LAYER_BOUND * update)
        assert ((a - b).abs() <= bound).all(), name


if __name__ == "__main__":
    run_mode(sys.argv[1], Path(sys.argv[2]))
