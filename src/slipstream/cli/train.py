"""`slipstream train`, `slipstream generate`, `slipstream eval`: train a model, sample from it, score it.

    slipstream train [--config FILE] [--section.key=value ...]
    slipstream generate --checkpoint PATH --prompt TEXT [--max-new-tokens N --temperature T --top-k K]
                        [--quantize int8|int4 | --sparse-kernel]
    slipstream eval --checkpoint PATH [--data.dir DIR --split val --tokens N --json]

generate prints the text on stdout and, on stderr once it is done, the model's weight size (bytes of
its saved state dict; with --quantize before -> after) and the generation speed in tokens/s (wall
time after one warm-up token). --quantize int8|int4 quantizes the weights of the blocks' linears
with torchao (weight-only; embedding and head stay in full precision; optimize/weight_quant.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from slipstream.cli._common import load, no_extra, with_config
from slipstream.errors import UserError


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.distributed.mesh import shutdown
    from slipstream.train.lm import train_lm

    train_lm(load(args, extra))
    # Leave the process group cleanly (no-op for one process). Not on errors: tearing NCCL down
    # while other ranks still wait in a collective can hang; the launcher stops them instead.
    shutdown()
    return 0


def cmd_generate(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.train.lm import generate_text

    no_extra(extra)

    def show(piece: str) -> None:  # each piece as soon as its tokens are sampled
        sys.stdout.write(piece)
        sys.stdout.flush()

    done: list[dict] = []

    def report(s: dict) -> None:  # on stderr: stdout stays the text alone, for pipes
        size = (f"{s['weight_bytes_before']:,} -> {s['weight_bytes_after']:,} bytes "
                f"({s['weight_bytes_before'] / s['weight_bytes_after']:.2f}x smaller, {s['quantize']} weight-only)"
                if s["quantize"] else f"{s['weight_bytes_after']:,} bytes")
        speed = f"{s['tokens_per_s']:.1f} tokens/s" if s["tokens_per_s"] else "too fast to time"
        print(f"weights: {size}; generation: {speed} ({s['tokens']} tokens in {s['seconds']:.3f} s "
              f"after a warm-up token, on {s['device']})", file=sys.stderr, flush=True)

    try:
        generate_text(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k or None, seed=args.seed, device=args.device, on_text=show,
                      quantize=args.quantize, on_stats=done.append, sparse_kernel=args.sparse_kernel)
        print(flush=True)  # ends the text's line before the report goes to the same terminal
        report(done[0])
    except BrokenPipeError:  # `slipstream generate ... | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
    return 0


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.train.evaluate import evaluate_checkpoint

    no_extra(extra)
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


def add_commands(sub) -> None:
    """Register `train`, `generate` and `eval` on the top-level subparsers."""
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
    p.add_argument("--quantize", choices=("int8", "int4"), default=None,
                   help="weight-only quantization of the blocks' linears (torchao); prints the bytes before/after")
    p.add_argument("--sparse-kernel", action="store_true",
                   help="a 2:4-pruned model's blocks run the semi-structured sparse matmul (torchao; CUDA sm80+, bf16)")
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
