"""`slipstream plan` and `slipstream cost`: the planner's commands.

    slipstream plan --model llama-70b --gpus 8xH100 --nodes 8 --seq 8192 --global-batch 512 [--top 10]
                    [--write-config best.toml] [--json]
    slipstream plan ... --layout "fsdp:16 tp4+sp mb1 ac:full"      one layout, its memory and time whole
    slipstream plan ... --stack megatron [--bucket-mb 100]          collectives as that stack issues them
    slipstream plan ... --stack megatron --overlap-grad-reduce on   the gradient reduction behind backward
    slipstream cost --model llama-70b --tokens 300e9 --gpus 8xH100 --nodes 8 [--price 3.5]
(`slipstream bench planner` is in cli/bench.py; `slipstream tune system` in cli/tune.py.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from slipstream.cli.hardware_args import add_hardware_arguments, cluster_from_args, hardware_input_files
from slipstream.errors import UserError
from slipstream.outputs import refuse_existing, refuse_same_file
from slipstream.plan.hardware import STACKS
from slipstream.plan.memory import GIB
from slipstream.plan.render import cluster_record, format_layout, format_plan, plan_record, write_best_config
from slipstream.plan.search import Candidate, explain_infeasible, plan, plan_layout
from slipstream.plan.space import (AC_MODES, ATTENTION_IMPLEMENTATIONS, DP_STRATEGIES, LAYOUT_SYNTAX, PP_SCHEDULES,
                                   PRECISIONS, Workload, parse_layout)
from slipstream.plan.timing import DEFAULT_EFFICIENCY

# cost: tokens per optimizer step when --global-batch is not given (a common LLM setting;
# Llama 3 used 4M-16M, GPT-3 0.5M-3.2M).
DEFAULT_STEP_TOKENS = 2**21


def _add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset (e.g. gpt2, llama-70b, mixtral-8x7b), a TOML config, "
                   "or a factory 'package.module:function' returning an nn.Module")
    add_hardware_arguments(p)
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the model's, or GPT-2's 50257)")
    p.add_argument("--precision", default="bf16", choices=PRECISIONS)
    p.add_argument("--attention", default="flash", choices=ATTENTION_IMPLEMENTATIONS,
                   help="how attention runs: flash (fused, the scores never in memory), efficient (memory-efficient "
                        "kernel) or materialized (scores and softmax kept for backward, as older stacks do)")
    p.add_argument("--efficiency", type=float, default=DEFAULT_EFFICIENCY,
                   help="compute efficiency factor (fitted to published runs; `slipstream tune system` measures yours)")
    p.add_argument("--calibrate", nargs="+", default=None, metavar="RUN_DIR",
                   help="finished `slipstream train` run directories on this kind of device: their measured "
                        "tokens/s set the efficiency (replaces --efficiency)")
    p.add_argument("--stack", default="torch", choices=STACKS,
                   help="the training stack whose collectives and model states to plan: torch (slipstream / PyTorch "
                        "DDP and FSDP2; fp32 weights and gradients; zero1 = all-reduce + broadcast), megatron "
                        "(grad-buffer buckets; its distributed optimizer reduce-scatters and all-gathers, 16-bit "
                        "weights, fp32 master copy and moments sharded) or deepspeed (ZeRO buckets, reduce-scatter + "
                        "all-gather, 16-bit weights and gradients, fp32 master copy and moments sharded)")
    p.add_argument("--bucket-mb", type=float, default=None, metavar="MB",
                   help="gradient bucket size in MiB, replacing the stack's default (DDP bucket_cap_mb 25, Megatron "
                        "max(40M, 1M x dp) parameters, DeepSpeed reduce_bucket_size 5e8 elements)")
    p.add_argument("--overlap-grad-reduce", default=None, choices=("on", "off"),
                   help="whether the data-parallel gradient reduction runs behind backward (default: the stack's: "
                        "torch on; megatron off, its overlap_grad_reduce default, one bucket of all gradients; "
                        "deepspeed off, its ZeRO-1/2 overlap_comm default)")
    p.add_argument("--runnable-only", action="store_true", help="only layouts slipstream can run today")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def add_commands(sub) -> None:
    """Register `plan` and `cost` on the top-level subparsers."""
    p = sub.add_parser("plan", help="predict memory and speed of every layout on a cluster; rank the ones that fit")
    _add_cluster_arguments(p)
    p.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step (all GPUs)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--rejected", type=int, default=5, help="rejected layouts to show (the fastest ones)")
    p.add_argument("--dp-strategy", nargs="+", choices=DP_STRATEGIES, help="only these data-parallel strategies")
    p.add_argument("--tp", type=int, nargs="+", help="only these tensor-parallel degrees")
    p.add_argument("--pp", type=int, nargs="+", help="only these pipeline degrees")
    p.add_argument("--pp-schedule", nargs="+", choices=PP_SCHEDULES, help="pipeline schedules (default: 1f1b interleaved)")
    p.add_argument("--cp", type=int, nargs="+", help="only these context-parallel degrees")
    p.add_argument("--ac", nargs="+", choices=AC_MODES, help="only these activation-checkpointing modes")
    p.add_argument("--micro-batch", type=int, nargs="+", help="only these micro-batch sizes (default: powers of two)")
    p.add_argument("--ep", type=int, nargs="+", help="only these expert-parallel degrees")
    p.add_argument("--pp-virtual", type=int, nargs="+",
                   help="chunks per pipeline rank for the interleaved schedules (default: 2 and the counts up to 8 "
                        "that split the layers evenly)")
    p.add_argument("--pp-layers", default=None, metavar="N,N,...",
                   help="blocks per pipeline stage, e.g. 9,10,10,9 (pp x chunks of them, adding up to the layers; "
                        "default: the trainer's balanced split)")
    p.add_argument("--sequence-parallel", default="both", choices=("on", "off", "both"),
                   help="sequence parallel with tensor parallel (default: both searched)")
    p.add_argument("--fused-loss", default="both", choices=("on", "off", "both"),
                   help="the fused linear + cross-entropy loss (default: both searched)")
    p.add_argument("--layout", default=None,
                   help="evaluate this one layout, written as the table writes it, e.g. \"zero1:8 tp4 pp12 mb2 "
                        "ac:full\" (left out: the obvious defaults); prints its memory and time whole")
    p.add_argument("--write-config", default="", help="write the best runnable layout as a TOML for `slipstream train`")
    p.add_argument("--force", action="store_true", help="overwrite an existing --write-config file")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("cost", help="wall time, GPU-hours and money of a training run, with failure and preemption losses")
    _add_cluster_arguments(p)
    p.add_argument("--tokens", type=float, required=True, help="tokens to train, e.g. 300e9")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (default: the model's, at most 8192)")
    p.add_argument("--global-batch", type=int, default=0, help=f"sequences per step (default: about {DEFAULT_STEP_TOKENS:,} tokens)")
    p.add_argument("--price", type=float, default=None, help="on-demand USD per GPU-hour")
    p.add_argument("--spot-price", type=float, default=None, help="spot USD per GPU-hour")
    p.add_argument("--reserved-price", type=float, default=None, help="reserved USD per GPU-hour")
    p.add_argument("--checkpoint-interval", default="", help="e.g. 30m (default: the Young/Daly optimum)")
    p.add_argument("--save-time", default="30s", help="time one checkpoint save stalls training")
    p.add_argument("--restart-time", default="5m", help="time from a failure to training again")
    p.add_argument("--mtbf-gpu-hours", type=float, default=None, help="GPU-hours between job-killing failures per GPU")
    p.add_argument("--spot-preemptions-per-day", type=float, default=None, help="per GPU")
    p.set_defaults(func=cmd_cost)


def _setup(args: argparse.Namespace, seq_len: int | None):
    from slipstream.observe.peaks import this_cpu
    from slipstream.plan.model import resolve_model

    if args.nodes < 1:
        raise UserError(f"--nodes must be >= 1, got {args.nodes}")
    if not 0 < args.efficiency <= 2:
        raise UserError(f"--efficiency must be in (0, 2], got {args.efficiency}")
    if args.vocab is not None and args.vocab < 1:
        raise UserError(f"--vocab must be >= 1, got {args.vocab}")
    for name in ("seq", "global_batch"):  # 0 means "the default" for cost; plan's Workload refuses it
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    overlap = None if args.overlap_grad_reduce is None else args.overlap_grad_reduce == "on"
    cluster = dataclasses.replace(cluster_from_args(args, cpu=this_cpu()), stack=args.stack, bucket_mb=args.bucket_mb,
                                  overlap_grad_reduce=overlap)
    if args.calibrate:
        from slipstream.plan.report import efficiency_from_runs

        args.efficiency, runs = efficiency_from_runs(args.calibrate, cluster)
        if not args.json:
            print(f"efficiency {args.efficiency:.3f}, measured by {len(runs)} run(s): " + "; ".join(
                f"{r['layout']} {r['measured_tokens_per_s']:,.0f} vs {r['predicted_tokens_per_s']:,.0f} tokens/s "
                "predicted" for r in runs))
    return resolve_model(args.model, vocab=args.vocab, seq_len=seq_len), cluster


# The search flags of `plan` (argparse dest -> SearchSpace option); --layout pins all of them.
_SEARCH_FLAGS = {"dp_strategy": "dp_strategies", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "ac": "ac",
                 "micro_batch": "micro_batches", "pp_schedule": "pp_schedules", "pp_virtual": "pp_virtual",
                 "pp_layers": "pp_layers"}


def _space(args: argparse.Namespace) -> dict:
    space = {"precision": args.precision, "attention": args.attention}
    for key in ("tp", "pp", "cp", "ep", "micro_batch", "pp_virtual"):
        bad = [v for v in getattr(args, key, None) or () if v < 1]
        if bad:
            raise UserError(f"--{key.replace('_', '-')} values must be >= 1, got {bad}")
    for key, name in _SEARCH_FLAGS.items():
        value = getattr(args, key, None)
        if key == "pp_layers" and value:
            value = _layer_counts(value)
        if value:
            space[name] = tuple(value)
    for key in ("sequence_parallel", "fused_loss"):
        if getattr(args, key, "both") != "both":
            space[key] = getattr(args, key)
    return space


def _layer_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--pp-layers {text!r}: give blocks per stage as comma-separated integers, e.g. 9,10,10,9") from None
    if min(counts) < 1:
        raise UserError(f"--pp-layers {text!r}: every stage needs at least one block")
    return counts


def _plan_one_layout(args: argparse.Namespace, model, cluster, work):
    """--layout: that layout alone (the search flags would have nothing to choose)."""
    given = [f"--{key.replace('_', '-')}" for key in (*_SEARCH_FLAGS, "runnable_only") if getattr(args, key, None)]
    given += [f"--{key.replace('_', '-')}" for key in ("sequence_parallel", "fused_loss") if getattr(args, key) != "both"]
    if given:
        raise UserError(f"--layout pins the whole layout; drop {', '.join(given)} (or write it into the layout: "
                        f"{LAYOUT_SYNTAX})")
    strategy = parse_layout(args.layout, cluster.world, work.global_batch, precision=args.precision,
                            attention=args.attention, n_layer=model.cfg.n_layer if model.traced is None else None)
    return plan_layout(model, cluster, work, strategy, efficiency=args.efficiency)


def cmd_plan(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise UserError(f"unexpected arguments: {' '.join(extra)}")
    if args.top < 1 or args.rejected < 0:
        raise UserError(f"--top must be >= 1 and --rejected >= 0, got {args.top} and {args.rejected}")
    refuse_existing(args.write_config, args.force, "--write-config")
    refuse_same_file(args.write_config, [args.model, *hardware_input_files(args)], "--write-config", "an input of this plan")
    model, cluster = _setup(args, args.seq)
    work = Workload(seq_len=args.seq, global_batch=args.global_batch)
    if args.layout is not None:
        result = _plan_one_layout(args, model, cluster, work)
        written = write_best_config(result, args.write_config) if args.write_config else None
        if args.json:
            print(json.dumps({**plan_record(result, 1, 1, written), "efficiency": args.efficiency}, indent=2))
        else:
            print(format_layout(result))
            if written:
                print(written)
        return 0
    result = plan(model, cluster, work, efficiency=args.efficiency, runnable_only=args.runnable_only, **_space(args))
    if not result.ranked:
        raise UserError(explain_infeasible(result))
    written = write_best_config(result, args.write_config) if args.write_config else None
    if args.json:
        print(json.dumps({**plan_record(result, args.top, args.rejected, written), "efficiency": args.efficiency},
                         indent=2))
    else:
        print(format_plan(result, args.top, args.rejected))
        if written:
            print(written)
    return 0


def cmd_cost(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.plan.cost import DEFAULT_MTBF_GPU_HOURS, DEFAULT_SPOT_PREEMPTIONS_PER_DAY, cost_record, estimate_cost, \
        format_cost, prices_for
    from slipstream.plan.checkpoint_interval import parse_duration

    if extra:
        raise UserError(f"unexpected arguments: {' '.join(extra)}")
    model, cluster = _setup(args, args.seq or None)
    seq = args.seq or min(model.cfg.max_seq_len, 8192)
    batch = args.global_batch or max(1, round(DEFAULT_STEP_TOKENS / seq / cluster.world)) * cluster.world
    result = plan(model, cluster, Workload(seq, batch, tokens=args.tokens), efficiency=args.efficiency,
                  runnable_only=args.runnable_only, precision=args.precision, attention=args.attention)
    if not result.ranked:
        raise UserError(explain_infeasible(result))
    best: Candidate = result.ranked[0]
    prices = prices_for(cluster.short_name, args.price, args.spot_price, args.reserved_price)
    interval = parse_duration(args.checkpoint_interval, "--checkpoint-interval") if args.checkpoint_interval else None
    est = estimate_cost(args.tokens, best.time.tokens_per_s, cluster.world, prices,
                        checkpoint_interval_s=interval,
                        save_s=parse_duration(args.save_time, "--save-time"),
                        restart_s=parse_duration(args.restart_time, "--restart-time"),
                        mtbf_gpu_hours=DEFAULT_MTBF_GPU_HOURS if args.mtbf_gpu_hours is None else args.mtbf_gpu_hours,
                        spot_preemptions_per_day=(DEFAULT_SPOT_PREEMPTIONS_PER_DAY if args.spot_preemptions_per_day is None
                                                  else args.spot_preemptions_per_day))
    if args.json:
        print(json.dumps({"layout": best.to_record(), "seq_len": seq, "global_batch": batch,
                          "cluster": cluster_record(cluster), "cost": cost_record(est)}, indent=2))
        return 0
    flag = f" (not runnable in slipstream yet: {', '.join(best.not_runnable)})" if best.not_runnable else ""
    print(f"{model.name}, {args.tokens:.3g} tokens on {cluster.world} x {cluster.gpu.name}: fastest layout that fits "
          f"{best.strategy.label()}{flag}\n  seq {seq}, global batch {batch}: {best.time.tokens_per_s:,.0f} tokens/s, "
          f"MFU {best.time.mfu:.1%}, {best.memory.total_bytes / GIB:.1f} GiB per GPU\n")
    print(format_cost(est))
    return 0
