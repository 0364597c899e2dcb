"""`slipstream bench ladder compression`: every compression switch of slipstream, measured side by side.

One row per technique, each trained from the same init (train.seed) on the same batches for the
same token budget and scored on the same val windows (train.eval_tokens), against dense fp32:

    dense fp32                      the baseline; its checkpoint feeds the export and one-shot rows
    magnitude 50 % / 90 %           [sparsity] method magnitude, reached on Zhu & Gupta's cubic schedule
                                    by 3/5 of the run, then trained on with the masks
    2:4                             [sparsity] method 2:4, all at once at 1/5 of the run
    QAT int8-dynact-int4-weight     quant.qat from the first step; also its converted (real int4) model
    QAT int8-weight                 quant.qat int8 weights
    optimizer state int8 / int4     optim.state_dtype (torchao AdamW8bit / AdamW4bit)
    export int8 / int4              weight-only quantization of the dense checkpoint
                                    (`checkpoint export --quantize int8|int4`), no training
    one-shot magnitude / Wanda 50 % the dense checkpoint pruned once (`checkpoint prune`), no fine-tuning

Columns: peak memory of a training step (metrics.memory_breakdown's tracker, step 2, as `bench
ladder memory` measures it), median step time of the steady steps (3..N), final val loss,
sparsity measured from the weights, optimizer-state bytes (from the optimizer's state),
checkpoint size (bytes of the `checkpoint export --format torch` model.pt; export and QAT rows
also the quantized model.pt and its val loss) and generate tokens/s on the ladder's device (dense
and export rows; on CUDA also the 2:4 row), each absolute and as a ratio to dense.

Low-bit optimizer states on CPU: torchao's compiled update (optim.implementation = auto) cannot
run under the memory tracker (a dispatch mode: torch.compile(fullgraph=True) finds no frame), and
its eager update (for-loop) is slow on large tensors (GPT-2 124M: ~45 s per step here). So the
`ci` and `tiny` shapes train these rows eagerly (tracked in the same run), while `gpt2` trains
them compiled and measures the peak in a separate 2-step eager run (`memory_run` in the row).

CUDA (`--device cuda`, run by `slipstream bench gpu` as its ladder-compression item at the `gpu`
size): the same rows train, evaluate, export, prune and generate on the GPU. Peak memory is then
the CUDA allocator's peak of step 2 (metrics.memory_breakdown on CUDA reads
torch.cuda.max_memory_allocated per phase, as `bench ladder memory --device cuda` does), after
the previous row's tensors were collected (`cuda_allocated_before_bytes` in each trained row
shows what was still held). The 2:4 row also times generation with `--sparse-kernel` (torchao's
semi-structured sparse matmul, sm80+, bf16 weights: the dense rows generate in fp32), and the
export rows generate their quantized model on the GPU.

Everything runs in this process, one row after the other (no repeats: the loss needs the whole
budget; step time is the median over the steady steps of the one run).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from slipstream.config.load import load_config
from slipstream.errors import UserError


@dataclass(frozen=True)
class Shape:
    model: tuple[str, ...]  # model overrides
    batch: int
    seq_len: int
    steps: int  # the token budget: steps x batch x seq_len, the same for every trained row
    eval_tokens: int
    generate_tokens: int  # new tokens per generate timing (the first one is a warm-up)
    lowbit_implementation: str  # for-loop: eager and tracked; auto: compiled + a 2-step eager memory run
    calibration_tokens: int  # one-shot Wanda: train tokens whose input norms rank the weights
    note: str


SHAPES = {
    # The smallest shapes: seconds, for the tests.
    "ci": Shape(("--model.preset=tiny",), batch=4, seq_len=64, steps=6, eval_tokens=1024, generate_tokens=8,
                lowbit_implementation="for-loop", calibration_tokens=1024,
                note="tiny preset (2 layers, width 64), seconds: for tests"),
    # The default job's model (configs/quickstart.toml: what `make train` trains): gpt-mini, batch 16 x 256.
    "tiny": Shape(("--model.preset=gpt-mini",), batch=16, seq_len=256, steps=50, eval_tokens=65_536,
                  generate_tokens=64, lowbit_implementation="for-loop", calibration_tokens=65_536,
                  note="the default job's model and batch (configs/quickstart.toml: gpt-mini, 16 x 256 tokens)"),
    # GPT-2 124M shapes (12 layers, width 768, vocabulary 50257) at a short context so 2 CPU cores finish.
    "gpt2": Shape(("--model.preset=gpt2",), batch=4, seq_len=64, steps=10, eval_tokens=4096, generate_tokens=16,
                  lowbit_implementation="auto", calibration_tokens=8192,
                  note="GPT-2 124M shapes (preset gpt2, vocabulary 50257) at seq_len 64, batch 4, so CPU finishes"),
    # For `--device cuda` inside `slipstream bench gpu`'s budget: GPT-2 124M shapes, a few steps. Its
    # linears (768 / 2304 / 3072 wide) are multiples of the (32 rows, 64 columns) the bf16 2:4 sparse
    # kernel accepts (torch/sparse/semi_structured.py, SparseSemiStructuredTensorCUTLASS's
    # _DTYPE_SHAPE_CONSTRAINTS; cuSPARSELt's are looser). Low-bit states run eagerly: no compile time
    # in the budget, and the step is tracked in the same run.
    "gpu": Shape(("--model.preset=gpt2",), batch=8, seq_len=128, steps=6, eval_tokens=4096, generate_tokens=16,
                 lowbit_implementation="for-loop", calibration_tokens=4096,
                 note="GPT-2 124M shapes (preset gpt2) at seq_len 128, batch 8, 6 steps: sized for `slipstream bench "
                      "gpu`'s budget"),
}

DEVICES = ("cpu", "cuda")


def check_device(device: str) -> None:
    """The ladder runs on "cpu" or "cuda"; "cuda" needs a CUDA device in this process."""
    import torch

    if device not in DEVICES:
        raise UserError(f"--device {device} is not a device of the compression ladder; choose cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda needs a CUDA GPU that PyTorch can use (torch.cuda.is_available() is False "
                        "here); run the ladder on a GPU machine (`slipstream bench gpu` runs it as its "
                        "ladder-compression item) or use --device cpu")


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # train | export | oneshot
    overrides: tuple[str, ...] = ()
    quantize: str = ""  # train rows with QAT: the scheme their export converts to; export rows: int8 / int4
    criterion: str = ""  # one-shot rows
    note: str = ""


def rows_for(shape: Shape, steps: int, device: str = "cpu") -> list[Row]:
    start, end = steps // 5, steps * 3 // 5
    every = max(1, (end - start) // 4)
    schedule = (f"--sparsity.start_step={start}", f"--sparsity.end_step={end}", f"--sparsity.every={every}")
    lowbit = f"--optim.implementation={shape.lowbit_implementation}"
    update = "eager update" if shape.lowbit_implementation == "for-loop" else \
        "compiled update; peak from 2 eager steps"
    return [
        Row("dense fp32", "train", (), note="the baseline: fp32 AdamW, no compression"),
        Row("magnitude 50%", "train", ("--sparsity.method=magnitude", "--sparsity.target=0.5") + schedule,
            note=f"per-layer magnitude pruning, cubic schedule steps {start}..{end} every {every}, then trained on"),
        Row("magnitude 90%", "train", ("--sparsity.method=magnitude", "--sparsity.target=0.9") + schedule,
            note="as above, to 90 %"),
        Row("2:4", "train", ("--sparsity.method=2:4", "--sparsity.target=0.5", f"--sparsity.start_step={start}",
                             "--sparsity.end_step=0"),
            note=f"two zeros in every four input weights from step {start}; trained with dense matmuls"
                 + ("; generate: the 2:4 sparse kernel (--sparse-kernel, bf16)" if device == "cuda" else
                    " (the sparse kernel needs CUDA)")),
        Row("QAT int8-dynact-int4-weight", "train", ("--quant.qat=int8-dynact-int4-weight", "--quant.qat_start_step=0"),
            quantize="int8-dynact-int4-weight",
            note="fake-quantized from step 0; quantized: the converted model (export --quantize)"),
        Row("QAT int8-weight", "train", ("--quant.qat=int8-weight", "--quant.qat_start_step=0"),
            quantize="int8-weight", note="fake-quantized int8 weights from step 0; quantized: the converted model"),
        Row("optimizer state int8", "train", ("--optim.state_dtype=int8", lowbit),
            note=f"torchao AdamW8bit ({update})"),
        Row("optimizer state int4", "train", ("--optim.state_dtype=int4", lowbit),
            note=f"torchao AdamW4bit ({update})"),
        Row("export int8", "export", quantize="int8",
            note="the dense checkpoint, weight-only int8 (checkpoint export --quantize int8); not trained"),
        Row("export int4", "export", quantize="int4",
            note="the dense checkpoint, weight-only int4 (stored one value per byte on CPU); not trained"),
        Row("one-shot magnitude 50%", "oneshot", criterion="magnitude",
            note="the dense checkpoint pruned once (checkpoint prune), no fine-tuning"),
        Row("one-shot Wanda 50%", "oneshot", criterion="wanda",
            note="the dense checkpoint pruned once by |w| x input norm (Sun et al. 2023), no fine-tuning"),
    ]


def compression_output(size: str, out_dir: str, device: str = "cpu") -> Path:
    return Path(out_dir) / f"ladder-compression-{device}-{size}.json"


def _quiet(fn: Callable[[], Any]) -> Any:
    """Run fn with its console output swallowed (the trainer's tables, export prints)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return fn()


def _train(base: list[str], row: Row, steps: int, run_dir: Path, eval_tokens: int, track_memory: bool
           ) -> dict[str, Any]:
    """Train one row; its numbers, measured from the run and the trained model."""
    from slipstream.optimize.optimizers import optimizer_state_bytes
    from slipstream.optimize.sparsity import masked_tensors, measured_sparsity
    from slipstream.train.lm import build_lm_trainer

    overrides = base + list(row.overrides) + [
        f"--run.dir={run_dir}", f"--train.max_steps={steps}", "--train.eval_interval=0",
        f"--train.eval_tokens={eval_tokens}", "--checkpoint.save_final=true", "--checkpoint.async_save=false",
        "--logging.progress=false", "--logging.tensorboard=false", "--logging.log_interval=1",
        f"--metrics.memory_breakdown={'true' if track_memory else 'false'}"]
    trainer = build_lm_trainer(load_config(None, overrides))
    summary = _quiet(trainer.fit)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Step 1 pays one-time costs and step 2 runs under the memory tracker: steps 3.. are steady.
    steady = [r for r in records if "loss" in r and r["step"] >= min(3, steps)]
    model = trainer.model
    out = {"steps": steps, "tokens": summary["tokens"], "val_loss": summary["val_loss"],
           "val_loss_stderr": summary["val_loss_stderr"], "val_tokens": summary["val_tokens"],
           "final_train_loss": summary["final_loss"],
           "step_time_s": statistics.median(r["step_time_s"] for r in steady),
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
           "peak_bytes": (summary.get("memory") or {}).get("peak_bytes"),
           "memory_categories": (summary.get("memory") or {}).get("categories"),
           "optimizer_state_bytes": optimizer_state_bytes(trainer.optimizer)}
    if masked_tensors(model):
        per_layer, overall = measured_sparsity(model)
        out.update(sparsity=overall, layer_sparsity_min=min(per_layer.values()),
                   layer_sparsity_max=max(per_layer.values()))
        if "--sparsity.method=2:4" in row.overrides:
            out["blocks_two_of_four"] = _two_of_four(model)
    return out


def _two_of_four(model) -> float:
    """Fraction of the blocks of four input weights (pruned tensors) holding exactly two zeros."""
    from slipstream.optimize.sparsity import masked_tensors

    good = total = 0
    for module, name in masked_tensors(model):
        zeros = (getattr(module, name).detach().reshape(-1, 4) == 0).sum(dim=1)
        good, total = good + int((zeros == 2).sum()), total + zeros.numel()
    return good / total


def _warm_up(base: list[str], run_dir: Path) -> None:
    """Three untimed dense steps first: the process's one-time costs (lazy imports, allocator
    growth, thread pools) would otherwise land on the dense row's timed steps only."""
    from slipstream.train.lm import build_lm_trainer

    overrides = base + [f"--run.dir={run_dir}", "--train.max_steps=3", "--train.eval_steps=0",
                        "--checkpoint.save_final=false", "--logging.progress=false", "--logging.tensorboard=false"]
    _quiet(build_lm_trainer(load_config(None, overrides)).fit)


def _memory_run(base: list[str], row: Row, run_dir: Path) -> dict[str, Any]:
    """The tracked peak of a low-bit row whose training ran compiled: 2 eager steps."""
    from slipstream.train.lm import build_lm_trainer

    overrides = base + [o for o in row.overrides if not o.startswith("--optim.implementation")] + [
        "--optim.implementation=for-loop", f"--run.dir={run_dir}", "--train.max_steps=2", "--train.eval_steps=0",
        "--checkpoint.save_final=false", "--logging.progress=false", "--logging.tensorboard=false",
        "--metrics.memory_breakdown=true"]
    summary = _quiet(build_lm_trainer(load_config(None, overrides)).fit)
    memory = summary.get("memory") or {}
    return {"peak_bytes": memory.get("peak_bytes"), "memory_categories": memory.get("categories"),
            "memory_run": "2 eager (optim.implementation=for-loop) steps, step 2 tracked: the compiled update "
                          "cannot run under the tracker"}


def _export_bytes(run_dir: Path, out: Path, quantize: str | None = None) -> int:
    from slipstream.checkpoint.export import export_checkpoint

    _quiet(lambda: export_checkpoint(run_dir, "torch", out, quantize=quantize))
    size = (out / "model.pt").stat().st_size
    shutil.rmtree(out)
    return size


def _val_loss(model, cfg, data_dir: str, eval_tokens: int) -> float:
    """The loss on the trainer's own windows: the same split, batch, seq_len and eval_tokens."""
    from slipstream.train.evaluate import evaluate_lm

    return evaluate_lm(model, cfg, data_dir, max_tokens=eval_tokens)["loss"]


def _generate_tokens_per_s(ckpt: Path, tokens: int, quantize: str | None, device: str,
                           sparse_kernel: bool = False) -> float:
    from slipstream.train.lm import generate_text

    stats: dict[str, Any] = {}
    generate_text(str(ckpt), "def ", max_new_tokens=tokens, device=device, quantize=quantize, on_stats=stats.update,
                  sparse_kernel=sparse_kernel)
    return stats["tokens_per_s"]


GENERATE_ROUNDS = 2


def generation_variants(results: list[dict[str, Any]], dense_run: Path, sparse_run: Path | None
                        ) -> list[tuple[dict[str, Any], Path, str | None, bool]]:
    """(row, checkpoint, quantize, sparse_kernel) of every generate timing: the dense checkpoint as
    it is and quantized as each export row quantizes it, and (sparse_run given: CUDA) the 2:4
    row's checkpoint through the sparse kernel."""
    variants = [(results[0], dense_run, None, False)]
    variants += [(r, dense_run, r["quantize"], False) for r in results if r["kind"] == "export"]
    if sparse_run is not None:
        variants += [(r, sparse_run, None, True) for r in results if r["rung"] == "2:4"]
    return variants


def _time_generation(variants: list[tuple[dict[str, Any], Path, str | None, bool]], tokens: int, device: str
                     ) -> None:
    """Generate tokens/s of each variant: interleaved rounds (dense, int8, int4, [2:4], dense, ...),
    the best round kept, so a busy moment of the machine does not land on one variant only."""
    for r, _, _, sparse_kernel in variants:
        r["generate_tokens_per_s_rounds"] = []
        if sparse_kernel:
            r["generate_sparse_kernel"] = True  # bf16 weights, torchao semi-structured sparse matmul
    for _ in range(GENERATE_ROUNDS):
        for r, ckpt, quantize, sparse_kernel in variants:
            r["generate_tokens_per_s_rounds"].append(_generate_tokens_per_s(ckpt, tokens, quantize, device,
                                                                            sparse_kernel))
    for r, _, _, _ in variants:
        r["generate_tokens_per_s"] = max(r["generate_tokens_per_s_rounds"])


def _quantized_val_loss(ckpt: Path, quantize: str, data_dir: str, eval_tokens: int, device: str) -> float:
    """Val loss of the dense or QAT checkpoint converted as `checkpoint export --quantize` converts it."""
    from slipstream.optimize.qat import SCHEMES, convert_qat
    from slipstream.optimize.weight_quant import quantize_weights
    from slipstream.train.lm import load_lm_from_checkpoint

    model, _, cfg = load_lm_from_checkpoint(ckpt, device=device)
    if quantize in SCHEMES:
        convert_qat(model, quantize, cfg.quant.qat_group_size)
    else:
        quantize_weights(model, quantize)
    return _val_loss(model, cfg, data_dir, eval_tokens)


def _oneshot(dense_run: Path, out: Path, criterion: str, data_dir: str, eval_tokens: int,
             calibration_tokens: int, device: str) -> dict[str, Any]:
    from slipstream.train.lm import load_lm_from_checkpoint
    from slipstream.train.prune_checkpoint import prune_checkpoint

    # evaluate=False: prune_checkpoint scores every window of the val split; we score the rows' windows
    result = _quiet(lambda: prune_checkpoint(dense_run, out, "magnitude", target=0.5, criterion=criterion,
                                             calibration_tokens=calibration_tokens, data_dir=data_dir,
                                             device=device, evaluate=False))
    model, _, cfg = load_lm_from_checkpoint(out, device=device)
    return {"val_loss": _val_loss(model, cfg, data_dir, eval_tokens), "sparsity": result["measured_sparsity"],
            "layer_sparsity_min": result["layer_sparsity_min"], "layer_sparsity_max": result["layer_sparsity_max"],
            "calibration_tokens": result["calibration_tokens"],
            "checkpoint_bytes": _export_bytes(out, out.parent / f"{out.name}-export")}


RATIO_KEYS = ("peak_bytes", "step_time_s", "val_loss", "optimizer_state_bytes", "checkpoint_bytes",
              "generate_tokens_per_s")


def _ratios(row: dict[str, Any], dense: dict[str, Any]) -> dict[str, float | None]:
    out = {}
    for key in RATIO_KEYS:
        value, base = row.get(key), dense.get(key)
        out[key] = value / base if isinstance(value, (int, float)) and isinstance(base, (int, float)) and base else None
    # Export and QAT rows: their quantized model.pt and its loss against the dense model's
    if row.get("quantized_bytes") and dense.get("checkpoint_bytes"):
        out["quantized_bytes"] = row["quantized_bytes"] / dense["checkpoint_bytes"]
    if row.get("quantized_val_loss") and dense.get("val_loss"):
        out["quantized_val_loss"] = row["quantized_val_loss"] / dense["val_loss"]
    return out


def _cuda_allocated_after_collect(device: str) -> int | None:
    """On CUDA: collect the previous row's garbage and return the bytes the allocator still holds
    (what the next row's allocator peak carries on top of its own); None on CPU."""
    if device != "cuda":
        return None
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated())


def run_compression_ladder(size: str = "tiny", steps: int | None = None, out_dir: str = "benchmarks",
                           data_dir: str = "", device: str = "cpu") -> dict[str, Any]:
    from slipstream.data.ensure import ensure_data
    from slipstream.observe.env import collect_env, write_json_atomic

    if size not in SHAPES:
        raise UserError(f"unknown --size '{size}' for the compression ladder; choose one of {', '.join(SHAPES)}")
    check_device(device)
    shape = SHAPES[size]
    steps = shape.steps if steps is None else steps
    if steps < 5:
        raise UserError(f"--steps {steps}: the compression ladder needs >= 5 (pruning starts at 1/5 of the run, "
                        "step 2 is the memory step, steps 3.. are timed)")
    base = [f"--train.device={device}", *shape.model, f"--train.micro_batch_size={shape.batch}",
            f"--train.seq_len={shape.seq_len}", "--train.grad_accum_steps=1",
            f"--optim.warmup_steps={max(1, steps // 10)}"] + ([f"--data.dir={data_dir}"] if data_dir else [])
    prepared, _ = ensure_data(load_config(None, base))  # prepare once, outside every timed region
    data_dir = str(prepared)
    base.append(f"--data.dir={data_dir}")
    rows = rows_for(shape, steps, device)
    pressure_before = _cpu_pressure()
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="slipstream-compression-") as tmp:
        dense_run = Path(tmp) / "0-dense"
        sparse_run: Path | None = None  # CUDA: the 2:4 checkpoint, kept for the sparse-kernel generate
        _warm_up(base, Path(tmp) / "warm-up")
        for i, row in enumerate(rows):
            t0 = time.perf_counter()
            run_dir = dense_run if i == 0 else Path(tmp) / f"{i}-run"
            r: dict[str, Any] = {"rung": row.name, "kind": row.kind, "note": row.note,
                                 "overrides": list(row.overrides), "quantize": row.quantize or None}
            if row.kind == "train":
                r["cuda_allocated_before_bytes"] = _cuda_allocated_after_collect(device)
                lowbit_compiled = "--optim.state_dtype" in " ".join(row.overrides) and \
                    shape.lowbit_implementation != "for-loop"
                r.update(_train(base, row, steps, run_dir, shape.eval_tokens, track_memory=not lowbit_compiled))
                if lowbit_compiled:
                    r.update(_memory_run(base, row, Path(tmp) / f"{i}-memory"))
                r["checkpoint_bytes"] = _export_bytes(run_dir, Path(tmp) / f"{i}-export")
                if row.quantize:  # QAT: the real quantized model its fake quantization trained
                    r["quantized_bytes"] = _export_bytes(run_dir, Path(tmp) / f"{i}-qexport", row.quantize)
                    r["quantized_val_loss"] = _quantized_val_loss(run_dir, row.quantize, data_dir, shape.eval_tokens,
                                                                  device)
            elif row.kind == "export":
                r["checkpoint_bytes"] = r["quantized_bytes"] = _export_bytes(dense_run, Path(tmp) / f"{i}-export",
                                                                             row.quantize)
                r["val_loss"] = r["quantized_val_loss"] = _quantized_val_loss(dense_run, row.quantize, data_dir,
                                                                              shape.eval_tokens, device)
            else:
                r.update(_oneshot(dense_run, Path(tmp) / f"{i}-oneshot", row.criterion, data_dir, shape.eval_tokens,
                                  shape.calibration_tokens, device))
            if device == "cuda" and row.name == "2:4":
                sparse_run = run_dir
            elif i > 0 and row.kind == "train":
                shutil.rmtree(run_dir, ignore_errors=True)  # GPT-2 checkpoints are large: keep only the dense one
            r["seconds"] = time.perf_counter() - t0
            r["cpu_pressure"] = _cpu_pressure()  # other work on the machine while this row ran (its avg60)
            results.append(r)
            print(f"[compression {size}] {row.name}: {_one_line(r)} ({r['seconds']:.0f} s)")
        _time_generation(generation_variants(results, dense_run, sparse_run), shape.generate_tokens, device)
    for r in results:
        r["vs_dense"] = _ratios(r, results[0])
    result = {"bench": "ladder-compression", "device": device, "size": size, "shape_note": shape.note,
              "base": base, "batch": shape.batch, "seq_len": shape.seq_len, "steps": steps,
              "tokens_per_row": steps * shape.batch * shape.seq_len, "eval_tokens": shape.eval_tokens,
              "generate_tokens": shape.generate_tokens, "lowbit_implementation": shape.lowbit_implementation,
              "repeats": 1, "rungs": results, "total_seconds": time.perf_counter() - started,
              "cpu_pressure": {"before": pressure_before, "after": _cpu_pressure()},
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "env": collect_env()}
    path = compression_output(size, out_dir, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result)
    print(markdown_table(result))
    print(f"wrote {path}")
    return result


def _cpu_pressure() -> dict[str, float] | None:
    """Linux's CPU pressure (/proc/pressure/cpu, "some": % of time a task waited for a CPU, averaged
    over 10 s / 60 s / 300 s): how busy the machine was with other work, which the step times carry."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = dict(f.split("=") for f in line.split()[1:])
    return {k: float(v) for k, v in fields.items() if k.startswith("avg")}


def _one_line(r: dict[str, Any]) -> str:
    parts = []
    if r.get("peak_bytes"):
        parts.append(f"peak {r['peak_bytes'] / 2**20:.1f} MiB")
    if r.get("step_time_s"):
        parts.append(f"{r['step_time_s'] * 1e3:.0f} ms/step")
    if r.get("val_loss") is not None:
        parts.append(f"val {r['val_loss']:.4f}")
    if r.get("sparsity") is not None:
        parts.append(f"sparsity {r['sparsity']:.3f}")
    if r.get("checkpoint_bytes"):
        parts.append(f"model.pt {r['checkpoint_bytes'] / 1e6:.2f} MB")
    return ", ".join(parts)


# --- the README table (a test checks the README's equals this, from the committed JSON) ------

def _mib(v: Any) -> str:
    return f"{v / 2**20:.1f}" if isinstance(v, (int, float)) else "-"


def _mb(v: Any) -> str:
    return f"{v / 1e6:.2f}" if isinstance(v, (int, float)) else "-"


def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def _ratio(v: Any) -> str:
    return f" ({v:.2f}x)" if isinstance(v, (int, float)) else ""


def markdown_table(result: dict[str, Any]) -> str:
    """The result as one markdown table: absolute numbers, ratios to dense in parentheses."""
    header = ("| technique | peak train memory MiB | ms/step | val loss | sparsity | optimizer state MiB "
              "| model.pt MB | quantized model.pt MB (val loss) | generate tok/s |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in result["rungs"]:
        v = r.get("vs_dense") or {}
        quantized = "-"
        if r.get("quantized_bytes") is not None:
            quantized = (f"{_mb(r['quantized_bytes'])}{_ratio(v.get('quantized_bytes'))} "
                         f"({_num(r.get('quantized_val_loss'), '.4f')})")
        cells = [r["rung"], _mib(r.get("peak_bytes")) + _ratio(v.get("peak_bytes")),
                 _num(r["step_time_s"] * 1e3 if r.get("step_time_s") else None, ".0f") + _ratio(v.get("step_time_s")),
                 _num(r.get("val_loss"), ".4f"), _num(r.get("sparsity"), ".3f"),
                 _mib(r.get("optimizer_state_bytes")) + _ratio(v.get("optimizer_state_bytes")),
                 _mb(r.get("checkpoint_bytes")) + _ratio(v.get("checkpoint_bytes")), quantized,
                 _num(r.get("generate_tokens_per_s"), ".0f") + _ratio(v.get("generate_tokens_per_s"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
