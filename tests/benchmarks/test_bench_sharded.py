"""`python -m bench.fsdp2` and `bench.zero3`: 2-rank runs and their tables.

FSDP2 runs for real on tiny steps (2 ranks, gloo). A ZeRO-3 run imports DeepSpeed on each
rank, minutes on a small machine (tests/distributed/test_zero3.py runs those ranks): here
its driver runs on given rank figures, which say what its table must show.
"""

from __future__ import annotations

import json
import statistics
import sys

import pytest
from support.bench_cli import main
from support.dependencies import require

from bench import zero3
from bench.common import sharded

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/status and /proc/self/clear_refs"
)


def test_a_step_takes_the_slower_rank_time() -> None:
    ranks = [{"step_s": [1.0, 5.0, 2.0]}, {"step_s": [3.0, 1.0, 2.5]}]
    assert sharded.step_seconds(ranks) == statistics.median([3.0, 5.0, 2.5])


@pytest.mark.slow
def test_fsdp2_run_gives_each_rank_peak_and_step_time(tmp_path, capsys) -> None:
    require("transformers")
    out = tmp_path / "fsdp2.json"
    argv = ["fsdp2", "--configs", "lomo", "--rounds", "1", "--steps", "3"]
    assert main([*argv, "--batch", "1", "--seq", "16", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (run,) = result["runs"]["lomo"]
    assert [r["rank"] for r in run] == [0, 1]
    parameters = sharded.MODEL.num_parameters
    for rank in run:
        assert rank["params"] == parameters  # every parameter, sharded over the ranks
        # fp32 shards: half of the model's fp32 bytes each (rows split between the ranks).
        assert rank["shard_mib"] == pytest.approx(parameters * 4 / 2 / 2**20, rel=0.01)
        assert len(rank["step_s"]) == len(rank["peak_mib"]) == 2  # step 0 not measured
        assert all(s > 0 for s in rank["step_s"]) and all(p > 0 for p in rank["peak_mib"])
    (row,) = result["summary"]
    assert row["peak_mib"] == max(p for rank in run for p in rank["peak_mib"])
    assert row["step_s"] == sharded.step_seconds(run)
    printed = capsys.readouterr().out
    assert "| FSDP2 + lomo_kernels.Lomo (fused_backward) |" in printed


def test_zero3_table_from_the_ranks_figures(monkeypatch, tmp_path, capsys) -> None:
    peaks = {"lomo": ([3.0, 4.0], [5.0, 2.0]), "deepspeed_sgd": ([30.0, 31.0], [29.0, 33.0])}
    seconds = {"lomo": ([1.0, 2.0], [1.5, 1.0]), "deepspeed_sgd": ([4.0, 4.0], [3.0, 5.0])}
    launched = []

    def launch(rank_main, metered: bool, **settings):
        launched.append((rank_main, metered, settings["config"], settings["batch"]))
        figures = seconds[settings["config"]] if not metered else ([0.0], [0.0])
        return [
            {"rank": rank, "step_s": figures[rank], "peak_mib": peaks[settings["config"]][rank]}
            for rank in (0, 1)
        ]

    monkeypatch.setattr(zero3, "launch", launch)
    out = tmp_path / "zero3.json"
    argv = ["zero3", "--configs", "lomo,deepspeed_sgd", "--batch", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    # Memory from metered runs, times from runs without the malloc setting.
    assert launched == [
        (zero3.rank_main, metered, config, 1)
        for config in ("lomo", "deepspeed_sgd")
        for metered in (True, False)
    ]
    rows = json.loads(out.read_text())["rows"]
    assert rows["lomo"] == {"peak_above_model_mib": [4.0, 5.0], "step_s": 1.75}
    assert rows["deepspeed_sgd"] == {"peak_above_model_mib": [31.0, 33.0], "step_s": 4.5}
    assert "| lomo | 4 / 5 | 1.75 | 0.39x |" in capsys.readouterr().out
