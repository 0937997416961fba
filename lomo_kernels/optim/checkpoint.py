"""The optimizer's checkpoint: `state_dict()` and a `load_state_dict` that checks the whole
checkpoint before applying any of it (lomo-optim's state_dicts included).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..distributed import Sharding
from ._hyper import check_step_count
from .loss_scaler import check_scaler_state
from .loss_scaling import LossScaling
from .param_groups import check_saved_groups
from .parameter_state import ParameterState
from .reporting import StepReports
from .single_backward import SingleBackwardClip
from .step import Step
from .validation import parameter_names

# The param-group keys of lomo-optim 0.1.1's state_dict(), by class: its torch.optim
# defaults (it keeps AdaLomo's moments and step count outside the state, so they are absent).
LOMO_OPTIM_GROUP_KEYS = {
    "Lomo": frozenset({"lr", "clip_grad_norm", "clip_grad_value"}),
    "AdaLomo": frozenset({"lr", "eps", "weight_decay", "clip_grad_norm", "clip_grad_value"}),
}


def lomo_optim_writer(state_dict: Any) -> str | None:
    """The lomo-optim class that wrote `state_dict` (no 'lomo' entry, no per-parameter state,
    one group with exactly its keys), or None."""
    if not isinstance(state_dict, dict) or "lomo" in state_dict or state_dict.get("state") != {}:
        return None
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0], dict):
        return None
    if not isinstance(groups[0].get("params"), list):
        return None
    keys = set(groups[0]) - {"params"}
    return next((name for name, own in LOMO_OPTIM_GROUP_KEYS.items() if keys == own), None)


def _lifted(state_dict: Any) -> Any:
    """`state_dict` with the param groups' copies of the "lomo" entry removed. The top-level
    entry is the one read; where only the groups hold it (after torch.distributed.checkpoint's
    ``set_state_dict``), their copies must agree and are lifted to the top level."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
        return state_dict
    groups = state_dict["param_groups"]
    copies = [g["lomo"] for g in groups if isinstance(g, dict) and "lomo" in g]
    if not copies:
        return state_dict
    if "lomo" not in state_dict and any(c != copies[0] for c in copies):
        raise ValueError(
            "state_dict['param_groups'] hold different 'lomo' entries (step count, loss "
            "scaler): the param groups come from different checkpoints"
        )
    stripped = [
        {k: v for k, v in g.items() if k != "lomo"} if isinstance(g, dict) else g for g in groups
    ]
    return {**state_dict, "param_groups": stripped, "lomo": state_dict.get("lomo", copies[0])}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor"


def _load_torch_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Applies torch.optim's part (param_groups, per-parameter state), already checked.
    torch.optim would cast floating state to the parameter's dtype: the state is kept in
    fp32 on the parameter's device instead (AdaLomo's moments; Lomo keeps none)."""
    saved_states = state_dict["state"]
    container = optimizer.state  # torch.optim replaces it; the class's own kind is kept
    torch.optim.Optimizer.load_state_dict(optimizer, {**state_dict, "state": {}})
    optimizer.state = container
    params = _params(optimizer)
    for index, values in saved_states.items():
        param = params[index]
        optimizer.state[param] = {
            k: v.to(device=param.device, dtype=torch.float32).clone() for k, v in values.items()
        }


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """An in-backward optimizer's state_dict and its checks. Each method takes the optimizer
    whose torch.optim part (param_groups, per-parameter state) it reads or writes.

    ``state_dict()["lomo"]`` holds what torch.optim's part does not: the class whose state
    it is (`ParameterState.name`), the step count, the loss scaler and the single-backward
    norm history. Every param group carries a copy under the same key, because
    torch.distributed.checkpoint's ``get_state_dict`` keeps only "state" and
    "param_groups" (and passes group keys through).

    The state tensors are copies, so a checkpoint loaded into a state_dict in place
    (``torch.distributed.checkpoint.load``) changes nothing until `load_state_dict` has
    checked it. Sharded, a tensor that holds this rank's slice (`ParameterState.sliced`) is
    a DTensor of the whole, which torch.distributed.checkpoint saves per rank and reshards
    to another world size; the others are whole and equal on every rank.
    """

    kept: ParameterState  # the optimizer's per-parameter state's rules
    model: nn.Module
    reports: StepReports  # the step count's keeper
    step: Step  # whose measured norm a load makes stale
    loss_scaling: LossScaling
    clip: SingleBackwardClip | None
    sharding: Sharding | None

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = self._local_state_dict(optimizer)
        if self.sharding is not None:
            params = _params(optimizer)
            for index, values in state["state"].items():
                state["state"][index] = self.kept.as_dtensors(self.sharding, params[index], values)
        return state

    def consolidated_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """`state_dict()` with sharded state gathered whole, on every rank (a collective)."""
        state = self._local_state_dict(optimizer)
        if self.sharding is None:
            return state
        params = _params(optimizer)
        for index, values in state["state"].items():
            state["state"][index] = self.kept.unsharded(self.sharding, params[index], values)
        return state

    def _local_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = torch.optim.Optimizer.state_dict(optimizer)
        state["state"] = {
            index: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
            for index, values in state["state"].items()
        }
        extra = {
            "optimizer": self.kept.name,
            "step_count": self.reports.step_count,
            "loss_scaler": self.loss_scaling.state_dict(),
        }
        if self.clip is not None:
            extra["single_backward"] = self.clip.state_dict()
        state["lomo"] = extra
        for group in state["param_groups"]:
            group["lomo"] = copy.deepcopy(extra)
        return state

    def load_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Loads `state_dict` after checking the whole of it: a checkpoint of another
        optimizer class, model or sharding, or with non-finite values, is refused with
        nothing applied."""
        writer, state_dict = self._checked(optimizer, state_dict)
        state_dict = dict(state_dict)
        extra = state_dict.pop("lomo", None)
        _load_torch_state(optimizer, state_dict)
        self.step.forget_norm()  # a norm measured before the load belongs to the old state
        if extra is not None:
            self.reports.step_count = int(extra["step_count"])
            self.loss_scaling.load_state_dict(extra["loss_scaler"])
            if self.clip is not None and "single_backward" in extra:
                self.clip.load_state_dict(extra["single_backward"])
        if writer is not None and self.kept.lomo_optim_gap is not None:
            warnings.warn(self.kept.lomo_optim_gap, UserWarning, stacklevel=3)

    def check_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
        """Raises what `load_state_dict` would refuse; changes nothing."""
        self._checked(optimizer, state_dict)

    def _checked(self, optimizer: torch.optim.Optimizer, state_dict: Any) -> tuple[Any, Any]:
        """(the lomo-optim class that wrote `state_dict` or None, `state_dict` in this
        optimizer's own form), after checking the whole of it."""
        writer = lomo_optim_writer(state_dict)
        if writer is not None:
            state_dict = self._from_lomo_optim(optimizer, state_dict, writer)
        else:
            state_dict = self._by_index(optimizer, _lifted(state_dict))
        self._check_state_dict(optimizer, state_dict)
        return writer, state_dict

    def _from_lomo_optim(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], writer: str
    ) -> dict[str, Any]:
        """This optimizer's own state_dict with the hyper-parameters of a lomo-optim one.

        lomo-optim's state_dict holds only its constructor's hyper-parameters (lomo-optim
        itself never reads them back); what it lacks (AdaLomo's moments and step count,
        the loss scaler) stays as it is here. Its ``weight_decay <= 0`` means off, as here 0.
        """
        own = self.kept.name
        if writer != own:
            raise ValueError(
                f"this state_dict was written by lomo_optim.{writer}; {own} keeps other "
                f"hyper-parameters: load it into lomo_kernels.{writer}, or start {own} from its "
                "fresh state"
            )
        saved = state_dict["param_groups"][0]
        # lomo-optim lists every parameter of the model, frozen ones included.
        count = len(list(self.model.parameters()))
        if len(optimizer.param_groups) != 1 or len(saved["params"]) != count:
            raise ValueError(
                f"this lomo_optim.{writer} state_dict lists {len(saved['params'])} parameters, "
                f"this model has {count}: the checkpoint belongs to another model"
            )
        hyper = {k: v for k, v in saved.items() if k != "params"}
        if "weight_decay" in hyper and _is_number(hyper["weight_decay"]):
            hyper["weight_decay"] = max(hyper["weight_decay"], 0.0)
        current = self.state_dict(optimizer)
        group = current["param_groups"][0]
        return {**current, "param_groups": [{**group, **hyper, "params": group["params"]}]}

    def _by_index(self, optimizer: torch.optim.Optimizer, state_dict: Any) -> Any:
        """`state_dict` with its per-parameter state keyed by parameter index, as
        `state_dict()` writes it, and this rank's slices as plain tensors.

        torch.distributed.checkpoint's ``set_state_dict`` hands the state over keyed by
        parameter name, each group's "params" listing the names in this optimizer's order;
        a group or parameter count that does not match is left for the checks to refuse.
        """
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
            return state_dict
        states = dict(state_dict["state"])
        groups = state_dict.get("param_groups")
        if isinstance(groups, list) and len(groups) == len(optimizer.param_groups):
            index = 0
            for saved, own in zip(groups, optimizer.param_groups, strict=True):
                keys = saved.get("params", []) if isinstance(saved, dict) else []
                if len(keys) == len(own["params"]):
                    for offset, key in enumerate(keys):
                        if not isinstance(key, int) and key in states:
                            states[index + offset] = states.pop(key)
                index += len(own["params"])
        params = _params(optimizer)
        names = parameter_names(self.model)
        for index, values in states.items():
            if isinstance(values, dict) and any(_is_dtensor(v) for v in values.values()):
                param = params[index] if isinstance(index, int) and index < len(params) else None
                where = f"state_dict['state'][{index}] (parameter {names.get(id(param), '?')!r})"
                states[index] = self._local_slices(where, param, values)
        return {**state_dict, "state": states}

    def _local_slices(
        self, where: str, param: nn.Parameter | None, values: dict[str, Any]
    ) -> dict[str, Any]:
        """This rank's part of each DTensor in `values`, after checking it is sliced as this
        optimizer slices the parameter's state."""
        local = dict(values)
        for key, value in values.items():
            if not _is_dtensor(value):
                continue
            if self.sharding is None or param is None or key not in self.kept.sliced:
                raise ValueError(
                    f"{where}[{key!r}] is a DTensor where this optimizer keeps a whole tensor: "
                    "load a sharded checkpoint with torch.distributed.checkpoint into this "
                    "optimizer's own state_dict (lomo_kernels.load_checkpoint does), or "
                    "consolidated_state_dict() of the sharded run"
                )
            shard = self.sharding.shard(param)
            if value.numel() != shard.full_numel:
                raise ValueError(
                    f"{where}[{key!r}] covers {value.numel()} elements, the parameter "
                    f"{shard.full_numel}: the checkpoint belongs to another model"
                )
            local[key] = value.to_local()
        return local

    def _check_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError(
                "load_state_dict takes an optimizer state_dict: a dict with 'state' and "
                "'param_groups' (from optimizer.state_dict())"
            )
        extra = state_dict.get("lomo")
        if extra is not None and not isinstance(extra, dict):
            raise ValueError("state_dict['lomo'] must be a dict (from optimizer.state_dict())")
        own = self.kept.name
        writer = (extra or {}).get("optimizer", own)
        if writer != own:
            raise ValueError(
                f"this state_dict was written by {writer}; {own} keeps other state and "
                f"hyper-parameters: load it into a {writer}, or start {own} from its fresh state"
            )
        check_saved_groups(state_dict["param_groups"], optimizer.param_groups)
        self._check_saved_states(optimizer, state_dict["state"])
        if extra is not None:
            self._check_saved_extra(extra)

    def _check_saved_states(self, optimizer: torch.optim.Optimizer, states: Any) -> None:
        """Per-parameter state: the same indices, keys and shapes as this optimizer's own
        (Lomo keeps none), values without a `ParameterState.problem`."""
        params = _params(optimizer)
        own_states = optimizer.state
        names = parameter_names(self.model)
        if not isinstance(states, dict):
            raise ValueError("state_dict['state'] must be a dict of parameter index -> state")
        expected = {i for i, p in enumerate(params) if own_states.get(p)}
        unknown = set(states) - expected
        if unknown:
            raise ValueError(
                f"state_dict['state'] holds state for parameter indices {sorted(unknown)[:8]}, "
                f"for which {type(optimizer).__name__} keeps none: the checkpoint belongs "
                "to another optimizer class or model"
            )
        for index in sorted(expected):
            param = params[index]
            where = f"state_dict['state'][{index}] (parameter {names.get(id(param), '?')!r})"
            if index not in states:
                raise ValueError(f"{where} is missing: the checkpoint belongs to another model")
            self._check_saved_state(where, states[index], own_states[param])

    def _check_saved_state(self, where: str, saved: Any, own: dict[str, Any]) -> None:
        if not isinstance(saved, dict) or set(saved) != set(own):
            keys = sorted(saved) if isinstance(saved, dict) else saved
            raise ValueError(f"{where} has the keys {keys}, this optimizer's {sorted(own)}")
        for key, value in own.items():
            if not isinstance(value, torch.Tensor):
                continue
            incoming = saved[key]
            if not isinstance(incoming, torch.Tensor) or incoming.shape != value.shape:
                shape = tuple(incoming.shape) if isinstance(incoming, torch.Tensor) else incoming
                raise ValueError(
                    f"{where}[{key!r}] has shape {shape}, this optimizer's "
                    f"{tuple(value.shape)}: the checkpoint belongs to another model or "
                    "sharding (consolidated_state_dict() loads into the unsharded model)"
                )
            if not incoming.is_floating_point():
                raise ValueError(
                    f"{where}[{key!r}] has dtype {incoming.dtype}, not a floating-point one: "
                    "the checkpoint is corrupt"
                )
            # Checked as it is kept (fp32, `_load_torch_state`): a float64 value past fp32's
            # range would become inf there.
            problem = self.kept.problem(incoming.to(torch.float32))
            if problem:
                raise ValueError(f"{where}[{key!r}] {problem}: the checkpoint is corrupt")

    def _check_saved_extra(self, extra: dict[str, Any]) -> None:
        try:
            check_step_count(extra.get("step_count"), "state_dict['lomo']['step_count']")
        except TypeError as error:  # a corrupt checkpoint's, as its other values are
            raise ValueError(str(error)) from None
        if extra.get("loss_scaler") is not None:
            check_scaler_state(extra["loss_scaler"], "state_dict['lomo']['loss_scaler']")
        if extra.get("single_backward") is not None:
            SingleBackwardClip.check_state_dict(extra["single_backward"])
