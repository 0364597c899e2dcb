"""`slipstream bench ...`: benchmarks whose JSON results go to benchmarks/ (or --out).

    slipstream bench overhead [--config FILE] [--section.key=value ...] [--rounds N] [--out FILE]
    slipstream bench sharding [--nproc N --strategies ddp zero1 zero2 fsdp --steps N --size default|ci]
    slipstream bench sharding --layouts tp1 tp2 tp4 cp2 cp4 cp2tp2
    slipstream bench pipeline [--schedules gpipe 1f1b ... --nproc 2 4 --steps N --size default|ci --out FILE]
    slipstream bench moe [--steps N --balance-steps N --size default|ci --out FILE]
    slipstream bench checkpoint [--repeats N] [--model.* overrides]
    slipstream bench fused-ce [--rows N --d D --vocab V --dtype ... --chunk-size ...]
    slipstream bench ladder [memory|speed|both] [--device D --size S --repeats N --steps N --batch B]
    slipstream bench ladder compression [--device cpu|cuda --size ci|tiny|gpt2|gpu --steps N --out-dir D --force
                                        --data-dir D]
    slipstream bench planner [--device cpu|cuda] [--cases grid|stratified] [--published-only] [--out FILE]
    slipstream bench recompute [--device cpu|cuda --rounds N --steps N --repredict FILE --out FILE]
    slipstream bench gpu [--dry-run] [--only ITEM ...] [--out-dir DIR]
    slipstream bench packing [--size default|ci --rounds N --steps N --device D --out FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from slipstream.cli._common import add_force, load, no_extra, with_config
from slipstream.errors import UserError
from slipstream.outputs import refuse_existing


def cmd_bench_overhead(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.perf.overhead import run_overhead_bench

    if args.rounds < 1 or args.steps < 1:
        raise UserError(f"--rounds and --steps must be >= 1 (got {args.rounds} and {args.steps})")
    refuse_existing(args.out, args.force)  # an explicit --out; the default benchmarks/ file is refreshed
    run_overhead_bench(load(args, extra), rounds=args.rounds, steps_per_round=args.steps, out=args.out)
    return 0


def cmd_bench_ladder(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.perf.ladder import ladder_outputs, run_ladder

    no_extra(extra)
    if args.ladder == "compression":
        return _bench_compression_ladder(args)
    if args.size in ("gpt2", "gpu"):
        raise UserError(f"--size {args.size} is a size of the compression ladder; the memory and speed ladders take "
                        "ci, tiny, small or book")
    ladders = ["memory", "speed"] if args.ladder == "both" else [args.ladder]
    if args.out_dir:  # an explicit --out-dir; the default benchmarks/ files are refreshed
        for which in ladders:
            for path in ladder_outputs(which, args.device, args.size, args.out_dir):
                refuse_existing(path, args.force, "--out-dir", what="ladder result")
    for which in ladders:
        run_ladder(which, device=args.device, size=args.size, repeats=args.repeats,
                   steps=6 if args.steps is None else args.steps,
                   batch=args.batch, out_dir=args.out_dir or "benchmarks", data_dir=args.data_dir,
                   augment_ms=args.augment_ms)
    return 0


def _bench_compression_ladder(args: argparse.Namespace) -> int:
    from slipstream.perf.compression_ladder import SHAPES, check_device, compression_output, run_compression_ladder

    check_device(args.device)  # before anything is prepared: --device cuda needs a GPU
    if args.size not in SHAPES:
        raise UserError(f"--size {args.size} is not a size of the compression ladder; choose one of "
                        f"{', '.join(SHAPES)}")
    if args.out_dir:  # an explicit --out-dir; the default benchmarks/ file is refreshed
        refuse_existing(compression_output(args.size, args.out_dir, args.device), args.force, "--out-dir",
                        what="ladder result")
    run_compression_ladder(size=args.size, steps=args.steps, out_dir=args.out_dir or "benchmarks",
                           data_dir=args.data_dir, device=args.device)
    return 0


def cmd_bench_sharding(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.perf.sharding import run_sharding_bench

    no_extra(extra)
    refuse_existing(args.out, args.force)
    if args.layouts:  # the tensor- / context-parallel rungs
        from slipstream.perf.model_parallel_bench import run_model_parallel_bench

        run_model_parallel_bench(layouts=tuple(args.layouts), data_dir=args.data_dir, steps=args.steps, out=args.out)
        return 0
    run_sharding_bench(nproc=args.nproc, strategies=tuple(args.strategies), data_dir=args.data_dir,
                       steps=args.steps, out=args.out, size=args.size)
    return 0


def cmd_bench_pipeline(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.perf.pipeline_bench import run_pipeline_bench

    no_extra(extra)
    refuse_existing(args.out, args.force)  # an explicit --out; the default benchmarks/ file is refreshed
    run_pipeline_bench(schedules=tuple(args.schedules or ()), nproc=tuple(args.nproc or ()), steps=args.steps,
                       size=args.size, out=args.out, data_dir=args.data_dir)
    return 0


def cmd_bench_moe(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.perf.moe_bench import run_moe_bench

    no_extra(extra)
    refuse_existing(args.out, args.force)  # an explicit --out; the default benchmarks/ file is refreshed
    run_moe_bench(steps=args.steps, balance_steps=args.balance_steps, size=args.size, out=args.out,
                  data_dir=args.data_dir)
    return 0


def cmd_bench_data(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.perf.data_bench import run_data_bench

    no_extra(extra)
    refuse_existing(args.out, args.force)
    run_data_bench(out=args.out, size=args.size, data_dir=args.data_dir)
    return 0


def cmd_bench_checkpoint(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.config.load import split_overrides
    from slipstream.perf.checkpoint_bench import run_checkpoint_bench

    refuse_existing(args.out, args.force)
    run_checkpoint_bench(repeats=args.repeats, overrides=split_overrides(extra), out=args.out)
    return 0


def cmd_bench_fused_ce(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.perf.fused_ce_bench import run_fused_ce_bench

    no_extra(extra)
    if min(args.rows, args.d, args.vocab, args.repeats, *args.chunk_size) < 1:
        raise UserError("--rows, --d, --vocab, --repeats and --chunk-size must be >= 1")
    refuse_existing(args.out, args.force)
    run_fused_ce_bench(args.rows, args.d, args.vocab, tuple(args.dtype), args.device, args.repeats,
                       tuple(args.chunk_size), args.backend, args.out)
    return 0


def cmd_bench_planner(args: argparse.Namespace, extra: list[str]) -> int:
    import dataclasses
    import json

    from slipstream.observe.env import collect_env, write_json_atomic
    from slipstream.plan.accuracy import TARGET_ERROR, run_accuracy
    from slipstream.plan.accuracy_cases import stratified_cases
    from slipstream.plan.efficiency import FITTED, PRIORS
    from slipstream.plan.report import (SPEED_METRICS, fit_constants, fit_efficiency, fit_record, held_out_summary,
                                        published_report)
    from slipstream.plan.timing import DEFAULT_EFFICIENCY

    no_extra(extra)
    refuse_existing(args.out, args.force)  # an explicit --out; the default benchmarks/ file is refreshed
    if args.device != "cpu":
        if args.cases != "grid" or args.published_only:
            raise UserError(f"--cases {args.cases} and --published-only are for --device cpu")
        return _bench_planner_on_device(args.device, args.out)
    if args.cases == "stratified" and not args.out:
        raise UserError("--cases stratified needs --out: benchmarks/planner-accuracy-cpu.json holds the whole grid")
    out = args.out or "benchmarks/planner-accuracy-cpu.json"
    if args.published_only:
        # the memory rows are measured (a minute of training steps): kept from the committed file
        source = args.out or "benchmarks/planner-accuracy-cpu.json"
        try:
            with open(source, encoding="utf-8") as f:
                previous = json.load(f)
            rows, memory_env = previous["memory_cases"], previous.get("memory_env") or previous["env"]
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"--published-only keeps the memory rows of {source}, which cannot be read ({e}); "
                            "run without --published-only to measure them") from None
    else:
        rows, memory_env = run_accuracy(stratified_cases() if args.cases == "stratified" else None), None
        for r in rows:
            print(f"  {r['case']:<72} measured {r['measured_bytes'] / 2**20:8.2f} MiB  planned "
                  f"{r['planned_bytes'] / 2**20:8.2f} MiB  {r['error']:+6.1%}")
    worst = max(abs(r["error"]) for r in rows)
    print(f"memory: {len(rows)} cases, worst error {worst:.1%} (target {TARGET_ERROR:.0%})")
    fitted, in_sample = fit_constants()
    published = published_report(DEFAULT_EFFICIENCY)
    summary = held_out_summary(published)
    print(f"  {'run':<46} {'metric':<20} {'reported':>10} {'planned':>10} {'error':>7} {'held out':>10} {'error':>7}")
    for r in published:
        if r["metric"] in SPEED_METRICS:
            print(f"  {r['run']:<46} {r['metric']:<20} {r['reported']:>10.4g} {r['planned']:>10.4g} {r['error']:+7.1%} "
                  f"{r['held_out_planned']:>10.4g} {r['held_out_error']:+7.1%}")
        else:
            print(f"  {r['run']:<46} {r['metric']:<20} {r['reported']:>10.4g} {r['planned']:>10.4g} {r['error']:+7.1%}")
    print(f"published: {summary['runs']} runs, {summary['figures']} speed figures; median run error in-sample "
          f"{summary['in_sample_median_run_error']:.1%}, held out (leave-one-run-out) "
          f"{summary['held_out_median_run_error']:.1%}")
    print(f"fit: {fit_record(fitted)} (in use: {fit_record(FITTED)})")
    result = {"benchmark": "planner-accuracy", "target_error": TARGET_ERROR, "memory_cases": rows,
              "memory_worst_error": worst, "published": published, "published_summary": summary,
              "fit": {"fitted": fit_record(fitted), "in_use": fit_record(FITTED), "in_sample_median_run_error":
                      round(in_sample, 4), "priors": {gen: dataclasses.asdict(r) for gen, r in PRIORS.items()}},
              "efficiency": DEFAULT_EFFICIENCY, "efficiency_fitted": fit_efficiency(), "env": collect_env()}
    result["memory_env"] = memory_env or result["env"]   # where the memory rows were measured
    write_json_atomic(out, result)
    print(f"wrote {out}")
    return 0 if worst <= TARGET_ERROR else 1


def cmd_bench_recompute(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.perf.recompute_bench import run_recompute_bench

    no_extra(extra)
    refuse_existing(args.out, args.force)  # an explicit --out; the default benchmarks/ file is refreshed
    run_recompute_bench(device=args.device, rounds=args.rounds, steps=args.steps, out=args.out,
                        repredict=args.repredict)
    return 0


def _bench_planner_on_device(device: str, out: str) -> int:
    """GPT-2 steps on the GPU: allocator peak and step time vs the plan for this GPU."""
    import torch

    from slipstream.observe.env import collect_env, write_json_atomic
    from slipstream.plan.accuracy import run_device_accuracy
    from slipstream.plan.memory import GIB
    from slipstream.plan.timing import DEFAULT_EFFICIENCY
    from slipstream.tune.system import gpu_short_name

    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise UserError(f"bench planner --device {device}: needs a CUDA GPU here (or --device cpu)")
    short = gpu_short_name(torch.cuda.get_device_name(torch.device(device)))
    if short is None:
        raise UserError(f"{torch.cuda.get_device_name()} is not in the planner's GPU table")
    rows = run_device_accuracy(device, f"1x{short}")
    for r in rows:
        if "error" in r:
            print(f"  {r['case']:<64} memory {r['measured_bytes'] / GIB:6.2f} GiB planned {r['planned_bytes'] / GIB:6.2f} "
                  f"({r['error']:+6.1%})  step {r['measured_step_s'] * 1e3:7.1f} ms planned "
                  f"{r['planned_step_s'] * 1e3:7.1f} ({r['step_error']:+6.1%})")
        else:
            print(f"  {r['case']:<64} {r['measured']} (planned {r['planned_total_bytes'] / GIB:.1f} GiB)")
    out = out or f"benchmarks/planner-accuracy-{short.lower()}.json"
    write_json_atomic(out, {"benchmark": "planner-accuracy-gpu", "gpu": short, "cases": rows,
                            "efficiency": DEFAULT_EFFICIENCY, "env": collect_env()})
    print(f"wrote {out}")
    return 0


def cmd_bench_gpu(args: argparse.Namespace, extra: list[str]) -> int:
    """The GPU suite (perf/gpu_suite.py); 1 when any item failed (or, with --dry-run, any wiring check)."""
    from slipstream.perf.gpu_suite import run_gpu_suite

    no_extra(extra)
    summary = run_gpu_suite(Path(args.out_dir), dry_run=args.dry_run, only=args.only,
                            timeout_scale=args.timeout_scale, echo_output=not args.quiet)
    if args.dry_run:
        return 0 if summary["ok"] else 1
    return 1 if summary["failed"] else 0


def cmd_bench_packing(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.perf.packing_bench import run_packing_bench

    no_extra(extra)
    refuse_existing(args.out, args.force)  # an explicit --out; the default benchmarks/ file is refreshed
    run_packing_bench(size=args.size, rounds=args.rounds, steps=args.steps, device=args.device, out=args.out,
                      threads=args.threads)
    return 0


def _add_data_dir_and_out(p: argparse.ArgumentParser, default_out: str) -> None:
    """--data-dir, --out and --force of a bench that trains on the prepared corpus."""
    p.add_argument("--data-dir", default="", help="prepared data folder (default: the stdlib corpus, prepared once)")
    p.add_argument("--out", default="", help=f"JSON file (default {default_out})")
    add_force(p)


def add_commands(sub) -> None:
    """Register `bench overhead|ladder|sharding|pipeline|moe|checkpoint|fused-ce|planner|recompute|gpu` on the
    top-level parser."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_cmd", required=True)
    p = with_config(bench.add_parser("overhead", help="Trainer vs a hand-written loop, alternated"))
    p.add_argument("--rounds", type=int, default=5, help="alternations of (trainer, hand loop)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per round and contender")
    p.add_argument("--out", default="", help="JSON result file (default benchmarks/overhead-<machine>.json)")
    add_force(p)
    p.set_defaults(func=cmd_bench_overhead)
    p = bench.add_parser("ladder", help="the books' memory and speed optimization ladders, measured rung by rung; "
                                        "compression: every compression switch against dense fp32")
    p.add_argument("ladder", nargs="?", default="both", choices=["memory", "speed", "both", "compression"],
                   help="both = memory and speed; compression = sparsity, QAT, low-bit optimizer states, "
                        "quantized export and one-shot pruning, each against dense fp32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--size", default="tiny", choices=["ci", "tiny", "small", "book", "gpt2", "gpu"],
                   help="model scale: book = the books' settings (GPU), small/tiny for CPU, ci = the smallest "
                        "shapes at which every rung still shows its effect (a seconds-long smoke run for tests); "
                        "compression: ci, tiny (the default job's model), gpt2 (GPT-2 124M shapes) or gpu "
                        "(GPT-2 124M shapes, a few steps: `bench gpu`'s ladder-compression item)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per rung")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per rung and repeat (step 1 is warm-up; default 6); compression: the "
                        "token budget of every row (default per size: ci 6, tiny 50, gpt2 10, gpu 6)")
    p.add_argument("--batch", type=int, default=32, help="global batch in sequences (the books used 32)")
    p.add_argument("--out-dir", default="", help="where the JSON and PNG go (default benchmarks)")
    add_force(p)
    p.add_argument("--data-dir", default="", help="prepared data folder (default: the stdlib corpus, prepared once)")
    p.add_argument("--augment-ms", type=float, default=5.0,
                   help="speed ladder: CPU cost of the augmentation per sequence (makes the baseline data-bound)")
    p.set_defaults(func=cmd_bench_ladder)
    p = bench.add_parser("sharding", help="memory per rank of ddp vs zero1 vs zero2 vs fsdp (torchrun, CPU)")
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks)")
    p.add_argument("--strategies", nargs="+", default=["ddp", "zero1", "zero2", "fsdp"])
    p.add_argument("--steps", type=int, default=3, help="training steps per strategy (step 2 is measured)")
    p.add_argument("--size", default="default", choices=["default", "ci"],
                   help="model scale: default = a wide 4-layer GPT-2 (35.4M parameters); ci = the same shape at a "
                        "third of the width (3.9M; a seconds-long smoke run for tests; needs --out)")
    p.add_argument("--layouts", nargs="+", default=None, metavar="LAYOUT",
                   help="instead of the data-parallel strategies: tensor / context-parallel layouts (tp1 tp2 tp4 cp2 "
                        "cp4 cp2tp2), memory per rank vs the planner (default file benchmarks/model-parallel-cpu.json)")
    _add_data_dir_and_out(p, "benchmarks/sharding-cpu.json")
    p.set_defaults(func=cmd_bench_sharding)
    from slipstream.plan.space import SCHEDULE_VIRTUAL

    p = bench.add_parser("pipeline", help="every pipeline schedule at world 2 and 4: step time, bubble measured vs "
                                          "planned, memory per stage (torchrun, CPU)")
    p.add_argument("--schedules", nargs="+", default=None, choices=list(SCHEDULE_VIRTUAL), metavar="SCHEDULE",
                   help=f"schedules to run (default: all: {' '.join(SCHEDULE_VIRTUAL)}; --size ci: gpipe 1f1b)")
    p.add_argument("--nproc", nargs="+", type=int, default=None, choices=[2, 4],
                   help="worlds (pp = world; at 4 also 1f1b as pp 2 x fsdp 2); default 2 4 (--size ci: 2)")
    p.add_argument("--steps", type=int, default=0,
                   help="training steps per rung: step 2 is memory-tracked, 3.. timed (default 8; --size ci: 3)")
    p.add_argument("--size", default="default", choices=["default", "ci"],
                   help="model scale: default = GPT-2 shape, 8 blocks of width 256, 8 micro-batches of 128 tokens; "
                        "ci = 4 blocks of width 64 (a seconds-long smoke run for tests; needs --out)")
    _add_data_dir_and_out(p, "benchmarks/pipeline-cpu.json")
    p.set_defaults(func=cmd_bench_pipeline)
    p = bench.add_parser("moe", help="mixture of experts: dense vs MoE at equal active parameters, ep 1/2/4 (tokens/s, "
                                     "memory per rank, all-to-all share), expert load under each balancing method")
    p.add_argument("--steps", type=int, default=8, help="training steps per rung (2: memory, 4-5: profiled)")
    p.add_argument("--balance-steps", type=int, default=200, help="training steps per balancing method")
    p.add_argument("--size", default="default", choices=["default", "ci"],
                   help="default = 4 blocks of width 256, 8 experts top-2; ci = moe-tiny at ep2 only, no balancing "
                        "runs (a seconds-long smoke run for tests; needs --out)")
    _add_data_dir_and_out(p, "benchmarks/moe-cpu.json")
    p.set_defaults(func=cmd_bench_moe)
    p = bench.add_parser("data", help="tokens/s of every data reader (local shards, Parquet, streaming over HTTP and "
                                      "S3) vs what the step consumes; data wait at 2 workers")
    p.add_argument("--size", default="default", choices=["default", "ci"],
                   help="default = 60 GPT-2 batches per reader, a 64 MB prepare, 30 training steps; ci = a "
                        "seconds-long smoke run for tests (needs --out)")
    _add_data_dir_and_out(p, "benchmarks/data-cpu.json")
    p.set_defaults(func=cmd_bench_data)
    p = bench.add_parser("checkpoint", help="checkpoint save: training stall of synchronous vs asynchronous saves")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="", help="JSON file (default benchmarks/checkpoint-cpu.json)")
    add_force(p)
    p.set_defaults(func=cmd_bench_checkpoint)
    p = bench.add_parser("fused-ce", help="fused linear + cross-entropy vs the unfused path: time and peak memory")
    p.add_argument("--rows", type=int, default=4096, help="tokens (batch x sequence)")
    p.add_argument("--d", type=int, default=256, help="hidden size")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk-size", type=int, nargs="+", default=[1024])
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--out", default="", help="JSON file (default benchmarks/fused-ce-<device>.json)")
    add_force(p)
    p.set_defaults(func=cmd_bench_fused_ce)
    p = bench.add_parser("planner", help="planner accuracy: planned vs measured memory on this CPU, vs published runs")
    p.add_argument("--device", default="cpu", help="cpu: the fake-process-group grid; cuda: GPT-2 steps on this GPU")
    p.add_argument("--cases", default="grid", choices=["grid", "stratified"],
                   help="cpu: grid = every case (the committed JSON); stratified = 21 of them covering every "
                        "model family, strategy, AC mode and precision, QAT, low-bit optimizer states and the stacks' "
                        "ZeRO states (a seconds-long smoke run for tests; needs --out)")
    p.add_argument("--published-only", action="store_true",
                   help="cpu: recompute only the published runs' part (the fit and its leave-one-run-out table), "
                        "keeping the measured memory rows of the file (--out, default the committed one)")
    p.add_argument("--out", default="", help="JSON file (default benchmarks/planner-accuracy-<cpu|gpu>.json)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    p.set_defaults(func=cmd_bench_planner)
    p = bench.add_parser("recompute", help="step time with activation checkpointing none / selective / full on "
                                           "small models, measured vs the planner's predicted ratios")
    p.add_argument("--device", default="cpu", help="cpu (fits the planner's cpu constants) or cuda")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds over every model and AC mode")
    p.add_argument("--steps", type=int, default=2, help="timed training steps per model, AC mode and round")
    p.add_argument("--repredict", default="", metavar="FILE",
                   help="no measurement: refit and re-predict from FILE's measured rows (after a change of the "
                        "planner's constants)")
    p.add_argument("--out", default="", help="JSON file (default benchmarks/planner-recompute-<device>.json)")
    add_force(p)
    p.set_defaults(func=cmd_bench_recompute)
    from slipstream.perf.gpu_suite import add_gpu_arguments

    p = bench.add_parser("gpu", help="every CUDA-only check and benchmark on one GPU, under 8 minutes")
    add_gpu_arguments(p)
    p.set_defaults(func=cmd_bench_gpu)
    p = bench.add_parser("packing", help="training tokens/s with data.packing = eos vs document (dense SDPA mask, "
                                         "FlexAttention where it trains)")
    p.add_argument("--size", default="default", choices=["default", "ci"],
                   help="default = 4 blocks of width 128 at seq_len 512, documents of 128 tokens on average; "
                        "ci = a seconds-long smoke run for tests (needs --out)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every variant")
    p.add_argument("--steps", type=int, default=3, help="training steps per variant and round")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's default: all cores)")
    p.add_argument("--out", default="", help="JSON file (default benchmarks/packing-<device>.json)")
    add_force(p)
    p.set_defaults(func=cmd_bench_packing)
    from slipstream.cli import bench_suite

    bench_suite.add_commands(bench)
