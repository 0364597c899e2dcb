"""The collectives of a training step as the planner models them: one record per kind and group
(`Collective`), and their time as NCCL runs them (docs/planner-collectives.md).

NCCL times every call of every (algorithm, protocol) with its own tuning model and runs the
fastest; `call_time` does the same with that model's constants (src/graph/tuning.cc, NCCL
v2.27.7-1, quoted with their lines below):

    time = latency(algorithm, protocol, where the ranks sit) + bytes / algorithm bandwidth

algorithms  ring (every collective), tree (all-reduce: a chain within each node and a binary
            tree between nodes, so its latency grows with log2 of the nodes where a ring's grows
            with the ranks), PAT (all-gather / reduce-scatter with one rank per node), NVLS and
            NVLS-tree (all-reduce in the NVSwitch, where the link table says it has NVLink SHARP).
protocols   LL (8-byte flag + data stores: the lowest latency, half the bandwidth), LL128
            (128-byte lines: 120/128 of the bandwidth, on NVLink only) and Simple (the full
            bandwidth, the highest latency): tiny messages go LL, large ones Simple.
steps       a ring's steps within a node pay the node link's latency, the steps between nodes
            the network's (hierarchical: 2(nodes-1) of an all-reduce's 2(n-1) steps cross nodes).

The bandwidth a group gets is Cluster.link_for's (the NVLink of a node, or the node's NICs shared
by its ranks). Links NCCL does not run (Link.fabric "": gloo on a CPU, RCCL's Infinity Fabric) are
a plain ring: steps x the link's latency + bus bytes / bandwidth (ring_time). All-to-all is
point-to-point traffic outside the tuning model (all_to_all_time).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from slipstream.plan.hardware import CPU, Cluster
from slipstream.plan.links import Link

NCCL_RELEASE = "v2.27.7-1"   # the release whose src/graph/tuning.cc the constants below are quoted from
PROTOCOLS = ("LL", "LL128", "Simple")

# Base latency per call, us: baseLat[algorithm][protocol] (tuning.cc lines 134-137). NVLS's is 0.
BASE_LATENCY_US = {"tree": {"LL": 6.8, "LL128": 14.0, "Simple": 8.4},
                   "ring": {"LL": 6.6, "LL128": 14.0, "Simple": 8.4}}
# Latency per step (ring) or per hop (tree), us, by hardware: hwLat[NVLINK | PCI | NET][algorithm]
# [protocol] (tuning.cc lines 143-156). Link.latency_us scales a fabric's row: the table's links
# carry hwLat[.][ring][Simple] (3.4 / 5.7 / 14.0), so they get NCCL's numbers exactly.
HW_LATENCY_US = {
    "nvlink": {"tree": {"LL": 0.6, "LL128": 1.25, "Simple": 4.0}, "ring": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4},
               "nvls": {"Simple": 25.0}, "nvls_tree": {"Simple": 25.0}},
    "pcie": {"tree": {"LL": 1.0, "LL128": 1.9, "Simple": 4.0}, "ring": {"LL": 1.0, "LL128": 2.5, "Simple": 5.7}},
    "net": {"tree": {"LL": 5.0, "LL128": 8.5, "Simple": 14.0}, "ring": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0},
            "nvls": {"Simple": 18.0}, "nvls_tree": {"Simple": 14.0}},
}
# A multi-node ring's steps within a node still post network work: at least this many us per
# step (getNetOverhead, tuning.cc lines 204-209: 1.0 on Intel x86, 2.0 on AMD; we plan Intel's),
# x3 for Simple (line 351).
NET_OVERHEAD_US = 1.0
NET_OVERHEAD_SIMPLE = 3.0
# Bus-bandwidth factors of the protocols on the link's (Simple ring) bus bandwidth (tuning.cc
# lines 279-283): ring LL 0.5 (capped at LL_MAX_BUSBW), ring LL128 0.92 (120/128), tree
# all-reduce 0.92, then tree LL 1/3.8 (capped) and tree LL128 7/9 on one node, 120/128 across.
RING_LL = 0.5
RING_LL128 = 0.92
TREE = 0.92
TREE_LL = 1.0 / 3.8
TREE_LL128_NODE, TREE_LL128_NET = 7.0 / 9.0, 120.0 / 128.0
# LL's bus bandwidth ceiling, GB/s: llMaxBws (tuning.cc lines 165-170), by GPU generation on one
# node, by host CPU across nodes ([1 node, 2 nodes, more]; Intel's row, as NET_OVERHEAD_US).
LL_MAX_BUSBW_NODE = {"volta": 39.0, "turing": 39.0, "ampere": 87.7, "ada": 87.7, "hopper": 141.0,
                     "blackwell": 282.0}
LL_MAX_BUSBW_NET = (39.0, 20.4)    # 2 nodes, more (Intel row of llMaxBws)
# Multi-node ring all-reduce with Simple: latency x 1.4 (sm80 and later) or 1.9 (older), the
# "plateau effect of ring" (tuning.cc lines 570-573), once each channel's share of each rank's
# slice is at least 64 bytes: nBytes / (nChannels x nRanks) >= 64 (line 570).
RING_PLATEAU = 1.4
RING_PLATEAU_OLD = 1.9
RING_PLATEAU_MIN_BYTES = 64
# The channels that condition divides by: NCCL picks them per topology at init; we assume 16, what
# it logs on an 8-GPU NVLink node ("16 coll channels, 0 nvls channels, 16 p2p channels", an 8 x H800
# node: https://github.com/NVIDIA/nccl/issues/892). Fewer channels would start the plateau earlier.
NCCL_CHANNELS = 16
# Tree all-reduce's bandwidth correction by message size, powers of two from 64 B to 256 MiB
# (treeCorrectionFactor, tuning.cc lines 555-559; applied at line 569).
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
}
# PAT (all-gather / reduce-scatter, one rank per node, since NCCL 2.23): latency 8 us + log2(nodes)
# x the network hop / 3.5 + 2.8 us per rank, bandwidth x 0.75 (tuning.cc lines 285, 372-377).
PAT_BASE_US, PAT_HOP_DIVISOR, PAT_PER_RANK_US, PAT_BANDWIDTH = 8.0, 3.5, 2.8, 0.75
# NVLS-tree across nodes: the network bandwidth, halved beyond 2 nodes, x 5/6 (tuning.cc lines
# 275 and 324: NCCL's bus-to-algorithm ratio for NVLS).
NVLS_TREE_RATIO = 5.0 / 6.0
# Link.nvls_busbw_gbs is nccl-tests' all-reduce busbw on a node of this many GPUs (8 H100, nccl-tests#212).
NVLS_QUOTED_RANKS = 8


@dataclass(frozen=True)
class Collective:
    """One kind of collective of a training step as one rank issues it, summed over the step."""

    dim: str       # the group's dim: tp, cp, dp (data parallel, with the cp ranks folded in), dp_replicate (hsdp), ep
    kind: str      # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast
    part: str      # who issues it: blocks, embedding, head, loss, parameters, gradients
    group: int     # ranks in the group
    nbytes: float  # bytes per step: every call's full buffer (nccl-tests' size), summed
    calls: float   # calls per step (each pays a call's latency; a call moves nbytes / calls)


@dataclass(frozen=True)
class Span:
    """Where the ranks of a group sit, as NCCL's tuning model reads it."""

    link: Link            # what bounds the group's bus bandwidth (Cluster.link_for)
    intra: Link           # the node's link: the latency of the steps within a node
    inter: Link           # the network: the latency of the steps between nodes
    nodes: int            # nodes the group spans
    per_node: int         # its ranks on each node
    generation: str = ""  # the GPU generation (LL's bandwidth ceiling, the ring plateau)
    nccl: bool = True     # False: gloo (a CPU cluster) or RCCL, planned as plain rings


def span(cluster: Cluster, group: int, stride: int = 1) -> Span:
    """The Span of a group of `group` ranks `stride` apart on `cluster` (ranks node-major, as
    Cluster.link_for numbers them)."""
    link = cluster.link_for(group, stride)
    if group * stride <= cluster.gpus_per_node:
        nodes, per_node = 1, group
    else:
        per_node = min(group, max(1, cluster.gpus_per_node // stride))
        nodes = math.ceil(group / per_node)
    generation = cluster.gpu.generation
    nccl = cluster.short_name != CPU and generation not in ("cdna2", "cdna3")
    return Span(link, cluster.intra, cluster.inter, nodes, per_node, generation, nccl)


def link_span(link: Link, group: int) -> Span:
    """A group on one link alone: the ranks of one node over a node link, or one rank per node
    over a network link."""
    if link.fabric == "net":
        return Span(link, link, link, group, 1)
    return Span(link, link, link, 1, group)


def bus_factor(kind: str, group: int) -> float:
    """Bytes each rank moves per byte of buffer on a ring (nccl-tests' bus bandwidth factors)."""
    if group <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (group - 1) / group
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (group - 1) / group
    return 1.0


def collectives_by_dim(rows: list[Collective], key: str = "bytes") -> dict[str, dict[str, int]]:
    """dim -> kind -> bytes per step (key "bus_bytes": x the ring factor, bus_factor)."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        n = r.nbytes * (bus_factor(r.kind, r.group) if key == "bus_bytes" else 1)
        kinds = out.setdefault(r.dim, {})
        kinds[r.kind] = kinds.get(r.kind, 0) + round(n)
    return out


def _fabric(link: Link) -> str:
    return link.fabric if link.fabric in HW_LATENCY_US else ""


def _hop_us(link: Link, algorithm: str, protocol: str) -> float:
    """NCCL's hwLat of `link`'s fabric, scaled by the link's latency over the fabric's ring Simple."""
    table = HW_LATENCY_US[_fabric(link)]
    return table[algorithm][protocol] * link.latency_us / table["ring"]["Simple"]


def _ll_ceiling(where: Span) -> float:
    if where.nodes == 1:
        return LL_MAX_BUSBW_NODE.get(where.generation, math.inf)
    return LL_MAX_BUSBW_NET[0 if where.nodes <= 2 else 1]


def candidates(kind: str, nbytes: float, where: Span) -> dict[tuple[str, str], float]:
    """Seconds of one `kind` call of `nbytes` (nccl-tests' size) for every (algorithm, protocol)
    NCCL's tuning model would consider for the group at `where` (ncclTopoTuneModel and
    ncclTopoGetAlgoTime). Empty for a group of one rank."""
    n = where.nodes * where.per_node
    if n <= 1:
        return {}
    busbw = where.link.bandwidth_gbs
    steps = 2 * (n - 1) if kind == "all_reduce" else (n - 1 if kind in ("all_gather", "reduce_scatter") else n)
    if not (where.nccl and _fabric(where.intra) and (where.nodes == 1 or _fabric(where.inter) == "net")):
        # not NCCL: a plain ring, every step at the bounding link's latency
        return {("ring", "Simple"): ring_time(nbytes, n, where.link, bus_factor(kind, n), steps)}
    protocols = PROTOCOLS if _fabric(where.intra) == "nvlink" else ("LL", "Simple")   # LL128 needs NVLink (line 468)
    old_gpu = where.generation in ("volta", "turing")
    out: dict[tuple[str, str], float] = {}

    def add(algorithm: str, protocol: str, latency_us: float, algbw_gbs: float) -> None:
        if algbw_gbs > 0:
            out[algorithm, protocol] = latency_us * 1e-6 + nbytes / (algbw_gbs * 1e9)

    inter_steps = 0 if where.nodes == 1 else (2 * (where.nodes - 1) if kind == "all_reduce" else where.nodes - 1)
    for p in protocols:
        # ---- ring (tuning.cc lines 337-356)
        bus = busbw
        if p == "LL":
            bus = min(_ll_ceiling(where), busbw * RING_LL)
        elif p == "LL128":
            bus = busbw * RING_LL128
        algbw = bus * n / steps if kind in ("all_reduce", "all_gather", "reduce_scatter") else bus
        if kind == "broadcast":
            hop = _hop_us(where.intra if where.nodes == 1 else where.inter, "tree" if p == "Simple" else "ring", p)
            latency = BASE_LATENCY_US["ring"][p] + steps * hop
        else:
            intra = _hop_us(where.intra, "ring", p)
            if where.nodes > 1:
                intra = max(intra, NET_OVERHEAD_US * (NET_OVERHEAD_SIMPLE if p == "Simple" else 1.0))
            inter = _hop_us(where.inter, "tree" if where.per_node == 1 else "ring", p)
            latency = BASE_LATENCY_US["ring"][p] + (steps - inter_steps) * intra + inter_steps * inter
            if (kind == "all_reduce" and p == "Simple" and where.nodes > 1
                    and nbytes / (NCCL_CHANNELS * n) >= RING_PLATEAU_MIN_BYTES):
                latency *= RING_PLATEAU_OLD if old_gpu else RING_PLATEAU
        add("ring", p, latency, algbw)
        if kind == "all_reduce":
            # ---- tree (lines 281-283, 357-361, 569): bus bandwidth x 0.92 (x the protocol's), algbw = bus / 2
            bus = busbw * TREE
            if p == "LL":
                bus = min(bus * TREE_LL, _ll_ceiling(where))
            elif p == "LL128":
                bus *= TREE_LL128_NODE if where.nodes == 1 else TREE_LL128_NET
            log_size = int(math.log2(nbytes)) - 6 if nbytes >= 64 else -1
            if 0 <= log_size < len(TREE_CORRECTION[p]):
                bus *= TREE_CORRECTION[p][log_size]
            latency = BASE_LATENCY_US["tree"][p] + 2 * ((where.per_node - 1) * _hop_us(where.intra, "tree", p)
                                                        + _log2i(where.nodes) * _hop_us(where.inter, "tree", p))
            add("tree", p, latency, bus * 0.5)
    if kind in ("all_gather", "reduce_scatter") and where.per_node == 1 and where.nodes > 1:
        # ---- PAT (lines 196, 285, 372-377): one rank per node, Simple
        latency = (PAT_BASE_US + _log2i(where.nodes) * _hop_us(where.inter, "tree", "Simple") / PAT_HOP_DIVISOR
                   + n * PAT_PER_RANK_US)
        add("pat", "Simple", latency, busbw * PAT_BANDWIDTH)
    nvls = where.intra.nvls_busbw_gbs
    if kind == "all_reduce" and nvls > 0 and where.per_node > 1:
        # ---- NVLink SHARP: the switch reduces (tuning.cc lines 267-275, 367-371)
        # each rank sends its buffer up once and gets the sum back once, whatever the group: the
        # quoted busbw of a full node (NVLS_QUOTED_RANKS) over nccl-tests' all-reduce factor
        nvls_algbw = nvls * NVLS_QUOTED_RANKS / (2 * (NVLS_QUOTED_RANKS - 1))
        if where.nodes == 1:
            add("nvls", "Simple", HW_LATENCY_US["nvlink"]["nvls"]["Simple"], nvls_algbw)
        else:   # NVLS within the nodes, a tree between them (lines 275, 371)
            net = busbw * (1.0 if where.nodes <= 2 else 0.5) * NVLS_TREE_RATIO
            latency = (HW_LATENCY_US["nvlink"]["nvls_tree"]["Simple"]
                       + 2 * _log2i(where.nodes) * _hop_us(where.inter, "nvls_tree", "Simple"))
            add("nvls_tree", "Simple", latency, min(nvls_algbw, net))
    return out


def link_latency_from_time(kind: str, nbytes: float, seconds: float, link: Link, intra: Link, nodes: int,
                           per_node: int, generation: str = "") -> float:
    """The ring Simple step latency (Link.latency_us, us) of `link` under which NCCL's model times
    one `kind` call of `nbytes` at `seconds`: what a probe's smallest NCCL all_reduce says about
    the link (NCCL ran it LL, past its base latency, so its time / 2(n-1) is not the step). The
    group is `per_node` ranks on one node over `link` (nodes = 1), or one rank on each of `nodes`
    nodes over the network `link` with `intra` the node's link. 0 when even a zero step is slower
    than the measurement (the base latency alone is); bisection, the time rising with the step."""

    def timed(latency_us: float) -> float:
        trial = replace(link, latency_us=latency_us)
        node = trial if nodes == 1 else intra
        return call_time(kind, nbytes, Span(trial, node, trial, nodes, per_node, generation))

    low, high = 0.0, 1e6
    if timed(low) >= seconds:
        return 0.0
    for _ in range(80):
        mid = (low + high) / 2
        low, high = (mid, high) if timed(mid) < seconds else (low, mid)
    return (low + high) / 2


def _log2i(n: int) -> int:
    """NCCL's log2i: the floor of log2."""
    return max(0, int(n).bit_length() - 1)


def call_time(kind: str, nbytes: float, where: Span | Link, group: int | None = None) -> float:
    """Seconds of one `kind` call of `nbytes` over `where` (a Span, or one Link with `group`
    ranks: link_span), at the (algorithm, protocol) NCCL's model finds fastest."""
    where = where if isinstance(where, Span) else link_span(where, group or 1)
    return _fastest(kind, float(nbytes), where)


@functools.lru_cache(maxsize=1 << 16)
def _fastest(kind: str, nbytes: float, where: Span) -> float:
    # a layout search times the same calls over and over (plan/search.py: thousands of layouts)
    times = candidates(kind, nbytes, where)
    return min(times.values()) if times else 0.0


def choice(kind: str, nbytes: float, where: Span | Link, group: int | None = None) -> tuple[str, str]:
    """The (algorithm, protocol) NCCL's model runs one `kind` call of `nbytes` with."""
    where = where if isinstance(where, Span) else link_span(where, group or 1)
    times = candidates(kind, nbytes, where)
    return min(times, key=times.get) if times else ("", "")


def collective_time(rows: list[Collective], where: Span | Link) -> float:
    """Seconds of `rows` over `where` (a Span; or one Link: link_span of each row's group): each
    row's calls, each of nbytes / calls, at NCCL's fastest algorithm and protocol for that size."""
    total = 0.0
    for r in rows:
        if r.group <= 1 or r.calls <= 0:
            continue
        place = where if isinstance(where, Span) else link_span(where, r.group)
        if place.nodes * place.per_node != r.group:
            # a row over more or fewer ranks than the span placed (the cp ranks folded into an
            # experts' group): the span's nodes, the row's ranks spread over them
            nodes = min(place.nodes, r.group)
            place = replace(place, nodes=nodes, per_node=max(1, r.group // nodes))
        total += r.calls * call_time(r.kind, r.nbytes / r.calls, place)
    return total


def all_to_all_time(rows: list[Collective], cluster: Cluster, stride: int) -> float:
    """Seconds of the all-to-all `rows` over groups of ranks `stride` apart. Every rank sends
    1/n of its buffer to each other member: to the k - 1 on its node over `intra`, to the n - k
    on other nodes through its own share of the network (`inter`, per GPU), both at once, so
    the slower side bounds a call, plus a latency per peer. Within a node this is the ring time
    (gather_or_scatter); across nodes it is not: the (n - k) / n of every rank's buffer bound
    elsewhere all crosses its NIC, where a ring crosses each node's NICs once (link_for)."""
    total = 0.0
    for r in rows:
        n = r.group
        if n <= 1:
            continue
        k = n if n * stride <= cluster.gpus_per_node else min(n, max(1, cluster.gpus_per_node // stride))
        intra_s = r.nbytes * (k - 1) / n / (cluster.intra.bandwidth_gbs * 1e9)
        inter_s = r.nbytes * (n - k) / n / (cluster.inter.bandwidth_gbs * 1e9)
        latency_us = (cluster.inter if n > k else cluster.intra).latency_us
        total += max(intra_s, inter_s) + (n - 1) * r.calls * latency_us * 1e-6
    return total


def rows_of(rows: list[Collective], dim: str, part: str | None = None) -> list[Collective]:
    return [r for r in rows if r.dim == dim and (part is None or r.part == part)]


def ring_time(nbytes: float, group: int, link: Link, factor: float, steps: int) -> float:
    """Seconds of one plain ring collective moving `nbytes` (the full buffer) over `link` in
    `steps` ring steps: factor = 2(n-1)/n and 2(n-1) steps for all-reduce, (n-1)/n and n-1 steps
    for all-gather / reduce-scatter (nccl-tests' bus bandwidth). The model of links NCCL does not
    run (gloo, RCCL); NCCL's own calls go through call_time."""
    if group <= 1:
        return 0.0
    return nbytes * factor / (link.bandwidth_gbs * 1e9) + steps * link.latency_us * 1e-6


def all_reduce(nbytes: float, group: int, link: Link) -> float:
    """A plain ring all-reduce (ring_time)."""
    return ring_time(nbytes, group, link, 2 * (group - 1) / max(group, 1), 2 * (group - 1))


def gather_or_scatter(nbytes: float, group: int, link: Link) -> float:
    """A plain ring all-gather or reduce-scatter (ring_time)."""
    return ring_time(nbytes, group, link, (group - 1) / max(group, 1), group - 1)
