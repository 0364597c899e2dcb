"""`slipstream doctor` on expert-parallel runs: the moe_dispatch rule.

Under expert parallelism (parallel.ep > 1) every MoE layer's forward sends each token to the
rank that holds its experts and back (distributed/expert_parallel.py: an all-to-all of counts,
one of the token rows, the expert GEMMs, one back; the backward runs two more). An all-to-all
ends on every rank of the ep group only when the last one joins it, so a rank whose experts get
more tokens than the others' computes longer while the others wait. The rule puts two
measurements side by side:

* each rank's all-to-all wait per step, from its trace (perf.trace's a2a_wait_us): the time
  inside an all-to-all while no compute runs. What the traces show (torch 2.13):
  CPU, gloo: `_c10d_functional::all_to_all_single` (and `c10d::alltoall_base_` in it) posts one,
  gloo runs it on its own thread (a `gloo:all_to_all` range that lasts until every rank of the
  group is there), and the rank blocks in `_c10d_functional::wait_tensor` when it first uses the
  result: a top-level op, or nested in the op that touches the result (an `aten::new_zeros`
  via `PythonSubclass`, which the CPU timeline counts as compute: the wait is taken out of it).
  The backward's all-to-alls run inside `autograd::engine::evaluate_function:
  GeneratedBackwardFor__c10d_functional_all_to_all_single_defaultBackward`.
  CUDA, NCCL: the all-to-all runs as grouped sends and receives (`ncclDevKernel_SendRecv`), told
  from a pipeline's transfers by the kernel's "Collective name" (all_to_all / all_to_allv); the
  wait is such kernel time not overlapped by compute kernels.
* the share of the routed tokens each ep rank's experts received, from the run's metrics.jsonl:
  the last record with `moe/<layer>/load` (per expert, the fraction of the whole batch's routed
  tokens over the log interval). ep rank j holds experts [j E/ep, (j+1) E/ep), so its share is
  the sum of their loads; the fair share is 1/ep. The worst layer is the one whose most loaded
  ep rank is furthest above it. The ep ranks of a group are consecutive data-parallel ranks
  (the mesh is pp x dp_mod_ep x ep x cp x tp, outermost first).

It fires when a rank waits on the all-to-all for MOE_DISPATCH_MIN of its step or more while
another rank of its ep group gets MOE_OVERLOAD_MIN x its fair share or more and waits less
itself (the overloaded rank computes while the others wait).

metrics_records reads a metrics.jsonl for this rule and for pipeline_bubble (doctor.py).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slipstream.errors import UserError
from slipstream.perf.doctor import Finding, RunContext, format_ms, format_pct
from slipstream.perf.trace import TraceAnalysis

MOE_DISPATCH_MIN = 0.10  # a rank waiting on the all-to-all for this share of its step
MOE_OVERLOAD_MIN = 1.5  # an ep rank's experts receiving this multiple of the fair share (1/ep)
LOAD_SUFFIX = "/load"  # moe/<layer>/load in metrics.jsonl


def metrics_records(metrics: Path) -> Iterator[dict[str, Any]]:
    """The records of a run's metrics.jsonl in order; lines that don't parse (a run cut off while
    writing one) are skipped, a missing file has none."""
    from slipstream.safe_read import DOCUMENT, loads_bounded, read_line_capped

    with contextlib.suppress(OSError), open(metrics, "rb") as f:
        for line_no in itertools.count(1):
            line = read_line_capped(f, DOCUMENT, metrics, line_no)
            if not line:
                break
            record = None
            with contextlib.suppress(ValueError, UserError):
                record = loads_bounded(line, metrics)
            if isinstance(record, dict):
                yield record


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def last_moe_loads(metrics: Path) -> tuple[int | None, dict[str, list[float]]]:
    """(step, {layer: per-expert load}) of the last record with MoE loads; (None, {}) if none."""
    step, loads = None, {}
    for record in metrics_records(metrics):
        found = {key[len("moe/"):-len(LOAD_SUFFIX)]: [float(v) for v in value] for key, value in record.items()
                 if key.startswith("moe/") and key.endswith(LOAD_SUFFIX) and isinstance(value, list)
                 and value and all(is_number(v) for v in value)}
        if found:
            step, loads = (record["step"] if is_number(record.get("step")) else None), found
    return step, loads


def ep_place(rank: int, ep: int, tp: int = 1, cp: int = 1) -> tuple[tuple[int, int], int]:
    """(the ep group, the ep rank in it) of a global rank: the ep ranks are consecutive
    data-parallel ranks, so they sit tp x cp global ranks apart."""
    inner = tp * cp
    return (rank // (inner * ep), rank % inner), (rank // inner) % ep


def ep_token_shares(loads: dict[str, list[float]], ep: int) -> dict[str, list[float]]:
    """Per layer: the share of the routed tokens each ep rank's experts got (layers whose expert
    count ep does not divide are left out)."""
    out = {}
    for layer, load in loads.items():
        total = sum(load)
        if len(load) % ep or total <= 0:
            continue
        local = len(load) // ep
        out[layer] = [sum(load[j * local:(j + 1) * local]) / total for j in range(ep)]
    return out


def balancing_overrides(cfg) -> list[str]:
    """Turn on the auxiliary-loss-free bias (DeepSeek-V3's rate) if it is off, else a 10x
    stronger auxiliary loss."""
    m = cfg.model
    if m.moe_bias_rate == 0:
        return ["--model.moe_bias_rate=0.001"]
    return [f"--model.moe_aux_loss={10 * m.moe_aux_loss if m.moe_aux_loss > 0 else 0.01:g}"]


def rule_moe_dispatch(analyses: list[TraceAnalysis], cfg, loads: dict[str, list[float]],
                      metrics_step: int | None = None) -> Finding | None:
    """The finding for measured all-to-all waits (the analyses) and expert loads (`loads`: per
    layer, per expert, as metrics.jsonl logs them), or None (see the module doc)."""
    ep = cfg.parallel.ep if cfg is not None else 1
    timed = {a.rank: a for a in analyses if a.a2a_wait_us is not None}
    shares = ep_token_shares(loads, ep) if ep > 1 else {}
    if not timed or not shares:
        return None
    tp, cp = cfg.parallel.tp, cfg.parallel.cp
    worst_layer = max(shares, key=lambda layer: max(shares[layer]))
    token = shares[worst_layer]
    ratio = [ep * s for s in token]
    heavy = max(range(ep), key=ratio.__getitem__)  # the most loaded ep rank
    if ratio[heavy] < MOE_OVERLOAD_MIN:
        return None
    wait = {r: a.share(a.a2a_wait_us) for r, a in timed.items()}
    # Ranks waiting long enough, each longer than its group's overloaded rank (when traced).
    waiting = []
    for r in timed:
        group, j = ep_place(r, ep, tp, cp)
        heavy_rank = group[0] * tp * cp * ep + heavy * tp * cp + group[1]
        if j != heavy and wait[r] >= MOE_DISPATCH_MIN and wait[r] > wait.get(heavy_rank, 0.0):
            waiting.append((wait[r], r, heavy_rank))
    if not waiting:
        return None
    share, waiter, heavy_rank = max(waiting)
    per_rank = ", ".join(f"rank {r} {format_ms(timed[r].a2a_wait_us)} ({format_pct(wait[r])})" for r in sorted(timed))
    local = len(loads[worst_layer]) // ep
    per_ep = ", ".join(f"ep rank {j} (experts {j * local}-{(j + 1) * local - 1}) {format_pct(token[j])} "
                       f"({ratio[j]:.1f}x)" for j in range(ep))
    where = f"step {metrics_step}" if metrics_step is not None else "the last log interval"
    others = ", ".join(f"{layer} {max(s) * ep:.1f}x" for layer, s in shares.items() if layer != worst_layer)
    return Finding(
        "moe_dispatch",
        f"rank {waiter} waits on the MoE all-to-all for {format_pct(share)} of the step: rank {heavy_rank}'s experts "
        f"get {ratio[heavy]:.1f}x their share of the tokens",
        f"all-to-all wait per step with no compute running: {per_rank}; tokens routed to each ep rank's experts "
        f"in {worst_layer}, the worst layer (metrics.jsonl, {where}; fair share {format_pct(1 / ep)}): {per_ep}"
        + (f"; the most loaded ep rank in the other layers: {others}" if others else ""),
        share,
        "balance the experts' load: raise model.moe_aux_loss (the auxiliary load-balancing loss), or turn on "
        "model.moe_bias_rate (auxiliary-loss-free balancing: every step moves each expert's routing bias toward "
        "balance; 1e-3 is DeepSeek-V3's), or cap what an expert takes with model.moe_dropless=false and "
        "model.moe_capacity_factor (e.g. 1.25 x the fair share; the overflow tokens are dropped and pass on "
        "through the residual)",
        balancing_overrides(cfg),
        {"share": wait, "a2a_wait_us": {r: a.a2a_wait_us for r, a in timed.items()},
         "step_us": {r: a.step_us for r, a in timed.items()}, "token_share": dict(enumerate(token)),
         "token_ratio": dict(enumerate(ratio)), "worst_layer": worst_layer, "layers": shares, "ep": ep,
         "waiting_rank": waiter, "overloaded_rank": heavy_rank, "overloaded_ep_rank": heavy,
         "metrics_step": metrics_step},
        rank=waiter, ranks=sorted(r for _, r, _ in waiting))


def moe_dispatch(analyses: list[TraceAnalysis], run: RunContext) -> Finding | None:
    """rule_moe_dispatch with the loads of the run's metrics.jsonl (the run dir beside the traces)."""
    if run.cfg is None or run.cfg.parallel.ep <= 1 or run.run_dir is None:
        return None
    if all(a.a2a_wait_us is None for a in analyses):
        return None
    step, loads = last_moe_loads(Path(run.run_dir) / "metrics.jsonl")
    return rule_moe_dispatch(analyses, run.cfg, loads, step)
