"""`slipstream` command line: subcommands only, one module per command group; each delegates to library functions.

    slipstream train [--config FILE] [--section.key=value ...]
    slipstream eval --checkpoint PATH [--data.dir DIR --split val --tokens N --json]
    slipstream generate --checkpoint PATH --prompt TEXT [--max-new-tokens N --temperature T --top-k K --quantize int8|int4]
    slipstream data prepare --input PATH... --tokenizer T --out DIR
    slipstream data verify --dir DIR
    slipstream data train-tokenizer --input PATH... --vocab-size N --out FILE [--force]
    slipstream config show [--config FILE] [--section.key=value ...]
    slipstream profile [--config FILE] [--section.key=value ...] [--steps N]
    slipstream doctor [--config FILE] [overrides] [--apply] [--json] | doctor --trace FILE...
    slipstream probe [--sections compute memory comm storage] [--device D] [--data-dir DIR] [--out FILE --force]
    slipstream config reference
    slipstream bench overhead|sharding|checkpoint|fused-ce|ladder|planner|gpu ...   (cli/bench.py lists their options)
    slipstream bench suite [--quick] | bench compare BASE NEW | bench noise RUN... | bench speedrun [--quick]
    slipstream plan --model M --gpus 8xH100|8xGPU.toml [--nodes N --inter ib:400Gb/s --nics-per-node K --probe F...]
                    --seq S --global-batch B [--layout "tp4+sp pp12 zero1:8 mb2 ac:full" | --tp/--pp/... filters]
                    [--attention flash|efficient|materialized --top K --calibrate RUN_DIR... --json]
    slipstream cost --model M --tokens 300e9 --gpus 8xH100 [--nodes N --price P --json]
    slipstream tune system --config FILE [--budget 10m --top K --nproc N --steps S --json --write-config OUT]
    slipstream tune hparams --config FILE [--trials N --budget 30m --resume --nproc N --storage URL --write-config OUT]
    slipstream tune lr --config FILE [--steps N --min-lr A --max-lr B --plot PNG --json]
    slipstream tune batch --config FILE [--memory-gib G --max-micro-batch M --json]
    slipstream report PATH... [--out report.html --force]   |   slipstream compare RUN_A RUN_B [--json]
    slipstream launch local|slurm|slurm-node|k8s [options] -- COMMAND
    slipstream checkpoint inspect|export|advise ...

Command groups (each module has `add_commands(subparsers)` and its `cmd_*` handlers):
    cli/train.py       train, generate, eval
    cli/perf.py        profile, doctor, probe
    cli/launch.py      launch local|slurm|slurm-node|k8s
    cli/checkpoint.py  checkpoint inspect|export|advise
    cli/data.py        data prepare|verify|train-tokenizer
    cli/config.py      config show|reference
    cli/bench.py       bench overhead|ladder|sharding|checkpoint|fused-ce|planner|recompute|gpu
                       (+ bench suite|compare|noise|speedrun from cli/bench_suite.py)
    cli/plan.py        plan, cost
    cli/tune.py        tune system (+ tune hparams from cli/tune_hparams.py, tune lr|batch from cli/tune_finders.py)
    cli/report.py      report, compare

A handler is `cmd_x(args, extra) -> exit code`; `extra` holds the arguments the parser did not
know (config overrides `--section.key=value` where the command takes them). Library modules
never see an argparse Namespace and never import this package.

User errors print one line `error: ...` and exit with code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from slipstream.errors import UserError

EXIT_USER_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    from slipstream.cli import bench, checkpoint, config, data, launch, perf, plan, report, train, tune

    parser = argparse.ArgumentParser(prog="slipstream", description="PyTorch-native high-performance training.")
    sub = parser.add_subparsers(dest="command", required=True)
    # The order is the order of `slipstream --help` and of launch's list of commands.
    for group in (train, perf, launch, checkpoint, data, config, bench, plan, tune, report):
        group.add_commands(sub)
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
