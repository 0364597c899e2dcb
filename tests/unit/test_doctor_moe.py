"""slipstream doctor sees the MoE dispatch: the moe_dispatch finding (issue 15).

Real traces: one torchrun launch of this file (2 ranks, gloo, CPU) trains moe-tiny at ep 2 twice
with the profiler on, through slipstream's Trainer: once skewed (every MoE layer's balancing bias
set to [0, 0, -50, -50] after build_model, bias_rate 0: every token goes to experts 0 and 1, rank
0's; rank 1 computes no expert and waits in the all-to-all), once as built (balanced). The doctor
reads each run's two traces and its run dir (config.toml, metrics.jsonl).

On the loaded 2-core machine the wait shares are noisy: when the other process (or another job)
holds a core, a rank of the balanced run also waits 15-45% of its step in the all-to-all. So the
rule's evidence is not the wait alone: it also needs an ep rank whose experts get >= 1.5x their
share of the tokens (the routing's own numbers, not timing) and the waiter to wait longer than
that rank. The skewed run's experts are wide (moe_expert_hidden 1024, 8 sequences of 64 per
rank) so that rank 0's expert work, which rank 1 waits for, dwarfs the scheduling noise.

Hand-made traces and analyses check the measurement (CPU: gloo's ranges and nested waits; CUDA:
NCCL kernels by their collective name) and the rule's conditions one by one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.config.load import config_to_toml, load_config
from slipstream.perf.doctor import diagnose, run_doctor
from slipstream.perf.doctor_moe import (MOE_DISPATCH_MIN, MOE_OVERLOAD_MIN, balancing_overrides, ep_place,
                                        ep_token_shares, last_moe_loads, rule_moe_dispatch)
from slipstream.perf.trace import analyze, load_trace

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 150
SKEW_BIAS = [0.0, 0.0, -50.0, -50.0]  # experts 0 and 1 (rank 0's at ep 2) get every token
VOCAB, SEQ_LEN = 60, 64
JOB = ["--model.preset=moe-tiny", f"--model.vocab_size={VOCAB}", "--model.vocab_multiple=64",
       "--model.moe_expert_hidden=1024", "--model.moe_bias_rate=0", "--parallel.ep=2", "--parallel.dp_strategy=ddp",
       f"--train.seq_len={SEQ_LEN}", "--train.micro_batch_size=8", "--train.max_steps=5", "--train.eval_steps=0",
       "--profile.enabled=true", "--profile.start_step=2", "--profile.steps=3", "--profile.record_shapes=false",
       "--profile.profile_memory=false", "--logging.log_interval=1", "--logging.progress=false",
       "--logging.tensorboard=false", "--metrics.memory_breakdown=false", "--checkpoint.interval=0",
       "--checkpoint.save_final=false", "--parallel.timeout_s=60", "--parallel.init_timeout_s=60"]
RUNS = ("skewed", "balanced")


# ---------------------------------------------------------------------------- the worker (torchrun runs this file)


def _worker(out: Path) -> int:
    """Both runs in one process group: rank R writes <out>/<run>/traces/rankR.json."""
    import torch

    from slipstream import Trainer
    from slipstream.distributed.mesh import shutdown
    from slipstream.models.moe import moe_layers
    from slipstream.models.transformer import build_model
    from slipstream.train.lm_loss import lm_loss_fn

    tokens = torch.randint(0, VOCAB, (64, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    for name in RUNS:
        cfg = load_config(None, JOB + [f"--run.dir={out / name}"])
        model = build_model(cfg.model, "cpu", seed=7)
        if name == "skewed":
            for _, layer in moe_layers(model):
                layer.expert_bias.copy_(torch.tensor(SKEW_BIAS))
        Trainer(model, dataset, lm_loss_fn, config=cfg).fit()
    shutdown()
    return 0


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    env.setdefault("SLIPSTREAM_CACHE_DIR", str(ROOT / ".cache" / "test"))
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Per run: its dir and `run_doctor` on its two traces (the run dir beside them gives the rest)."""
    out = tmp_path_factory.mktemp("moe_doctor")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__, str(out)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
        _, err = proc.communicate()
        pytest.fail(f"the ep2 runs did not finish within {LAUNCH_TIMEOUT_S} s (a hang):\n{err[-4000:]}")
    assert proc.returncode == 0, err[-6000:]
    result = {}
    for name in RUNS:
        traces = [str(out / name / "traces" / f"rank{r}.json") for r in (0, 1)]
        result[name] = {"dir": out / name, "traces": traces, "doctor": run_doctor(traces, as_json=True)}
    return result


def _finding(doctor: dict) -> dict | None:
    return next((f for f in doctor["findings"] if f["rule"] == "moe_dispatch"), None)


def test_the_skewed_run_gets_the_finding_rank_1_waits_for_rank_0s_experts(runs):
    doctor = runs["skewed"]["doctor"]
    f = _finding(doctor)
    wait = {t["rank"]: t["shares"]["a2a_wait"] for t in doctor["traces"]}
    assert f is not None, (wait, [g["rule"] for g in doctor["findings"]])
    n = f["numbers"]
    print(f"\nskewed: all-to-all wait share {wait}, token share {n['token_share']}")  # the report's numbers (-s)
    assert (f["rank"], n["waiting_rank"], n["overloaded_rank"], n["overloaded_ep_rank"]) == (1, 1, 0, 0)
    assert f["ranks"] == [1]
    # every token went to experts 0 and 1, in both layers: rank 0's experts got all of them (2x the fair half)
    assert n["token_share"] == {0: pytest.approx(1.0), 1: pytest.approx(0.0)}
    assert n["token_ratio"][0] == pytest.approx(2.0) and n["ep"] == 2
    assert set(n["layers"]) == {"blocks.0", "blocks.1"} and n["metrics_step"] == 5
    # rank 1 waits a significant share of its step, longer than rank 0 (which computes meanwhile)
    assert n["share"] == {r: pytest.approx(wait[r]) for r in (0, 1)}
    assert f["severity"] == n["share"][1] >= MOE_DISPATCH_MIN and n["share"][1] > n["share"][0]
    assert 0 < n["a2a_wait_us"][1] < n["step_us"][1]
    assert f["title"].startswith("rank 1 waits on the MoE all-to-all for ")
    assert f["title"].endswith("of the step: rank 0's experts get 2.0x their share of the tokens")
    assert "rank 0 " in f["evidence"] and "rank 1 " in f["evidence"] and "ep rank 0 (experts 0-1) 100% (2.0x)" \
        in f["evidence"] and "metrics.jsonl, step 5" in f["evidence"]
    for switch in ("model.moe_aux_loss", "model.moe_bias_rate", "model.moe_dropless=false", "moe_capacity_factor"):
        assert switch in f["fix"]
    # bias_rate is 0 in the run: the overrides turn it on, as a valid config
    assert f["overrides"] == ["--model.moe_bias_rate=0.001"] and f["overrides"][0] in doctor["suggested_overrides"]
    assert load_config(None, JOB + f["overrides"]).model.moe_bias_rate == 0.001


def test_the_balanced_run_gets_no_finding(runs):
    doctor = runs["balanced"]["doctor"]
    assert _finding(doctor) is None, _finding(doctor)
    # not for lack of measurements: both traces hold the all-to-alls, the metrics the loads
    wait = {t["rank"]: t["shares"]["a2a_wait"] for t in doctor["traces"]}
    assert all(w is not None and w > 0 for w in wait.values())
    step, loads = last_moe_loads(runs["balanced"]["dir"] / "metrics.jsonl")
    ratios = {layer: max(s) * 2 for layer, s in ep_token_shares(loads, 2).items()}
    print(f"\nbalanced: all-to-all wait share {wait}, worst ep rank's token ratio per layer {ratios}")
    assert step == 5 and set(ratios) == {"blocks.0", "blocks.1"} and max(ratios.values()) < MOE_OVERLOAD_MIN


def test_the_trace_shows_every_all_to_all(runs):
    """2 MoE layers x (3 in the forward + 2 in the backward) gloo all-to-alls per profiled step."""
    for name in RUNS:
        for path in runs[name]["traces"]:
            events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
            steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
            assert len(steps) == 3
            a2a = [e["ts"] for e in events if e["name"] == "gloo:all_to_all"]
            for s in steps:
                assert sum(s["ts"] <= ts < s["ts"] + s["dur"] for ts in a2a) == 10, (name, path, s["name"])


# ---------------------------------------------------------------------------- hand-made traces


def _x(name, cat, ts, dur, tid=1, pid=1, **args):
    event = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid}
    return {**event, "args": args} if args else event


def _write(path: Path, events: list[dict]) -> Path:
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def _cpu_step(wait: float = 400) -> list[dict]:
    """A 1000 µs step (wait 400): compute 0-100; an all-to-all posted at 100-120 that gloo runs
    110-600 (its thread); the rank blocks for its result 200-600 inside an aten::new_zeros
    (190-610); compute 610-1000. The all-to-all wait: 90 + wait."""
    return [
        _x("ProfilerStep#2", "user_annotation", 0, 1000),
        _x("aten::mm", "cpu_op", 0, 100),
        _x("_c10d_functional::all_to_all_single", "cpu_op", 100, 20),
        _x("c10d::alltoall_base_", "cpu_op", 105, 10),
        _x("gloo:all_to_all", "user_annotation", 110, 90 + wait, tid=2),
        _x("aten::new_zeros", "cpu_op", 190, 20 + wait),
        _x("PythonSubclass", "cpu_op", 195, 10 + wait),
        _x("_c10d_functional::wait_tensor", "cpu_op", 200, wait),
        _x("aten::mm", "cpu_op", 210 + wait, 790 - wait),
    ]


def test_cpu_all_to_all_wait_takes_the_nested_wait_out_of_compute(tmp_path):
    a = analyze(load_trace(_write(tmp_path / "rank1.json", _cpu_step())))
    # in the all-to-all (100-600) with no compute: 100-190 (the post is communication) and the wait 200-600
    assert a.a2a_wait_us == 490 and a.steps[0].a2a_wait_us == 490
    assert a.share(a.a2a_wait_us) == pytest.approx(0.49)
    assert a.compute_us == 910  # the timeline itself is unchanged: new_zeros (190-610) still counts as compute
    assert a.pp_wait_us is None


def test_no_all_to_all_no_measurement(tmp_path):
    events = [_x("ProfilerStep#0", "user_annotation", 0, 100), _x("aten::mm", "cpu_op", 0, 50),
              _x("_c10d_functional::wait_tensor", "cpu_op", 50, 30), _x("gloo:all_reduce", "user_annotation", 40, 45)]
    a = analyze(load_trace(_write(tmp_path / "rank0.json", events)))
    assert a.a2a_wait_us is None and a.steps[0].a2a_wait_us is None
    assert diagnose([a]).to_dict()["traces"][0]["shares"]["a2a_wait"] is None


def test_cuda_all_to_all_is_told_from_pipeline_sendrecv_by_its_collective_name(tmp_path):
    kernel = "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)"
    events = [
        _x("ProfilerStep#1", "user_annotation", 0, 2000),
        _x("slipstream/pipeline", "gpu_user_annotation", 0, 2000, pid=0, tid=7),
        _x("ampere_sgemm_128x64", "kernel", 0, 500, pid=0, tid=7),
        _x(kernel, "kernel", 400, 600, pid=0, tid=20, **{"Collective name": "all_to_allv", "Group size": 2}),
        _x(kernel, "kernel", 1200, 300, pid=0, tid=20),  # a pipeline transfer (no collective name)
        _x("ampere_sgemm_128x64", "kernel", 1500, 500, pid=0, tid=7),
    ]
    a = analyze(load_trace(_write(tmp_path / "rank0.json", events)))
    assert a.device == "cuda"
    assert a.a2a_wait_us == 500  # 400-1000 minus the gemm until 500
    assert (a.pp_wait_us, a.pp_transfers_per_step) == (300, 1)  # only the SendRecv without a collective name


# ---------------------------------------------------------------------------- the rule on made-up analyses


def _cfg(*extra: str, ep: int = 2):
    return load_config(None, ["--model.preset=moe-tiny", f"--parallel.ep={ep}", *extra])


@pytest.fixture
def base(tmp_path):
    return analyze(load_trace(_write(tmp_path / "rank0.json", _cpu_step())))


def _ranks(base, waits: dict[int, float]) -> list:
    """One analysis per rank: a 1000 µs step waiting waits[rank] of it in the all-to-all."""
    return [dataclasses.replace(base, rank=r, step_us=1000.0, a2a_wait_us=w * 1000) for r, w in waits.items()]


SKEWED = {"blocks.0": [0.3, 0.3, 0.2, 0.2], "blocks.1": [0.6, 0.3, 0.05, 0.05]}  # blocks.1: ep rank 0 gets 90%


def test_the_rule_fires_on_the_waiting_rank_and_names_the_overloaded_one(base):
    f = rule_moe_dispatch(_ranks(base, {0: 0.04, 1: 0.35}), _cfg(), SKEWED, metrics_step=40)
    assert f is not None and f.rule == "moe_dispatch"
    assert f.title == "rank 1 waits on the MoE all-to-all for 35% of the step: rank 0's experts get 1.8x their share " \
                      "of the tokens"
    assert (f.rank, f.ranks, f.severity) == (1, [1], pytest.approx(0.35))
    n = f.numbers
    assert n["worst_layer"] == "blocks.1" and n["token_share"] == {0: pytest.approx(0.9), 1: pytest.approx(0.1)}
    assert n["layers"]["blocks.0"] == pytest.approx([0.6, 0.4]) and n["metrics_step"] == 40
    assert "rank 0 40.0 µs (4%), rank 1 0.35 ms (35%)" in f.evidence
    assert "in blocks.1, the worst layer (metrics.jsonl, step 40; fair share 50%)" in f.evidence
    assert "ep rank 0 (experts 0-1) 90% (1.8x), ep rank 1 (experts 2-3) 10% (0.2x)" in f.evidence
    assert "blocks.0 1.2x" in f.evidence
    assert f.overrides == ["--model.moe_bias_rate=0.001"]
    # through diagnose: the run context carries the config, the loads come from the run dir (none here)
    assert diagnose(_ranks(base, {0: 0.04, 1: 0.35}), _cfg()).finding("moe_dispatch") is None


def test_the_rule_stays_quiet_without_its_evidence(base):
    cfg = _cfg()
    balanced = {"blocks.0": [0.3, 0.2, 0.25, 0.25], "blocks.1": [0.2, 0.2, 0.3, 0.3]}
    assert rule_moe_dispatch(_ranks(base, {0: 0.45, 1: 0.15}), cfg, balanced) is None  # balanced: a slow host
    assert rule_moe_dispatch(_ranks(base, {0: 0.02, 1: 0.08}), cfg, SKEWED) is None  # the wait costs little
    assert rule_moe_dispatch(_ranks(base, {0: 0.40, 1: 0.30}), cfg, SKEWED) is None  # the loaded rank waits more
    assert rule_moe_dispatch(_ranks(base, {0: 0.35, 1: 0.02}), cfg, SKEWED) is None  # only the loaded rank waits
    assert rule_moe_dispatch(_ranks(base, {0: 0.04, 1: 0.35}), cfg, {}) is None  # no loads logged
    assert rule_moe_dispatch(_ranks(base, {0: 0.04, 1: 0.35}), _cfg(ep=1), SKEWED) is None  # no expert parallelism
    assert rule_moe_dispatch(_ranks(base, {0: 0.04, 1: 0.35}), None, SKEWED) is None  # config unknown
    no_trace = [dataclasses.replace(a, a2a_wait_us=None) for a in _ranks(base, {0: 0.04, 1: 0.35})]
    assert rule_moe_dispatch(no_trace, cfg, SKEWED) is None
    # the thresholds: 1.5x exactly and 10% exactly fire
    edge = {"blocks.0": [0.375, 0.375, 0.125, 0.125]}
    assert rule_moe_dispatch(_ranks(base, {0: 0.0, 1: MOE_DISPATCH_MIN}), cfg, edge) is not None


def test_ep_groups_are_consecutive_data_parallel_ranks(base):
    # world 4, ep 2: groups {0, 1} and {2, 3}; with tp 2 the ep ranks sit 2 apart: {0, 2} and {1, 3}
    assert [ep_place(r, 2) for r in range(4)] == [((0, 0), 0), ((0, 0), 1), ((1, 0), 0), ((1, 0), 1)]
    assert [ep_place(r, 2, tp=2) for r in range(4)] == [((0, 0), 0), ((0, 1), 0), ((0, 0), 1), ((0, 1), 1)]
    # rank 3 waits; its group's overloaded rank (ep rank 0) is rank 2, whose wait is what it is compared with
    f = rule_moe_dispatch(_ranks(base, {0: 0.02, 1: 0.30, 2: 0.01, 3: 0.40}), _cfg(), SKEWED)
    assert (f.rank, f.numbers["overloaded_rank"], f.ranks) == (3, 2, [1, 3])
    assert "rank 3 waits" in f.title and "rank 2's experts" in f.title
    f = rule_moe_dispatch(_ranks(base, {0: 0.02, 1: 0.01, 2: 0.30, 3: 0.40}), _cfg("--parallel.tp=2"), SKEWED)
    assert (f.rank, f.numbers["overloaded_rank"], f.ranks) == (3, 1, [2, 3])


def test_token_shares_per_ep_rank():
    shares = ep_token_shares({"blocks.0": [1, 1, 1, 5], "blocks.1": [0.5, 0.5, 0.0], "blocks.2": [0, 0, 0, 0]}, 2)
    assert shares == {"blocks.0": [0.25, 0.75]}  # 3 experts do not split over 2 ranks; no tokens: no share


def test_overrides_turn_on_the_bias_else_strengthen_the_aux_loss():
    assert balancing_overrides(_cfg()) == ["--model.moe_bias_rate=0.001"]
    assert balancing_overrides(_cfg("--model.moe_bias_rate=0.001")) == ["--model.moe_aux_loss=0.1"]
    assert balancing_overrides(_cfg("--model.moe_bias_rate=0.001", "--model.moe_aux_loss=0")) == \
        ["--model.moe_aux_loss=0.01"]
    for extra in ([], ["--model.moe_bias_rate=0.001"]):
        load_config(None, ["--model.preset=moe-tiny", *extra, *balancing_overrides(_cfg(*extra))])


def test_the_run_dir_gives_the_config_and_the_last_loads(tmp_path):
    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    # rank 0 (the loaded experts' rank) waits 140 µs of its 1000 µs step, rank 1 490 µs
    traces = [str(_write(run / "traces" / f"rank{r}.json", _cpu_step(wait))) for r, wait in ((0, 50), (1, 400))]
    (run / "config.toml").write_text(config_to_toml(_cfg("--model.moe_bias_rate=0.001")))
    (run / "metrics.jsonl").write_text(
        '{"step": 10, "moe/blocks.0/load": [0.5, 0.5, 0.0, 0.0]}\n'
        '{"step": 20, "moe/blocks.0/load": [0.45, 0.45, 0.05, 0.05], "moe/blocks.1/load": [0.3, 0.3, 0.2, 0.2]}\n'
        '{"step": 20, "val_loss": 3.0}\n{"step": 30, "moe/blocks.0/lo')  # a record without loads, a cut-off line
    assert last_moe_loads(run / "metrics.jsonl") == (20, {"blocks.0": [0.45, 0.45, 0.05, 0.05],
                                                          "blocks.1": [0.3, 0.3, 0.2, 0.2]})
    out = run_doctor(traces)
    f = _finding(out)
    assert f is not None and f["rank"] == 1 and f["numbers"]["metrics_step"] == 20
    assert f["numbers"]["share"] == {0: pytest.approx(0.14), 1: pytest.approx(0.49)}
    assert f["numbers"]["token_ratio"][0] == pytest.approx(1.8)
    assert f["overrides"] == ["--model.moe_aux_loss=0.1"]  # the bias is on already
    # the traces alone (no run dir beside them): the loads are unknown, no finding
    (run / "metrics.jsonl").unlink()
    assert _finding(run_doctor(traces)) is None


if __name__ == "__main__":
    sys.exit(_worker(Path(sys.argv[1])))


def test_comm_exposed_leaves_the_all_to_all_wait_to_moe_dispatch(base):
    from slipstream.perf.doctor import _rule_comm_exposed

    # 40% of the step exposed in collectives, 35% of it the MoE all-to-all: 5% left, below the bar.
    waiting = dataclasses.replace(base, step_us=1000.0, comm_exposed_us=400.0, a2a_wait_us=350.0, pp_wait_comm_us=None)
    assert _rule_comm_exposed(waiting, None) is None
    # Without the all-to-all wait the same exposure is a finding.
    other = dataclasses.replace(waiting, a2a_wait_us=None)
    assert _rule_comm_exposed(other, None) is not None
