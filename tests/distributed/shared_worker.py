"""One torchrun launch for the scenario workers of several test modules.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/distributed/shared_worker.py OUT_DIR PART ...

A launch costs seconds before its first scenario and after its last (torchrun, one torch import
per rank, the rendezvous, the teardown: about 6 s at world 2 and 9 s at world 4 on 2 cores),
so the modules below share one launch per world size (tests/distributed/conftest.py) instead of
starting one each. Each PART runs its worker's scenarios exactly as the worker's own launch
would (`run_scenarios`), into OUT_DIR/<PART>/, one part after the other in the same process
group; every rank then writes OUT_DIR/<PART>/exit_rank<R>.json with the part's exit code and
seconds. Before each part the process-wide state a fresh worker process starts with is put back:
the thread count, the global RNG, the deterministic-algorithms switch, the default dtype, the
environment and dynamo's caches and counters (ep reads the count of compiled graphs).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# part -> (worker module, the test module it serves, its world sizes, the seconds its own launch
# was given). pp runs last: after a failed pipeline scenario the other rank may be stuck in its
# communication.
PARTS: dict[str, tuple[str, str, tuple[int, ...], float]] = {
    "dp": ("tests.distributed.dp_worker", "test_data_parallel.py", (2, 4), 150),
    "ep": ("tests.distributed.ep_worker", "test_expert_parallel.py", (2, 4), 300),
    "dropout": ("tests.distributed.dropout_worker", "test_sharded_dropout.py", (2, 4), 240),
    "user_tp": ("tests.distributed.user_tp_worker", "test_user_tp_plan.py", (2,), 180),
    "pp": ("tests.distributed.pp_worker", "test_pipeline_parallel.py", (2, 4), 120),
}


class FreshState:
    """What a part may change for the parts after it, as this process had it before the first."""

    def __init__(self):
        self.threads = torch.get_num_threads()
        self.rng = torch.get_rng_state()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.dtype = torch.get_default_dtype()
        self.environ = dict(os.environ)

    def restore(self) -> None:
        torch.set_num_threads(self.threads)
        torch.set_rng_state(self.rng)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        os.environ.clear()
        os.environ.update(self.environ)
        dynamo = sys.modules.get("torch._dynamo")  # imported by a part that compiled (or its libraries)
        if dynamo is not None:
            dynamo.reset()
            dynamo.utils.counters.clear()


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    out, parts = Path(argv[0]), argv[1:]
    rank = int(os.environ["RANK"])
    fresh = FreshState()
    failed = []
    for part in parts:
        fresh.restore()
        where = out / part
        where.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            code = importlib.import_module(PARTS[part][0]).run_scenarios(where)
        except BaseException:  # outside any scenario: the ranks may disagree on what comes next, so stop
            (where / f"error_rank{rank}.txt").write_text(traceback.format_exc())
            raise
        (where / f"exit_rank{rank}.json").write_text(json.dumps({"rc": code, "seconds": time.perf_counter() - t0}))
        failed += [part] if code else []
        if dist.is_initialized():
            dist.barrier()  # the next part starts on every rank together, as a launch would
    fresh.restore()
    if dist.is_initialized():
        dist.destroy_process_group()
    if failed:
        print(f"rank {rank}: parts {failed} failed", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
