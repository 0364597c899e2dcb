"""`slipstream launch local -- train --parallel.pp=N` end to end, against one process.

The LM job (5 blocks: an uneven split) at the same global batch, fp32: one process with 8
sequences per step, and pipelines whose schedule splits the same 8 sequences into micro-batches.
Every schedule at pp 2 must log the single process's losses and validation losses (the
stages hold every block once; the gradient norm and clipping span both stages; evaluation runs
through the stages), and the pipeline must be seen to run: each rank reports the blocks of its
stages, the measured bubble is logged next to the planned one. At world 4: pp2 x fsdp2 and
pp2 x ddp2 (with activation checkpointing). Checkpoints saved by a pp2 run resume at pp2
(bitwise), at pp1 and at pp2 x dp2; a rank that dies mid-run is restarted and resumes.

The gradient-level comparison of every schedule (each gradient, parameters after AdamW) is in
tests/distributed/test_pipeline_parallel.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.config.load import load_config
from slipstream.train.lm import train_lm

SRC = str(Path(__file__).resolve().parents[2] / "src")
COMMON = ["--model.preset=tiny", "--model.n_layer=5", "--train.seq_len=32", "--train.max_steps=4",
          "--data.sampling=sequential", "--train.eval_interval=2", "--train.eval_steps=2", "--optim.warmup_steps=2",
          "--logging.log_interval=1", "--logging.progress=false", "--logging.tensorboard=false",
          "--train.deterministic=true", "--checkpoint.interval=2",
          "--checkpoint.async_save=false"]
SCHEDULES = ["1f1b", "gpipe", "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble", "zbv", "dualpipev"]
REL = 5e-6  # measured <= 1.8e-7 (losses) and <= 2.3e-9 (val losses) over every schedule and layout


def _launch(args: list[str], nproc: int, fault: str = "", restarts: int = 0, timeout: float = 240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC}
    env.pop("SLIPSTREAM_INJECT_FAULT", None)
    if fault:
        env["SLIPSTREAM_INJECT_FAULT"] = fault
    launch = ["launch", "local", "--nproc", str(nproc), *(["--max-restarts", str(restarts)] if restarts else [])]
    return subprocess.run([sys.executable, "-m", "slipstream", *launch, "--", "train", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run) if "loss" in r}


def _val_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in _records(run) if "val_loss" in r}


def _close(got: dict[int, float], want: dict[int, float]) -> None:
    assert got.keys() <= want.keys() and got
    for step, value in got.items():
        assert value == pytest.approx(want[step], rel=REL), f"step {step}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir) -> Path:
    run = tmp_path_factory.mktemp("single") / "run"
    train_lm(load_config(None, COMMON + [f"--data.dir={data_dir}", f"--run.dir={run}", "--train.micro_batch_size=8"]))
    return run


@pytest.fixture(scope="module")
def pp2_1f1b(tmp_path_factory, data_dir) -> Path:
    """pp 2, 1F1B, 8 micro-batches of one sequence (the default): also the checkpoints' source."""
    run = tmp_path_factory.mktemp("pp2") / "run"
    proc = _launch(COMMON + [f"--data.dir={data_dir}", f"--run.dir={run}", "--train.micro_batch_size=8",
                             "--parallel.pp=2"], nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return run


def _check_pipeline_ran(run: Path, pp: int, dp: int, n_layer: int = 5, memory: bool = True) -> None:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mesh"][0] == ["pp", pp] and summary["world_size"] == pp * dp
    assert summary["tokens"] == 4 * 8 * 32  # the job's tokens, each counted once
    # Every rank reports the blocks of its stages: each block exactly once per pipeline replica.
    blocks = sorted(b for rank in summary["ranks"] for layers in rank["pp_stages"].values() for b in layers)
    assert blocks == sorted(list(range(n_layer)) * dp)
    # The memory breakdown (on by default; not under compile) measured step 2 on every rank,
    # whatever the schedule.
    assert all((rank["step_peak_bytes"] or 0) > 0 for rank in summary["ranks"]) == memory
    logged = [r for r in _records(run) if "loss" in r]
    assert all(0.0 <= r["pp_bubble"] < 1.0 and 0.0 < r["pp_bubble_planned"] < 1.0 for r in logged)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_trains_like_one_process(schedule, reference, pp2_1f1b, data_dir, tmp_path):
    if schedule == "1f1b":
        run = pp2_1f1b
    else:
        run = tmp_path / "run"
        # Regional compile inside the stages on one of them (fp32: the same losses); zbv's split
        # backward retains the graph, which a compiled backward must allow.
        compiled = ["--compile.scope=blocks"] if schedule == "zbv" else []
        proc = _launch(COMMON + [f"--data.dir={data_dir}", f"--run.dir={run}", "--train.micro_batch_size=4",
                                 "--train.grad_accum_steps=2", "--parallel.pp=2", f"--parallel.pp_schedule={schedule}",
                                 *compiled], nproc=2)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "parallel: none on 2 process(es) [pp 2 x dp_replicate 1]" in proc.stdout
    _close(_losses(run), _losses(reference))
    _close(_val_losses(run), _val_losses(reference))
    _check_pipeline_ran(run, pp=2, dp=1, memory=schedule != "zbv")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy, extra", [
    ("fsdp", ["--parallel.pp_schedule=zbv"]),  # V: the tied table and its copy on one rank, both sharded
    ("ddp", ["--activations.checkpointing=full", "--parallel.pp_schedule=interleaved-1f1b"]),
])
def test_pipeline_with_data_parallel_trains_like_one_process(strategy, extra, reference, data_dir, tmp_path):
    run = tmp_path / "run"
    proc = _launch(COMMON + [f"--data.dir={data_dir}", f"--run.dir={run}", "--train.micro_batch_size=4",
                             "--parallel.pp=2", f"--parallel.dp_strategy={strategy}", *extra], nproc=4)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    _close(_losses(run), _losses(reference))
    _close(_val_losses(run), _val_losses(reference))
    _check_pipeline_ran(run, pp=2, dp=2)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dp_strategy"] == strategy


GPT2_TP = ["--model.n_head=4"]  # heads tp 2 divides
LLAMA = ["--model.position=rope", "--model.norm=rmsnorm", "--model.mlp=swiglu", "--model.n_head=4",
         "--model.n_kv_head=2", "--model.bias=false", "--model.tie_embeddings=false"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model, extra", [
    # GPT-2 (tied table, learned positions) on a V: the table and its copy on one rank, vocabulary-sharded;
    # sequence and loss parallel on (the defaults).
    (GPT2_TP, ["--parallel.pp_schedule=zbv"]),
    # Llama (RoPE on a stream cut along the sequence, GQA, SwiGLU, untied) interleaved.
    (LLAMA, ["--parallel.pp_schedule=interleaved-1f1b"]),
], ids=["gpt2-zbv", "llama-interleaved"])
def test_pipeline_with_tensor_parallel_trains_like_one_process(model, extra, data_dir, tmp_path):
    """The 3D mesh's pp x tp: [pp 2, tp 2] at world 4 against one process of the same model."""
    single = tmp_path / "single"
    train_lm(load_config(None, COMMON + model + [f"--data.dir={data_dir}", f"--run.dir={single}",
                                                 "--train.micro_batch_size=8"]))
    run = tmp_path / "run"
    proc = _launch(COMMON + model + [f"--data.dir={data_dir}", f"--run.dir={run}", "--train.micro_batch_size=8",
                                     "--parallel.pp=2", "--parallel.tp=2", *extra], nproc=4)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "[pp 2 x dp_replicate 1 x tp 2]" in proc.stdout
    _close(_losses(run), _losses(single))
    _close(_val_losses(run), _val_losses(single))
    _check_pipeline_ran(run, pp=2, dp=2)  # each tp rank of a stage holds its blocks (split over tp)


@pytest.mark.timeout(300)
def test_bf16_autocast_reaches_the_stages(data_dir, tmp_path):
    """bf16 autocast around the schedule: the pipeline logs one bf16 process's losses, which are
    not the fp32 ones (the switch acted inside the stages)."""
    bf16 = ["--precision.autocast=bf16", "--train.eval_steps=0", "--checkpoint.interval=0"]
    single, fp32 = tmp_path / "single", tmp_path / "fp32"
    for run, extra in ((single, bf16), (fp32, ["--train.eval_steps=0", "--checkpoint.interval=0"])):
        train_lm(load_config(None, COMMON + extra + [f"--data.dir={data_dir}", f"--run.dir={run}",
                                                     "--train.micro_batch_size=8"]))
    run = tmp_path / "run"
    proc = _launch(COMMON + bf16 + [f"--data.dir={data_dir}", f"--run.dir={run}", "--train.micro_batch_size=8",
                                    "--parallel.pp=2"], nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got, want, full = _losses(run), _losses(single), _losses(fp32)
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-3)
    assert max(abs(got[s] - full[s]) / full[s] for s in got) > 1e-5  # bf16 did change the numbers


@pytest.mark.timeout(300)
def test_the_stability_guards_agree_across_stages(data_dir, tmp_path):
    """A NaN loss seen on one stage's rank only skips the step on every stage: injected on the
    first stage's rank or on the last's, the runs continue identically (a skip on one stage
    alone would leave the two runs with different models)."""
    losses = []
    for rank in (0, 1):
        run = tmp_path / f"run{rank}"
        proc = _launch(COMMON + [f"--data.dir={data_dir}", f"--run.dir={run}", "--train.micro_batch_size=8",
                                 "--parallel.pp=2", "--stability.policy=skip", "--checkpoint.interval=0"],
                       nproc=2, fault=f"nan@3@{rank}")
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        events = [r for r in _records(run) if "guard_event" in r]
        assert [(e["step"], e["action"]) for e in events] == [(3, "skip")]
        losses.append({s: v for s, v in _losses(run).items() if s != 3})
    assert sorted(losses[0]) == sorted(losses[1]) == [1, 2, 4]
    for step, value in losses[0].items():  # a skip on one stage alone moves step 4 by ~1e-2
        assert losses[1][step] == pytest.approx(value, rel=1e-6), step


# --- checkpoints: the unsplit names, resumed at another pipeline degree ------------------------------

def test_a_pipeline_checkpoint_holds_the_unsplit_names(pp2_1f1b):
    """Both stages' parameters under the whole model's names, optimizer state keyed by them."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(pp2_1f1b / "checkpoints" / "step_00000002" / "model_optim")).read_metadata()
    keys = set(meta.state_dict_metadata)
    for name in ("model.tok_emb.weight", "model.blocks.0.attn.q_proj.weight", "model.blocks.4.mlp.down_proj.weight",
                 "model.final_norm.weight", "optim.state.blocks.4.mlp.down_proj.weight.exp_avg"):
        assert name in keys, sorted(keys)[:20]
    assert not any("stages" in key or "_orig_mod" in key for key in keys)


def test_checkpoint_export_consolidates_a_pipeline_checkpoint(pp2_1f1b, reference, tmp_path):
    """`checkpoint export` of a pp2 checkpoint: one file with every weight by its unsplit name,
    equal to the export of the single process's checkpoint at the same step (fp32 noise)."""
    from safetensors.torch import load_file

    outs = []
    for source, name in ((pp2_1f1b, "piped"), (reference, "single")):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "slipstream", "checkpoint", "export",
                               str(source / "checkpoints" / "step_00000002"), "--format", "safetensors", "--out",
                               str(out)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": SRC})
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(load_file(out / "model.safetensors"))
    piped, single = outs
    assert sorted(piped) == sorted(single) and "blocks.4.attn.q_proj.weight" in piped
    for name, tensor in single.items():
        assert (piped[name] - tensor).abs().max().item() <= 1e-5, name


@pytest.mark.timeout(300)
def test_resume_at_the_same_layout_is_bitwise(pp2_1f1b, data_dir, tmp_path):
    run = tmp_path / "run"
    proc = _launch(COMMON + [f"--data.dir={data_dir}", f"--run.dir={run}", "--train.micro_batch_size=8",
                             "--parallel.pp=2", f"--checkpoint.resume={pp2_1f1b / 'checkpoints' / 'step_00000002'}"],
                   nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    resumed = _losses(run)
    assert sorted(resumed) == [3, 4]
    assert resumed == {step: _losses(pp2_1f1b)[step] for step in (3, 4)}


def test_a_pipeline_checkpoint_resumes_in_one_process(pp2_1f1b, reference, data_dir, tmp_path):
    run = tmp_path / "run"
    train_lm(load_config(None, COMMON + [f"--data.dir={data_dir}", f"--run.dir={run}", "--train.micro_batch_size=8",
                                         f"--checkpoint.resume={pp2_1f1b / 'checkpoints' / 'step_00000002'}"]))
    assert sorted(_losses(run)) == [3, 4]
    _close(_losses(run), _losses(reference))
    _close(_val_losses(run), _val_losses(reference))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [
    ["--train.micro_batch_size=4", "--parallel.dp_strategy=fsdp"],  # pp2 x fsdp2: the stages sharded
    ["--train.micro_batch_size=8", "--parallel.tp=2"],               # pp2 x tp2: the stages split over tp
], ids=["pp2xfsdp2", "pp2xtp2"])
def test_a_pipeline_checkpoint_resumes_at_world_4(layout, pp2_1f1b, reference, data_dir, tmp_path):
    run = tmp_path / "run"
    proc = _launch(COMMON + [f"--data.dir={data_dir}", f"--run.dir={run}", "--parallel.pp=2", *layout,
                             f"--checkpoint.resume={pp2_1f1b / 'checkpoints' / 'step_00000002'}"], nproc=4)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert sorted(_losses(run)) == [3, 4]
    _close(_losses(run), _losses(reference))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_single_process_checkpoint_resumes_as_a_pipeline(schedule, reference, data_dir, tmp_path):
    """The one process's tied table has one optimizer state; the head's copy (on the last rank,
    or beside the table on a V rank) starts from it."""
    run = tmp_path / "run"
    proc = _launch(COMMON + [f"--data.dir={data_dir}", f"--run.dir={run}", "--train.micro_batch_size=8",
                             "--parallel.pp=2", f"--parallel.pp_schedule={schedule}",
                             f"--checkpoint.resume={reference / 'checkpoints' / 'step_00000002'}"], nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert sorted(_losses(run)) == [3, 4]
    _close(_losses(run), _losses(reference))


@pytest.mark.timeout(400)
def test_a_dead_stage_restarts_the_pipeline_and_resumes(pp2_1f1b, data_dir, tmp_path):
    """The last stage's rank dies in step 3: the whole job stops, `--max-restarts 1` starts both
    ranks again and they resume from the step-2 checkpoint, logging the uninterrupted losses."""
    run = tmp_path / "run"
    proc = _launch(COMMON + [f"--data.dir={data_dir}", f"--run.dir={run}", "--train.micro_batch_size=8",
                             "--parallel.pp=2", "--checkpoint.resume=auto"], nproc=2, fault="crash@3@1", restarts=1)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "injected crash at step 3 on rank 1" in proc.stdout + proc.stderr
    assert proc.stdout.split("resumed from ")[1].split()[0].endswith("step_00000002")
    assert _losses(run) == _losses(pp2_1f1b)

