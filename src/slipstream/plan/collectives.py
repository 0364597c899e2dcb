"""The collectives of a training step as the planner models them: one record per kind and group
(`Collective`), and their time on a link (ring all-reduce / all-gather / reduce-scatter, all-to-all
within and across nodes). plan/timing.py builds the records and adds the times up."""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.plan.hardware import Cluster, Link


@dataclass(frozen=True)
class Collective:
    """One kind of collective of a training step as one rank issues it, summed over the step."""

    dim: str       # the group's dim: tp, cp, dp (data parallel, with the cp ranks folded in), dp_replicate (hsdp), ep
    kind: str      # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast
    part: str      # who issues it: blocks, embedding, head, loss, parameters, gradients
    group: int     # ranks in the group
    nbytes: float  # bytes per step: every call's full buffer (nccl-tests' size), summed
    calls: float   # calls per step (each pays a ring's latency)


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


def collective_time(rows: list[Collective], link: Link) -> float:
    """Seconds of `rows` on a ring over `link`: their bus bytes, and a ring's latency per call
    (2(n-1) steps for an all-reduce, n-1 for the others)."""
    total = 0.0
    for r in rows:
        steps = 2 * (r.group - 1) if r.kind == "all_reduce" else r.group - 1
        total += ring_time(r.nbytes, r.group, link, bus_factor(r.kind, r.group), steps * r.calls)
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


def _rows(rows: list[Collective], dim: str, part: str | None = None) -> list[Collective]:
    return [r for r in rows if r.dim == dim and (part is None or r.part == part)]


def ring_time(nbytes: float, group: int, link: Link, factor: float, steps: int) -> float:
    """Seconds of one ring collective moving `nbytes` (the full buffer) over `link` in `steps`
    ring steps: factor = 2(n-1)/n and 2(n-1) steps for all-reduce, (n-1)/n and n-1 steps for
    all-gather / reduce-scatter (nccl-tests' bus bandwidth)."""
    if group <= 1:
        return 0.0
    return nbytes * factor / (link.bandwidth_gbs * 1e9) + steps * link.latency_us * 1e-6


def all_reduce(nbytes: float, group: int, link: Link) -> float:
    return ring_time(nbytes, group, link, 2 * (group - 1) / max(group, 1), 2 * (group - 1))


def gather_or_scatter(nbytes: float, group: int, link: Link) -> float:
    return ring_time(nbytes, group, link, (group - 1) / max(group, 1), group - 1)
