"""Read a PyTorch chrome trace and measure where each profiled step's time goes.

The input is the JSON that `torch.profiler` writes with `export_chrome_trace` (plain or
gzipped). Steps are the `ProfilerStep#N` ranges the profiler records on every
`prof.step()`, so a trace without a schedule has no steps and is rejected.

What "busy" means depends on the trace:

* CUDA traces (device kernels present): the device timeline. Compute = kernels,
  communication = NCCL/gloo kernels, memory copies = Memcpy/Memset, idle = the part of
  the step window where no device activity runs.
* CPU traces: the host timeline. Compute = top-level CPU ops (an op not nested in
  another op on its thread; nested ops are already inside their parent's time),
  communication = c10d/gloo ops, idle = the step window not covered by any top-level op
  (Python overhead, sleeping, waiting for data).

The split is made exclusive so it adds up to the step time:
compute + exposed communication + exposed memory copies + idle = step.

Slipstream's trainer labels its phases with record_function ranges named
`slipstream/data`, `slipstream/forward`, ...; they give the data-loading wait. Traces
from other programs work too; the data wait is then reported as unknown.

Pipeline parallelism: the trainer runs each step's schedule inside `slipstream/pipeline`.
What a pipelined trace shows there (CPU, gloo; torch 2.13): the stage's forward/backward
ops, the `c10d::send` / `c10d::recv_` ops that post each transfer, and a `gloo:send` /
`gloo:recv` range per transfer. The wait sits in one or the other: a `c10d::recv_` (or
send) that blocks until the peer is there, its gloo range then lasting microseconds, or a
short post followed by a gloo range that lasts until the schedule's wait returns (1F1B posts
a send and a recv together and waits for both). torch's 1F1B and interleaved schedules
label no forward/backward chunks, so the chunks can't be timed from the trace, and the
op-free time of the range is mostly the schedule's Python gaps between ops, not waiting.
So the bubble is measured from the transfers: the part of the pipeline range inside a
transfer (the union of those ops and ranges) while no compute runs (CPU: no top-level op
but communication; CUDA: NCCL SendRecv kernels not overlapped by compute kernels, in the
device copy of the range). A stage that finishes early and then waits in a collective
(the tied embedding's all-reduce, the gradient norm) is not counted: a lower bound.

Expert parallelism (MoE dispatch): the all-to-all wait is the time inside an all-to-all while no
compute runs; perf/doctor_moe.py says what the traces show of them (gloo, NCCL).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import sys
from bisect import bisect_left
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream import safe_read
from slipstream.errors import UserError
from slipstream.perf.intervals import intersect, length, subtract, union

LABEL_PREFIX = "slipstream/"
DATA_LABEL = "slipstream/data"
PIPELINE_LABEL = "slipstream/pipeline"

# A pipeline's point-to-point transfers on the host timeline (gloo's range of each transfer
# and the ops that post them); on the device, NCCL's p2p kernel (NCCL's host ranges end when
# the work is queued, so they say nothing about waiting).
P2P_RANGES = frozenset({"gloo:send", "gloo:recv"})
P2P_POST_OPS = frozenset({"c10d::send", "c10d::recv_", "c10d::recv_any_source_"})
P2P_KERNEL_MARKER = "sendrecv"  # ncclDevKernel_SendRecv, ncclKernel_SendRecv_RING_...
A2A_MARKERS = ("all_to_all", "alltoall")  # in the name (CPU) or a kernel's collective name (CUDA)
WAIT_OPS = frozenset({"_c10d_functional::wait_tensor", "c10d_functional::wait_tensor"})

# Host-device synchronization points: the host blocks until the device catches up.
# On a CPU trace they cost nothing yet, but the same code stalls the GPU pipeline.
SYNC_OPS = frozenset({
    "aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero",
    "aten::equal", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
    "cudaMemcpy",  # the synchronous variant; cudaMemcpyAsync is not a sync point
})
# The runtime calls that actually block: on a CUDA trace an aten::item counts only when one
# of these runs inside it (item() on a CPU tensor, e.g. in the data pipeline, blocks nothing).
RUNTIME_SYNCS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"})

# Substrings (lowercase) of communication ops and kernels.
COMM_MARKERS = ("nccl", "gloo", "c10d", "all_reduce", "allreduce", "all_gather", "allgather",
                "reduce_scatter", "reducescatter", "all_to_all", "alltoall", "record_param_comms")

HOST_OP_CATS = frozenset({"cpu_op", "operator"})  # "operator": older torch versions
DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"})
DEVICE_ANNOTATION_CAT = "gpu_user_annotation"  # device-side copies of record_function ranges

# Launch-bound detection: many top-level ops that are each too short to amortize the
# per-op dispatch/launch overhead.
TINY_OP_US = 20.0
LAUNCH_BOUND_MIN_OPS = 200
TINY_STRETCH_MIN_OPS = 20  # a run of at least this many consecutive tiny ops is a "stretch"
MIN_GAP_US = 50.0  # idle gaps shorter than this are normal launch latency, not worth listing

_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
_RANK_RE = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


@dataclass(frozen=True, slots=True)  # slots: a big trace keeps millions of these
class Event:
    """One complete ("X") event; times in microseconds as the trace stores them."""

    name: str
    cat: str
    ts: float
    dur: float
    pid: Any
    tid: Any
    collective: str | None = None  # NCCL kernels: the "Collective name" of their args

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass
class Trace:
    path: str
    rank: int
    events: list[Event]
    steps: list[Event]  # the ProfilerStep#N ranges, in time order
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def is_cuda(self) -> bool:
        return any(e.cat in DEVICE_CATS for e in self.events)


@dataclass
class Gap:
    """A stretch of the step where the device (CPU traces: the host ops) did nothing."""

    step: int
    offset_us: float  # from the start of the step
    dur_us: float
    host: list[tuple[str, float]]  # host ranges overlapping the gap: (name, overlap µs), longest first


@dataclass
class StepStats:
    step: int
    start_us: float
    step_us: float
    compute_us: float
    comm_us: float  # all communication time
    comm_exposed_us: float  # communication not hidden under compute
    memcpy_us: float  # copies not hidden under compute or communication
    idle_us: float
    long_idle_us: float  # idle in gaps >= MIN_GAP_US outside slipstream/data (short gaps: launch overhead)
    data_wait_us: float | None  # None: the trace has no slipstream labels
    phases_us: dict[str, float]
    sync_points: int  # outermost sync events (aten::item calls _local_scalar_dense: one point)
    sync_us: float
    sync_ops: dict[str, int]  # the sync-op events of these points by name, nested ones included
    top_level_ops: int
    tiny_ops: int
    tiny_stretch_us: float  # wall time of runs of consecutive tiny ops (launch overhead included)
    gaps: list[Gap]  # idle gaps, the pipeline's transfer wait left out (that is pp_wait_us)
    # Pipelined runs (a slipstream/pipeline range in the trace), else None:
    pipeline_us: float | None = None  # time inside slipstream/pipeline
    pp_wait_us: float | None = None  # of it: inside a p2p transfer with no compute running (the bubble)
    pp_wait_comm_us: float | None = None  # the part of pp_wait_us counted in comm_exposed_us too
    pp_transfers: int = 0  # p2p transfers (sends and receives) in the pipeline range
    a2a_wait_us: float | None = None  # traces with all-to-alls (else None): in one with no compute running


@dataclass
class TraceAnalysis:
    path: str
    rank: int
    device: str  # "cuda" or "cpu": which timeline "busy" refers to
    steps: list[StepStats]
    has_labels: bool
    # Averages per step (microseconds).
    step_us: float
    step_us_median: float
    compute_us: float
    comm_us: float
    comm_exposed_us: float
    memcpy_us: float
    idle_us: float
    long_idle_us: float
    data_wait_us: float | None
    phases_us: dict[str, float]
    sync_points_per_step: float
    sync_us: float
    sync_ops_per_step: dict[str, float]
    ops_per_step: float
    median_op_us: float
    tiny_stretch_us: float
    top_ops: list[dict[str, Any]]  # host top-level ops by total time
    top_kernels: list[dict[str, Any]]  # device kernels by total time (CUDA traces)
    gaps: list[Gap]  # the longest idle gaps over all steps
    idle_by_host: dict[str, float]  # per step: idle time by what the host was doing
    notes: list[str]
    # Pipelined runs only (else None): per step, see StepStats.
    pipeline_us: float | None = None
    pp_wait_us: float | None = None
    pp_wait_comm_us: float | None = None
    pp_transfers_per_step: float = 0.0
    a2a_wait_us: float | None = None  # traces with all-to-alls (expert parallelism) only, see StepStats

    @property
    def pp_bubble(self) -> float | None:
        """The transfer wait's share of the pipeline range (the schedule's time), comparable with
        the trainer's logged pp_bubble; share(pp_wait_us) is its share of the whole step."""
        if self.pp_wait_us is None or not self.pipeline_us:
            return None
        return self.pp_wait_us / self.pipeline_us

    @property
    def comm_overlapped_us(self) -> float:
        return self.comm_us - self.comm_exposed_us

    def share(self, us: float | None) -> float | None:
        """Fraction of the mean step time."""
        if us is None:
            return None
        return us / self.step_us if self.step_us > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["comm_overlapped_us"] = self.comm_overlapped_us
        return out


# ---------------------------------------------------------------------------- loading


def _rank_of(p: Path, data: dict[str, Any], default: int) -> int:
    m = _RANK_RE.search(p.name)
    if m:
        return int(m.group(1))
    info = data.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    return default


def _event(e: Any) -> Event | None:
    """The Event of one raw trace event, or None for anything but a well-formed complete event."""
    # Only complete events have a duration; metadata, flow and counter events don't.
    if not isinstance(e, dict) or e.get("ph") != "X":
        return None
    name, cat, pid, tid = e.get("name", ""), e.get("cat", ""), e.get("pid"), e.get("tid")
    # A file from elsewhere may put anything here: keep scalars only (a nested list would be
    # unhashable as a thread key, and printing a deep one recurses).
    if not all(v is None or isinstance(v, (str, int, float)) for v in (name, cat, pid, tid)):
        return None
    try:
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
    except (KeyError, TypeError, ValueError):
        return None  # a malformed event: skip it rather than reject the whole trace
    coll = e["args"].get("Collective name") if isinstance(e.get("args"), dict) else None
    # Names repeat millions of times in a big trace: one shared string each saves memory.
    return Event(sys.intern(str(name)), sys.intern(str(cat).lower()), ts, dur, pid, tid,
                 sys.intern(coll) if isinstance(coll, str) else None)


def _read_events(p: Path, cap: safe_read.Cap) -> tuple[list[Event], dict[str, Any]]:
    """The complete events and the other top-level members of a chrome trace (.json or
    .json.gz, told by the content). The file is parsed as a stream: memory holds the kept
    events, not the whole JSON, and the cap bounds the (decompressed) bytes read."""
    stream = safe_read.JsonStream(
        p, cap, decompress=True, what="chrome trace",
        # The file starts like JSON but does not parse: almost always an interrupted write.
        hint="; the trace is probably truncated (the run stopped while the profiler was writing it)")
    first = stream.peek()
    if first not in ("{", "["):
        raise UserError(f"{p}: not a chrome trace (not JSON); pass the .json or .json.gz file "
                        "that torch.profiler's export_chrome_trace wrote")
    events: list[Event] = []
    metadata: dict[str, Any] = {}

    def keep(raw_events: Any) -> None:
        for raw in raw_events:
            event = _event(raw)
            if event is not None:
                events.append(event)

    if first == "[":  # the chrome format also allows a bare array of events
        keep(stream.items())
        found = True
    else:
        found = False
        for key in stream.members():
            if key != "traceEvents":
                metadata[key] = stream.value()
                continue
            if stream.peek() != "[":
                stream.value()  # parse it, so that a damaged file says so first
                raise UserError(f"{p}: 'traceEvents' must be a list of events")
            found = True
            keep(stream.items())
    stream.finish()
    if not found:
        raise UserError(f"{p}: JSON without 'traceEvents': not a chrome trace from torch.profiler")
    return events, metadata


def load_trace(path: str | Path, default_rank: int = 0, max_bytes: int | None = None) -> Trace:
    """Read one chrome trace (.json or .json.gz). Raises UserError for anything else.

    The rank comes from the file name (`rank3.json`), else the trace's distributedInfo,
    else `default_rank`. max_bytes caps the (decompressed) size read: None is
    safe_read.TRACE's default.
    """
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{p} is a folder; pass the trace files in it (e.g. {p}/rank0.json)")
    if not p.is_file():
        raise UserError(f"trace file {p} does not exist")
    events, metadata = _read_events(p, safe_read.TRACE.with_limit(max_bytes))
    events.sort(key=lambda e: (e.ts, -e.dur))

    # The profiler also mirrors ranges onto the device timeline; the host copy is the step.
    steps, seen = [], set()
    for e in events:
        m = _STEP_RE.match(e.name)
        if m and e.cat != DEVICE_ANNOTATION_CAT and m.group(1) not in seen:
            seen.add(m.group(1))
            steps.append(e)
    if steps and all(step.dur <= 0 for step in steps):
        raise UserError(f"{p}: its ProfilerStep events have no duration; the trace is damaged or incomplete")
    if not steps:
        raise UserError(f"{p}: no steps: the trace has no ProfilerStep#N events. Profile with a schedule "
                        "(torch.profiler.schedule and prof.step() after each step) or use `slipstream profile`")
    return Trace(str(p), _rank_of(p, metadata, default_rank), events, steps, metadata)


def _clip(events: list[Event], start: float, end: float) -> list[tuple[float, float]]:
    return [(max(e.ts, start), min(e.end, end)) for e in events if e.end > start and e.ts < end]


def _is_comm(name: str) -> bool:
    low = name.lower()
    return any(m in low for m in COMM_MARKERS)


def _is_p2p(e: Event, cuda: bool) -> bool:
    if cuda:
        return e.cat == "kernel" and P2P_KERNEL_MARKER in e.name.lower() and not _is_a2a(e, cuda)
    return e.name in P2P_RANGES or e.name in P2P_POST_OPS


def _is_a2a(e: Event, cuda: bool) -> bool:
    """An all-to-all: on CUDA its kernel, on CPU its ops and gloo's range of it."""
    what = (f"{e.name} {e.collective}" if e.collective else e.name).lower() if (e.cat == "kernel") == cuda else ""
    return any(m in what for m in A2A_MARKERS)


def _is_memcpy(e: Event) -> bool:
    return e.cat in ("gpu_memcpy", "gpu_memset", "memcpy", "memset") or e.name.startswith(("Memcpy", "Memset"))


def _by_thread(events: list[Event]) -> list[list[Event]]:
    by_thread: dict[Any, list[Event]] = defaultdict(list)
    for e in events:
        by_thread[(e.pid, e.tid)].append(e)
    return list(by_thread.values())


def _outermost(events: list[Event]) -> list[tuple[Event, list[Event]]]:
    """(outermost event, the events nested in it) per thread, in time order.

    Events are sorted by (start, longest first), so a parent always precedes its children.
    """
    out = []
    for thread_events in _by_thread(events):
        end = float("-inf")  # end of the current outermost event on this thread
        for e in thread_events:
            # 1e-3 µs slack: a child may end at its parent's end up to rounding.
            if e.ts >= end - 1e-3:
                out.append((e, []))
                end = e.end
            else:
                out[-1][1].append(e)
    out.sort(key=lambda pair: pair[0].ts)
    return out


def _sync_points(events: list[Event], top_ops: list[Event], data_ranges: list[Event],
                 cuda: bool) -> list[tuple[Event, list[str]]]:
    """The host-device sync points: (outermost sync event, names of the sync events in it).

    CUDA traces: only points where a blocking runtime call runs. CPU traces can't show
    that, so they count the sync ops the step's own code calls (top-level ops) outside
    slipstream/data: an aten::item inside another op (CPU fused AdamW reads its step count)
    or in the data pipeline works on CPU tensors and would not block a GPU either.
    """
    top_ids = {id(e) for e in top_ops}
    data = _Index(data_ranges)
    points = []
    for outer, nested in _outermost([e for e in events if e.name in SYNC_OPS]):
        names = [outer.name] + [e.name for e in nested]
        if cuda:
            keep = any(n in RUNTIME_SYNCS for n in names)
        else:
            keep = id(outer) in top_ids and not data.overlapping(outer.ts, outer.end)
        if keep:
            points.append((outer, names))
    return points


class _Index:
    """Events sorted by start time, to find those overlapping a window quickly."""

    def __init__(self, events: list[Event]):
        self.events = sorted(events, key=lambda e: e.ts)
        self.starts = [e.ts for e in self.events]
        self.max_dur = max((e.dur for e in self.events), default=0.0)

    def overlapping(self, start: float, end: float) -> list[Event]:
        lo = bisect_left(self.starts, start - self.max_dur)
        hi = bisect_left(self.starts, end)
        return [e for e in self.events[lo:hi] if e.end > start]

    def starting_in(self, start: float, end: float) -> list[Event]:
        return self.events[bisect_left(self.starts, start):bisect_left(self.starts, end)]


# ---------------------------------------------------------------------------- analysis


def _tiny_stretches(ops: list[Event]) -> float:
    """Wall time covered by runs of >= TINY_STRETCH_MIN_OPS consecutive tiny top-level ops."""
    total, run = 0.0, []
    for e in ops + [None]:
        if e is not None and e.dur < TINY_OP_US:
            run.append(e)
            continue
        if len(run) >= TINY_STRETCH_MIN_OPS:
            total += run[-1].end - run[0].ts
        run = []
    return total


def analyze(trace: Trace, top_n: int = 10) -> TraceAnalysis:
    """Per-step measurements of one trace, and their averages."""
    cuda = trace.is_cuda
    top_ops = [outer for outer, _ in _outermost([e for e in trace.events if e.cat in HOST_OP_CATS])]
    labels = [e for e in trace.events if e.name.startswith(LABEL_PREFIX) and e.cat != DEVICE_ANNOTATION_CAT]
    sync_points = _sync_points(trace.events, top_ops, [e for e in labels if e.name == DATA_LABEL], cuda)
    has_labels = any(e.name == DATA_LABEL for e in labels)
    device = [e for e in trace.events if e.cat in DEVICE_CATS]

    # What counts as busy: the device timeline on CUDA, top-level host ops on CPU.
    busy_events = device if cuda else top_ops
    comm_idx = _Index([e for e in busy_events if _is_comm(e.name)])
    copy_idx = _Index([e for e in busy_events if _is_memcpy(e) and not _is_comm(e.name)])
    compute_idx = _Index([e for e in busy_events if not _is_memcpy(e) and not _is_comm(e.name)])
    top_idx, label_idx = _Index(top_ops), _Index(labels)
    sync_idx = _Index([outer for outer, _ in sync_points])
    sync_names = {id(outer): names for outer, names in sync_points}
    # Host context for gaps: our labels, top-level ops and runtime calls (e.g. a sync wait).
    host_ctx_idx = _Index(labels + top_ops + [e for e in trace.events if e.cat in ("cuda_runtime", "cuda_driver")])
    # The pipeline's range: on CUDA its device copy (the kernels run after the host range), if any.
    pipeline = [e for e in labels if e.name == PIPELINE_LABEL]
    if cuda:
        pipeline = [e for e in trace.events if e.name == PIPELINE_LABEL and e.cat == DEVICE_ANNOTATION_CAT] or pipeline
    pipeline_idx = _Index(pipeline)
    p2p_idx = _Index([e for e in trace.events if _is_p2p(e, cuda)])
    a2a_idx = _Index([e for e in trace.events if _is_a2a(e, cuda)])
    wait_idx = _Index([] if cuda else [e for e in trace.events if e.name in WAIT_OPS])

    steps: list[StepStats] = []
    for step_event in trace.steps:
        s, e = step_event.ts, step_event.end
        number = int(_STEP_RE.match(step_event.name).group(1))
        compute = union(_clip(compute_idx.overlapping(s, e), s, e))
        comm = union(_clip(comm_idx.overlapping(s, e), s, e))
        copies = union(_clip(copy_idx.overlapping(s, e), s, e))
        busy = union(compute + comm + copies)
        comm_exposed = subtract(comm, compute)
        copies_exposed = subtract(copies, union(compute + comm))
        idle = subtract([(s, e)], busy)

        phases: dict[str, float] = {}
        step_labels = label_idx.overlapping(s, e)
        for name in sorted({x.name for x in step_labels}):
            phases[name] = length(union(_clip([x for x in step_labels if x.name == name], s, e)))

        pipe_window = union(_clip(pipeline_idx.overlapping(s, e), s, e))
        transfers = union(_clip(p2p_idx.overlapping(s, e), s, e))
        pp_wait = subtract(intersect(transfers, pipe_window), compute)
        pp = {} if not pipeline else {
            "pipeline_us": length(pipe_window), "pp_wait_us": length(pp_wait),
            "pp_wait_comm_us": length(intersect(pp_wait, comm_exposed)),
            "pp_transfers": sum(1 for x in p2p_idx.starting_in(s, e)
                                if x.name not in P2P_POST_OPS and any(ws <= x.ts < we for ws, we in pipe_window))}

        # CPU: where a rank blocks for a collective's result (wait_tensor, even inside an op) is no compute.
        waits = union(_clip(wait_idx.overlapping(s, e), s, e))
        a2a = {} if not a2a_idx.events else {
            "a2a_wait_us": length(subtract(union(_clip(a2a_idx.overlapping(s, e), s, e)), subtract(compute, waits)))}

        data_ranges = union(_clip([x for x in step_labels if x.name == DATA_LABEL], s, e))
        long_idle = sum(ge - gs for gs, ge in subtract(idle, union(data_ranges + pp_wait)) if ge - gs >= MIN_GAP_US)

        gaps = []
        for gs, ge in subtract(idle, pp_wait):
            if ge - gs < MIN_GAP_US:
                continue
            overlap: Counter[str] = Counter()
            for h in host_ctx_idx.overlapping(gs, ge):
                overlap[h.name] += min(h.end, ge) - max(h.ts, gs)
            gaps.append(Gap(number, gs - s, ge - gs, overlap.most_common(3)))

        ops_in_step = top_idx.starting_in(s, e)
        syncs = sync_idx.starting_in(s, e)
        steps.append(StepStats(
            step=number, start_us=s, step_us=e - s,
            compute_us=length(compute), comm_us=length(comm), comm_exposed_us=length(comm_exposed),
            memcpy_us=length(copies_exposed), idle_us=length(idle), long_idle_us=long_idle,
            data_wait_us=phases.get(DATA_LABEL, 0.0) if has_labels else None, phases_us=phases,
            sync_points=len(syncs), sync_us=sum(x.dur for x in syncs),
            sync_ops=dict(Counter(name for x in syncs for name in sync_names[id(x)])),
            top_level_ops=len(ops_in_step), tiny_ops=sum(1 for x in ops_in_step if x.dur < TINY_OP_US),
            tiny_stretch_us=_tiny_stretches(ops_in_step), gaps=gaps, **pp, **a2a))

    n = len(steps)

    def mean(values: list[float]) -> float:
        return sum(values) / n

    # Totals by name over the events that start inside a step, for the "top ops / kernels" tables.
    def top_by_name(events: list[Event]) -> list[dict[str, Any]]:
        total, count = Counter(), Counter()
        for x in events:
            total[x.name] += x.dur
            count[x.name] += 1
        return [{"name": k, "total_us": v, "per_step_us": v / n, "count": count[k]}
                for k, v in total.most_common(top_n)]

    step_ops = [x for st in trace.steps for x in top_idx.starting_in(st.ts, st.end)]
    device_idx = _Index(device)
    step_kernels = [x for st in trace.steps for x in device_idx.starting_in(st.ts, st.end)]

    idle_by_host: Counter[str] = Counter()
    for st in steps:
        for g in st.gaps:
            explained = 0.0
            for name, us in g.host:
                idle_by_host[name] += us / n
                explained += us
            if g.dur_us - explained > 0:
                # No op or label on the host: Python code, a sleep or a blocking call.
                idle_by_host["(no op recorded)"] += (g.dur_us - explained) / n

    seen_sync_ops = sorted({k for st in steps for k in st.sync_ops})
    all_phase_names = sorted({k for st in steps for k in st.phases_us})
    notes = []
    if not has_labels:
        notes.append("no slipstream/data labels in this trace: data wait is unknown (reported as 0)")
    if not cuda:
        notes.append("CPU trace: busy time is top-level CPU op time, idle is the step time outside any op")

    all_gaps = sorted((g for st in steps for g in st.gaps), key=lambda g: -g.dur_us)
    step_times = [st.step_us for st in steps]
    return TraceAnalysis(
        path=trace.path, rank=trace.rank, device="cuda" if cuda else "cpu", steps=steps, has_labels=has_labels,
        step_us=mean(step_times), step_us_median=statistics.median(step_times),
        compute_us=mean([st.compute_us for st in steps]), comm_us=mean([st.comm_us for st in steps]),
        comm_exposed_us=mean([st.comm_exposed_us for st in steps]),
        memcpy_us=mean([st.memcpy_us for st in steps]), idle_us=mean([st.idle_us for st in steps]),
        long_idle_us=mean([st.long_idle_us for st in steps]),
        data_wait_us=mean([st.data_wait_us for st in steps]) if has_labels else None,
        phases_us={k: mean([st.phases_us.get(k, 0.0) for st in steps]) for k in all_phase_names},
        sync_points_per_step=mean([st.sync_points for st in steps]), sync_us=mean([st.sync_us for st in steps]),
        sync_ops_per_step={k: mean([st.sync_ops.get(k, 0) for st in steps]) for k in seen_sync_ops},
        ops_per_step=mean([st.top_level_ops for st in steps]),
        median_op_us=statistics.median([x.dur for x in step_ops]) if step_ops else 0.0,
        tiny_stretch_us=mean([st.tiny_stretch_us for st in steps]),
        top_ops=top_by_name(step_ops), top_kernels=top_by_name(step_kernels),
        gaps=all_gaps[:top_n], idle_by_host=dict(idle_by_host.most_common(top_n)), notes=notes,
        pipeline_us=mean([st.pipeline_us for st in steps]) if pipeline else None,
        pp_wait_us=mean([st.pp_wait_us for st in steps]) if pipeline else None,
        pp_wait_comm_us=mean([st.pp_wait_comm_us for st in steps]) if pipeline else None,
        pp_transfers_per_step=mean([st.pp_transfers for st in steps]),
        a2a_wait_us=mean([st.a2a_wait_us for st in steps]) if a2a_idx.events else None)


def load_and_analyze(paths: list[str | Path], max_bytes: int | None = None) -> list[TraceAnalysis]:
    """Analyze several traces (one per rank); ranks default to the position in the list.
    max_bytes: the cap on each trace's (decompressed) size, see load_trace."""
    if not paths:
        raise UserError("no trace files given")
    traces = [load_trace(p, default_rank=i, max_bytes=max_bytes) for i, p in enumerate(paths)]
    by_rank: dict[int, list[str]] = {}
    for t in traces:
        by_rank.setdefault(t.rank, []).append(t.path)
    clashes = {rank: files for rank, files in by_rank.items() if len(files) > 1}
    if clashes:
        rank, files = next(iter(clashes.items()))
        raise UserError(f"several traces claim rank {rank} ({', '.join(files)}); pass one trace per rank of "
                        "the same run (e.g. <run dir>/traces/rank*.json)")
    return [analyze(t) for t in traces]
