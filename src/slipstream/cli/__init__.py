"""`slipstream` command line: subcommands only; each delegates to a module function.

    slipstream train [--config FILE] [--section.key=value ...]
    slipstream eval --checkpoint PATH [--data.dir DIR --split val --tokens N --json]
    slipstream generate --checkpoint PATH --prompt TEXT [--max-new-tokens N --temperature T --top-k K]
    slipstream data prepare --input PATH... --tokenizer T --out DIR
    slipstream data verify --dir DIR
    slipstream data train-tokenizer --input PATH... --vocab-size N --out FILE [--force]
    slipstream config show [--config FILE] [--section.key=value ...]
    slipstream profile [--config FILE] [--section.key=value ...] [--steps N]
    slipstream doctor [--config FILE] [overrides] [--apply] [--json] | doctor --trace FILE...
    slipstream probe [--sections compute memory comm storage] [--device D] [--data-dir DIR] [--out FILE --force]
    slipstream config reference
    slipstream bench overhead [--config FILE] [--section.key=value ...] [--rounds N] [--out FILE]
    slipstream bench sharding [--nproc N --strategies ddp zero1 zero2 fsdp --steps N]
    slipstream bench checkpoint [--repeats N] [--model.* overrides]
    slipstream bench fused-ce [--rows N --d D --vocab V --dtype ... --chunk-size ...]
    slipstream bench ladder [memory|speed|both] [--device D --size S --repeats N --steps N --batch B]
    slipstream bench planner [--device cpu|cuda] [--out FILE]
    slipstream plan --model M --gpus 8xH100 [--nodes N] --seq S --global-batch B [--top K --calibrate RUN_DIR... --json]
    slipstream cost --model M --tokens 300e9 --gpus 8xH100 [--nodes N --price P --json]
    slipstream tune system --config FILE [--budget 10m --top K --nproc N --steps S --json --write-config OUT]

User errors print one line `error: ...` and exit with code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from slipstream.errors import UserError
from slipstream.outputs import refuse_existing, refuse_same_file

EXIT_USER_ERROR = 2


def _split_overrides(extra: list[str]) -> list[str]:
    """Unknown argparse leftovers must be `--section.key=value` (or `--section.key value`)."""
    overrides, i = [], 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise UserError(f"unexpected argument '{arg}'; config overrides look like --section.key=value")
        if "=" not in arg:
            if i + 1 >= len(extra) or extra[i + 1].startswith("--"):
                raise UserError(f"override '{arg}' has no value; write {arg}=VALUE")
            arg = f"{arg}={extra[i + 1]}"
            i += 1
        overrides.append(arg)
        i += 1
    return overrides


def _load(args, extra):
    from slipstream.config import load_config

    return load_config(args.config, _split_overrides(extra))


def cmd_train(args, extra) -> int:
    from slipstream.distributed.mesh import shutdown
    from slipstream.train.lm import train_lm

    train_lm(_load(args, extra))
    # Leave the process group cleanly (no-op for one process). Not on errors: tearing NCCL down
    # while other ranks still wait in a collective can hang; the launcher stops them instead.
    shutdown()
    return 0


def cmd_generate(args, extra) -> int:
    from slipstream.train.lm import generate_text

    if extra:
        raise UserError(f"unexpected arguments: {' '.join(extra)}")
    def show(piece: str) -> None:  # each piece as soon as its tokens are sampled
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        generate_text(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k or None, seed=args.seed, device=args.device, on_text=show)
        print(flush=True)
    except BrokenPipeError:  # `slipstream generate ... | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
    return 0


def cmd_config_show(args, extra) -> int:
    from slipstream.config.load import config_to_toml

    print(config_to_toml(_load(args, extra)), end="")
    return 0


def cmd_config_reference(args, extra) -> int:
    from slipstream.config.load import reference_markdown

    print(reference_markdown())
    return 0


def cmd_data_prepare(args, extra) -> int:
    from slipstream.data import prepare_dataset

    if extra:
        raise UserError(f"unexpected arguments: {' '.join(extra)}")
    manifest = prepare_dataset(args.input, args.tokenizer, args.out, text_field=args.text_field,
                               val_fraction=args.val_fraction, num_workers=args.workers or None,
                               progress=not args.quiet)
    splits = manifest.get("splits", {})
    counts = ", ".join(f"{name}: {info.get('tokens', 0):,} tokens" for name, info in splits.items())
    print(f"prepared {args.out} ({manifest['tokenizer']}, vocab {manifest['vocab_size']}): {counts}")
    return 0


def cmd_data_verify(args, extra) -> int:
    from slipstream.data.prepare import verify_data

    if extra:
        raise UserError(f"unexpected arguments: {' '.join(extra)}")
    _manifest, results = verify_data(args.dir)
    for split, name, problem in results:
        print(f"{'ok ' if problem is None else 'BAD'} {split} {name}" + (f": {problem}" if problem else ""), flush=True)
    bad = [name for _split, name, problem in results if problem]
    if bad:
        print(f"{args.dir}: {len(bad)} of {len(results)} shards damaged ({', '.join(bad[:5])}"
              f"{', ...' if len(bad) > 5 else ''}); run `slipstream data prepare` again", file=sys.stderr)
        return 1
    print(f"{args.dir}: all {len(results)} shards intact (sizes, sha256s, token ids < vocab)")
    return 0


def cmd_data_train_tokenizer(args, extra) -> int:
    from slipstream.data import train_bpe

    if extra:
        raise UserError(f"unexpected arguments: {' '.join(extra)}")
    refuse_existing(args.out, args.force)
    refuse_same_file(args.out, args.input, "--out", "one of the inputs")
    tok = train_bpe(args.input, args.out, vocab_size=args.vocab_size, text_field=args.text_field)
    print(f"wrote {args.out} (vocab {tok.vocab_size}); use it with --tokenizer bpe:{args.out}")
    return 0


def cmd_bench_overhead(args, extra) -> int:
    from slipstream.perf.overhead import run_overhead_bench

    if args.rounds < 1 or args.steps < 1:
        raise UserError(f"--rounds and --steps must be >= 1 (got {args.rounds} and {args.steps})")
    refuse_existing(args.out, args.force)  # an explicit --out; the default benchmarks/ file is refreshed
    run_overhead_bench(_load(args, extra), rounds=args.rounds, steps_per_round=args.steps, out=args.out)
    return 0


def cmd_bench_ladder(args, extra) -> int:
    from slipstream.perf.ladder import ladder_outputs, run_ladder

    if extra:
        raise UserError(f"unexpected arguments: {' '.join(extra)}")
    ladders = ["memory", "speed"] if args.ladder == "both" else [args.ladder]
    if args.out_dir:  # an explicit --out-dir; the default benchmarks/ files are refreshed
        for which in ladders:
            for path in ladder_outputs(which, args.device, args.size, args.out_dir):
                refuse_existing(path, args.force, "--out-dir", what="ladder result")
    for which in ladders:
        run_ladder(which, device=args.device, size=args.size, repeats=args.repeats, steps=args.steps,
                   batch=args.batch, out_dir=args.out_dir or "benchmarks", data_dir=args.data_dir,
                   augment_ms=args.augment_ms)
    return 0


def cmd_bench_sharding(args, extra) -> int:
    from slipstream.perf.sharding import run_sharding_bench

    if extra:
        raise UserError(f"unexpected arguments: {' '.join(extra)}")
    refuse_existing(args.out, args.force)
    run_sharding_bench(nproc=args.nproc, strategies=tuple(args.strategies), data_dir=args.data_dir,
                       steps=args.steps, out=args.out)
    return 0


def cmd_bench_checkpoint(args, extra) -> int:
    from slipstream.perf.checkpoint_bench import run_checkpoint_bench

    refuse_existing(args.out, args.force)
    run_checkpoint_bench(repeats=args.repeats, overrides=_split_overrides(extra), out=args.out)
    return 0


def cmd_bench_fused_ce(args, extra) -> int:
    from slipstream.ops.bench_fused_ce import run_fused_ce_bench

    if extra:
        raise UserError(f"unexpected arguments: {' '.join(extra)}")
    if min(args.rows, args.d, args.vocab, args.repeats, *args.chunk_size) < 1:
        raise UserError("--rows, --d, --vocab, --repeats and --chunk-size must be >= 1")
    refuse_existing(args.out, args.force)
    run_fused_ce_bench(args.rows, args.d, args.vocab, tuple(args.dtype), args.device, args.repeats,
                       tuple(args.chunk_size), args.backend, args.out)
    return 0


def cmd_eval(args, extra) -> int:
    import json

    from slipstream.train.evaluate import evaluate_checkpoint

    if extra:
        raise UserError(f"unexpected arguments: {' '.join(extra)}")
    for flag, value in (("--tokens", args.tokens), ("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    r = evaluate_checkpoint(args.checkpoint, data_dir=args.data_dir, split=args.split, max_tokens=args.tokens,
                            batch_size=args.batch_size, seq_len=args.seq_len, device=args.device)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    stderr = f" ± {r['stderr']:.4f}" if r["stderr"] is not None else ""
    what = "a fixed sample of" if r["sampled"] else "every"
    print(f"{r['split']} loss {r['loss']:.4f}{stderr} (perplexity {r['perplexity']:.2f}) on {what} "
          f"{r['seq_len']}-token window of {r['data_dir']}: {r['windows']:,} windows, {r['tokens']:,} tokens")
    return 0


def cmd_profile(args, extra) -> int:
    from slipstream.perf.profiling import profile_run

    profile_run(_load(args, extra), steps=args.steps)
    return 0


def cmd_doctor(args, extra) -> int:
    from slipstream.perf.doctor import run_doctor
    from slipstream.safe_read import parse_size

    overrides = _split_overrides(extra)
    # Traces from an unknown run: no config, so the advice does not assume that run's settings.
    cfg = None if args.trace and not (args.apply or args.config or overrides) else _load(args, extra)
    max_bytes = parse_size(args.max_trace_bytes, "--max-trace-bytes") if args.max_trace_bytes else None
    run_doctor(args.trace or None, cfg=cfg, overrides=overrides, apply=args.apply, as_json=args.json,
               max_trace_bytes=max_bytes)
    return 0


def add_force(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--force: the one way to replace an existing output file (slipstream/outputs.py)."""
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description="PyTorch-native high-performance training.")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p):
        p.add_argument("--config", help="TOML config file (may `extends` another)")
        return p

    p = with_config(sub.add_parser("train", help="train a language model (default: gpt-mini on the stdlib corpus)"))
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("generate", help="sample text from a checkpoint")
    p.add_argument("--checkpoint", required=True, help="checkpoint folder or run directory (its latest checkpoint)")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample from the k most likely tokens; 0 = all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="validation loss of a checkpoint on every window of a split (or a fixed sample)")
    p.add_argument("--checkpoint", required=True, help="checkpoint folder or run directory (its latest checkpoint)")
    p.add_argument("--data.dir", dest="data_dir", default=None, help="prepared data folder (default: the run's own)")
    p.add_argument("--split", default="val", help="split of the data folder to score (default: val)")
    p.add_argument("--tokens", type=int, default=None, help="at most this many tokens: a fixed sample spread over the split (default: all)")
    p.add_argument("--batch-size", type=int, default=None, help="windows per forward pass (default: the run's micro-batch)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per window (default: the run's seq_len)")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_eval)

    p = with_config(sub.add_parser("profile", help="a short profiled training run: top ops and a chrome trace"))
    p.add_argument("--steps", type=int, default=None, help="profiled steps (default: profile.steps)")
    p.set_defaults(func=cmd_profile)

    p = with_config(sub.add_parser("doctor", help="name the bottlenecks of a run (or of traces) and the switches that fix them"))
    p.add_argument("--trace", nargs="+", default=None, help="read these chrome traces (.json or .json.gz) instead of running")
    p.add_argument("--apply", action="store_true", help="rerun with the suggested switches; print before/after")
    p.add_argument("--max-trace-bytes", default=None, metavar="SIZE",
                   help="refuse a trace larger than this once decompressed, e.g. 4GiB (default 2GiB)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("probe", help="measure this machine: matmul TFLOP/s, memory and copy bandwidth, collectives, storage")
    from slipstream.perf.probe import add_probe_arguments, main_probe

    add_probe_arguments(p)
    p.set_defaults(func=main_probe)

    from slipstream.checkpoint.export import add_checkpoint_parser
    from slipstream.distributed.launch import add_launch_parser

    add_launch_parser(sub)
    add_checkpoint_parser(sub)

    data = sub.add_parser("data", help="prepare token shards, train tokenizers").add_subparsers(dest="data_cmd", required=True)
    p = data.add_parser("prepare", help="tokenize inputs into token shards + manifest")
    p.add_argument("--input", nargs="+", required=True, help="files, folders, .jsonl files or `stdlib`")
    p.add_argument("--tokenizer", default="byte", help="byte | bpe:FILE | tiktoken:NAME")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--text-field", default="text", help="JSONL field holding the text")
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--workers", type=int, default=0, help="tokenizer processes; 0 = all cores")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_data_prepare)
    p = data.add_parser("verify", help="check every shard of a prepared folder (sizes, sha256, token ids); exit 1 on damage")
    p.add_argument("--dir", required=True, help="prepared data folder")
    p.set_defaults(func=cmd_data_verify)
    p = data.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on the inputs")
    p.add_argument("--input", nargs="+", required=True)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--out", required=True, help="tokenizer JSON file to write")
    add_force(p)
    p.add_argument("--text-field", default="text")
    p.set_defaults(func=cmd_data_train_tokenizer)

    config = sub.add_parser("config", help="show the resolved config").add_subparsers(dest="config_cmd", required=True)
    p = with_config(config.add_parser("show", help="print the resolved config as TOML"))
    p.set_defaults(func=cmd_config_show)
    p = config.add_parser("reference", help="print the config reference (markdown)")
    p.set_defaults(func=cmd_config_reference)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_cmd", required=True)
    p = with_config(bench.add_parser("overhead", help="Trainer vs a hand-written loop, alternated"))
    p.add_argument("--rounds", type=int, default=5, help="alternations of (trainer, hand loop)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per round and contender")
    p.add_argument("--out", default="", help="JSON result file (default benchmarks/overhead-<machine>.json)")
    add_force(p)
    p.set_defaults(func=cmd_bench_overhead)
    p = bench.add_parser("ladder", help="the books' memory and speed optimization ladders, measured rung by rung")
    p.add_argument("ladder", nargs="?", default="both", choices=["memory", "speed", "both"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--size", default="tiny", choices=["tiny", "small", "book"],
                   help="model scale: book = the books' settings (GPU), small/tiny for CPU")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per rung")
    p.add_argument("--steps", type=int, default=6, help="training steps per rung and repeat (step 1 is warm-up)")
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
    p.add_argument("--data-dir", default="", help="prepared data folder (default: the stdlib corpus, prepared once)")
    p.add_argument("--out", default="", help="JSON file (default benchmarks/sharding-cpu.json)")
    add_force(p)
    p.set_defaults(func=cmd_bench_sharding)
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

    from slipstream.plan.cli import add_plan_parsers
    from slipstream.plan.tune import add_tune_arguments, main_tune_system

    add_plan_parsers(sub, bench)
    tune = sub.add_parser("tune", help="measure layouts on this machine").add_subparsers(dest="tune_cmd", required=True)
    p = tune.add_parser("system", help="short real trials of the planner's top-K layouts; keep the fastest that fits")
    add_tune_arguments(p)
    p.set_defaults(func=main_tune_system)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        return _run(args, extra)
    except BaseException:
        _leave_now_if_distributed(1)
        raise


def _report_final_exit(code: int) -> None:
    """Tell `slipstream launch` that this exit must not be retried (a user error or a preemption):
    torchrun's own exit code does not carry the workers' codes."""
    path = os.environ.get("SLIPSTREAM_EXIT_FILE")
    if path:
        with contextlib.suppress(OSError):
            with open(path, "w", encoding="ascii") as f:
                f.write(str(code))


def _leave_now_if_distributed(code: int) -> None:
    """A failed rank of a distributed job exits at once: background threads (an asynchronous
    checkpoint write waiting on a dead peer) must not keep it alive, or the launcher could not
    restart the group."""
    dist = sys.modules.get("torch.distributed")
    if code != 0 and dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        import traceback

        from slipstream.resilience.runtime import Preempted

        if sys.exc_info()[0] is not None and not isinstance(sys.exc_info()[1], (UserError, SystemExit, Preempted)):
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(args, extra) -> int:
    try:
        return args.func(args, extra)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        _report_final_exit(EXIT_USER_ERROR)
        _leave_now_if_distributed(EXIT_USER_ERROR)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from slipstream.resilience.runtime import Preempted

        if isinstance(e, Preempted):  # the checkpoint is saved: a distinct code tells the scheduler to requeue
            print(f"exiting after preemption: {e}", file=sys.stderr)
            _report_final_exit(e.exit_code)
            _leave_now_if_distributed(e.exit_code)
            return e.exit_code
        raise


if __name__ == "__main__":
    sys.exit(main())
