"""`slipstream launch local -- train --parallel.pp=N` end to end, against one process.

The LM job (5 blocks: an uneven split) at the same global batch, fp32: one process with 8
sequences per step, and pipelines whose schedule splits the same 8 sequences into micro-batches.
Each launch logs the single process's losses and validation losses (the stages hold every block
once; the gradient norm and clipping span the stages; evaluation runs through the stages), and
the pipeline is seen to run: each rank reports its stages (placed as the schedule places them)
and their blocks, the measured bubble is logged next to the planned one, the step's memory is
measured (not under compile). The single-process runs are in-process and shared where the model is.

A launch costs seconds of start-up alone, so each one tests a composition only a whole job tests,
and the schedules are spread over them (every schedule runs in one launch at least):

    pp2 1F1B                         from scratch; the checkpoints' source (names, export, pp1 resume)
    pp2 1F1B, rank 1 dies at step 3  restarted, resumes its step-2 checkpoint: bitwise the 1F1B run
    pp2 x fsdp2, ZBV                 resumes the pp2 checkpoint (V rank: the table and its copy, sharded)
    pp2 x ddp2, looped BFS, AC       resumes the single process's checkpoint (the head's copy on rank 1)
    pp2 x tp2, GPT-2, DualPipeV      from scratch (the tied table and its copy on one rank, vocab-sharded)
    pp2 x tp2, Llama, interleaved    resumes its single process's checkpoint (RoPE, GQA, SwiGLU, untied)
    pp2 bf16 autocast, GPipe         from scratch, against one bf16 process
    pp2 guards + compile, izb        NaNs on each stage's rank skip the step on both; regional compile
                                     under a split backward

The launches that depend on no other (JOBS) start together when the first test asks for one, two
at a time (the `jobs` fixture). The gradient-level comparison of every schedule (each gradient,
parameters after AdamW) is in tests/distributed/test_pipeline_parallel.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from slipstream.config.load import load_config
from slipstream.train.lm import train_lm
from tests.e2e.background import Jobs

SRC = str(Path(__file__).resolve().parents[2] / "src")
COMMON = ["--model.preset=tiny", "--model.n_layer=5", "--model.n_head=4",  # heads tp 2 divides
          "--train.seq_len=32", "--train.max_steps=4",
          "--data.sampling=sequential", "--train.eval_interval=2", "--train.eval_steps=2", "--optim.warmup_steps=2",
          "--logging.log_interval=1", "--logging.progress=false", "--logging.tensorboard=false",
          "--train.deterministic=true", "--checkpoint.interval=2",
          "--checkpoint.async_save=false"]
NO_CHECKPOINTS = ["--checkpoint.interval=0"]  # no step-2 save (the end of the run still saves)
REL = 5e-6  # measured <= 1.9e-7 (losses) and <= 7e-9 (val losses) over every schedule and layout
# Each pipeline rank's stage indices at pp 2: one stage, two looped stages, or the two ends of a V.
STAGES = {**dict.fromkeys(("gpipe", "1f1b"), {(0,), (1,)}),
          **dict.fromkeys(("interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble"), {(0, 2), (1, 3)}),
          **dict.fromkeys(("zbv", "dualpipev"), {(0, 3), (1, 2)})}
LLAMA = ["--model.position=rope", "--model.norm=rmsnorm", "--model.mlp=swiglu", "--model.n_kv_head=2",
         "--model.bias=false", "--model.tie_embeddings=false"]


@dataclass
class Job:
    run: Path
    stdout: str


def _command(args: list[str], nproc: int, fault: str = "", restarts: int = 0) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC}
    env.pop("SLIPSTREAM_INJECT_FAULT", None)
    if fault:
        env["SLIPSTREAM_INJECT_FAULT"] = fault
    launch = ["launch", "local", "--nproc", str(nproc), *(["--max-restarts", str(restarts)] if restarts else [])]
    return [sys.executable, "-m", "slipstream", *launch, "--", "train", *args], env


def _launch(args: list[str], nproc: int, fault: str = "", restarts: int = 0, timeout: float = 240):
    cmd, env = _command(args, nproc, fault, restarts)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _done(run: Path, proc: subprocess.CompletedProcess) -> Job:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return Job(run, proc.stdout + proc.stderr)


def _job(run: Path, data_dir: Path, args: list[str], nproc: int, **kw) -> Job:
    return _done(run, _launch(COMMON + [f"--data.dir={data_dir}", f"--run.dir={run}", *args], nproc, **kw))


def _single(run: Path, data_dir: Path, args: list[str]) -> Path:
    """One process, in this one, 8 sequences per step. On one thread like each launched rank: a
    model this small gains nothing from more, and threads that spin on a busy machine cost seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_lm(load_config(None, COMMON + [f"--data.dir={data_dir}", f"--run.dir={run}",
                                             "--train.micro_batch_size=8", *args]))
    finally:
        torch.set_num_threads(threads)
    return run


def _step2(run: Path) -> str:
    return f"--checkpoint.resume={run / 'checkpoints' / 'step_00000002'}"


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> dict[int, float]:
    """Logged training losses by step (a restarted run's last attempt wins; a skipped step logs none)."""
    return {r["step"]: r["loss"] for r in _records(run)
            if r.get("loss") is not None and "guard_event" not in r}


def _val_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in _records(run) if "val_loss" in r}


def _close(got: dict[int, float], want: dict[int, float]) -> None:
    assert got.keys() <= want.keys() and got
    for step, value in got.items():
        assert value == pytest.approx(want[step], rel=REL), f"step {step}"


def _like(run: Path, single: Path, steps: list[int], val_steps: list[int]) -> None:
    """The launch logged `steps` and `val_steps`, at the single process's values."""
    assert sorted(_losses(run)) == steps and sorted(_val_losses(run)) == val_steps
    _close(_losses(run), _losses(single))
    if val_steps:
        _close(_val_losses(run), _val_losses(single))


def _check_pipeline_ran(run: Path, schedule: str, dp: int, n_layer: int = 5, memory: bool = True) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mesh"][0] == ["pp", 2] and summary["world_size"] == 2 * dp
    assert summary["tokens"] == 4 * 8 * 32  # the job's tokens (a resumed job's too), each counted once
    # Every rank reports its stages, placed as the schedule places them, and their blocks: each
    # block exactly once per pipeline replica.
    assert {tuple(sorted(int(s) for s in rank["pp_stages"])) for rank in summary["ranks"]} == STAGES[schedule]
    blocks = sorted(b for rank in summary["ranks"] for layers in rank["pp_stages"].values() for b in layers)
    assert blocks == sorted(list(range(n_layer)) * dp)
    # The memory breakdown (on by default; not under compile) measured its step on every rank,
    # whatever the schedule.
    assert all((rank["step_peak_bytes"] or 0) > 0 for rank in summary["ranks"]) == memory
    logged = [r for r in _records(run) if r.get("loss") is not None and "guard_event" not in r]
    assert logged and all(0.0 <= r["pp_bubble"] < 1.0 and 0.0 < r["pp_bubble_planned"] < 1.0 for r in logged)
    return summary


def _resumed_from(job: Job, source: Path) -> None:
    printed = Path(job.stdout.split("resumed from ")[1].split()[0])
    assert printed.resolve() == (source / "checkpoints" / "step_00000002").resolve()


# --- shared runs -------------------------------------------------------------------------------------

BF16 = ["--precision.autocast=bf16", "--train.eval_steps=0", *NO_CHECKPOINTS]
GUARDED = ["--stability.policy=skip", "--train.eval_steps=0", *NO_CHECKPOINTS]
# Every launch of this module that depends on no other (the tests below say what each shows):
# name -> (overrides after COMMON, ranks, injected faults, restarts, timeout s).
JOBS = {
    # pp 2, 1F1B, 8 micro-batches of one sequence (the defaults): also the checkpoints' source.
    "pp2 1f1b": (["--train.micro_batch_size=8", "--parallel.pp=2"], 2, "", 0, 240),
    "bf16 gpipe": ([*BF16, "--train.micro_batch_size=4", "--train.grad_accum_steps=2", "--parallel.pp=2",
                    "--parallel.pp_schedule=gpipe"], 2, "", 0, 240),
    # 4 micro-batches of 2 sequences: under tp each micro-batch costs many small DTensor ops.
    "gpt2 dualpipev": (["--train.micro_batch_size=8", "--parallel.pp_microbatches=4", "--parallel.pp=2",
                        "--parallel.tp=2", "--parallel.pp_schedule=dualpipev", "--train.eval_interval=4",
                        *NO_CHECKPOINTS], 4, "", 0, 240),
    # a cold compile cache: minutes on a busy machine
    "guards izb compile": ([*GUARDED, "--train.micro_batch_size=4", "--train.grad_accum_steps=2", "--parallel.pp=2",
                            "--parallel.pp_schedule=interleaved-zero-bubble", "--compile.scope=blocks"],
                           2, "nan@2@0,nan@3@1", 0, 480),
    "dead stage": (["--train.micro_batch_size=8", "--parallel.pp=2", "--checkpoint.resume=auto"],
                   2, "crash@3@1", 1, 240),
}
# The jobs each test reads (by test name and parameters).
READS = {
    **dict.fromkeys(["test_a_pipeline_trains_like_one_process", "test_a_pipeline_checkpoint_holds_the_unsplit_names",
                     "test_checkpoint_export_consolidates_a_pipeline_checkpoint",
                     "test_a_pipeline_checkpoint_resumes_in_one_process",
                     "test_pipeline_with_data_parallel_resumes_and_trains_like_one_process[pp2xfsdp2-zbv]"],
                    ["pp2 1f1b"]),
    "test_bf16_autocast_reaches_the_stages": ["bf16 gpipe"],
    "test_the_guards_agree_across_stages_and_compiled_stages_train": ["guards izb compile"],
    "test_a_dead_stage_restarts_the_pipeline_and_resumes_bitwise": ["dead stage", "pp2 1f1b"],
    "test_pipeline_with_tensor_parallel_trains_like_one_process[gpt2-dualpipev]": ["gpt2 dualpipev"],
}


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory, data_dir):
    """name -> Job (asserting the launch exited 0). The selected tests' jobs start when the first
    test asks, two at a time in JOBS's order (tests/e2e/background.py: a launch keeps 2 cores only
    about half busy), the 4-rank one early, next to 2-rank ones and before the tests' own 4-rank
    launches; the in-process single-process runs fit next to them."""
    selected = {name for item in request.session.items if item.path == Path(__file__)
                for name in READS.get(item.name, [])}
    runs, commands = {}, {}
    for name, (overrides, nproc, fault, restarts, timeout) in JOBS.items():
        if name in selected:
            runs[name] = tmp_path_factory.mktemp(name.replace(" ", "-")) / "run"
            cmd, env = _command(COMMON + [f"--data.dir={data_dir}", f"--run.dir={runs[name]}", *overrides], nproc,
                                fault, restarts)
            commands[name] = (cmd, env, timeout)
    started = Jobs(commands)
    yield lambda name: _done(runs[name], started.result(name))
    started.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir) -> Path:
    """One process, 8 sequences per step; its step-2 checkpoint is resumed as a pipeline."""
    return _single(tmp_path_factory.mktemp("single") / "run", data_dir, [])


@pytest.fixture(scope="module")
def pp2_1f1b(jobs) -> Job:
    return jobs("pp2 1f1b")


# --- pp 2 alone ----------------------------------------------------------------------------------------

def test_a_pipeline_trains_like_one_process(pp2_1f1b, reference):
    assert "parallel: none on 2 process(es) [pp 2 x dp_replicate 1]" in pp2_1f1b.stdout
    _like(pp2_1f1b.run, reference, [1, 2, 3, 4], [2, 4])
    _check_pipeline_ran(pp2_1f1b.run, "1f1b", dp=1)


@pytest.mark.timeout(300)
def test_bf16_autocast_reaches_the_stages(jobs, reference, data_dir, tmp_path):
    """bf16 autocast around the schedule (GPipe): the pipeline logs one bf16 process's losses, which
    are not the fp32 ones (the switch acted inside the stages)."""
    single = _single(tmp_path / "single", data_dir, BF16)
    job = jobs("bf16 gpipe")
    got, want, full = _losses(job.run), _losses(single), _losses(reference)  # the reference: fp32
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-3)
    assert max(abs(got[s] - full[s]) / full[s] for s in got) > 1e-5  # bf16 did change the numbers
    _check_pipeline_ran(job.run, "gpipe", dp=1)


@pytest.mark.timeout(600)
def test_the_guards_agree_across_stages_and_compiled_stages_train(jobs, data_dir, tmp_path, monkeypatch):
    """A NaN loss seen on one stage's rank only skips the step on every stage: injected on the
    first stage's rank in step 2 and on the last's in step 3, the pipeline logs one process that
    skipped both steps (a skip on one stage alone moves step 4's loss by ~1e-2).

    The same launch compiles the blocks inside the stages (regional; fp32: the same losses) under
    interleaved zero bubble, whose split backward retains the graph, which a compiled backward must
    allow. Evaluation is off here: it would compile the blocks a second time."""
    monkeypatch.setenv("SLIPSTREAM_INJECT_FAULT", "nan@2,nan@3")
    single = _single(tmp_path / "single", data_dir, GUARDED)
    monkeypatch.delenv("SLIPSTREAM_INJECT_FAULT")
    job = jobs("guards izb compile")  # its ranks' faults: nan@2 on rank 0, nan@3 on rank 1
    assert "skipped with torch.compile" in job.stdout  # the memory breakdown's note: the blocks were compiled
    for run in (single, job.run):
        events = [r for r in _records(run) if "guard_event" in r]
        assert [(e["step"], e["action"]) for e in events] == [(2, "skip"), (3, "skip")]
    _like(job.run, single, [1, 4], [])
    _check_pipeline_ran(job.run, "interleaved-zero-bubble", dp=1, memory=False)


# --- checkpoints: the unsplit names, resumed at the same layout and at another ------------------------

def test_a_pipeline_checkpoint_holds_the_unsplit_names(pp2_1f1b):
    """Both stages' parameters under the whole model's names, optimizer state keyed by them."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(pp2_1f1b.run / "checkpoints" / "step_00000002" / "model_optim")).read_metadata()
    keys = set(meta.state_dict_metadata)
    for name in ("model.tok_emb.weight", "model.blocks.0.attn.q_proj.weight", "model.blocks.4.mlp.down_proj.weight",
                 "model.final_norm.weight", "optim.state.blocks.4.mlp.down_proj.weight.exp_avg"):
        assert name in keys, sorted(keys)[:20]
    assert not any("stages" in key or "_orig_mod" in key for key in keys)


def test_checkpoint_export_consolidates_a_pipeline_checkpoint(pp2_1f1b, reference, tmp_path):
    """`slipstream checkpoint export` of a pp2 checkpoint: one file with every weight by its unsplit
    name, equal to the export of the single process's checkpoint at the same step (fp32 noise)."""
    from safetensors.torch import load_file

    from slipstream.checkpoint.export import export_checkpoint

    proc = subprocess.run([sys.executable, "-m", "slipstream", "checkpoint", "export",
                           str(pp2_1f1b.run / "checkpoints" / "step_00000002"), "--format", "safetensors", "--out",
                           str(tmp_path / "piped")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert proc.returncode == 0, proc.stderr[-2000:]
    piped = load_file(tmp_path / "piped" / "model.safetensors")
    export_checkpoint(reference / "checkpoints" / "step_00000002", "safetensors", tmp_path / "single")
    single = load_file(tmp_path / "single" / "model.safetensors")
    assert sorted(piped) == sorted(single) and "blocks.4.attn.q_proj.weight" in piped
    for name, tensor in single.items():
        assert (piped[name] - tensor).abs().max().item() <= 1e-5, name


def test_a_pipeline_checkpoint_resumes_in_one_process(pp2_1f1b, reference, data_dir, tmp_path):
    run = _single(tmp_path / "run", data_dir, [_step2(pp2_1f1b.run)])
    _like(run, reference, [3, 4], [4])


@pytest.mark.timeout(400)
def test_a_dead_stage_restarts_the_pipeline_and_resumes_bitwise(jobs, pp2_1f1b):
    """The last stage's rank dies in step 3: the whole job stops, `--max-restarts 1` starts both
    ranks again and they resume from the step-2 checkpoint at the same layout, logging the
    uninterrupted run's losses bit for bit."""
    job = jobs("dead stage")
    assert "injected crash at step 3 on rank 1" in job.stdout
    _resumed_from(job, job.run)
    assert _losses(job.run) == _losses(pp2_1f1b.run)
    assert _val_losses(job.run) == _val_losses(pp2_1f1b.run)


# --- world 4: the pipeline composed with data and tensor parallelism ---------------------------------

@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy, schedule, source, extra", [
    # V: the tied table and its copy on one rank, both sharded; from the pp2 1F1B checkpoint.
    ("fsdp", "zbv", "pp2_1f1b", []),
    # The one process's tied table has one optimizer state; the head's copy on the last rank starts from it.
    ("ddp", "looped-bfs", "reference", ["--activations.checkpointing=full"]),
], ids=["pp2xfsdp2-zbv", "pp2xddp2-looped-bfs"])
def test_pipeline_with_data_parallel_resumes_and_trains_like_one_process(strategy, schedule, source, extra, reference,
                                                                         request, data_dir, tmp_path):
    """pp2 x dp2 at world 4, resumed from a checkpoint of another layout (the stages resharded)."""
    source_run = request.getfixturevalue(source)
    source_run = getattr(source_run, "run", source_run)
    job = _job(tmp_path / "run", data_dir, ["--train.micro_batch_size=4", "--parallel.pp=2",
                                            f"--parallel.dp_strategy={strategy}", f"--parallel.pp_schedule={schedule}",
                                            _step2(source_run), *extra],
               nproc=4)
    _resumed_from(job, source_run)
    _like(job.run, reference, [3, 4], [4])
    summary = _check_pipeline_ran(job.run, schedule, dp=2)
    assert summary["dp_strategy"] == strategy


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model, schedule, resume", [
    # GPT-2 (tied table, learned positions) on a V (DualPipeV) from scratch (the job "gpt2 dualpipev"):
    # the table and its copy on one rank, vocabulary-sharded; sequence and loss parallel on (the
    # defaults). Evaluated at step 4 only.
    ([], "dualpipev", False),
    # Llama (RoPE on a stream cut along the sequence, GQA, SwiGLU, untied) interleaved, resumed from
    # its single process's checkpoint (the stages split over tp).
    (LLAMA, "interleaved-1f1b", True),
], ids=["gpt2-dualpipev", "llama-interleaved"])
def test_pipeline_with_tensor_parallel_trains_like_one_process(model, schedule, resume, jobs, reference, data_dir,
                                                               tmp_path):
    """The 3D mesh's pp x tp: [pp 2, tp 2] at world 4 against one process of the same model."""
    if not resume:
        single, job = reference, jobs("gpt2 dualpipev")
    else:
        single = _single(tmp_path / "single", data_dir, model)
        # 4 micro-batches of 2 sequences: under tp each micro-batch costs many small DTensor ops.
        job = _job(tmp_path / "run", data_dir, [*model, "--train.micro_batch_size=8", "--parallel.pp_microbatches=4",
                                                "--parallel.pp=2", "--parallel.tp=2",
                                                f"--parallel.pp_schedule={schedule}", _step2(single)], nproc=4)
    assert "[pp 2 x dp_replicate 1 x tp 2]" in job.stdout
    if resume:
        _resumed_from(job, single)
    _like(job.run, single, [3, 4] if resume else [1, 2, 3, 4], [4])
    _check_pipeline_ran(job.run, schedule, dp=2)  # each tp rank of a stage holds its blocks (split over tp)
