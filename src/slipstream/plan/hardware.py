"""The cluster a plan runs on: GPU model, how many, and the links between them.

`make_cluster("8xH100", nodes=4)` builds a Cluster from three sources, in rising priority:
  1. the datasheet table in plan/gpus.py (peak TFLOP/s, memory, memory bandwidth),
  2. documented defaults here (link bandwidths, matmul efficiency, memory reserve),
  3. a `slipstream probe --out FILE` result and explicit overrides (`memory_gib`, link names).
Every number that did not come from 1 or 2 is listed in Cluster.sources, so a plan can say
what it assumed. `cpu` plans for this machine: its peaks are measured (cached) rates, which
the caller reads and passes in (`cpu=observe.peaks.this_cpu()`; this module measures nothing).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from slipstream.errors import UserError
from slipstream.plan.gpus import GpuSpec, lookup_gpu


@dataclass(frozen=True)
class Link:
    name: str             # e.g. "nvlink4", "ib-ndr", "pcie5", "shm"
    bandwidth_gbs: float  # achievable bus bandwidth per GPU of large ring collectives, GB/s, one direction
    latency_us: float     # per-step latency of a collective over this link
    description: str


# Bandwidths are ACHIEVABLE nccl-tests bus bandwidths (busbw) of large ring collectives, not
# wire rates: a ring moves every byte over every hop, so busbw compares directly with one
# direction of one GPU's link. Where figures came from:
# - NVLink: NCCL's own model of one link (src/graph/topo.h: SM70/SM80 20, SM90 20.6, SM100
#   40.1 GB/s) times the links per GPU (V100 6, A100 12, H100/H200 18, B200 18). NCCL's
#   maintainers quote ~370 GB/s ring busbw for H100 (nccl-tests#212; 450 GB/s line rate, ~20 %
#   protocol overhead; NVLink SHARP all_reduce can show ~480), 8xB200 report ~720 ring (nccl#1807).
#   A100 measures below its 240 model (~200-230 reported in nccl-tests#149, #178): we use 230.
# - PCIe: x16 raw rate per direction is ~16/32/64 GB/s for gen 3/4/5; rings between GPUs go
#   through switches or the CPU root complex and rarely reach the copy-engine rate, so we
#   take ~65 % of it (NCCL itself models a gen3 x16 path at 12 GB/s).
# - Networks: ~88 % of the wire rate for InfiniBand (nccl-tests#119: 4xHDR per 8 A100 gave
#   85-96 of 100 GB/s), ~80 % for RoCE and TCP Ethernet. ib-* and roce-* are one NIC per GPU
#   (rail-optimised HGX/DGX); ethernet-* is one NIC per NODE, shared by its GPUs (see below).
# Latencies are per ring step, order of magnitude only (they matter for small messages):
# NCCL's tuning model (src/graph/tuning.cc) has ~0.5-3.4 us per NVLink step and several us
# per network step; TCP sockets and gloo add tens of us.
LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        Link("nvlink2", 120.0, 2.0, "NVLink 2 (V100 SXM2): 6 links x 25 GB/s, hybrid cube-mesh"),
        Link("nvlink3", 230.0, 2.0, "NVLink 3 (A100 SXM): 600 GB/s bidirectional = 300 per direction"),
        Link("nvlink4", 370.0, 2.0, "NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional = 450 per direction"),
        Link("nvlink5", 720.0, 2.0, "NVLink 5 (B200): 1800 GB/s bidirectional = 900 per direction"),
        Link("pcie3", 10.0, 3.0, "PCIe gen3 x16 (~16 GB/s raw per direction)"),
        Link("pcie4", 20.0, 3.0, "PCIe gen4 x16 (~32 GB/s raw per direction)"),
        Link("pcie5", 40.0, 3.0, "PCIe gen5 x16 (~64 GB/s raw per direction)"),
        Link("ib-hdr", 22.0, 5.0, "InfiniBand HDR, one 200 Gb/s NIC per GPU"),
        Link("ib-ndr", 44.0, 5.0, "InfiniBand NDR, one 400 Gb/s NIC per GPU"),
        Link("roce-400g", 40.0, 6.0, "RoCE, one 400 Gb/s NIC per GPU"),
        Link("ethernet-100g", 10.0, 25.0, "TCP Ethernet, one 100 Gb/s NIC per node"),
        Link("ethernet-25g", 2.5, 25.0, "TCP Ethernet, one 25 Gb/s NIC per node"),
        # gloo between processes of one machine (TCP over loopback / shared memory). A rough
        # figure for a CPU development box; `slipstream probe --sections comm` measures it.
        Link("shm", 3.0, 50.0, "gloo between processes of one machine"),
    )
}
# These NICs serve a whole node: each GPU's share is the bandwidth / GPUs per node.
PER_NODE_LINKS = frozenset({"ethernet-100g", "ethernet-25g"})
# A group of one rank communicates with nobody: infinite bandwidth, no latency.
LOCAL = Link("local", math.inf, 0.0, "no communication (group of one rank)")

# short name -> (device-name-like string for plan.gpus.lookup_gpu, intra link, inter
# link, host<->device GB/s per GPU). The spec numbers live only in plan/gpus.py.
# Defaults: SXM parts get their NVLink and InfiniBand (A100 HDR, Hopper/Blackwell NDR);
# PCIe, NVL (bridged pairs only) and consumer cards get PCIe and a 100 Gb/s node NIC.
# Host links: achievable pinned copies, ~12/24/48 GB/s on PCIe gen 3/4/5 x16.
_GPUS: dict[str, tuple[str, str, str, float]] = {
    "B200": ("NVIDIA B200", "nvlink5", "ib-ndr", 48.0),
    "B100": ("NVIDIA B100", "nvlink5", "ib-ndr", 48.0),
    "H200": ("NVIDIA H200", "nvlink4", "ib-ndr", 48.0),
    "H200-NVL": ("NVIDIA H200 NVL", "pcie5", "ethernet-100g", 48.0),
    "H100": ("NVIDIA H100 SXM", "nvlink4", "ib-ndr", 48.0),
    "H100-NVL": ("NVIDIA H100 NVL", "pcie5", "ethernet-100g", 48.0),
    "H100-PCIe": ("NVIDIA H100 PCIe", "pcie5", "ethernet-100g", 48.0),
    "A100": ("NVIDIA A100 SXM 80GB", "nvlink3", "ib-hdr", 24.0),
    "A100-40GB": ("NVIDIA A100 SXM 40GB", "nvlink3", "ib-hdr", 24.0),
    "A100-PCIe": ("NVIDIA A100 PCIe 80GB", "pcie4", "ethernet-100g", 24.0),
    "A100-PCIe-40GB": ("NVIDIA A100 PCIe 40GB", "pcie4", "ethernet-100g", 24.0),
    "A10G": ("NVIDIA A10G", "pcie4", "ethernet-100g", 24.0),
    "A10": ("NVIDIA A10", "pcie4", "ethernet-100g", 24.0),
    "L40S": ("NVIDIA L40S", "pcie4", "ethernet-100g", 24.0),
    "L40": ("NVIDIA L40", "pcie4", "ethernet-100g", 24.0),
    "L4": ("NVIDIA L4", "pcie4", "ethernet-100g", 24.0),
    "V100": ("Tesla V100-SXM2-16GB", "nvlink2", "ethernet-100g", 12.0),
    "V100-32GB": ("Tesla V100-SXM2-32GB", "nvlink2", "ethernet-100g", 12.0),
    "V100-PCIe": ("Tesla V100-PCIE-16GB", "pcie3", "ethernet-100g", 12.0),
    "V100-PCIe-32GB": ("Tesla V100-PCIE-32GB", "pcie3", "ethernet-100g", 12.0),
    "T4": ("Tesla T4", "pcie3", "ethernet-100g", 12.0),
    "RTX4090": ("NVIDIA GeForce RTX 4090", "pcie4", "ethernet-100g", 24.0),
    "RTX3090": ("NVIDIA GeForce RTX 3090", "pcie4", "ethernet-100g", 24.0),
    "RTX6000-Ada": ("NVIDIA RTX 6000 Ada", "pcie4", "ethernet-100g", 24.0),
    "RTX-A6000": ("NVIDIA RTX A6000", "pcie4", "ethernet-100g", 24.0),
}
# Other spellings people use; matched after dropping case and separators ("a100_80gb").
_SYNONYMS = {
    "A100-80GB": "A100", "A100-SXM": "A100", "A100-SXM-80GB": "A100", "A100-SXM-40GB": "A100-40GB",
    "A100-PCIe-80GB": "A100-PCIe", "H100-SXM": "H100", "H100-80GB": "H100", "H200-SXM": "H200",
    "B200-SXM": "B200", "V100-SXM2": "V100", "V100-16GB": "V100", "A6000": "RTX-A6000",
}
CPU = "cpu"

# Per-node maximum: 8 GPUs is the HGX/DGX board; CPU "GPUs" are processes sharing one machine.
MAX_GPUS_PER_NODE = 8
MAX_CPU_PROCESSES = 16

# Datasheet GiB minus this is what tensors may use: the device reports ~1 GiB less than the
# nominal size on 80 GB parts, the CUDA context takes ~0.5 GiB and cuBLAS workspaces plus
# NCCL buffers another ~0.5 GiB.
GPU_MEMORY_RESERVE_GIB = 2.0
CPU_MEMORY_RESERVE_GIB = 2.0  # the OS, the Python interpreter, data loader workers
# Rough DRAM copy bandwidth of a desktop/server CPU when no probe says otherwise.
CPU_MEMORY_BW_GBS = 20.0

# Fraction of the dense datasheet peak that large training matmuls reach. Measured best-shape
# bf16 "maximum achievable matmul FLOPS" (stas00/ml-engineering, compute/accelerator): A100 SXM
# 86.9 %, H100 SXM 80.3 %, B200 77.6 %; fp8: H100 70.9 %, H200 73.4 %, B200 76.3 %. Training
# shapes are not the best shapes, so we stay a little below. tf32 and fp32 are not measured
# there: estimates. A `probe` file replaces these with this machine's numbers.
DEFAULT_MATMUL_EFFICIENCY = {"bf16": 0.75, "fp16": 0.75, "tf32": 0.70, "fp32": 0.80, "fp8": 0.65}


@dataclass(frozen=True)
class CpuFacts:
    """What a `cpu` cluster needs to know about this machine, read by the caller
    (observe.peaks.this_cpu()) so that the planner itself measures nothing.

    name: the CPU model, e.g. 'Intel(R) Xeon(R) Platinum 8480+'.
    peak_flops: dtype key ("fp32", "bf16", "fp16") -> matmul FLOP/s of the whole machine;
        called only for the dtypes a probe file does not give.
    """

    name: str
    peak_flops: Callable[[str], float]


@dataclass(frozen=True)
class Cluster:
    gpu: GpuSpec                 # datasheet (or, for cpu, measured) numbers of one GPU
    gpus_per_node: int
    nodes: int
    intra: Link                  # between GPUs of one node
    inter: Link                  # between nodes, per GPU (a node NIC's share for PER_NODE_LINKS)
    memory_bytes: int            # usable bytes per GPU for tensors
    matmul_efficiency: dict[str, float]  # achievable fraction of peak for large matmuls, per dtype
    host_link_gbs: float         # host<->device GB/s per GPU (CPU offload)
    sources: tuple[str, ...]     # one line per number that is not a table default
    short_name: str = ""         # the known_gpus() name, e.g. "H100" (for prices)

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def peak_flops(self, dtype_key: str) -> float:
        """Dense datasheet peak in FLOP/s (for cpu: the measured rate)."""
        if dtype_key not in self.gpu.peaks:
            raise UserError(f"{self.gpu.name} has no fast {dtype_key!r} matmul; it has "
                            f"{', '.join(self.gpu.peaks)}. Pick one of those precisions.")
        return self.gpu.peaks[dtype_key] * 1e12

    def achievable_flops(self, dtype_key: str) -> float:
        return self.peak_flops(dtype_key) * self.matmul_efficiency.get(dtype_key, 1.0)

    def link_for(self, group_size: int, stride: int = 1) -> Link:
        """The link a ring over `group_size` ranks, `stride` ranks apart, is limited by.

        Ranks are numbered node-major (rank = node * gpus_per_node + local rank). A group
        that fits in one node uses `intra`. One that crosses nodes is limited by the network:
        with one member per node that is `inter` itself; with k members per node NCCL runs
        k rings side by side, one per NIC, so the group sees k x inter, never more than
        intra (nccl-tests#119: 8 A100 per node, 4 HDR NICs = 100 GB/s per node, measured
        85-96 GB/s busbw across 3 nodes). A group of one rank gets LOCAL (free).
        """
        if group_size < 1 or stride < 1:
            raise UserError(f"a communication group needs size >= 1 and stride >= 1 (got size "
                            f"{group_size}, stride {stride}); check the parallel sizes.")
        if group_size * stride > self.world:
            raise UserError(f"a group of {group_size} ranks {stride} apart spans {group_size * stride} "
                            f"ranks, more than the {self.world} in the cluster; check the parallel sizes.")
        if group_size == 1:
            return LOCAL
        if group_size * stride <= self.gpus_per_node:
            return self.intra
        per_node = min(group_size, max(1, self.gpus_per_node // stride))
        if per_node == 1:
            return self.inter
        bandwidth = min(self.intra.bandwidth_gbs, per_node * self.inter.bandwidth_gbs)
        return replace(self.inter, bandwidth_gbs=bandwidth,
                       description=f"{self.inter.description}; {per_node} GPUs per node side by side")


def _normalize(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", name.upper())


_BY_NORMAL = {_normalize(n): n for n in _GPUS} | {_normalize(k): v for k, v in _SYNONYMS.items()}


def known_gpus() -> list[str]:
    """The short names make_cluster accepts (case and separators do not matter)."""
    return [*_GPUS, CPU]


def canonical_gpu_name(name: str) -> str | None:
    """"a100_80gb" -> "A100"; "cpu" -> "cpu"; None when unknown."""
    if _normalize(name) == "CPU":
        return CPU
    return _BY_NORMAL.get(_normalize(name))


def parse_gpus(text: str) -> tuple[int, str]:
    """"8xH100" -> (8, "H100"); "H100" -> (1, "H100"); "8 x a100-80gb" -> (8, "a100-80gb")."""
    match = re.fullmatch(r"\s*(?:(\d+)\s*[x×*]\s*)?([A-Za-z][\w\-. ]*?)\s*", str(text), flags=re.IGNORECASE)
    if not match or (match.group(1) is not None and int(match.group(1)) < 1):
        raise UserError(f"cannot read --gpus {text!r}; write COUNTxNAME per node, e.g. 8xH100, "
                        f"4xA100-40GB or 2xcpu (count >= 1). Known names: {', '.join(known_gpus())}.")
    return int(match.group(1) or 1), match.group(2)


def _unknown_gpu(name: str) -> UserError:
    close = difflib.get_close_matches(_normalize(name), list(_BY_NORMAL) + ["CPU"], n=1, cutoff=0.5)
    hint = f" Did you mean {canonical_gpu_name(close[0])}?" if close else ""
    return UserError(f"unknown GPU {name!r}.{hint} Known: {', '.join(known_gpus())}. For a GPU not "
                     "listed, plan with the most similar one (same generation, memory and form factor).")


def _link(name: str, flag: str) -> Link:
    if name not in LINKS:
        raise UserError(f"unknown {flag} link {name!r}; choose one of {', '.join(LINKS)}.")
    return LINKS[name]


def _cpu_spec(processes: int, measured: dict[str, float], cpu: CpuFacts | None) -> GpuSpec:
    """This machine as a GpuSpec, shared by `processes` processes. `measured` (TFLOP/s of the
    whole machine, from a probe) is used as given; missing dtypes come from `cpu.peak_flops`."""
    if cpu is None:
        raise ValueError("make_cluster('Nxcpu') plans for this machine: pass its facts, "
                         "cpu=slipstream.observe.peaks.this_cpu()")
    tflops = {}
    for key in ("fp32", "bf16", "fp16"):  # CPUs have no TF32 or fp8 matmul worth planning for
        whole = measured[key] if key in measured else cpu.peak_flops(key) / 1e12
        # The processes split the cores, so each gets about its share of the machine's rate.
        tflops[key] = whole / processes
    tflops["tf32"] = tflops["fp32"]  # fp32 matmuls run at the fp32 rate
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return GpuSpec(f"CPU {cpu.name}", tflops, ram_gib, CPU_MEMORY_BW_GBS, "cpu")


def _read_probe(path: str) -> dict:
    how = "make one with `slipstream probe --out FILE` (add --sections comm under torchrun for links)"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise UserError(f"cannot read probe file {path}: {e.strerror or e}; {how}.") from None
    except ValueError as e:
        raise UserError(f"probe file {path} is not valid JSON ({e}); {how}.") from None
    sections = data.get("sections") if isinstance(data, dict) else None
    if not isinstance(sections, dict) or not any(s in sections for s in ("compute", "memory", "comm")):
        raise UserError(f"probe file {path} has no compute, memory or comm section; {how}.")
    return data


def _number(value: object, path: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise UserError(f"probe file {path}: {where} should be a positive number, got {value!r}; "
                        "re-run `slipstream probe --out FILE`.")
    return float(value)


def _host_gbs(memory: dict, path: str) -> tuple[float, str] | None:
    """Offload copies both ways: the slower direction, pinned buffers if measured."""
    for kind in ("pinned", "pageable"):
        h2d, d2h = memory.get(f"h2d_{kind}"), memory.get(f"d2h_{kind}")
        if isinstance(h2d, dict) and isinstance(d2h, dict):
            where = f"sections.memory.{{h2d,d2h}}_{kind}.gbs"
            return min(_number(h2d.get("gbs"), path, where), _number(d2h.get("gbs"), path, where)), kind
    return None


def make_cluster(gpus: str, nodes: int = 1, intra: str | None = None, inter: str | None = None,
                 probe: str | None = None, memory_gib: float | None = None,
                 cpu: CpuFacts | None = None) -> Cluster:
    """A Cluster for `--gpus NxNAME` (N per node) times `nodes`; see the module doc. `cpu`
    (observe.peaks.this_cpu()) is needed for a `cpu` cluster only, and ignored otherwise."""
    per_node, name = parse_gpus(gpus)
    short = canonical_gpu_name(name)
    if short is None:
        raise _unknown_gpu(name)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise UserError(f"--nodes must be a whole number >= 1, got {nodes!r}.")
    sources: list[str] = []
    limit = MAX_CPU_PROCESSES if short == CPU else MAX_GPUS_PER_NODE
    if per_node > limit:
        if nodes == 1 and short != CPU and per_node % MAX_GPUS_PER_NODE == 0:
            nodes, per_node = per_node // MAX_GPUS_PER_NODE, MAX_GPUS_PER_NODE
            sources.append(f"--gpus {gpus}: more than {limit} per node, read as {nodes} nodes of {per_node}")
        else:
            raise UserError(f"--gpus {gpus}: {per_node} per node is more than the {limit} a node holds. The "
                            f"count is per node: write e.g. --gpus {limit}x{name} --nodes {max(2, nodes)}.")

    data = _read_probe(probe) if probe is not None else None
    probed = data["sections"] if data else {}
    machine = data.get("machine", {}) if data else {}
    probe_on_cpu = str(machine.get("device", "")).startswith("cpu")
    if data and probe_on_cpu != (short == CPU):
        raise UserError(f"probe file {probe} was measured on {'a CPU' if probe_on_cpu else 'a GPU'} but "
                        f"--gpus asks for {short}; probe the machine you plan for, or drop --probe.")

    # Matmul rates measured by the probe, TFLOP/s per dtype.
    compute = probed.get("compute", {})
    measured = {key: _number(entry.get("best_tflops"), probe, f"sections.compute.dtypes.{key}.best_tflops")
                for key, entry in compute.get("dtypes", {}).items()
                if isinstance(entry, dict) and entry.get("status") == "ok"}

    if short == CPU:
        spec = _cpu_spec(per_node, {k: v for k, v in measured.items() if k in ("fp32", "bf16", "fp16")}, cpu)
        efficiency = dict.fromkeys(spec.peaks, 1.0)  # measured rates already are achievable rates
        intra_link, inter_link, host_gbs = LINKS["shm"], LINKS["ethernet-25g"], CPU_MEMORY_BW_GBS
        reserve_gib = CPU_MEMORY_RESERVE_GIB
        sources.append(f"cpu peaks: measured matmul rates of this machine / {per_node} process(es)")
    else:
        lookup_name, intra_name, inter_name, host_gbs = _GPUS[short]
        spec = lookup_gpu(lookup_name)
        assert spec is not None, f"{lookup_name} missing from plan.gpus"
        efficiency = {k: DEFAULT_MATMUL_EFFICIENCY.get(k, 0.75) for k in spec.peaks}
        intra_link, inter_link = LINKS[intra_name], LINKS[inter_name]
        reserve_gib = GPU_MEMORY_RESERVE_GIB
        probe_spec = lookup_gpu(str(machine.get("device_name") or compute.get("datasheet") or ""))
        if probe_spec is not None and probe_spec.name != spec.name:
            raise UserError(f"probe file {probe} was measured on {probe_spec.name} but --gpus asks for "
                            f"{spec.name}; probe the GPU you plan for, or drop --probe.")
        for key, tflops in measured.items():
            if key in spec.peaks:
                efficiency[key] = tflops / spec.peaks[key]
                sources.append(f"{key} matmul {efficiency[key]:.2f} of peak ({tflops:.1f} TFLOP/s): probe file {probe}")

    if intra is not None:
        intra_link = _link(intra, "--intra")
        sources.append(f"intra-node link {intra}: --intra")
    if inter is not None:
        inter_link = _link(inter, "--inter")
        sources.append(f"inter-node link {inter}: --inter")
    if inter_link.name in PER_NODE_LINKS and per_node > 1:
        share = inter_link.bandwidth_gbs / per_node
        inter_link = replace(inter_link, bandwidth_gbs=share,
                             description=f"{inter_link.description}, {share:.3g} GB/s per GPU of {per_node}")

    comm = probed.get("comm")
    if isinstance(comm, dict):
        world = int(_number(comm.get("world_size"), probe, "sections.comm.world_size"))
        rows = comm.get("collectives", {}).get("all_reduce") or []
        if world >= 2 and rows and world <= per_node:
            largest = max(rows, key=lambda r: r.get("bytes", 0))
            smallest = min(rows, key=lambda r: r.get("bytes", 0))
            bandwidth = _number(largest.get("busbw_gbs"), probe, "sections.comm.collectives.all_reduce.busbw_gbs")
            # A ring all_reduce takes 2(n-1) steps; the smallest message is all latency.
            seconds = _number(smallest.get("seconds"), probe, "sections.comm.collectives.all_reduce.seconds")
            latency = seconds * 1e6 / (2 * (world - 1))
            intra_link = Link(intra_link.name, bandwidth, latency, f"{intra_link.description} (measured)")
            sources.append(f"intra-node link {bandwidth:.1f} GB/s, {latency:.1f} us/step: all_reduce of "
                           f"{largest['bytes']} B over {world} ranks, probe file {probe}")
        else:
            sources.append(f"probe file {probe}: comm over {world} rank(s) does not measure one node of "
                           f"{per_node}; link defaults kept")

    memory = probed.get("memory")
    if isinstance(memory, dict):
        host = _host_gbs(memory, probe)
        if host is not None:
            host_gbs = host[0]
            sources.append(f"host<->device {host_gbs:.1f} GB/s ({host[1]}): probe file {probe}")
        if short == CPU and isinstance(memory.get("copy"), dict):
            copy_gbs = _number(memory["copy"].get("gbs"), probe, "sections.memory.copy.gbs")
            spec = replace(spec, mem_bw_gbs=copy_gbs)
            host_gbs = copy_gbs  # "offload" on a CPU is a copy within RAM
            sources.append(f"memory bandwidth {copy_gbs:.1f} GB/s: probe file {probe}")

    if memory_gib is not None:
        if not (isinstance(memory_gib, (int, float)) and 0 < memory_gib <= spec.memory_gib):
            raise UserError(f"--memory-gib {memory_gib!r}: must be > 0 and at most the {spec.memory_gib:g} GiB "
                            f"of a {spec.name}.")
        usable_gib = float(memory_gib)
        sources.append(f"usable memory {usable_gib:g} GiB per GPU: --memory-gib")
    else:
        whole = spec.memory_gib / (per_node if short == CPU else 1)  # CPU processes share the RAM
        usable_gib = max(whole - reserve_gib / (per_node if short == CPU else 1), 0.0)
    return Cluster(gpu=spec, gpus_per_node=per_node, nodes=nodes, intra=intra_link, inter=inter_link,
                   memory_bytes=int(usable_gib * 2**30), matmul_efficiency=efficiency,
                   host_link_gbs=host_gbs, sources=tuple(sources), short_name=short)
