"""`python -m bench.preference_rl` at its smallest: the `tiny` model (32,000 words, hidden
128), 2 prompt/completion pairs of 8 + 16 words, 2 steps, each configuration in its own
metered process. The study must measure what it says: with the fused head and Lomo the
head's gradient never exists, and the step's peak is below the same step with TRL's head and
AdamW by at least AdamW's two fp32 states of the head and the embedding (2 x 2 x 32,000 x
128 x 4 bytes = 62.5 MiB), which no measurement noise of a few MiB hides."""

from __future__ import annotations

import pytest

from bench import preference_rl

pytestmark = pytest.mark.slow
SMALLEST = dict(model="tiny", batch=2, prompt=8, completion=16, steps=2)
STATES_MIB = 2 * 2 * 32000 * 128 * 4 / 2**20


def test_smallest_form_measures_dpo_and_grpo_and_formats_the_table():
    pytest.importorskip("trl")
    results, meta = preference_rl.run(
        kinds=("dpo", "grpo"), configs=("fused_lomo", "trl_adamw"), **SMALLEST
    )
    assert [r.get("error") for r in results] == [None] * 4, results
    by = {(r["kind"], r["config"]): r for r in results}
    for kind in ("dpo", "grpo"):
        fused, adamw = by[kind, "fused_lomo"], by[kind, "trl_adamw"]
        # With the fused head and Lomo autograd never forms the head's gradient; AdamW's
        # unfused run forms it every step.
        assert not fused["head_grad_exists"] and adamw["head_grad_exists"]
        assert fused["vocab"] == 32000
        assert len(fused["peaks_mb"]) == 1  # step 0 not measured
        assert fused["peak_above_start_mb"] + STATES_MIB < adamw["peak_above_start_mb"]
    table = preference_rl.format_table(results)
    assert "| DPO | fused head + Lomo |" in table and "GRPO: fused head + Lomo at" in table
    assert meta["cpu"]
