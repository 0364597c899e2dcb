"""observe/comm.py: the bytes every collective of a step moves, counted exactly, and the
planner's step_collectives (plan/timing_comm.py) against the counts of real tp2 and cp2 runs.

One torchrun launch (2 ranks, gloo; tests/unit/comm_worker.py, ~15 s on 2 cores) runs every
case: collectives of known sizes (c10d, functional, DTensor, DDP's reducer), and two 2-step
Trainer fits on a tiny GPT-2 with metrics.comm_volume (and the memory breakdown on the same
step: both are dispatch modes).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from slipstream.config import load_config
from slipstream.observe.comm import StepComm, compare_with_plan, plan_dim
from slipstream.plan.collectives import bus_factor
from tests.distributed.test_data_parallel import _env, _run

WORKER = Path(__file__).resolve().parent / "comm_worker.py"
LAUNCH_TIMEOUT_S = 120
# The planner leaves out the gradient norm's scalars (a few hundred bytes: one all-reduce of the
# per-parameter norms, one of the total); on the tiny model they are measured at +0.04 % (tp2),
# +0.11 % (cp), +0.04 % (dp, with FSDP's padding of odd-sized parameters).
PLAN_RTOL = 0.01


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("comm")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WORKER), str(out)]
    env = {**_env(), "PYTHONPATH": f"{_env()['PYTHONPATH']}:{Path(__file__).resolve().parents[2]}"}
    result = _run(cmd, LAUNCH_TIMEOUT_S, env)
    assert result.returncode == 0, f"comm_worker failed (rc {result.returncode}):\n{result.stderr[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _rows(case: dict) -> dict[tuple[str, str], dict]:
    return {(r["api"], r["kind"]): r for r in case["rows"]}


def test_every_c10d_kind_counts_its_full_buffer(ranks):
    for rank, result in enumerate(ranks):
        rows = _rows(result["c10d"])
        point = ("c10d", "send") if rank == 0 else ("c10d", "recv")
        expected = {("c10d", "all_reduce"): 4000, ("c10d", "all_gather"): 800, ("c10d", "reduce_scatter"): 2400,
                    ("c10d", "broadcast"): 80, ("c10d", "all_to_all"): 32, point: 28}
        assert {k: r["bytes"] for k, r in rows.items()} == expected
        assert all(r["calls"] == 1 and r["size"] == 2 and r["group"] == "cp+dp_shard_cp" for r in rows.values())
        # nccl-tests' bus factors on 2 ranks: all-reduce 2(n-1)/n = 1, gather/scatter (n-1)/n = 1/2, p2p 1
        assert {k: r["bus_bytes"] for k, r in rows.items()} == {
            ("c10d", "all_reduce"): 4000, ("c10d", "all_gather"): 400, ("c10d", "reduce_scatter"): 1200,
            ("c10d", "broadcast"): 80, ("c10d", "all_to_all"): 16, point: 28}
        assert result["c10d"]["summary"]["total_bytes"] == sum(expected.values())


def test_functional_and_dtensor_collectives_count_once_and_go_to_the_model_dim(ranks):
    result = ranks[0]
    # The cp group, the flattened dp_shard_cp group and the world are one process group on 2 ranks.
    assert list(result["groups"].values()) == ["cp+dp_shard_cp"]
    rows = _rows(result["functional"])
    assert {k: (r["calls"], r["bytes"]) for k, r in rows.items()} == {
        ("functional", "all_reduce"): (2, 224),        # 200 B + the Partial DTensor's 24 B
        ("functional", "all_gather"): (2, 192),        # the autograd gather + DTensor's Shard -> Replicate
        ("functional", "reduce_scatter"): (1, 96),     # the autograd gather's backward
        ("c10d", "all_reduce"): (1, 20),
        ("c10d", "scatter"): (1, 96),                  # distribute_tensor scatters rank 0's tensor: 2 x 48 B
    }
    # DTensor's own dispatch runs inside the counter (its collectives are seen), once each.
    assert rows[("functional", "all_gather")]["bus_bytes"] == 96
    # by_dim: functional calls to the model-parallel dim, c10d calls to the data-parallel one.
    assert result["functional"]["by_dim"] == {"cp": {"all_reduce": 224, "all_gather": 192, "reduce_scatter": 96},
                                              "dp_shard_cp": {"all_reduce": 20, "scatter": 96}}
    assert result["c10d"]["by_dim"] == {"dp_shard_cp": {"all_reduce": 4000, "all_gather": 800,
                                                        "reduce_scatter": 2400, "broadcast": 80, "all_to_all": 32,
                                                        "send": 28}}


def test_ddp_bucket_all_reduce_is_seen_from_the_backward_pass(ranks):
    for result in ranks:
        rows = result["ddp"]["rows"]
        # Linear(8, 8): 64 weights + 8 biases = 72 fp32 gradients in one bucket, nothing else.
        assert [(r["api"], r["kind"], r["calls"], r["bytes"]) for r in rows] == [("c10d", "all_reduce", 1, 288)]


def test_nothing_is_counted_without_collectives(ranks):
    for result in ranks:
        assert result["none"]["rows"] == [] and result["none"]["by_dim"] == {}
        assert result["none"]["summary"]["total_bytes"] == 0


@pytest.mark.parametrize("run, dims", [("tp2", {"tp"}), ("cp2", {"cp", "dp"})])
def test_planner_predicts_the_measured_step(ranks, run, dims):
    """step_collectives against metrics.comm_volume on real tp2 / cp2 fits (rank 0 and 1 alike)."""
    for result in ranks:
        comm = result[run]["comm"]
        assert result[run]["memory_measured"], "the memory breakdown of the same step went missing"
        assert comm["step"] == 2
        assert set(comm["vs_planned"]) == dims
        for dim, row in comm["vs_planned"].items():
            assert row["planned_bytes"] > 0
            assert row["ratio"] == pytest.approx(1.0, rel=PLAN_RTOL), (run, dim, row)
        # The activation collectives (SP's all-gathers and reduce-scatters, cp's K/V) to the byte.
        measured = {plan_dim(d, comm["planned"]): kinds for d, kinds in comm["by_dim"].items()}
        for dim in dims & {"tp", "cp"}:
            for kind in ("all_gather", "reduce_scatter"):
                assert measured[dim][kind] == comm["planned"][dim][kind], (run, dim, kind)


def test_bus_factors():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert bus_factor("broadcast", 4) == 1.0 and bus_factor("all_reduce", 1) == 0.0


def test_compare_with_plan_folds_the_data_parallel_dims():
    planned = {"cp": {"all_gather": 100}, "dp": {"all_gather": 50, "reduce_scatter": 50}}
    measured = {"cp": {"all_gather": 110}, "dp_shard_cp": {"all_gather": 50, "reduce_scatter": 50},
                "world": {"all_reduce": 8}}
    out = compare_with_plan(measured, planned)
    assert out["cp"]["ratio"] == pytest.approx(1.1) and out["dp"]["ratio"] == pytest.approx(1.0)
    assert out["world"] == {"measured_bytes": 8, "planned_bytes": 0, "ratio": None}
    assert plan_dim("dp_replicate", {"dp_replicate": {}}) == "dp_replicate" and plan_dim("dp_replicate", {}) == "dp"


def _parallel(world: int):
    return types.SimpleNamespace(world_size=world, mesh=None, grad_mesh=None, dims=None)


def test_step_comm_skips_under_compile_with_the_reason_and_one_process(capsys):
    compiled = load_config(None, ["--compile.scope=blocks", "--train.max_steps=4"])
    comm = StepComm(compiled, 0, _parallel(2))
    assert comm.measure_at is None and "torch.compile" in comm.summary()["skipped"]
    assert "metrics.comm_volume is skipped" in capsys.readouterr().out
    assert StepComm(load_config(None, ["--train.max_steps=4"]), 0, _parallel(1)).summary() is None
    off = load_config(None, ["--train.max_steps=4", "--metrics.comm_volume=false"])
    assert StepComm(off, 0, _parallel(2)).summary() is None
    # too short a run: step 2 never comes
    assert StepComm(load_config(None, ["--train.max_steps=1"]), 0, _parallel(2)).summary() is None
