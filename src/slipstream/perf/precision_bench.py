"""The precision switches on one model: equivalence (loss per step vs fp32) and speed (tokens/s).

    python -m slipstream.perf.precision_bench --device cuda [--preset gpt2 --steps 8 --out FILE]

Variants, each a fresh trainer with the same seed, data order and initial weights:

    fp32        the reference
    tf32        --precision.tf32=true (CUDA tensor cores for fp32 matmuls)
    bf16        --precision.autocast=bf16
    bf16+fp8    bf16 plus --precision.fp8=true (torchao float8 linears; CUDA capability >= 8.9)

Equivalence: the largest relative difference of the per-step training loss from fp32's over
the run must stay within TOLERANCE (step 1 is before any update, so it isolates the forward
numerics; later steps include the drift of a few updates). A variant that cannot run here
(tf32 on CPU, fp8 without torchao or on an older GPU) is reported as skipped with the reason.
Speed: the median tokens/s of steps 3.. (steps 1-2 pay allocation and warm-up). fp8 runs in
eager mode here; its speed-up over bf16 needs torch.compile to fuse the casts, so this file
measures its numerics first and its eager cost second.

Exit code 1 when a variant is outside its tolerance or failed; the JSON holds every variant.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from slipstream.errors import UserError

VARIANTS: dict[str, tuple[str, ...]] = {
    "fp32": (),
    "tf32": ("--precision.tf32=true",),
    "bf16": ("--precision.autocast=bf16",),
    "bf16+fp8": ("--precision.autocast=bf16", "--precision.fp8=true"),
}
# Largest |loss - loss_fp32| / loss_fp32 over the steps.
TOLERANCE = {"tf32": 0.01, "bf16": 0.03, "bf16+fp8": 0.05}


def _skip_reason(variant: str, device: str) -> str | None:
    import torch

    from slipstream.optimize.precision import fp8_support

    target = torch.device(device)
    if variant == "tf32" and target.type != "cuda":
        return f"TF32 is a CUDA tensor-core mode (this run is on {target.type})"
    if variant == "bf16+fp8":
        return fp8_support(target)
    return None


def _run_variant(base: list[str], variant: str, run_dir: str) -> dict[str, Any]:
    from slipstream.config.load import load_config
    from slipstream.train.lm import build_lm_trainer

    cfg = load_config(None, base + list(VARIANTS[variant]) + [f"--run.dir={run_dir}"])
    trainer = build_lm_trainer(cfg)
    with contextlib.redirect_stdout(io.StringIO()):
        summary = trainer.fit()
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    steps = [r for r in records if "loss" in r]
    steady = [r for r in steps if r["step"] >= min(3, len(steps))]
    seconds = sum(r["step_time_s"] for r in steady)  # tokens over time: one slow step cannot skew a median of two
    return {"losses": [r["loss"] for r in steps],
            "tokens_per_s": sum(r["tokens_per_s"] * r["step_time_s"] for r in steady) / seconds,
            "step_time_s": statistics.median(r["step_time_s"] for r in steady),
            "mfu": summary.get("mfu"), "mem_peak_bytes": summary.get("mem_peak_bytes")}


def run_precision_bench(device: str = "cuda", preset: str = "gpt2", seq_len: int = 1024, micro_batch: int = 8,
                        steps: int = 8, variants: tuple[str, ...] = tuple(VARIANTS), out: str = "") -> dict[str, Any]:
    from slipstream.config.load import load_config
    from slipstream.observe.env import collect_env, write_json_atomic
    from slipstream.data.ensure import ensure_data

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise UserError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if steps < 3:
        raise UserError(f"--steps must be >= 3 (steps 1-2 are warm-up), got {steps}")
    if "fp32" not in variants:
        variants = ("fp32", *variants)  # the reference of every comparison
    base = [f"--model.preset={preset}", f"--train.seq_len={seq_len}", f"--train.micro_batch_size={micro_batch}",
            f"--train.device={device}", f"--train.max_steps={steps}", "--train.grad_accum_steps=1",
            "--train.eval_tokens=0", "--checkpoint.save_final=false", "--checkpoint.interval=0",
            "--logging.progress=false", "--logging.tensorboard=false", "--logging.log_interval=1",
            "--metrics.memory_breakdown=false", "--optim.warmup_steps=1", "--train.seed=1337"]
    ensure_data(load_config(None, base))  # prepare once, outside every timed region
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="slipstream-precision-") as tmp:
        for i, variant in enumerate(variants):
            reason = _skip_reason(variant, device)
            if reason:
                rows[variant] = {"status": "skipped", "reason": reason}
                print(f"{variant:<9} skipped: {reason}")
                continue
            try:
                rows[variant] = {"status": "ok", **_run_variant(base, variant, str(Path(tmp) / str(i)))}
            except Exception as e:  # one variant failing (out of memory, a missing kernel) still reports the rest
                rows[variant] = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:1000]}
                print(f"{variant:<9} failed: {rows[variant]['error']}")
    ref = rows.get("fp32", {})
    failed = [v for v, r in rows.items() if r["status"] == "failed"]
    for variant, r in rows.items():
        if r["status"] != "ok" or variant == "fp32" or ref.get("status") != "ok":
            continue
        diffs = [abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]) if b]
        r["step1_rel_diff"] = diffs[0] if diffs else None
        r["max_rel_diff"] = max(diffs) if diffs else None
        r["tolerance"] = TOLERANCE[variant]
        r["equivalent"] = r["max_rel_diff"] is not None and r["max_rel_diff"] <= TOLERANCE[variant]
        r["speedup_vs_fp32"] = r["tokens_per_s"] / ref["tokens_per_s"]
        if not r["equivalent"]:
            failed.append(variant)
    for variant, r in rows.items():
        if r["status"] == "ok":
            eq = "" if variant == "fp32" else (f", loss vs fp32: step 1 {r['step1_rel_diff']:.2e}, max {r['max_rel_diff']:.2e} "
                                               f"(tolerance {r['tolerance']:g}: {'ok' if r['equivalent'] else 'OUT'}), "
                                               f"{r['speedup_vs_fp32']:.2f}x fp32")
            print(f"{variant:<9} {r['tokens_per_s']:,.0f} tok/s, {r['step_time_s'] * 1e3:.1f} ms/step{eq}")
    result = {"bench": "precision", "device": device, "preset": preset, "seq_len": seq_len, "micro_batch": micro_batch,
              "steps": steps, "base": base, "variants": rows, "failed": failed, "env": collect_env()}
    if out:
        write_json_atomic(out, result)
        print(f"wrote {out}")
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slipstream.perf.precision_bench",
                                description="precision switches: loss vs fp32 and tokens/s")
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="gpt2", help="model preset (default gpt2: GPT-2 124M)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="training steps per variant (>= 3)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", default="", help="JSON result file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run_precision_bench(args.device, args.preset, args.seq_len, args.micro_batch, args.steps,
                                     tuple(args.variants), args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
