"""The single-process workloads of `slipstream bench suite`: time to a target val loss, GPT-2 124M
training steps, the trainer's overhead, the data path and the checkpoint stall.

Every workload is a `Workload`: its stable name, what its primary metric is and which way is
better, how it scales across machines, its methodology (what is warm-up, what one sample is) and
its recipe per mode (the exact overrides on the default job, which the suite's JSON records as
its "definition"). `measure(ctx, n)` runs it and returns n samples of the primary metric, the
secondary numbers (medians) and the quality gate: a number only counts when the run's loss is
where it should be. The multi-rank workloads are in suite_parallel.py; suite.py runs the table.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from slipstream.errors import UserError

MODES = ("full", "quick", "ci")
# The tests' size: configs/tiny.toml's model and batch, as overrides on the default job.
TINY = ["--model.preset=tiny", "--train.micro_batch_size=4", "--train.seq_len=64", "--optim.warmup_steps=5"]
# Step-throughput runs: no evaluation or final checkpoint, every step logged (one sample each).
STEP_RUN = ["--train.eval_tokens=0", "--checkpoint.save_final=false", "--logging.log_interval=1",
            "--logging.progress=false", "--logging.tensorboard=false"]


@dataclass
class SuiteContext:
    """What every workload of one suite run shares."""

    mode: str
    device: str  # "cpu" or "cuda"
    data_dir: str  # the prepared corpus (prepared once, before any timing)
    data_note: str  # how the definition names the data (never a machine's path)
    workdir: Path  # a temporary folder for run directories
    results: dict[str, Any] = field(default_factory=dict)  # what one workload leaves for another


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    metric: str
    unit: str
    higher_is_better: bool
    normalize_by: str  # compute (scales with matmul TFLOP/s), memory (copy GB/s) or none
    samples: dict[str, int]  # default samples per mode (--repeats overrides)
    methodology: str
    recipe: Callable[[SuiteContext], list[str]]  # the overrides that define it on this mode and device
    measure: Callable[[SuiteContext, int], dict[str, Any]]  # -> samples, secondary, quality


# ----------------------------------------------------------------------------------------------- helpers

def spawn_train(overrides: list[str], run_dir: Path, timeout_s: float) -> tuple[float, dict[str, Any]]:
    """`slipstream train` in a fresh process (a cold start: imports, data check, model build all
    count); returns (wall seconds from spawn to exit, summary.json)."""
    cmd = [sys.executable, "-m", "slipstream", "train", *overrides, f"--run.dir={run_dir}"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise UserError(f"the training run did not finish within {timeout_s:g} s: {' '.join(overrides)}") from None
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).splitlines()
        cause = next((line for line in lines if re.match(r"(\w+(Error|Exception)|error): ", line)), "")
        raise UserError(f"the training run failed (exit {proc.returncode}): {cause}\n" + "\n".join(lines[-10:]))
    return wall, json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl of a run the suite itself started (the doctor's bounded reader)."""
    from slipstream.perf.doctor_moe import metrics_records

    return list(metrics_records(run_dir / "metrics.jsonl"))


def timed_steps(records: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """The per-step records after the warm-up steps."""
    return [r for r in records if "tokens_per_s" in r and r["step"] > warmup]


def median_of(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _quiet_fit(cfg) -> dict[str, Any]:
    """Train in this process with the trainer's console output swallowed."""
    from slipstream.train.lm import build_lm_trainer

    with contextlib.redirect_stdout(io.StringIO()):
        return build_lm_trainer(cfg).fit()


# ----------------------------------------------------------------------------------------------- time to target

# mode -> (what the recipe is, overrides on the default job, target val loss). The default job's val loss
# (eval every 25 steps) is 2.364 at step 250 and 2.342 at step 275: the target 2.35 is reached at step 275,
# about 2.5 min on 2 cores. Quick (seq 128, cosine over 300 steps): 2.460 at step 125, 2.408 at 150, so 2.43
# is reached at step 150 (51 s per repeat). Tiny reaches 4.8 at step 10. The curves: docs/benchmark-suite.md.
TIME_TO_TARGET = {
    "full": ("the default job (configs/quickstart.toml: gpt-mini, 16 x 256 byte tokens)",
             ["--train.max_steps=500", "--train.eval_interval=25", "--train.eval_tokens=32768",
              "--checkpoint.interval=100"], 2.35),
    "quick": ("the default job at seq 128 (gpt-mini, 16 x 128 byte tokens)",
              ["--train.seq_len=128", "--train.max_steps=300", "--train.eval_interval=25",
               "--train.eval_tokens=16384", "--checkpoint.interval=50"], 2.43),
    "ci": ("configs/tiny.toml's model and batch (tiny, 4 x 64 byte tokens)",
           [*TINY, "--train.max_steps=60", "--train.eval_interval=5", "--train.eval_tokens=4096",
            "--checkpoint.interval=10"], 4.8),
}
TIME_TO_TARGET_TIMEOUT_S = {"full": 1800.0, "quick": 900.0, "ci": 300.0}


def time_to_target_recipe(mode: str) -> list[str]:
    _, overrides, target = TIME_TO_TARGET[mode]
    return [*overrides, f"--train.target_val_loss={target:g}", "--logging.progress=false"]


def time_to_target_once(overrides: list[str], mode: str, data_dir: str, workdir: Path) -> dict[str, Any]:
    """One cold-start time-to-target run: `slipstream train` of the mode's recipe with `overrides`
    appended (a speed-run switch), run directory under `workdir` (which must be empty). Returns
    wall_s (spawn to exit), target_reached, steps and tokens (at the stop), val_loss (the best
    evaluation), loop_time_s, train_wall_s and the definition (the recipe's overrides). A run that
    fails raises UserError; one that misses the target returns target_reached False."""
    if mode not in MODES:
        raise UserError(f"unknown mode '{mode}'; use {', '.join(MODES)}")
    data_dir = data_dir or prepare_data()
    recipe = [*time_to_target_recipe(mode), *overrides]
    wall, summary = spawn_train([*recipe, f"--data.dir={data_dir}"], Path(workdir) / "run",
                                TIME_TO_TARGET_TIMEOUT_S[mode])
    stopped = summary.get("stopped_early") or {}
    reached = bool(stopped.get("target_reached"))
    # the trainer logs one checkpoint_stall_s record per save: the checkpoints this time paid for
    saves = sum(1 for record in read_metrics(Path(workdir) / "run") if "checkpoint_stall_s" in record)
    return {"wall_s": wall, "target_reached": reached, "target": TIME_TO_TARGET[mode][2],
            "steps": stopped.get("step", summary["steps"]), "tokens": summary["tokens"],
            "val_loss": stopped.get("best_val_loss") if reached else summary.get("val_loss"),
            "loop_time_s": summary["loop_time_s"], "train_wall_s": summary["wall_time_s"], "checkpoints": saves,
            "definition": " ".join(recipe)}


def prepare_data(data_dir: str = "") -> str:
    """The prepared folder `data_dir` checked (a bad one is a UserError before anything runs), or the
    default corpus (stdlib sources, byte tokens) prepared on first use; its path."""
    from slipstream.config.load import load_config
    from slipstream.data.ensure import ensure_data

    given = [f"--data.dir={data_dir}"] if data_dir else []
    return str(ensure_data(load_config(None, ["--logging.progress=false", *given]))[0])


def _measure_time_to_target(ctx: SuiteContext, n: int) -> dict[str, Any]:
    runs = []
    for i in range(n):
        workdir = ctx.workdir / f"time_to_target-{i}"
        workdir.mkdir()
        runs.append(time_to_target_once([], ctx.mode, ctx.data_dir, workdir))
        print(f"  repeat {i + 1}/{n}: {runs[-1]['wall_s']:.1f} s, step {runs[-1]['steps']}, "
              f"val {runs[-1]['val_loss']:.4f}", flush=True)
    target = TIME_TO_TARGET[ctx.mode][2]
    missed = [i for i, run in enumerate(runs) if not run["target_reached"]]
    unsaved = [i for i, run in enumerate(runs) if not run["checkpoints"]]  # a time without checkpointing is cheaper
    worst = max(run["val_loss"] if run["val_loss"] is not None else math.inf for run in runs)
    return {"samples": [run["wall_s"] for run in runs],
            "secondary": {key: median_of([run[key] for run in runs])
                          for key in ("steps", "tokens", "loop_time_s", "train_wall_s", "val_loss", "checkpoints")},
            "quality": {"passed": not missed and not unsaved, "value": worst,
                        "criterion": f"every repeat's val loss <= {target:g} within the step cap (summary: "
                                     f"target_reached) and it saved checkpoints"
                                     + (f"; repeats {missed} missed the target" if missed else "")
                                     + (f"; repeats {unsaved} saved no checkpoint" if unsaved else "")}}


# ----------------------------------------------------------------------------------------------- GPT-2 124M steps

# mode -> (shape overrides, warm-up steps). ci trains the tiny preset instead of 124M.
GPT2_SHAPE = {
    "full": (["--model.preset=gpt2", "--train.micro_batch_size=1", "--train.seq_len=1024"], 2),
    "quick": (["--model.preset=gpt2", "--train.micro_batch_size=1", "--train.seq_len=128"], 2),
    "ci": (["--model.preset=tiny", "--train.micro_batch_size=4", "--train.seq_len=64"], 2),
}
GPT2_SHAPE_CUDA_FULL = (["--model.preset=gpt2", "--train.micro_batch_size=8", "--train.seq_len=1024"], 3)
GPT2_CUDA_WARMUP = 3  # the best switches compile the blocks on CUDA in every mode: one more step of warm-up
# The best run's loss at the last step vs the fp32 run's (same init, same batches): fused kernels
# only reorder sums; bf16 autocast rounds every matmul input.
GPT2_LOSS_TOLERANCE = {"fp32": 1e-3, "bf16": 3e-2}


def cpu_bf16_flags() -> list[str]:
    """This CPU's native bf16 matmul instructions (AMX-BF16, AVX512-BF16) from /proc/cpuinfo; [] if none."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "").split()
    return [flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags]


def best_switches(device: str) -> tuple[list[str], list[str]]:
    """(overrides, names) of the fastest switches for GPT-2 124M training steps on this device.

    CPU, measured on the development machine (AMD EPYC with AVX512-BF16, no AMX; 1 x 128 tokens): bf16
    autocast 200 tokens/s vs fp32 130; the fused loss 157 vs 200 with bf16 (and no gain at fp32): it
    saves memory and costs time on a CPU, so it is a CUDA switch here. Without native bf16
    instructions (AVX2 only) bf16 matmuls are slower than fp32, so bf16 is chosen only with them."""
    if device == "cuda":
        return (["--precision.autocast=bf16", "--precision.tf32=true", "--compile.scope=blocks",
                 "--train.fused_loss=true", "--optim.implementation=fused"],
                ["bf16 autocast", "TF32", "regional compile", "fused loss", "fused AdamW"])
    overrides, names = ["--optim.implementation=fused"], ["fused AdamW", "no fused loss (slower on a CPU)"]
    if bf16 := cpu_bf16_flags():
        return [*overrides, "--precision.autocast=bf16"], [*names, f"bf16 autocast ({', '.join(bf16)})"]
    return overrides, [*names, "no bf16 autocast (no AMX-BF16 or AVX512-BF16: bf16 would be slower)"]


def _gpt2_shape(ctx: SuiteContext) -> tuple[list[str], int]:
    """(shape overrides, warm-up steps); the fp32 and best runs share both, so their losses meet step by step."""
    if ctx.device != "cuda":
        return GPT2_SHAPE[ctx.mode]
    return GPT2_SHAPE_CUDA_FULL if ctx.mode == "full" else (GPT2_SHAPE[ctx.mode][0], GPT2_CUDA_WARMUP)


def _gpt2_recipe(best: bool) -> Callable[[SuiteContext], list[str]]:
    def recipe(ctx: SuiteContext) -> list[str]:
        shape, warmup = _gpt2_shape(ctx)
        switches = best_switches(ctx.device) if best else ([], ["fp32, the defaults"])
        return [*shape, *switches[0], *STEP_RUN, f"(warm-up steps: {warmup}; switches: {', '.join(switches[1])})"]
    return recipe


def _measure_gpt2(best: bool) -> Callable[[SuiteContext, int], dict[str, Any]]:
    def measure(ctx: SuiteContext, n: int) -> dict[str, Any]:
        from slipstream.config.load import load_config
        from slipstream.train.lm import known_vocab

        shape, warmup = _gpt2_shape(ctx)
        overrides = [*shape, *(best_switches(ctx.device)[0] if best else []), *STEP_RUN,
                     f"--train.max_steps={warmup + n}", f"--data.dir={ctx.data_dir}"]
        run_dir = ctx.workdir / ("gpt2-best" if best else "gpt2-fp32")
        _, summary = spawn_train(overrides, run_dir, 1800.0)
        records = read_metrics(run_dir)
        timed = timed_steps(records, warmup)
        losses = {r["step"]: r["loss"] for r in records if "loss" in r}
        bound = math.log(known_vocab(load_config(None, overrides))) + 0.5
        last = losses[max(losses)]
        finite = all(math.isfinite(v) for v in losses.values())
        passed, criterion = finite and last < bound, f"losses finite, last loss < ln(vocab) + 0.5 = {bound:.2f}"
        reference = ctx.results.get("gpt2_fp32_losses")
        if best and reference and max(losses) in reference:
            tol = GPT2_LOSS_TOLERANCE["bf16" if "--precision.autocast=bf16" in overrides else "fp32"]
            ref = reference[max(losses)]
            passed = passed and abs(last - ref) <= tol * abs(ref)
            criterion += f", within {tol:g} (relative) of the fp32 run's {ref:.4f} at step {max(losses)}"
        elif best:
            criterion += " (no fp32 run in this suite to compare the loss with)"
        if not best:
            ctx.results["gpt2_fp32_losses"] = losses
        memory = summary.get("memory") or {}
        return {"samples": [r["tokens_per_s"] for r in timed],
                "secondary": {"mfu": median_of([r.get("mfu") for r in timed]),
                              "step_time_s": median_of([r.get("step_time_s") for r in timed]),
                              "step_peak_bytes": memory.get("peak_bytes"),
                              "process_peak_bytes": summary.get("mem_peak_bytes"), "loss_last": last},
                "quality": {"passed": passed, "criterion": criterion, "value": last},
                "dtype": "bf16" if "--precision.autocast=bf16" in overrides else "fp32"}
    return measure


# ----------------------------------------------------------------------------------------------- trainer overhead

# mode -> (model overrides, steps per round). One sample = one round (trainer and hand loop alternated).
OVERHEAD = {"full": ([], 20), "quick": ([], 10), "ci": (TINY, 5)}


def _overhead_overrides(ctx: SuiteContext, run_dir: Path | None, steps: int) -> list[str]:
    model, _ = OVERHEAD[ctx.mode]
    # As `bench overhead`: eval, checkpoints and the one-step memory diagnostic off for both contenders.
    return [*model, f"--train.max_steps={steps}", "--train.eval_steps=0", "--train.eval_interval=0",
            "--checkpoint.save_final=false", "--checkpoint.interval=0", "--logging.progress=false",
            "--metrics.memory_breakdown=false", *([f"--run.dir={run_dir}", f"--data.dir={ctx.data_dir}"]
                                                  if run_dir else [])]


def _measure_overhead(ctx: SuiteContext, n: int) -> dict[str, Any]:
    from slipstream.config.load import load_config
    from slipstream.perf.overhead import hand_loop

    _, steps = OVERHEAD[ctx.mode]
    warm = load_config(None, _overhead_overrides(ctx, ctx.workdir / "overhead-warmup", min(steps, 5)))
    _quiet_fit(warm)  # one untimed round each: page cache, allocator, thread pools
    hand_loop(warm, min(steps, 5))
    ratios, trainer_s, hand_s, losses = [], [], [], []
    for r in range(n):
        cfg = load_config(None, _overhead_overrides(ctx, ctx.workdir / f"overhead-{r}", steps))
        summary = _quiet_fit(cfg)
        trainer_s.append(summary["loop_time_s"] / steps)
        losses.append(summary["final_loss"])
        hand_s.append(hand_loop(cfg, steps) / steps)
        ratios.append(trainer_s[-1] / hand_s[-1])
        print(f"  round {r + 1}/{n}: trainer {trainer_s[-1] * 1e3:.1f} ms/step, hand loop "
              f"{hand_s[-1] * 1e3:.1f} ms/step", flush=True)
    # Every round starts from the same init and batches: the trainer's loss must repeat exactly.
    same = all(math.isfinite(v) for v in losses) and max(losses) - min(losses) <= 1e-4 * abs(losses[0])
    return {"samples": ratios,
            "secondary": {"trainer_step_s": median_of(trainer_s), "hand_loop_step_s": median_of(hand_s),
                          "loss": losses[0]},
            "quality": {"passed": same, "value": losses[0],
                        "criterion": "both loops ran every round; the trainer's final loss is finite and the same "
                                     "in every round (same init and batches)"}}


# ----------------------------------------------------------------------------------------------- data path

# mode -> (model overrides, warm-up steps, steps per sample, loader batches per sample)
DATA_PATH = {"full": ([], 3, 4, 100), "quick": ([], 2, 3, 50), "ci": (TINY, 2, 2, 10)}


def _measure_data_path(ctx: SuiteContext, n: int) -> dict[str, Any]:
    import torch

    from slipstream.config.load import load_config
    from slipstream.data.train_data import make_train_loader, open_train_data

    model, warmup, per_sample, batches = DATA_PATH[ctx.mode]
    run_dir = ctx.workdir / "data_path"
    cfg = load_config(None, [*model, *STEP_RUN, "--metrics.memory_breakdown=false", f"--run.dir={run_dir}",
                             f"--train.max_steps={warmup + n * per_sample}", f"--data.dir={ctx.data_dir}"])
    _quiet_fit(cfg)
    timed = timed_steps(read_metrics(run_dir), warmup)
    step_rates = [median_of([r["tokens_per_s"] for r in timed[i * per_sample:(i + 1) * per_sample]])
                  for i in range(n)]
    tokens_per_batch = cfg.train.micro_batch_size * cfg.train.seq_len
    loader = make_train_loader(cfg, open_train_data(cfg), 0, 1, torch.device(ctx.device))
    loader_rates = []
    try:
        for _ in range(2):  # warm-up: prefetch thread or workers start, first pages mapped
            next(loader)
        for _ in range(n):
            t0 = time.perf_counter()
            for _ in range(batches):
                next(loader)
            loader_rates.append(batches * tokens_per_batch / (time.perf_counter() - t0))
    finally:
        if hasattr(loader, "close"):
            loader.close()
    headroom = [lr / sr for lr, sr in zip(loader_rates, step_rates)]
    worst = min(headroom)
    return {"samples": headroom,
            "secondary": {"loader_tokens_per_s": median_of(loader_rates), "step_tokens_per_s": median_of(step_rates)},
            "quality": {"passed": worst >= 1.0, "value": worst,
                        "criterion": "the loader delivers at least the step's tokens/s in every sample "
                                     + ("(it keeps up)" if worst >= 1.0 else "(it does not: the job is data-bound)")}}


# ----------------------------------------------------------------------------------------------- checkpoint stall

CHECKPOINT_CI_MODEL = ["--model.preset=gpt2", "--model.n_layer=2", "--model.d_model=128", "--model.n_head=2",
                       "--model.vocab_size=512", "--train.seq_len=32"]


def stall_normalize_by(device: str) -> str:
    """What the async stall scales with across machines: on a CPU the copy stays in the memory the probe
    measures (copy_gb_s); on a GPU it crosses the host link, which the device's own bandwidth does not
    describe (an H200's HBM is 1.4x an H100's, their PCIe the same), so it is compared raw."""
    return "memory" if device == "cpu" else "none"


def _checkpoint_model(ctx: SuiteContext) -> list[str]:
    from slipstream.perf.checkpoint_bench import MODEL

    return CHECKPOINT_CI_MODEL if ctx.mode == "ci" else MODEL


def _measure_checkpoint(ctx: SuiteContext, n: int) -> dict[str, Any]:
    import torch

    from slipstream.checkpoint.manager import load_checkpoint, state_payload
    from slipstream.checkpoint.writer import state_bytes
    from slipstream.config.load import load_config
    from slipstream.models.transformer import build_model, lm_loss
    from slipstream.optimize.optimizers import make_adamw
    from slipstream.train.setup import param_groups

    cfg = load_config(None, _checkpoint_model(ctx))

    def model_and_optimizer(seed: int):
        model = build_model(cfg.model, ctx.device, seed=seed)  # on a GPU the stall is the copy to host memory
        optimizer = make_adamw(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1),
                          generator=torch.Generator().manual_seed(seed)).to(ctx.device)
        lm_loss(model(x[:, :-1].contiguous()), x[:, 1:].contiguous()).backward()
        optimizer.step()  # the Adam moments exist: a realistic checkpoint
        return model, optimizer

    model, optimizer = model_and_optimizer(0)
    with warnings.catch_warnings():
        # DCP's writer thread warns that one process saves alone, which is what this measures
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        sync_s, async_s, commit_s, last = _timed_saves(ctx.workdir / "checkpoint", model, optimizer, n)
    # Quality: the last checkpoint loads into a differently initialized model and optimizer equal.
    other_model, other_optimizer = model_and_optimizer(1)
    load_checkpoint(last, other_model, other_optimizer)
    saved, loaded = state_payload(model, optimizer), state_payload(other_model, other_optimizer)
    equal = _same_tensors(saved, loaded)
    return {"samples": async_s, "normalize_by": stall_normalize_by(ctx.device),
            "secondary": {"sync_save_s": median_of(sync_s), "async_commit_s": median_of(commit_s),
                          "state_bytes": state_bytes(saved)},
            "quality": {"passed": equal, "value": 1.0 if equal else 0.0,
                        "criterion": "the last checkpoint loads back into a freshly initialized model and AdamW "
                                     "with every tensor equal"}}


def _timed_saves(folder: Path, model, optimizer, n: int) -> tuple[list[float], list[float], list[float], Path]:
    """n rounds of a synchronous and an asynchronous save after one untimed save of each (DCP's planner and
    the writer thread warm up): (sync stalls, async stalls, async commit times, the last checkpoint)."""
    from slipstream.checkpoint.writer import CheckpointWriter

    sync_s, async_s, commit_s = [], [], []
    for step in range(1, n + 2):
        for mode, stalls in (("sync", sync_s), ("async", async_s)):
            writer = CheckpointWriter(folder / mode, keep_last=1, async_save=mode == "async")
            stall = writer.save(step, model, optimizer, {"step": step}, "", {})
            writer.wait()
            if step > 1:
                stalls.append(stall)
                if mode == "async":
                    commit_s.append(writer.last_write_s)
    return sync_s, async_s, commit_s, writer.last_committed


def _same_tensors(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same_tensors(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a.detach().cpu(), b.detach().cpu())
    return a == b


# ----------------------------------------------------------------------------------------------- the table

def _time_to_target_definition(ctx: SuiteContext) -> list[str]:
    return [f"slipstream train, {TIME_TO_TARGET[ctx.mode][0]}:", *time_to_target_recipe(ctx.mode)]


WORKLOADS = [
    Workload(
        name="time_to_target", title="time to a target val loss (cold start, checkpointing on)", metric="wall_s",
        unit="s", higher_is_better=False, normalize_by="compute", samples={"full": 3, "quick": 2, "ci": 1},
        methodology=(
            "Each repeat is a cold start: a fresh `slipstream train` process timed wall clock from spawn to exit, so "
            "imports, the data check, the model build, the periodic evaluations (train.eval_interval, a fixed "
            "train.eval_tokens sample of the val split) and the checkpoint saves (checkpoint.interval, asynchronous) "
            "all count, as in a real run; nothing is excluded as warm-up. The run stops at the first evaluation at or "
            "below the target (train.target_val_loss). One sample per repeat: 3 (full), 2 (quick), 1 (ci); the "
            "median with a distribution-free order-statistic confidence interval. The quality gate: every repeat "
            "reached the target and saved checkpoints. Secondary (medians): steps and tokens at the stop, the "
            "training loop's seconds, the run's own wall time, the val loss reached, the checkpoints saved."),
        recipe=_time_to_target_definition, measure=_measure_time_to_target),
    Workload(
        name="gpt2_124m_fp32", title="GPT-2 124M training step, fp32", metric="tokens_per_s", unit="tokens/s",
        higher_is_better=True, normalize_by="compute", samples={"full": 5, "quick": 3, "ci": 2},
        methodology=(
            "One `slipstream train` process of GPT-2 124M (model.preset=gpt2, vocabulary 50257; ci: the tiny preset) "
            "on the default corpus, every step logged. The first 2 steps (3 on CUDA, where the best run compiles its "
            "blocks) are warm-up and excluded; every later step is one sample, its tokens/s from metrics.jsonl: 5 "
            "steps (full), 3 (quick), 2 (ci). Secondary: MFU (the trainer's: measured CPU peak or the GPU's "
            "datasheet peak), step time, the step's peak memory (step 2's breakdown) and the process peak, the last "
            "loss."),
        recipe=_gpt2_recipe(False), measure=_measure_gpt2(False)),
    Workload(
        name="gpt2_124m_best", title="GPT-2 124M training step, the best switches for the device",
        metric="tokens_per_s", unit="tokens/s", higher_is_better=True, normalize_by="compute",
        samples={"full": 5, "quick": 3, "ci": 2},
        methodology=(
            "As gpt2_124m_fp32, with the switches that are fastest on the device (the definition names them): CUDA "
            "bf16 autocast, TF32, regional compile, fused loss and fused AdamW; CPU fused AdamW, and bf16 autocast "
            "on CPUs with native bf16 matmuls (AMX-BF16 or AVX512-BF16; elsewhere bf16 is slower than fp32); the "
            "fused loss saves memory but costs time on a CPU, so it is off there. The quality gate also compares "
            "the last loss with the fp32 run's at the same step (same init and batches)."),
        recipe=_gpt2_recipe(True), measure=_measure_gpt2(True)),
    Workload(
        name="trainer_overhead", title="Trainer step time / a hand-written loop's", metric="ratio", unit="x",
        higher_is_better=False, normalize_by="none", samples={"full": 5, "quick": 3, "ci": 1},
        methodology=(
            "`bench overhead`'s method in this process: the Trainer and perf.overhead's hand-written loop train the "
            "same model, data, AdamW and schedule, alternated round by round after one untimed warm-up round each; "
            "each round times all its steps (20 full, 10 quick, 5 ci) from a fresh model. One sample per round: "
            "trainer seconds per step / hand loop seconds per step; 5 rounds (full), 3 (quick), 1 (ci)."),
        recipe=lambda ctx: _overhead_overrides(ctx, None, OVERHEAD[ctx.mode][1]),
        measure=_measure_overhead),
    Workload(
        name="data_path", title="data path: the training loader's tokens/s / the step's", metric="headroom",
        unit="x", higher_is_better=True, normalize_by="none", samples={"full": 3, "quick": 2, "ci": 1},
        methodology=(
            "The default job's training loader (data.* as configured: in-process reader with its prefetch thread) "
            "pulled back to back without a model, after 2 warm-up batches (100 batches per sample full, 50 quick, 10 "
            "ci), against the same job's training step (one in-process run: warm-up steps excluded, then 4 / 3 / 2 "
            "steps per sample, the median of their tokens/s). One sample: loader tokens/s / step tokens/s; above 1 "
            "the loader keeps up."),
        recipe=lambda ctx: [*DATA_PATH[ctx.mode][0], *STEP_RUN], measure=_measure_data_path),
    Workload(
        name="checkpoint_stall", title="checkpoint stall of an asynchronous save", metric="stall_s", unit="s",
        higher_is_better=False, normalize_by="memory", samples={"full": 3, "quick": 2, "ci": 1},
        methodology=(
            "`bench checkpoint`'s method in this process: a model and its AdamW state after one real step (GPT-2 "
            "width, 4 blocks, vocabulary 8192; ci: 2 blocks of width 128) saved through the trainer's "
            "CheckpointWriter, synchronous and asynchronous alternated, after one untimed save of each. One sample "
            "per repeat: the asynchronous save's stall (the copy to host memory; the write and commit run in the "
            "background). Secondary: the synchronous save's seconds, the asynchronous commit's, the state bytes. "
            "Across machines it scales with the memory copy bandwidth on a CPU; on a GPU (the host link) it is raw."),
        recipe=lambda ctx: [*_checkpoint_model(ctx), "CheckpointWriter(keep_last=1), sync and async"],
        measure=_measure_checkpoint),
]
