"""One backward per step: clip by global norm and fp16 overflow handling without a norm pass.

The exact rule (``clip_coef = min(1, M / ||g||)``) needs the global gradient norm before the
first parameter is updated, hence a second backward. With ``single_backward=True`` each
gradient is clipped with what is known when it arrives:

    P    = the median of the last three clean steps' global norms (the first clean step
           fills all three; 0 before it), so one spiking step neither damps the steps
           after it nor, being one of three, moves P
    S_i  = sum of squares of this step's finite gradients arrived so far, this one included
    c_i  = min(1, M / (max(P, sqrt(S_i)) + 1e-6))

Guarantee. Parameters are disjoint blocks of the update, so the applied (clipped) gradient
has squared norm ``sum_i c_i^2 ||g_i||^2``. With ``Q = max(P, ||g_1||)`` (``g_1`` the first
gradient of the step) and ``||g||`` the step's true global norm:

    ||applied|| <= M * sqrt(1 + 2 ln(||g|| / Q))    when ||g|| > Q
    ||applied|| <= M * ||g|| / Q  (<= M)           otherwise

Proof: ``c_i^2 a_i <= M^2 a_i / max(Q^2, S_i)`` for ``a_i = ||g_i||^2`` (for i = 1 because
S_1 = a_1; for i >= 2 because S_i >= S_1). Each term is at most
``M^2 * integral over [S_{i-1}, S_i] of dx / max(Q^2, x)``, and the integral from 0 to
S_n = ||g||^2 is ``S_n / Q^2`` if S_n <= Q^2, else ``1 + ln(S_n / Q^2)``. Always also
``||applied|| <= ||g||`` (c_i <= 1). A gradient spike of a factor K over the previous norm
is therefore clipped within the step to at most ``M * sqrt(1 + 2 ln K)`` (about 4.4 M for
K = 1e4), not one step late; in practice much less, since the spike shows in the first
gradients (the head and last layers) and raises Q.

How it differs from exact clipping: when P >= ||g|| every tensor gets the same coefficient
``min(1, M / P)``, the exact direction with a norm at most exact clipping's (smaller by
``||g|| / P``); when P < ||g||, early gradients (the last layers, which backward reaches
first) are scaled down less than later ones, so the direction differs from exact clipping
and the norm may exceed M by the factor above.

Overflow (inf/nan in a gradient): each gradient's sum of squares and non-finite flag are
measured first, and a tensor whose gradient has any non-finite element is left unchanged
whole; the others are updated. Lomo and AdaLomo's 1-D tensors measure with
``ops.grad_sumsq_`` and skip through ``skip_if`` (`SingleBackwardClip.prepare`); AdaLomo's
factored tensors are measured by the first pass of their own update, whose workspace then
holds [sum of squares, non-finite flag] and skips the tensor by itself
(`SingleBackwardClip.prepare_measured`), so their gradients are not read an extra time. The
step is *partial*, the loss scale is lowered as for a skipped step, the non-finite tensors
do not count in S, and the norm history is kept from the last clean step. Everything stays
in device tensors: no host sync.

Sharded parameters (ZeRO-3, FSDP2): a rank holds a slice of each parameter, and the reduced
slices reach the optimizer per reduce-scatter bucket (ZeRO-3) or per FSDP2 unit, in the same
order on every rank. `SingleBackwardClip.prepare_bucket` measures each slice, then one
all-reduce of ``[sumsq_1..n, found_1..n]`` gives every rank each whole parameter's
``||g_i||^2`` and non-finite flag, and the bucket's parameters are walked in order exactly
as `prepare` walks arriving tensors. Every rank thus has the same S_i, coefficients and
skips, and at the step's end the same global S, flag count and norm history. The guarantee
above does not depend on the order; the coefficients do, so they follow the bucket order
rather than one process's backward order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .. import ops
from ..core.scalars import copied_to

CLIP_EPS = 1e-6  # as ops.clip_coef_from_sumsq, so the rule equals exact clipping's when P >= ||g||


class _Measured:
    """One gradient's [sumsq, found] and its skip mask, reused for every gradient on a device."""

    def __init__(self, device: torch.device) -> None:
        self.pair = torch.zeros(2, device=device)
        self.sumsq, self.found = self.pair[0:1], self.pair[1:2]
        self.bad = torch.zeros(1, dtype=torch.bool, device=device)


class SingleBackwardClip:
    """Device-side state of the one-backward rule for one optimizer (see the module doc).

    The step's running sum and flags live on one home device (the first parameter's); a
    gradient on another device is measured there and its sum copied over, device to device.
    """

    def __init__(self, max_norm: float | None, home: torch.device) -> None:
        self.max_norm = max_norm
        self.home = home
        # [S, number of tensors skipped this step]: adjacent, so that one add_ per gradient
        # accumulates a measured [sumsq, found] pair into both.
        self._step = torch.zeros(2, device=home)
        self.step_sumsq = self._step[0:1]
        self.step_found = self._step[1:2]
        self.norm_history = torch.zeros(3, device=home)  # last three clean steps' norms
        self.previous = torch.zeros(1, device=home)  # P, fixed for the step
        self._temp: dict[torch.device, _Measured] = {}

    def begin_step(self) -> None:
        self.step_sumsq.zero_()
        self.step_found.zero_()
        self.previous.copy_(self.norm_history.median().reshape(1))

    def prepare(
        self,
        grad: torch.Tensor,
        inv_scale: torch.Tensor | None,
        backend: str | None,
        clip_coef: torch.Tensor,
    ) -> torch.Tensor:
        """Measures one arriving gradient, writes its coefficient into `clip_coef` (with
        clipping on) and returns its skip flag: 1-element fp32 tensors on the gradient's
        device, valid until the next call for that device (the caller applies the update
        before the next gradient arrives).
        """
        # This runs once per gradient inside backward, where its cost is not hidden behind
        # anything: a fixed handful of in-place 1-element ops into buffers kept across steps,
        # no allocation.
        m = self._measured(grad.device)
        m.pair.zero_()
        if grad.numel():
            ops.grad_sumsq_(grad, m.sumsq, inv_scale=inv_scale, found_inf=m.found, backend=backend)
        self._account(m.pair, m.sumsq, m.found, m.bad, clip_coef)
        return m.found

    def prepare_measured(self, measured: torch.Tensor, clip_coef: torch.Tensor) -> None:
        """`prepare` for a gradient its update has already measured: `measured` is the
        2-element fp32 [sum of (grad * inv_scale)^2, non-finite flag] on the gradient's
        device (AdaLomo's pass-A workspace slots, `ops.adalomo.workspace.measured_view`).
        Writes the coefficient into `clip_coef` (with clipping on); the sum of a non-finite
        gradient is zeroed in place, as it does not count in the step's norm.
        """
        m = self._measured(measured.device)
        self._account(measured, measured[0:1], measured[1:2], m.bad, clip_coef)

    def _measured(self, device: torch.device) -> _Measured:
        m = self._temp.get(device)
        if m is None:
            m = self._temp[device] = _Measured(device)
        return m

    def _account(
        self,
        pair: torch.Tensor,
        sumsq: torch.Tensor,
        found: torch.Tensor,
        bad: torch.Tensor,
        clip_coef: torch.Tensor,
    ) -> None:
        """Adds one measured gradient (`pair` = [sumsq, found]; `sumsq`, `found` its halves)
        to the step and writes its coefficient; `bad` is a bool scratch on its device."""
        torch.ne(found, 0.0, out=bad)
        sumsq.masked_fill_(bad, 0.0)  # a skipped tensor does not count in the step's norm
        home = pair.device == self.home
        self._step.add_(pair if home else copied_to(pair, self.home))
        if self.max_norm is not None:
            # min(1, M / (max(P, sqrt(S_i)) + eps)), the same ops in the same order as
            # `prepare_bucket`, written straight into the coefficient on the home device.
            value = clip_coef if home else torch.empty_like(self.previous)
            torch.sqrt(self.step_sumsq, out=value)
            torch.maximum(self.previous, value, out=value)
            value.add_(CLIP_EPS).reciprocal_().mul_(self.max_norm).clamp_(max=1.0)
            if not home:
                clip_coef.copy_(copied_to(value, pair.device))

    def prepare_bucket(
        self,
        grads: list[torch.Tensor],
        inv_scale: torch.Tensor | None,
        backend: str | None,
        all_reduce_sum_: Callable[[torch.Tensor], None],
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """`prepare` for one bucket of this rank's slices of parameters (sharded training).

        `grads[i]` is this rank's reduced gradient slice of the bucket's i-th parameter; the
        buckets reach every rank in the same order with the same parameters. Each slice's
        partial sum of squares and non-finite count go into one vector, whose all-reduce
        gives every rank each whole parameter's ``||g_i||^2`` and flag; the parameters are
        then walked in bucket order as `prepare` walks arriving tensors. Returns
        (coefficients [n] or None with clipping off, skip flags [n]): fp32 tensors on the
        slices' device, identical on every rank.
        """
        n = len(grads)
        device = grads[0].device
        measured = torch.zeros(2 * n, device=device)  # [sumsq_1..n, found_1..n]
        for i, grad in enumerate(grads):
            ops.grad_sumsq_(
                grad,
                measured[i : i + 1],
                inv_scale=inv_scale,
                found_inf=measured[n + i : n + i + 1],
                backend=backend,
            )
        all_reduce_sum_(measured)
        bad = measured[n:] != 0
        skips = bad.to(torch.float32)
        sumsq = copied_to(measured[:n].masked_fill(bad, 0.0), self.home)
        # Running sums in bucket order, continuing the step's: S_i of every entry at once.
        running = torch.cumsum(torch.cat([self.step_sumsq, sumsq]), 0)[1:]
        self.step_sumsq.copy_(running[-1:])
        self.step_found.add_(copied_to(skips.sum().reshape(1), self.home))
        if self.max_norm is None:
            return None, skips
        denom = torch.maximum(self.previous, running.sqrt()).add_(CLIP_EPS)
        coefs = torch.reciprocal(denom).mul_(self.max_norm).clamp_(max=1.0)
        return copied_to(coefs, device), skips

    def end_step(self) -> torch.Tensor:
        """Closes the step: records its norm if clean, returns its found flag (home device)."""
        norm = self.step_sumsq.sqrt()
        older = self.norm_history[:2]
        # The first clean step fills every entry (0 means "no clean step yet").
        candidate = torch.cat([norm, torch.where(older > 0, older, norm)])
        clean = self.step_found == 0
        self.norm_history.copy_(torch.where(clean, candidate, self.norm_history))
        return self.step_found.clone()

    def last_norm(self) -> torch.Tensor:
        """The step's global norm over its finite gradients (device tensor)."""
        return self.step_sumsq.sqrt()

    def state_dict(self) -> dict[str, Any]:
        return {"norm_history": self.norm_history.tolist()}

    @staticmethod
    def check_state_dict(state: Any) -> None:
        """Refuses a saved norm history that is not three finite norms >= 0."""
        history = state.get("norm_history") if isinstance(state, dict) else None
        if not (
            isinstance(history, (list, tuple))
            and len(history) == 3
            and all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in history)
        ):
            raise ValueError(
                "state_dict['lomo']['single_backward']['norm_history'] must be three finite "
                f"norms >= 0, got {history!r}: the checkpoint is corrupt"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.norm_history.copy_(torch.tensor(state["norm_history"], dtype=torch.float32))
