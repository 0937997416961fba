"""The in-backward optimizer's hook state machine, shared by Lomo and AdaLomo.

Each trainable parameter gets one post-accumulate-grad hook (`hooks.py`). During
`fused_backward` the hook updates that parameter with a fused op and frees its gradient;
during `grad_norm` it only accumulates the gradient's squared norm and inf/nan flag on the
device. The step in progress is one object (`step.py`): its plan, decided once as it starts
(update; norm, then update; single backward; accumulate), the pass that runs, the flags the
hooks read and what the pass has seen. Flags, norms, clip coefficients, the loss scale and
the learning rate stay in device tensors (`device_scalars.py`), so backward never waits for
the host.

The other jobs are parts of the optimizer, each with its own state: the checks before any
change (`validation.py`, `_hyper.py`), what the hooks read of the param groups
(`param_groups.py`), the loss scaling (`loss_scaling.py`), the write-back's rounding
(`rounding.py`), the one-backward clip rule (`single_backward.py`), the sharding
(`distributed/`; the one-loss pattern of ZeRO-3, `sharded_steps.py`), the step reports
(`reporting.py`), the checkpoint (`checkpoint.py`, `parameter_state.py`) and the parameters
a fused op hands over in blocks of rows (`row_blocks.py`). No part holds the optimizer:
dropping it removes its hooks at once.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypedDict

import torch
from torch import nn

from .. import compile as _compiled_autograd
from .. import ops
from ..checkpoint import restore_engine_checkpoints, serve_engine_checkpoints
from ..core.ownership import Claim, refuse_claimed
from ..core.torch_internals import compiled_backward_donates_buffers
from ..distributed import DEFAULT_BUCKET_NUMEL, Shard, ShardGrads, sharding_for, unwrap_engine
from ..distributed.zero3 import is_deepspeed_engine
from ..ops.backends import LOMO, requested_backend
from . import int8_buffer
from ._hyper import check_lr, check_step_count, checked_group
from .accumulation import Accumulation, Buffer, check_accumulation
from .checkpoint import Checkpoint
from .device_scalars import DeviceScalars, DeviceScalarTable
from .head_guard import refuse_bypassed_head, trained_heads
from .hooks import attach_hooks
from .int8_buffer import Int8Buffer
from .loss_graph import LossGraph, read_loss_graph
from .loss_scaling import LossScaling
from .param_groups import GroupHyperParameter, HookGroups, build_param_groups
from .parameter_state import ParameterState
from .piece import Piece, PieceBatch
from .reporting import Reported, StepReports
from .rounding import WriteBackRounding
from .row_blocks import RowBlocks, RowBlockStep
from .sharded_steps import check_one_loss_pattern
from .single_backward import SingleBackwardClip
from .step import Phase, Plan, Step
from .validation import (
    ParameterLayout,
    check_loss,
    parameter_names,
    plain_backward_error,
    refuse_graph,
    refuse_inference_mode,
    sparse_gradient_error,
    trainable_parameters,
)

DONATED_BUFFERS_ERROR = (
    "the norm pass (clipping by global norm, or fp16: grad_norm(loss), or fused_backward's "
    "own) keeps the loss's graph for the update pass, but this graph's compiled backward "
    "reuses the buffers it saved (torch's donated buffers), so torch runs it only once. Set "
    "torch._functorch.config.donated_buffer = False before the first compiled forward (torch "
    "decides it as it compiles the backward, and its compile cache keeps the decision), or "
    "use single_backward=True with compiled autograd on (one backward per step, no norm "
    "pass). No parameter was changed."
)
# torch's own refusal to keep such a graph (AOTAutograd's runtime wrapper).
_TORCH_DONATED_BUFFERS = "compiled with non-empty donated buffers"
SINGLE_BACKWARD_ORDER_ERROR = (
    "single_backward=True clips each gradient by the norm of the gradients before it, so "
    "its step depends on the order the gradients arrive in; this loss's graph holds a "
    "torch.compile'd region whose backward runs eagerly, which hands its gradients over in "
    "another order than the eager model's (and from run to run of torch). Turn compiled "
    "autograd on (torch._dynamo.config.compiled_autograd = True), which keeps the eager "
    "order, or clip exactly (single_backward=False: a norm pass first). No parameter was "
    "changed."
)


GRAD_NORM_WITH_ACCUMULATION_ERROR = (
    "grad_norm(loss) measures one backward's gradients, but with accumulation_steps > 1 the "
    "step clips by the norm of the gradients accumulated over its micro-batches, which the "
    "last micro-batch's backward measures: call fused_backward(loss) for each micro-batch "
    "(opt.last_grad_norm is the step's norm). Nothing was changed."
)
ACCUMULATION_COMPILED_ERROR = (
    "accumulation_steps > 1 under compiled autograd is not supported: the micro-batches' "
    "buffers are allocated and looked up on the host in the hooks. Run the backward eagerly "
    "(a torch.compile'd forward is fine; leave torch._dynamo.config.compiled_autograd off) or "
    "use accumulation_steps=1 with a larger batch. Nothing was changed."
)


class InBackwardOptions(TypedDict, total=False):
    """The keyword-only options Lomo and AdaLomo share (`InBackwardOptimizer`'s, with its
    defaults)."""

    stochastic_rounding: bool
    seed: int
    backend: str | None
    bucket_numel: int
    single_backward: bool
    replicated: bool
    param_groups: Sequence[Mapping[str, Any]] | None
    accumulation_steps: int
    accumulation_dtype: torch.dtype | None


class InBackwardOptimizer(torch.optim.Optimizer):
    """Base of Lomo/AdaLomo. Subclasses implement `_update` (one `Piece`: a whole tensor, or
    any piece where `elementwise`), `_prepare_update_arguments` (once per step) and, where
    not elementwise, `_update_shards` (a batch of this rank's slices), and say what they keep
    per parameter (`_PARAMETER_STATE`).

    The hooks stay until `detach()`, the end of a ``with`` block, or the optimizer's
    collection; then the model trains with plain backward and any other optimizer.
    """

    _PARAMETER_STATE: ClassVar[ParameterState]
    # Whether the update is elementwise: any piece of a parameter (a block of rows, a slice)
    # is then stepped on its own exactly as the whole tensor's step steps it.
    elementwise: ClassVar[bool] = False
    # Whether `_update` reads an 8-bit accumulation buffer itself (`Piece.grad` an
    # `Int8Buffer`); else it is handed the buffer dequantised (int8_buffer.py).
    reads_int8_buffers: ClassVar[bool] = False
    # The param groups' checkpoint entries a sharded load takes as the checkpoint holds them,
    # as load_state_dict does (checkpoint/state.py): the one-backward clip's norm history, of
    # a run with or without single_backward, and the loss scaler's state, of a run in fp16 or
    # in another dtype (none).
    optional_group_entries: ClassVar[tuple[str, ...]] = (
        "lomo.single_backward",
        "lomo.loss_scaler",
    )

    def __init__(
        self,
        model: nn.Module,
        defaults: dict[str, Any],
        loss_scaling: Callable[[torch.device], LossScaling],
        *,
        stochastic_rounding: bool = True,
        seed: int = 0,
        backend: str | None = None,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        single_backward: bool = False,
        replicated: bool = True,
        param_groups: Sequence[Mapping[str, Any]] | None = None,
        accumulation_steps: int = 1,
        accumulation_dtype: torch.dtype | None = None,
    ) -> None:
        """Validates the shared hyper-parameters in `defaults` (lr, weight_decay,
        clip_grad_norm, clip_grad_value) and the sharding set-up, then attaches the hooks,
        last: a constructor that fails leaves the model as it was (subclasses build their
        own parts before calling this one).
        `loss_scaling(device)`: the loss scaling, on the first trained parameter's device.
        `stochastic_rounding`, `seed`: the write-back's rounding of bf16 and fp16
        parameters (rounding.py).
        `backend`: 'triton', 'cpp', 'torch' or None for automatic.
        `bucket_numel`: gradient elements per reduce-scatter under ZeRO-3; under ZeRO-3
        and FSDP2, also the elements whose 8-bit buffers a step dequantises at once for an
        update that does not read them itself (AdaLomo).
        `single_backward`: clip and check overflow within the update pass
        (single_backward.py).
        `replicated=False`: under torch.distributed, each rank's unsharded parameters are its
        own (pipeline stages, a model per rank), so no rank waits for another's gradients.
        `param_groups`: torch-style groups of the model's parameters (param_groups.py).
        `accumulation_steps`: micro-batches per step, each one `fused_backward` call; its
        gradients are summed into a buffer per parameter of `accumulation_dtype` (None: the
        parameter's dtype) and the step applied from them (accumulation.py)."""
        refuse_inference_mode(f"{type(self).__name__}(...)")
        rounding = WriteBackRounding(stochastic_rounding, seed)
        accumulation_steps, accumulation_dtype = check_accumulation(
            accumulation_steps, accumulation_dtype, bool(single_backward)
        )
        defaults = checked_group(defaults)
        engine = model if is_deepspeed_engine(model) else None
        model = unwrap_engine(model)
        params = trainable_parameters(model)
        refuse_claimed(params, parameter_names(model), type(self).__name__)
        sharding = sharding_for(
            params,
            parameter_names(model),
            model=model,
            bucket_numel=bucket_numel,
            replicated=bool(replicated),
        )
        super().__init__(build_param_groups(model, params, param_groups, defaults), defaults)
        self.model = model
        self.rounding = rounding
        self.backend = backend
        self._backend_name = requested_backend(backend)  # validated once, not per call
        hooked = [p for g in self.param_groups for p in g["params"]]
        self._loss_scaling = loss_scaling(hooked[0].device)
        self._step = Step()
        # The groups' lr before this call took its own (`_take_call_lr`), given back if the
        # call fails before any parameter changes; None: the call took none.
        self._lr_before_call: list[float] | None = None
        self._scalars = DeviceScalarTable()
        # The one record of the parameters this optimizer updates and their index (norm
        # slots, rounding seeds), held once the hooks attach.
        self._claim = Claim(self, params)
        self._groups = HookGroups(self.param_groups, self._claim.index_of, defaults)
        self._reports = StepReports(
            functools.partial(parameter_names, model), len(params), self._loss_scaling.scaler
        )
        self._layout = ParameterLayout(model, params, sharded=sharding is not None)
        self.single_backward = bool(single_backward)
        self._single_backward_clip = (
            SingleBackwardClip(None, params[0].device) if single_backward else None
        )
        self._sharding = sharding  # None: unsharded
        self._bucket_numel = int(bucket_numel)
        self._row_blocks = RowBlocks(
            model,
            self._step,
            steps_rows=self.elementwise,
            sharded=sharding is not None,
            clip=self._single_backward_clip,
            backend=backend,
        )
        self._checkpoint = Checkpoint(
            self._PARAMETER_STATE,
            model,
            self._reports,
            self._step,
            self._loss_scaling,
            self._single_backward_clip,
            sharding,
        )
        self._accumulation = (
            Accumulation(accumulation_steps, accumulation_dtype, rounding)
            if accumulation_steps > 1
            else None
        )
        # Set once a training loop decides where steps end (`_fused_backward_in_loop`).
        self._steps_by_loop = False
        self.state = self._PARAMETER_STATE.fresh_container()
        initial = self._PARAMETER_STATE.initial
        if initial is not None:
            for p in params:
                self.state[p] = initial(p, None if sharding is None else sharding.shard(p))
        # Last (see above).
        self._release_hooks = attach_hooks(self, self._claim, hooked)
        self._engine = engine
        if engine is not None:  # DeepSpeed's own need a ZeRO optimizer (checkpoint/)
            serve_engine_checkpoints(engine, self)

    # The hyper-parameters live in param_groups (as in torch.optim); these attributes are
    # lomo-optim's names for them (host values: reading them never syncs).
    lr = GroupHyperParameter("lr")
    weight_decay = GroupHyperParameter("weight_decay")
    clip_grad_norm = GroupHyperParameter("clip_grad_norm")
    clip_grad_value = GroupHyperParameter("clip_grad_value")

    # What the step reports tell (reporting.py).
    step_count = Reported(check=check_step_count)
    last_grad_norm = Reported()
    clip_coef = Reported()
    grad_norms = Reported()
    last_step_skipped = Reported()
    last_step_partial = Reported()
    last_step_interrupted = Reported()
    last_step_partial_names = Reported()

    @property
    def stochastic_rounding(self) -> bool:
        """Whether bf16 and fp16 parameters are written back with stochastic rounding."""
        return self.rounding.stochastic

    @property
    def seed(self) -> int:
        """The stochastic rounding's seed."""
        return self.rounding.seed

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches (`fused_backward` calls) per step; 1: every call is a step."""
        return 1 if self._accumulation is None else self._accumulation.steps

    @property
    def accumulation_dtype(self) -> torch.dtype | None:
        """The accumulation buffers' dtype (None: each parameter's; torch.int8: the 8-bit
        blockwise buffer)."""
        return None if self._accumulation is None else self._accumulation.dtype

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches accumulated since the last step (0 when none waits for `step()`)."""
        return 0 if self._accumulation is None else self._accumulation.pending

    # -- hooks' lifetime ----------------------------------------------------------------
    def detach(self) -> None:
        """Removes every hook from the model: plain ``loss.backward()`` and any other
        optimizer work on it again. This optimizer can no longer step. A DeepSpeed engine it
        was built on gets its own checkpoint methods back. Micro-batches accumulated and
        not applied are dropped, with a warning (``opt.step()`` first applies them)."""
        pending = self.pending_micro_batches
        waiting = self._accumulation.waiting() if pending else ""
        self._release_hooks()  # runs once; later calls do nothing
        if self._accumulation is not None:
            self._accumulation.release(free=True)  # nothing can apply them now
        if pending:
            warnings.warn(
                f"detach() dropped {waiting}; no parameter was changed by them. Call "
                "opt.step() before detach() or the end of the with block to apply them.",
                RuntimeWarning,
                stacklevel=2,
            )
        engine = getattr(self, "_engine", None)
        if engine is not None:
            restore_engine_checkpoints(engine, self)

    def __getstate__(self) -> dict[str, Any]:
        # A copy (copy.deepcopy, pickle) would hold no hooks on the model: refused, not
        # handed back as an optimizer that fails at its first use.
        owner = type(self).__name__
        raise TypeError(
            f"a {owner} cannot be copied or pickled: it steps its model through hooks on the "
            f"parameters, which a copy would not hold. Save opt.state_dict() (with the "
            f"model's), then build a new {owner} on the model and load_state_dict it."
        )

    def __enter__(self) -> InBackwardOptimizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.detach()

    @property
    def attached(self) -> bool:
        """Whether the hooks are on the model (False after `detach()`)."""
        return self._release_hooks.alive

    # -- what subclasses define ---------------------------------------------------------
    def _update(self, piece: Piece) -> None:
        """Applies the step to one piece of a parameter (see `Piece`)."""
        raise NotImplementedError

    def _update_shards(self, batch: PieceBatch) -> None:
        """Applies the step to this rank's slices in `batch`, given their reduced gradients:
        each on its own where the update is elementwise."""
        if not self.elementwise:
            raise NotImplementedError
        for piece in batch.pieces:
            if piece.written.numel():
                self._update(piece)

    def _piece(
        self,
        param: torch.Tensor,
        grad: torch.Tensor | Int8Buffer,
        scalars: DeviceScalars,
        skip_if: torch.Tensor | None,
        shard: Shard | None = None,
        **where: Any,
    ) -> Piece:
        """`param`'s piece with gradient `grad`, in its group: this rank's slice `shard` of
        it, or as `where` says (`Piece`'s optional fields)."""
        if shard is not None:
            where.update(target=shard.local, offset=shard.offset, shard=shard)
        index, group = self._groups.of(param)
        return Piece(param, grad, index, group, scalars, skip_if, **where)

    def _prepare_update_arguments(self) -> None:
        """Once per step, after the device scalars are set: what every update call of the
        step passes, checked as the op's public checks would (before any change)."""
        raise NotImplementedError

    def _update_measures(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        """single_backward: whether `_update` measures this gradient's sum of squares and
        non-finite flag itself (`Piece.on_grad_sumsq`)."""
        return False

    def _update_plan(self, measured: bool) -> Plan:
        """The plan of the step `fused_backward` starts (step.py), decided once: a norm pass
        measured (`measured`: one serves it) or to measure first where clipping by norm or
        fp16 needs one, unless the update pass measures as it goes (single_backward)."""
        if measured:
            return Plan.NORM_THEN_UPDATE
        if not self._needs_detection_pass():
            return Plan.UPDATE
        if self._single_backward_clip is not None:
            return Plan.SINGLE_BACKWARD
        return Plan.NORM_THEN_UPDATE

    def _needs_norm_pass(self) -> bool:
        """Whether each step's update pass needs a norm pass before it: an inf/nan check must
        precede the update, and neither the update pass (single_backward) nor the
        micro-batches (accumulation) measure the gradients as they come."""
        single, accumulating = self._single_backward_clip, self._accumulation
        measures_as_they_come = single is not None or accumulating is not None
        return self._needs_detection_pass() and not measures_as_they_come

    def _needs_detection_pass(self) -> bool:
        """Whether an inf/nan check must precede the update: clipping by the global norm,
        or fp16 (overflows are common there: found before any parameter changes)."""
        return self._loss_scaling.fp16 or self._groups.max_norm is not None

    # -- hooks ------------------------------------------------------------------------
    def _inv_scale_for(self, device: torch.device) -> torch.Tensor | None:
        """The gradients' inverse loss scale as the ops take it: a device tensor, or None
        for 1."""
        return self._loss_scaling.inv_scale_for(device, self._scalars)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        grad = param.grad
        param.grad = None  # the gradient is dropped as soon as it has been used
        if self._step.phase is Phase.IDLE:
            raise RuntimeError(plain_backward_error())
        if grad is None:
            return
        self._row_blocks.note_whole_gradient(param)
        if grad.layout != torch.strided:
            raise sparse_gradient_error(parameter_names(self.model).get(id(param), "?"))
        if self._sharding is not None:
            # Reduced first, then taken as slices.
            for ready in self._sharding.grad_ready(param, grad):
                self._step_slices(ready)
            return
        scalars = self._scalars.for_device(param.device)
        if self._step.phase is Phase.UPDATE:
            self._update_whole(param, grad, scalars)
        else:
            self._measure_or_accumulate(self._piece(param, grad, scalars, None))

    def _update_whole(
        self, param: torch.Tensor, grad: torch.Tensor | Int8Buffer, scalars: DeviceScalars
    ) -> None:
        """The update pass's step of a whole parameter from its gradient (or its buffer)."""
        self._step.note_updated(param)
        on_grad_sumsq = None
        if not self._step.single_backward:
            skip_if = scalars.skip_flag(self._step.norm_ready)
        elif self._update_measures(param, grad):
            # Measured by the update's own first pass, the coefficient written into
            # scalars.clip_coef before the update reads it; a non-finite gradient skips the
            # tensor from within the update.
            skip_if = None
            on_grad_sumsq = functools.partial(
                self._single_backward_clip.prepare_measured, clip_coef=scalars.clip_coef
            )
        else:
            skip_if = self._single_backward_clip.prepare(
                grad, self._inv_scale_for(param.device), self.backend, scalars.clip_coef
            )
        self._update(self._piece(param, grad, scalars, skip_if, on_grad_sumsq=on_grad_sumsq))

    def _step_slices(self, ready: ShardGrads) -> None:
        """One batch of this rank's slices with their reduced gradients (or buffers), taken
        by the pass in progress: measured, accumulated or updated together."""
        if not ready:
            return
        scalars = self._scalars.for_device(ready[0][1].device)
        if self._step.phase is not Phase.UPDATE:
            for shard, grad in ready:
                self._measure_or_accumulate(self._piece(shard.param, grad, scalars, None, shard))
            return
        for shard, _ in ready:
            self._step.note_updated(shard.param)
        skip_if = scalars.skip_flag(self._step.norm_ready)  # no_skip under single_backward
        pieces = [self._piece(shard.param, grad, scalars, skip_if, shard) for shard, grad in ready]
        if self._step.single_backward:  # each slice's own coefficient and skip flag
            grads, inv_scale = [grad for _, grad in ready], self._inv_scale_for(scalars.device)
            coefs, skips = self._single_backward_clip.prepare_bucket(
                grads, inv_scale, self.backend, self._sharding.all_reduce_sum_
            )
            for i, piece in enumerate(pieces):
                piece.skip_if = skips[i : i + 1]
                piece.clip_coef = None if coefs is None else coefs[i : i + 1]
        self._update_shards(PieceBatch(pieces, scalars, skip_if))

    def _measure_or_accumulate(self, piece: Piece) -> None:
        """A piece taken by a pass that writes no parameter: a norm pass adds its gradient's
        sum of squares and inf/nan flag into its parameter's slot (`DeviceScalars.measure`,
        the one norm accumulator); a micro-batch adds its gradient into the buffer."""
        device = piece.scalars.device
        slot = self._groups.index_of[id(piece.param)]
        inv_scale = self._inv_scale_for(device)
        if self._step.phase is Phase.ACCUMULATE:
            self._accumulation.add(piece, slot, inv_scale, self._accumulate_backends[device])
        else:
            piece.scalars.measure(piece.grad, slot, inv_scale, self.backend)

    def row_block_step(self, param: torch.Tensor) -> RowBlockStep | None:
        """How the pass in progress takes `param`'s gradient in row blocks, or None: give it
        the whole gradient (row_blocks.py says when). Refuses a second contribution to a
        parameter already stepped from blocks in this pass."""
        if not self._row_blocks.take(param):
            return None
        phase = self._step.phase
        if phase is Phase.UPDATE:
            self._step.note_updated(param)
        if phase is Phase.ACCUMULATE:
            # The measuring micro-batch sums every row of the buffer.
            changes_zero_rows = self._accumulation.measuring
        else:
            changes_zero_rows = self._groups.of(param)[1]["weight_decay"] != 0
        scalars = self._scalars.for_device(param.device)
        return RowBlockStep(
            self._row_blocks,
            self._piece(param, None, scalars, scalars.skip_flag(self._step.norm_ready)),
            inv_scale=self._inv_scale_for(param.device),
            changes_zero_rows=changes_zero_rows,
            take=self._update if phase is Phase.UPDATE else self._measure_or_accumulate,
        )

    # -- public API -------------------------------------------------------------------
    def grad_norm(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward pass that only measures: global grad norm and inf/nan, nothing updated.

        Keeps the graph (retain_graph=True) for the following `fused_backward(loss)`, except
        under ZeRO-3, where the update pass needs a forward of its own. Returns the total
        norm as a device tensor (no host sync).
        """
        if self._accumulation is not None:
            raise RuntimeError(GRAD_NORM_WITH_ACCUMULATION_ERROR)
        self._step.begin(Plan.NORM_THEN_UPDATE)
        self._read_graph(loss, whole=False)
        self._check_call(loss)
        self._reports.report_previous_step()
        try:
            return self._norm_pass(loss, new_attempt=True)
        except BaseException:
            # Refused by the checks above, the call left an earlier loss's measurement; from
            # here its preparation reset the device sums and flags that measurement was.
            self._step.forget_norm()
            raise

    @property
    def _one_loss_per_pass(self) -> bool:
        """Whether each pass needs a forward of its own (ZeRO-3)."""
        return self._sharding is not None and not self._sharding.second_backward_ok

    def _norm_pass(
        self, loss: torch.Tensor, lr: float | None = None, new_attempt: bool = False
    ) -> torch.Tensor:
        """A norm pass of `loss`, once the call's checks passed and the previous step was
        reported; `new_attempt`: a user's (`grad_norm`), which starts a step attempt
        (lomo-optim's trainer skips the update pass after an overflow and tries again): its
        overflow counts anew."""
        self._prepare_scalars(lr)
        # Per-parameter sums (grad_norms) in eager backward; a compiled backward keeps the
        # one running sum (a slot per parameter would be one more graph input each).
        per_parameter = not (
            torch.compiler.is_compiling() or _compiled_autograd.compiled_autograd_active()
        )
        self._scalars.begin_norm_pass(len(self._groups.index_of) if per_parameter else None)
        # Under ZeRO-3 the update pass has its own forward (see ONE_LOSS_UNDER_SHARDING):
        # keeping this graph would only hold its activations through the next forward.
        retain = not self._one_loss_per_pass
        try:
            self._run_backward(loss, Phase.NORM, retain_graph=retain)
        except RuntimeError as error:
            # torch's refusal to keep the graph of a compiled backward that reuses its saved
            # buffers, raised before that backward runs.
            donated = _TORCH_DONATED_BUFFERS in str(error)
            if donated and retain and compiled_backward_donates_buffers(loss):
                raise RuntimeError(DONATED_BUFFERS_ERROR) from error
            raise
        if new_attempt:  # from the completed pass on: a failed one changed nothing
            self._loss_scaling.begin_attempt()
        self._close_norm_pass(per_parameter)
        self._step.norm_measured(
            loss,
            self._groups.max_norm,
            keep_graph=self._sharding is not None,
            scale_setting=self._loss_scaling.setting,
        )
        return self._reports.last_grad_norm

    def _close_norm_pass(self, per_parameter: bool) -> None:
        """The gradients measured into the device scalars (by a norm pass, or by the
        micro-batches into their buffers) made the step's: their global sum of squares,
        inf/nan count and, `per_parameter`, each parameter's sum, all-reduced under sharding,
        reported, turned into the clip coefficient and given to every device's updates."""
        self._scalars.close_norm_pass()
        total_sumsq = self._scalars.combine(lambda s: s.sumsq)
        found = self._scalars.combine(lambda s: s.norm_found_inf)
        param_sumsq = self._scalars.combine(lambda s: s.param_sumsq) if per_parameter else None
        if self._sharding is not None:
            # Partial sums of this rank's slices: one all-reduce gives every rank the total
            # (and each parameter's) and the same overflow decision.
            parts = [total_sumsq.reshape(1), found.reshape(1)]
            both = torch.cat(parts if param_sumsq is None else [*parts, param_sumsq])
            self._sharding.all_reduce_sum_(both)
            total_sumsq, found = both[:1], both[1:2]
            param_sumsq = None if param_sumsq is None else both[2:]
        max_norm = self._groups.max_norm
        clip_coef = None
        if max_norm is not None:
            clip_coef = ops.clip_coef_from_sumsq(total_sumsq, max_norm).reshape(())
        param_norms = None if param_sumsq is None else param_sumsq.sqrt()
        self._reports.norms_measured(total_sumsq.sqrt(), param_norms, clip_coef)
        self._scalars.share_norm_outcome(found, clip_coef)
        self._loss_scaling.after_norm_pass(found)

    @torch.compiler.disable
    def _measured_norm_for(self, loss: torch.Tensor) -> tuple[bool, bool]:
        """Whether the measured norm serves `fused_backward(loss)`: of this loss (under
        ZeRO-3, of this batch) with the step's clip threshold, at the loss scale the update
        pass scales by; and whether the caller set the scale since it was measured. Only
        asks; under ZeRO-3 it refuses a pass that cannot run."""
        step = self._step
        # Compared from a norm pass until the first call after it (`_keep_measured_norm`),
        # also where its norm was dropped since (a failed grad_norm): a scale set since
        # starts the attempt anew all the same. A changed setting may sync: at most once.
        setting = step.norm_scale_setting
        scale_set = setting is not None and self._loss_scaling.scale_changed_since(setting)
        serves = not scale_set and step.norm_serves(
            loss, self._groups.max_norm, same_batch=self._one_loss_per_pass
        )
        if self._one_loss_per_pass:
            check_one_loss_pattern(step, loss, self._needs_norm_pass(), serves)
        return serves, scale_set

    @torch.compiler.disable
    def _keep_measured_norm(self, serves: bool, scale_set: bool) -> None:
        """Once nothing refuses the step (`_measured_norm_for` said): a norm that does not
        serve it is dropped, and a scale the caller set since starts the step attempt anew
        (measured again, its overflow lowers the scale from the value set)."""
        if scale_set:
            self._loss_scaling.begin_attempt()
        if not serves:
            self._step.forget_norm(scale_setting_too=True)  # compared (`_measured_norm_for`)
            self._reports.last_grad_norm = None  # until this step measures its own (or none)

    def fused_backward(self, loss: torch.Tensor, lr: float | None = None) -> None:
        """Backward with the update applied to each parameter as its gradient is ready.

        `lr` sets the learning rate of every param group (as lomo-optim does); omitted, the
        groups' own lr is used, so torch.optim.lr_scheduler schedulers work.

        With ``accumulation_steps=k`` each call is one micro-batch: its gradients are added
        into the buffers and the k-th call applies the step (with the lr then in force);
        scale each micro-batch's loss as for torch's accumulation (``loss / k``).
        """
        if self._accumulation is not None:
            self._accumulate_micro_batch(loss, lr)
            return
        self._check_call(loss, lr)
        # measured: by grad_norm(loss), which read this loss's graph.
        measured, scale_set = self._measured_norm_for(loss)
        plan = self._update_plan(measured)
        if not measured:
            # The whole graph where no norm pass would meet such a gradient first.
            graph = self._read_graph(loss, whole=plan is not Plan.NORM_THEN_UPDATE)
            eager_backward = not _compiled_autograd.compiled_autograd_active()
            if plan is Plan.SINGLE_BACKWARD and graph.compiled_region and eager_backward:
                raise RuntimeError(SINGLE_BACKWARD_ORDER_ERROR)
        self._keep_measured_norm(measured, scale_set)
        self._step.begin(plan)
        self._reports.report_previous_step()
        if plan is Plan.NORM_THEN_UPDATE and not measured:
            self._norm_pass(loss, lr)  # same attempt as a grad_norm of another loss
        else:
            self._prepare_scalars(lr)
        self._take_call_lr(lr, on_devices=True)  # nothing can refuse the call now
        single = self._step.begin_update()
        if single:
            self._single_backward_clip.max_norm = self._groups.max_norm
            self._single_backward_clip.begin_step()
        try:
            self._run_backward(loss, Phase.UPDATE, retain_graph=False)
        finally:
            detection = self._step.end_update()
        self._finish_step(detection, single)

    @torch.compiler.disable  # see _check_call
    def _read_graph(self, loss: torch.Tensor, whole: bool, blocks: bool = True) -> LossGraph:
        """Reads `loss`'s autograd graph once (`loss_graph.py`) and refuses, before anything
        changes, a patched model's head bypassed (`head_guard.py`) and, with `whole` (a pass
        no norm pass precedes), a gradient the step cannot take (`validation.refuse_graph`;
        `blocks`: whether this pass steps parameters from row blocks at all)."""
        heads = trained_heads(self._claim.updates, self.model)
        graph = read_loss_graph(loss, whole, heads)
        refuse_bypassed_head(graph, heads)
        if whole:

            def stepped_from_blocks(param: torch.Tensor) -> bool:
                return blocks and self._claim.updates(param) and self._row_blocks.eligible(param)

            refuse_graph(graph, stepped_from_blocks, self.model)
        return graph

    # Host-side bookkeeping runs eagerly even inside a compiled training step: traced, it
    # would specialise on the float lr and the step count and recompile every step. Only
    # these helpers are excluded, not the backward: compiled autograd stays on for it.
    @torch.compiler.disable
    def _check_call(self, loss: torch.Tensor, lr: float | None = None) -> None:
        """Checks everything the step reads on the host, before anything changes (`lr`: the
        call's, taken by `_take_call_lr` once nothing can refuse the call)."""
        check_loss(loss)
        self._check_state(lr)

    def _check_state(self, lr: float | None) -> None:
        """`_check_call` without a loss (a step applied by `step()`)."""
        owner = type(self).__name__
        refuse_inference_mode(f"a step of {owner}")
        if not self.attached:
            raise RuntimeError(
                f"this {owner} was detached (detach() or the end of its with block): its "
                "hooks are gone; build a new optimizer to train with it"
            )
        self._layout.check(owner)
        _compiled_autograd.check_supported()
        checked = self._groups.checked(self.param_groups, None if lr is None else check_lr(lr))
        self._loss_scaling.check(owner)
        if self._accumulation is not None:
            self._accumulation.check_scale(self._loss_scaling)
        names = functools.partial(parameter_names, self.model)
        self._groups.refresh(self.param_groups, checked, names)
        self._reports.begin_call()
        self._lr_before_call = None  # this call has taken no lr yet

    @torch.compiler.disable  # see _check_call
    def _take_call_lr(self, lr: float | None, on_devices: bool = False) -> None:
        """Sets every group's lr to the call's `lr` when given (as lomo-optim does), and with
        `on_devices` in the step's device tensors too (which `_prepare_scalars(lr)` left for
        it). Called once nothing can refuse the call: a refused call leaves the groups' lr."""
        self._lr_before_call = None if lr is None else [g["lr"] for g in self.param_groups]
        if lr is None:
            return
        for group in self.param_groups:
            group["lr"] = float(lr)
        if on_devices:
            self._scalars.fill_lr(self.param_groups)

    @torch.compiler.disable  # see _check_call
    def _update_pass_failed(self, error: BaseException | None, tracked: bool = True) -> None:
        """An update pass (fused_backward's, or the step from the buffers) raised `error`:
        the step attempt ends with it; where no parameter changed (`error` None: the graph
        failed to compile before it ran) the groups' lr is as before the call
        (`_take_call_lr`), in the device tensors too; else the interruption is reported."""
        self._loss_scaling.begin_attempt()
        unchanged = error is None or (tracked and not self._step.updated)
        if unchanged and self._lr_before_call is not None:
            for group, lr in zip(self.param_groups, self._lr_before_call, strict=True):
                group["lr"] = lr
            self._scalars.fill_lr(self.param_groups)
        if error is not None:
            self._reports.record_interruption(error, tracked, self._step.updated)

    @torch.compiler.disable
    def _finish_step(self, detection: bool, single: bool) -> None:
        if single:
            found = self._single_backward_clip.end_step()
            self._reports.last_grad_norm = self._single_backward_clip.last_norm()
        else:
            found = self._scalars.combine(
                lambda s: s.norm_found_inf if detection else s.update_found_inf
            )
        if self._sharding is not None:
            if not detection and not single:  # every rank reports the same step outcome
                self._sharding.all_reduce_sum_(found)
            self._sharding.after_update()
        self._loss_scaling.after_step(found, detection)
        self._reports.step_done(found, atomic=detection, single_backward=single)
        self._opt_called = True  # lets lr schedulers know the step happened

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """No-op: the update already happened inside `fused_backward`.

        Kept so frameworks that call `optimizer.step()` keep working. A closure is called
        (under grad) and its loss returned, but it updates nothing by itself.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.pending_micro_batches:
            self._check_state(None)
            self._apply_accumulated()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops every gradient: ``.grad`` and, with accumulation, the micro-batches
        accumulated since the last step (as torch's zero_grad drops accumulated gradients).
        The accumulation buffers are freed, or with ``set_to_none=False`` kept for the next
        step (they are reused from step to step otherwise)."""
        self._drop_gradients()
        if self._accumulation is not None:
            self._accumulation.release(free=set_to_none)

    def flush_report(self) -> None:
        """Reports the last step's overflow now (at the end of training, for example)."""
        self._reports.report_previous_step()

    # -- checkpoint (checkpoint.py) -----------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self.refuse_pending_micro_batches("state_dict()", saving=True)
        return self._checkpoint.state_dict(self)

    def consolidated_state_dict(self) -> dict[str, Any]:
        """`state_dict()` with sharded state gathered whole, on every rank (a collective).

        Loads into the same optimizer built on the unsharded model in one process. Without
        sharding it is `state_dict()`.
        """
        self.refuse_pending_micro_batches("consolidated_state_dict()", saving=True)
        return self._checkpoint.consolidated_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads `state_dict` after checking the whole of it: a checkpoint of another
        optimizer class, model or sharding, or with non-finite values, is refused with
        nothing applied (lomo-optim's state_dicts are taken too)."""
        self.refuse_pending_micro_batches("load_state_dict()")
        self._checkpoint.load_state_dict(self, state_dict)

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raises the error `load_state_dict(state_dict)` would refuse it with; changes
        nothing (a sharded load checks on every rank before any rank applies)."""
        self.refuse_pending_micro_batches("load_state_dict()")
        self._checkpoint.check_state_dict(self, state_dict)

    # -- accumulation (accumulation.py) -----------------------------------------------
    def refuse_pending_micro_batches(self, call: str, saving: bool = False) -> None:
        """Raises a RuntimeError naming `call` (a checkpoint's save or load) while
        micro-batches wait in the buffers: a checkpoint would leave them out (or a loaded one
        mix with them); does nothing otherwise. A save in a loop that decides where steps
        end (a Trainer's save at the end of an IterableDataset's pass, whose micro-batches it
        carries into the next step) leaves them out with a warning, as a checkpoint of
        torch's leaves out ``.grad``."""
        pending = self.pending_micro_batches
        waiting = self._accumulation.waiting() if pending else ""
        if pending and saving and self._steps_by_loop:
            warnings.warn(
                f"{call} leaves out {waiting}, as torch's checkpoints leave out .grad: a run "
                "resumed from it starts that step without them",
                RuntimeWarning,
                stacklevel=3,
            )
        elif pending:
            raise RuntimeError(
                f"{call} with {waiting}: the buffers are not part of a checkpoint. Call it "
                "after the step's last micro-batch, or after opt.step() (which applies what was "
                "accumulated), or drop them with opt.zero_grad(). Nothing was changed."
            )

    def _fused_backward_in_loop(
        self, loss: torch.Tensor, lr: float | None, loop_syncs: bool
    ) -> None:
        """`fused_backward` for a loop that decides where each step ends (transformers'
        Trainer, accelerate's ``accumulate()``), as torch's accumulation lets it: with
        accumulation, the step is applied at the micro-batch the loop syncs on, however many
        came. Fewer than k: an epoch's last step. More: the micro-batches an
        IterableDataset's pass left at its end, which the Trainer carries into the next
        epoch's first step, as torch's ``.grad`` carries them."""
        self._steps_by_loop = True
        if self._accumulation is None:
            self.fused_backward(loss, lr)
            return
        k = self._accumulation.steps
        if not loop_syncs and self.pending_micro_batches + 1 >= 2 * k - 1:
            # A carried step holds at most k - 1 + k micro-batches, its last synced.
            raise ValueError(
                f"the training loop has not synced gradients for {2 * k - 1} micro-batches "
                f"(a step is {k}), so no step would ever be applied: an IterableDataset whose "
                f"passes hold fewer than {k} micro-batches never reaches the Trainer's sync "
                "step (torch's accumulation would run on without a step). Give each pass at "
                "least gradient_accumulation_steps x the batch size rows. Nothing was changed."
            )
        self._accumulate_micro_batch(loss, lr, may_end_step=loop_syncs)
        if loop_syncs and self.pending_micro_batches:  # not the k-th: applied from the buffers
            self.step()

    def _accumulate_micro_batch(
        self, loss: torch.Tensor, lr: float | None, may_end_step: bool = True
    ) -> None:
        """One micro-batch: its gradients added into the buffers; the k-th applies the step
        (unless not `may_end_step`: the step then goes on past k)."""
        accumulation = self._accumulation
        self._check_call(loss, lr)
        if torch.compiler.is_compiling() or _compiled_autograd.compiled_autograd_active():
            raise RuntimeError(ACCUMULATION_COMPILED_ERROR)
        # At every call, as fused_backward's without accumulation: a report that raises (a
        # warning made an error, fp16's minimum scale) then leaves this micro-batch out whole.
        self._reports.report_previous_step()
        self._step.begin(Plan.ACCUMULATE)
        # The whole gradients go to the buffers: only a sparse gradient is refused there. A
        # parameter the graph gives more than one gradient is measured whole at the step.
        graph = self._read_graph(loss, whole=True, blocks=False)
        last = may_end_step and accumulation.pending + 1 == accumulation.steps
        devices = self._prepare_micro_batch()
        accumulation.begin_micro_batch(
            self.step_count, devices, measuring=last, measure_whole=graph.reused_row_block_params
        )
        try:
            self._run_backward(loss, Phase.ACCUMULATE, retain_graph=False)
        except BaseException as error:
            if accumulation.added:
                # Part of this micro-batch is in the buffers: none of the step's can be applied.
                accumulation.release()
                kept = "the micro-batches accumulated for this step were dropped"
            else:  # raised before any gradient reached a buffer (refused by the sharding, or
                # a graph already back-propagated): the buffers hold what they held
                kept = f"nothing of it was accumulated ({accumulation.pending} pending kept)"
            error.add_note(
                f"lomo_kernels: raised during a micro-batch's backward; {kept} and no "
                "parameter was changed"
            )
            raise
        accumulation.pending += 1
        self._take_call_lr(lr)  # the step's devices take it as the step is applied
        if last:
            self._apply_accumulated()

    def _buffer_read(self, param: torch.Tensor, buffer: Buffer) -> torch.Tensor | Int8Buffer:
        """What the update reads of `param`'s buffer: the buffer, or an 8-bit one dequantised
        into a transient for an update that does not read it itself."""
        if isinstance(buffer, Int8Buffer) and not self.reads_int8_buffers:
            return int8_buffer.dequantized(
                buffer, param.dtype, self._accumulate_backends[buffer.device]
            )
        return buffer

    @torch.compiler.disable  # see _check_call
    def _prepare_micro_batch(self) -> list[torch.device]:
        """What a micro-batch's hooks read: the loss scale's inverse, the accumulation's
        kernels and, from a step's first micro-batch, cleared norm sums, per device of the
        trained parameters (host-side, no sync)."""
        devices = list(dict.fromkeys(p.device for g in self.param_groups for p in g["params"]))
        for device in devices:
            self._scalars.for_device(device)
        if not self._accumulation.pending:  # a sum per parameter, as an eager norm pass's
            self._scalars.begin_norm_pass(len(self._groups.index_of))
        self._loss_scaling.begin_step(self._scalars)
        self._accumulate_backends = {d: LOMO.resolve(d, self._backend_name) for d in devices}
        self._drop_gradients()  # a stale gradient would be summed into this micro-batch's
        return devices

    @torch.compiler.disable  # see _check_call
    def _apply_accumulated(self) -> None:
        """The step from the buffers: the accumulated gradients' global norm and inf/nan flag
        (measured by the micro-batches, as a norm pass measures), then every parameter
        updated from its buffer as the update pass after a norm pass updates it (clipped,
        or skipped whole after an overflow); the buffers are released either way."""
        accumulation = self._accumulation
        try:
            self._prepare_scalars()
            accumulation.measure_rest(
                self._scalars.for_device,
                lambda param: self._groups.index_of[id(param)],
                self._inv_scale_for,
                self.backend,
            )
            self._close_norm_pass(per_parameter=True)
            self._step.norm_ready = True  # the buffers' norm serves this update pass
            self._step.begin_pass(Phase.UPDATE)
            if self._sharding is not None:
                # Batches of whole parameters, the same on every rank: all in one, or one
                # bucket of dequantised transients at a time.
                dequantised = self.accumulation_dtype == torch.int8 and not self.reads_int8_buffers
                for batch in accumulation.batches(self._bucket_numel if dequantised else None):
                    self._step_slices([(s, self._buffer_read(p, b)) for p, b, s in batch])
            else:
                for param, buffer, _ in accumulation.buffered():
                    read = self._buffer_read(param, buffer)  # one transient at a time
                    self._update_whole(param, read, self._scalars.for_device(param.device))
        except BaseException as error:
            self._update_pass_failed(error)
            error.add_note("lomo_kernels: the micro-batches accumulated for this step were dropped")
            raise
        finally:
            accumulation.release()
            self._step.end_pass()
            detection = self._step.end_update()
        self._finish_step(detection, single=False)

    # -- the step's passes --------------------------------------------------------------
    def _drop_gradients(self) -> None:
        """Sets every trained parameter's ``.grad`` to None."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = None

    @torch.compiler.disable  # see _check_call
    def _prepare_scalars(self, lr: float | None = None) -> None:
        """The step's device scalars and update arguments; the lr tensors from the groups
        unless the call gives `lr` (then set by `_take_call_lr`, after the last refusal)."""
        self._drop_gradients()  # stale gradients would be summed into this step's
        self._scalars.begin_step(self.param_groups, fill_lr=lr is None)
        self._loss_scaling.begin_step(self._scalars)
        self.rounding.begin_step(self.step_count, self._scalars)
        self._prepare_update_arguments()

    def _run_backward(self, loss: torch.Tensor, phase: Phase, retain_graph: bool) -> None:
        with torch.enable_grad():  # the scaled loss needs a graph under torch.no_grad() too
            loss = self._loss_scaling.scaled(loss)
        self._step.begin_pass(phase)
        tracked = not _compiled_autograd.compiled_autograd_active()
        sharding = self._sharding
        try:
            if sharding is not None:
                sharding.begin()
            loss.backward(retain_graph=retain_graph)
            if sharding is not None:
                for ready in sharding.finish():  # the last batches, stepped before returning
                    self._step_slices(ready)
        except BaseException as error:
            if sharding is not None:
                sharding.abandon()
            if phase is Phase.UPDATE:
                # Compilation fails before the graph runs: no parameter has been written.
                aliased = isinstance(error, Exception) and (
                    _compiled_autograd.is_aliased_input_failure(error)
                )
                self._update_pass_failed(None if aliased else error, tracked)
                if aliased:
                    raise RuntimeError(
                        _compiled_autograd.EAGER_FORWARD_MESSAGE.format(version=torch.__version__)
                    ) from error
            raise
        finally:
            self._step.end_pass()
