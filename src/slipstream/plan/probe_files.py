"""Reading `slipstream probe --out FILE` results for the planner: a probe file is JSON from
elsewhere, so it is read with a size cap and every value is checked (type, sign, a plausible
ceiling) before use, then turned into facts by name (probe_facts: matmul rates, host link,
memory copy, the intra- and inter-node links). plan/hardware.py checks that a file measured the
machine planned and merges several files into the Cluster.
"""

from __future__ import annotations

import json
import math
from typing import NamedTuple

from slipstream.errors import UserError
from slipstream.plan.gpus import MAX_HOST_LINK_GBS, MAX_MEM_BW_GBS, MAX_PEAK_TFLOPS
from slipstream.plan.links import MAX_LINK_GBS, MAX_LINK_LATENCY_US

# A probe file is a few KB (our own JSON); the cap keeps a wrong or hostile file from exhausting memory.
PROBE_MAX_BYTES = 16 * 2**20
PROBE_HOW = "make one with `slipstream probe --out FILE` (add --sections comm under torchrun for links)"


class ProbeFact(NamedTuple):
    value: float   # the number compared when two probe files measure the same thing
    detail: dict
    path: str


PROBE_REDO = "re-run `slipstream probe --out FILE` (add --sections comm under torchrun for links)"
# A measured matmul rate cannot beat the datasheet's dense peak, which already is the boost-clock
# rate; 20 % above it leaves room for timer noise and a rounded datasheet figure. More is a unit
# slip, another GPU, or a broken timer, and would plan with an efficiency above 1.
PROBE_MAX_OF_PEAK = 1.2


def read_probe(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            raw = f.read(PROBE_MAX_BYTES + 1)
    except OSError as e:
        raise UserError(f"cannot read probe file {path}: {e.strerror or e}; {PROBE_HOW}.") from None
    if len(raw) > PROBE_MAX_BYTES:
        raise UserError(f"probe file {path} is larger than {PROBE_MAX_BYTES // 2**20} MiB: not a probe result; "
                        f"{PROBE_HOW}.")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the decoder's stack
        raise UserError(f"probe file {path} is not valid JSON ({e}); {PROBE_HOW}.") from None
    sections = data.get("sections") if isinstance(data, dict) else None
    if not isinstance(sections, dict) or not any(s in sections for s in ("compute", "memory", "comm")):
        raise UserError(f"probe file {path} has no compute, memory or comm section; {PROBE_HOW}.")
    # The top levels are checked here, the deeper ones by their readers, before any .get() or .items().
    _table(data, "machine", path, "machine")
    for name in ("compute", "memory", "comm"):
        _table(sections, name, path, f"sections.{name}")
    return data


def _json_kind(value: object) -> str:
    for kind, name in ((bool, "true/false"), ((int, float), "a number"), (str, "a string"), (list, "a list"),
                       (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null"


def _table(parent: dict, key: str, path: str, where: str) -> dict | None:
    """parent[key] when it is a JSON object, None when there is no such key; anything else
    means the file is not (or no longer) what `slipstream probe` writes."""
    if key not in parent:
        return None
    value = parent[key]
    if not isinstance(value, dict):
        raise UserError(f"probe file {path}: {where} should be an object, got {_json_kind(value)}; {PROBE_REDO}.")
    return value


def _number(value: object, path: str, where: str, ceiling: float, unit: str) -> float:
    """A positive finite number (not a bool) at most `ceiling` (in `unit`, which may explain it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise UserError(f"probe file {path}: {where} should be a positive number, got {value!r}; {PROBE_REDO}.")
    if value > ceiling:
        raise UserError(f"probe file {path}: {where} = {value:g} is implausibly large (more than {ceiling:g}"
                        f"{unit}); {PROBE_REDO}.")
    return float(value)


def _host_gbs(memory: dict, path: str) -> tuple[float, str] | None:
    """Offload copies both ways: the slower direction, pinned buffers if measured. A direction
    the probe could not measure is a string ("n/a (no accelerator)")."""
    for kind in ("pinned", "pageable"):
        h2d, d2h = memory.get(f"h2d_{kind}"), memory.get(f"d2h_{kind}")
        if isinstance(h2d, dict) and isinstance(d2h, dict):
            return min(_number(h2d.get("gbs"), path, f"sections.memory.h2d_{kind}.gbs", MAX_HOST_LINK_GBS, " GB/s"),
                       _number(d2h.get("gbs"), path, f"sections.memory.d2h_{kind}.gbs", MAX_HOST_LINK_GBS,
                               " GB/s")), kind
    return None


def _ring(section: dict, path: str, where: str) -> dict | None:
    """A link measured by all_reduce over one group: the largest message's bus bandwidth, and
    the smallest message's time per ring step (a ring all_reduce takes 2(n-1) steps; a tiny
    message is all latency). None when the group had fewer than 2 ranks or no rows."""
    world = section.get("world_size")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise UserError(f"probe file {path}: {where}.world_size should be a whole number of ranks >= 1, got "
                        f"{world!r}; {PROBE_REDO}.")
    collectives = _table(section, "collectives", path, f"{where}.collectives") or {}
    rows = collectives.get("all_reduce", [])
    if not isinstance(rows, list) or not all(isinstance(r, dict) and type(r.get("bytes")) is int and r["bytes"] > 0
                                             for r in rows):
        raise UserError(f"probe file {path}: {where}.collectives.all_reduce should be a list of rows (objects), "
                        f"each with a whole positive number of bytes; {PROBE_REDO}.")
    if world < 2 or not rows:
        return None
    largest, smallest = max(rows, key=lambda r: r["bytes"]), min(rows, key=lambda r: r["bytes"])
    bandwidth = _number(largest.get("busbw_gbs"), path, f"{where}.collectives.all_reduce.busbw_gbs",
                        MAX_LINK_GBS, " GB/s, no real link")
    steps = 2 * (world - 1)
    seconds = _number(smallest.get("seconds"), path, f"{where}.collectives.all_reduce.seconds",
                      MAX_LINK_LATENCY_US / 1e6 * steps, f" s, over {MAX_LINK_LATENCY_US / 1e6:g} s per ring step")
    groups = section.get("groups")
    return {"bandwidth": bandwidth, "latency": seconds * 1e6 / steps, "world": world,
            "bytes": largest["bytes"], "groups": groups if type(groups) is int else None,
            "small_bytes": smallest["bytes"], "small_seconds": seconds}


def probe_facts(data: dict, path: str, per_node: int, notes: list[str],
                peaks: dict[str, float]) -> dict[str, ProbeFact]:
    """What one probe file measured, by name: "<dtype> matmul" (TFLOP/s), "host<->device" and
    "memory copy" (GB/s), "intra-node link" and "inter-node link" (bus bandwidth GB/s).
    peaks: the planned GPU's datasheet TFLOP/s per dtype (PROBE_MAX_OF_PEAK bounds a measured
    rate); empty for a CPU cluster, whose measured rates are its peaks."""
    sections, facts = data["sections"], {}
    compute = sections.get("compute") or {}
    for key, entry in (_table(compute, "dtypes", path, "sections.compute.dtypes") or {}).items():
        where = f"sections.compute.dtypes.{key}"
        if not isinstance(entry, dict):
            raise UserError(f"probe file {path}: {where} should be an object, got {_json_kind(entry)}; {PROBE_REDO}.")
        if entry.get("status") != "ok":
            continue
        if key in peaks:
            ceiling, unit = PROBE_MAX_OF_PEAK * peaks[key], (f" TFLOP/s = {PROBE_MAX_OF_PEAK:g} x the datasheet's "
                                                             f"{peaks[key]:g}; probe the GPU you plan for, or fix its "
                                                             "peak (--peak-tflops or the GPU file)")
        else:
            ceiling, unit = MAX_PEAK_TFLOPS, " TFLOP/s"
        facts[f"{key} matmul"] = ProbeFact(_number(entry.get("best_tflops"), path, f"{where}.best_tflops",
                                                   ceiling, unit), {}, path)
    memory = sections.get("memory")
    if memory is not None:
        host = _host_gbs(memory, path)
        if host is not None:
            facts["host<->device"] = ProbeFact(host[0], {"kind": host[1]}, path)
        copy = _table(memory, "copy", path, "sections.memory.copy")
        if copy is not None:
            facts["memory copy"] = ProbeFact(_number(copy.get("gbs"), path, "sections.memory.copy.gbs",
                                                     MAX_MEM_BW_GBS, " GB/s"), {}, path)
    comm = sections.get("comm")
    if comm is None:
        return facts
    backend = comm.get("backend")
    if "intra" in comm or "inter" in comm:
        # Two-level probe (multi-node, or a single node that says so): each level is its own group.
        for level, label in (("intra", "intra-node link"), ("inter", "inter-node link")):
            group = _table(comm, level, path, f"sections.comm.{level}")
            ring = _ring(group, path, f"sections.comm.{level}") if group is not None else None
            if ring is not None:
                facts[label] = ProbeFact(ring["bandwidth"], ring | {"backend": backend}, path)
        return facts
    # One group over the whole launch (older probes): a node's link only if it fits in one node.
    ring = _ring(comm, path, "sections.comm")
    if ring is not None:
        ring["backend"] = backend
    if ring is not None and ring["world"] <= per_node:
        facts["intra-node link"] = ProbeFact(ring["bandwidth"], ring, path)
    elif ring is not None:
        notes.append(f"probe file {path}: comm over {ring['world']} rank(s) does not measure one node of "
                     f"{per_node}; link defaults kept (probe under torchrun on several nodes to measure both "
                     "levels)")
    return facts
