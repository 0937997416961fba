"""Which of TRL's trainers Lomo and AdaLomo serve: those whose steps are checked against
torch's optimizers (SFT, DPO, GRPO, RLOO: tests/integrations/test_trl*.py). Any other trainer
TRL defines (KTO, distillation, and those of ``trl.experimental``: ORPO, CPO, online DPO,
GKD, ...) is refused by name when it builds its optimizer, before any change; a user's own
subclass of a served trainer is served.
"""

from __future__ import annotations

from typing import Any

SERVED_TRAINERS = ("SFTTrainer", "DPOTrainer", "GRPOTrainer", "RLOOTrainer")


def _trl_class(trainer: Any) -> type | None:
    """The most derived class of `trainer` that TRL defines, or None (not a TRL trainer)."""
    for cls in type(trainer).__mro__:
        if cls.__module__.split(".")[0] == "trl":
            return cls
    return None


def check_trl_trainer(trainer: Any) -> None:
    """Refuses a TRL trainer other than those served (module docstring) with
    ``optim="lomo"``/``"adalomo"``, naming it; any other trainer or optimizer passes."""
    optim = getattr(trainer.args.optim, "value", trainer.args.optim)  # an OptimizerNames
    if optim not in ("lomo", "adalomo"):
        return
    trl_class = _trl_class(trainer)
    if trl_class is None or trl_class.__name__ in SERVED_TRAINERS:
        return
    name = type(trainer).__name__
    what = name if trl_class.__name__ == name else f"{name} (a {trl_class.__name__})"
    raise ValueError(
        f"lomo_kernels: TRL's {what} with optim={optim!r} is not supported: its steps are not "
        f"checked against torch's optimizers. Use {', '.join(SERVED_TRAINERS)}, or another "
        "optimizer with this trainer. Nothing was changed."
    )
