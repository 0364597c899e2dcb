"""The cluster a plan runs on: GPU model, how many, and the links between them.

`make_cluster("8xH100", nodes=4)` builds a Cluster from these sources, in rising priority:
  1. the datasheet table in plan/gpus.py (peak TFLOP/s, memory, memory bandwidth), or the
     user's own GPU description (`--gpus 8xmy_gpu.toml`, and/or `gpu=gpus.gpu_from_flags(...)`
     for a GPU named by flags or a known GPU with some numbers changed),
  2. documented defaults here (link bandwidths, matmul efficiency, memory reserve),
  3. `slipstream probe --out FILE` results (one or several files, merged),
  4. explicit overrides: `memory_gib`, `intra` / `inter` (a link name or a bandwidth such as
     "12.5GB/s", "ib:400Gb/s@5us", see links.parse_link), `nics_per_node`.
Every number that did not come from 1's table or 2 is listed in Cluster.sources, so a plan
can say what it assumed. `cpu` plans for this machine: its peaks are measured (cached) rates,
which the caller reads and passes in (`cpu=observe.peaks.this_cpu()`; this module measures
nothing).

The links themselves (their table and parse_link) are in plan/links.py, the reading of probe
files in plan/probe_files.py; this module names the GPUs, builds the Cluster and decides which
probe facts apply to it.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from slipstream.errors import UserError
from slipstream.plan.gpus import DTYPE_KEYS, GpuDescription, GpuSpec, lookup_gpu, read_gpu_file
from slipstream.plan.links import LINKS, LOCAL, NCCL_FABRICS, PER_NODE_LINKS, Link, parse_link
from slipstream.plan.probe_files import ProbeFact, probe_facts, read_probe

MAX_NICS_PER_NODE = 64


class _Usual(NamedTuple):
    """What a short name stands for: the plan.gpus lookup string and the usual links."""
    device: str               # device-name-like string for plan.gpus.lookup_gpu
    intra: str
    inter: str
    host_gbs: float           # host<->device GB/s per GPU
    nics_per_node: int = 0    # 0: the inter link's own default (see _inter_per_gpu)


# short name -> its usual setup. The spec numbers live only in plan/gpus.py.
# Defaults: SXM/OAM parts get their NVLink / Infinity Fabric and InfiniBand (A100/A800 HDR,
# Hopper/Blackwell NDR: one 400 Gb/s CX7 per GPU on DGX/HGX H100 and on DeepSeek's H800s, DeepEP
# docs/legacy.md); PCIe, NVL (bridged pairs only) and consumer cards get PCIe and a 100 Gb/s node
# NIC. MI300X: RoCE, one 400 Gb/s NIC per GPU (the rail-optimised rdma0..rdma7 of AMD's 4-node
# rccl-tests run, ROCm docs how-to/rocm-for-ai/training/prerequisite-system-validation.rst).
# MI250X/MI250 (Frontier-like nodes of 4 packages = 8 GCDs): 4 Slingshot 200 Gb/s NICs per node
# (glennklockwood.com/garden/systems/frontier). H20: full NVLink 4, 900 GB/s (willitrunai.com,
# see plan/gpus.py). GH200: NVLink 4 through NVLink switches (DGX GH200 / NVL32; boards with
# fewer links: --intra) and NDR; its host link is NVLink-C2C, 450 GB/s per direction (GH200
# whitepaper, via MLCommons inference_results_v3.1 DGX-GH200 notes): 337.5 is an ESTIMATE, the
# 75 % that pinned PCIe copies reach of their per-direction rate, until a probe measures it.
# Host links: achievable pinned copies, ~12/24/48 GB/s on PCIe gen 3/4/5 x16 (MI250X: one
# gen 4 x16 per GCD, MI300X gen 5 x16: ROCm docs mi250.md / mi300.md).
_GPUS: dict[str, _Usual] = {
    "B200": _Usual("NVIDIA B200", "nvlink5", "ib-ndr", 48.0),
    "B100": _Usual("NVIDIA B100", "nvlink5", "ib-ndr", 48.0),
    "H200": _Usual("NVIDIA H200", "nvlink4", "ib-ndr", 48.0),
    "H200-NVL": _Usual("NVIDIA H200 NVL", "pcie5", "ethernet-100g", 48.0),
    "GH200": _Usual("NVIDIA GH200 96GB HBM3", "nvlink4", "ib-ndr", 337.5),
    "GH200-144GB": _Usual("NVIDIA GH200 144GB HBM3e", "nvlink4", "ib-ndr", 337.5),
    "H100": _Usual("NVIDIA H100 SXM", "nvlink4", "ib-ndr", 48.0),
    "H100-NVL": _Usual("NVIDIA H100 NVL", "pcie5", "ethernet-100g", 48.0),
    "H100-PCIe": _Usual("NVIDIA H100 PCIe", "pcie5", "ethernet-100g", 48.0),
    "H800": _Usual("NVIDIA H800", "nvlink4-400", "ib-ndr", 48.0),
    "H800-PCIe": _Usual("NVIDIA H800 PCIe", "pcie5", "ethernet-100g", 48.0),
    "H20": _Usual("NVIDIA H20", "nvlink4", "ib-ndr", 48.0),
    "A100": _Usual("NVIDIA A100 SXM 80GB", "nvlink3", "ib-hdr", 24.0),
    "A100-40GB": _Usual("NVIDIA A100 SXM 40GB", "nvlink3", "ib-hdr", 24.0),
    "A100-PCIe": _Usual("NVIDIA A100 PCIe 80GB", "pcie4", "ethernet-100g", 24.0),
    "A100-PCIe-40GB": _Usual("NVIDIA A100 PCIe 40GB", "pcie4", "ethernet-100g", 24.0),
    "A800": _Usual("NVIDIA A800 SXM 80GB", "nvlink3-400", "ib-hdr", 24.0),
    "A800-PCIe": _Usual("NVIDIA A800 PCIe 80GB", "pcie4", "ethernet-100g", 24.0),
    "A10G": _Usual("NVIDIA A10G", "pcie4", "ethernet-100g", 24.0),
    "A10": _Usual("NVIDIA A10", "pcie4", "ethernet-100g", 24.0),
    "L40S": _Usual("NVIDIA L40S", "pcie4", "ethernet-100g", 24.0),
    "L40": _Usual("NVIDIA L40", "pcie4", "ethernet-100g", 24.0),
    "L4": _Usual("NVIDIA L4", "pcie4", "ethernet-100g", 24.0),
    "MI300X": _Usual("AMD Instinct MI300X", "xgmi-mi300x", "roce-400g", 48.0),
    "MI250X": _Usual("AMD Instinct MI250X", "xgmi-mi250x", "slingshot-200g", 24.0, nics_per_node=4),
    "MI250": _Usual("AMD Instinct MI250", "xgmi-mi250x", "slingshot-200g", 24.0, nics_per_node=4),
    "V100": _Usual("Tesla V100-SXM2-16GB", "nvlink2", "ethernet-100g", 12.0),
    "V100-32GB": _Usual("Tesla V100-SXM2-32GB", "nvlink2", "ethernet-100g", 12.0),
    "V100-PCIe": _Usual("Tesla V100-PCIE-16GB", "pcie3", "ethernet-100g", 12.0),
    "V100-PCIe-32GB": _Usual("Tesla V100-PCIE-32GB", "pcie3", "ethernet-100g", 12.0),
    "T4": _Usual("Tesla T4", "pcie3", "ethernet-100g", 12.0),
    "RTX4090": _Usual("NVIDIA GeForce RTX 4090", "pcie4", "ethernet-100g", 24.0),
    "RTX3090": _Usual("NVIDIA GeForce RTX 3090", "pcie4", "ethernet-100g", 24.0),
    "RTX6000-Ada": _Usual("NVIDIA RTX 6000 Ada", "pcie4", "ethernet-100g", 24.0),
    "RTX-A6000": _Usual("NVIDIA RTX A6000", "pcie4", "ethernet-100g", 24.0),
}
# A GPU described only by numbers (a file or flags without `base`) gets the links of a PCIe card,
# the most conservative default; Cluster.sources says so, and the file or --intra/--inter fix it.
_CUSTOM_USUAL = _Usual("", "pcie4", "ethernet-100g", 24.0)
# Other spellings people use; matched after dropping case and separators ("a100_80gb").
_SYNONYMS = {
    "A100-80GB": "A100", "A100-SXM": "A100", "A100-SXM-80GB": "A100", "A100-SXM-40GB": "A100-40GB",
    "A100-PCIe-80GB": "A100-PCIe", "H100-SXM": "H100", "H100-80GB": "H100", "H200-SXM": "H200",
    "B200-SXM": "B200", "V100-SXM2": "V100", "V100-16GB": "V100", "A6000": "RTX-A6000",
    "A800-SXM": "A800", "A800-80GB": "A800", "A800-SXM-80GB": "A800", "A800-PCIe-80GB": "A800-PCIe",
    "H800-SXM": "H800", "H800-80GB": "H800", "H20-96GB": "H20", "GH200-96GB": "GH200", "GH200-480GB": "GH200",
    "L40S-48GB": "L40S",
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


# Training stacks whose data-parallel collectives the planner knows (plan/timing_comm.py):
#   torch      slipstream / PyTorch DDP (25 MiB buckets, zero1 = all-reduce + broadcast), FSDP2
#   megatron   Megatron-LM (grad-buffer buckets; its distributed optimizer = reduce-scatter + all-gather)
#   deepspeed  DeepSpeed ZeRO (reduce_bucket_size buckets; ZeRO-1/2 = reduce-scatter + all-gather)
STACKS = ("torch", "megatron", "deepspeed")
# Whether each stack, left at its defaults, reduces gradients behind backward:
#   torch      DDP's reducer launches each bucket's all-reduce asynchronously as backward fills it
#              (torch docs, "Distributed Data Parallel" design note: "overlapping gradient
#              synchronization with the backward pass"); FSDP2 reduce-scatters per unit the same way.
#   megatron   Megatron Core distributed/distributed_data_parallel_config.py: "overlap_grad_reduce:
#              bool = False"; off, finish_grad_sync "start(s) (and finish(es)) synchronous
#              communication call here", after backward, and DistributedDataParallel sets
#              bucket_size to None ("Set bucket_size to infinity if overlap_grad_reduce is False"):
#              one bucket of all gradients. Training scripts turn it on with --overlap-grad-reduce.
#   deepspeed  DeepSpeed runtime/zero/config.py, DeepSpeedZeroConfig.overlap_comm_valid: "if
#              self.overlap_comm is None: self.overlap_comm = self.stage == ZeroStageEnum.weights"
#              (on for stage 3 only); stages 1 / 2 without it reduce each bucket on the compute
#              stream, blocking backward.
STACK_OVERLAPS_GRAD_REDUCE = {"torch": True, "megatron": False, "deepspeed": False}
# A bucket above 64 GiB is a unit slip (MB for elements), not a setting.
MAX_BUCKET_MB = 65536.0


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
    # The training stack whose collectives the plan times (plan/timing_comm.py: its gradient bucket
    # size, its ZeRO collectives): one of STACKS. And a gradient bucket size in MB (2**20 bytes)
    # that replaces the stack's default (DDP's bucket_cap_mb, Megatron's bucket_size, DeepSpeed's
    # reduce_bucket_size); None: the stack's default.
    stack: str = "torch"
    bucket_mb: float | None = None
    # Whether the gradient reduction overlaps backward (`--overlap-grad-reduce on|off`); None: the
    # stack's default, STACK_OVERLAPS_GRAD_REDUCE.
    overlap_grad_reduce: bool | None = None

    def __post_init__(self) -> None:
        if self.stack not in STACKS:
            raise UserError(f"unknown training stack {self.stack!r}; use one of {', '.join(STACKS)} (--stack).")
        if self.bucket_mb is not None and not (isinstance(self.bucket_mb, (int, float)) and 0 < self.bucket_mb
                                               <= MAX_BUCKET_MB):
            raise UserError(f"--bucket-mb {self.bucket_mb!r}: a gradient bucket is more than 0 and at most "
                            f"{MAX_BUCKET_MB:g} MB; give e.g. --bucket-mb 25.")

    @property
    def overlaps_grad_reduce(self) -> bool:
        """Whether the data-parallel gradient reduction runs behind backward (plan/timing_comm.py)."""
        if self.overlap_grad_reduce is not None:
            return self.overlap_grad_reduce
        return STACK_OVERLAPS_GRAD_REDUCE[self.stack]

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
    """"8xH100" -> (8, "H100"); "H100" -> (1, "H100"); "8 x a100-80gb" -> (8, "a100-80gb");
    "8xmy_gpu.toml" -> (8, "my_gpu.toml"), a GPU described by a file (plan.gpus.read_gpu_file)."""
    text = str(text)
    match = (re.fullmatch(r"\s*(?:(\d+)\s*[x×*]\s*)?(\S.*?\.toml)\s*", text, flags=re.IGNORECASE)
             or re.fullmatch(r"\s*(?:(\d+)\s*[x×*]\s*)?([A-Za-z][\w\-. ]*?)\s*", text, flags=re.IGNORECASE))
    if not match or (match.group(1) is not None and int(match.group(1)) < 1):
        raise UserError(f"cannot read --gpus {text!r}; write COUNTxNAME per node, e.g. 8xH100, 4xA100-40GB or "
                        f"2xcpu (count >= 1), or COUNTxFILE.toml for a GPU described by a file. Known names: "
                        f"{', '.join(known_gpus())}.")
    return int(match.group(1) or 1), match.group(2)


def _unknown_gpu(name: str) -> UserError:
    close = difflib.get_close_matches(_normalize(name), list(_BY_NORMAL) + ["CPU"], n=1, cutoff=0.5)
    hint = f" Did you mean {canonical_gpu_name(close[0])}?" if close else ""
    return UserError(f"unknown GPU {name!r}.{hint} Known: {', '.join(known_gpus())}. For a GPU not listed, "
                     "describe it: --gpus 8xmy_gpu.toml (a small TOML file, see docs/planner.md), or name it and "
                     "give its numbers: --gpus 8xmy_gpu --peak-tflops bf16=400,fp8=800 --gpu-memory-gib 64 "
                     "--gpu-mem-bw 2000.")


def _inter_per_gpu(link: Link, per_node: int, nics: int) -> Link:
    """The network per GPU when `nics` NICs of `link` serve a node of `per_node` GPUs: NCCL runs
    one ring per NIC side by side, so a node moves nics x one NIC and each GPU gets its share."""
    if nics == per_node:
        return link
    share = link.bandwidth_gbs * nics / per_node
    return replace(link, bandwidth_gbs=share,
                   description=f"{link.description}; {nics} per node for {per_node} GPUs: {share:.3g} GB/s per GPU")


def _resolve_gpu(name: str, described: GpuDescription | None) -> tuple[str, GpuSpec | None, _Usual,
                                                                        GpuDescription | None, list[str]]:
    """(short name, spec, usual links, the user's description, source lines) for --gpus' NAME.
    NAME is a known short name (optionally with some numbers changed by `described`), a FILE.toml,
    or a new name whose numbers all come from `described`. spec is None for the cpu."""
    described = described if described is not None and described.given() else None
    where = ""
    if name.lower().endswith(".toml"):
        where = f"GPU file {name}: "
        from_file = read_gpu_file(name)
        described = from_file.merged(described) if described else from_file
        label = described.name or os.path.splitext(os.path.basename(name))[0]
        base = canonical_gpu_name(described.base) if described.base else None
        if described.base and base in (None, CPU):
            raise UserError(f"GPU file {name}: base {described.base!r} is not a known GPU; use one of "
                            f"{', '.join(_GPUS)}, or drop base and give every number.")
    else:
        base, label = canonical_gpu_name(name), ""
        if base == CPU:
            if described:
                raise UserError("--peak-tflops, --gpu-memory-gib, --gpu-mem-bw and --gpu-generation describe a "
                                "GPU; a cpu cluster measures this machine instead. Drop them, or plan for a GPU.")
            return CPU, None, _Usual("", "shm", "ethernet-25g", CPU_MEMORY_BW_GBS), None, []
        if base is None:
            if not described:
                raise _unknown_gpu(name)
            label = name
    usual = _GPUS[base] if base else _CUSTOM_USUAL
    spec = lookup_gpu(usual.device) if base else None
    assert base is None or spec is not None, f"{usual.device} missing from plan.gpus"
    if not described:
        return base, spec, usual, None, []
    if spec is None:
        missing = [key for key, have in (("peak_tflops", described.peaks), ("memory_gib", described.memory_gib),
                                         ("mem_bw_gbs", described.mem_bw_gbs)) if not have]
        if missing:
            raise UserError(f"{where}GPU {label!r} is not in the table, so its description needs {', '.join(missing)} "
                            "(missing). Give them in the GPU file ([peak_tflops] with bf16 = ..., memory_gib, "
                            "mem_bw_gbs), or as --peak-tflops bf16=...,fp8=... --gpu-memory-gib N --gpu-mem-bw "
                            "GB/s; or start from a known GPU with base = \"H100\" in the file.")
    origin = described.origin
    sources = [f"peak {key} {value:g} TFLOP/s (dense): {origin[f'peak_tflops.{key}']}"
               for key, value in sorted(described.peaks.items(), key=lambda kv: DTYPE_KEYS.index(kv[0]))]
    for key, what, unit in (("memory_gib", "GPU memory", "GiB"), ("mem_bw_gbs", "memory bandwidth", "GB/s"),
                            ("host_link_gbs", "host<->device", "GB/s")):
        if key in origin:
            sources.append(f"{what} {getattr(described, key):g} {unit}: {origin[key]}")
    if "generation" in origin:
        sources.append(f"generation {described.generation}: {origin['generation']}")
    spec = GpuSpec(
        name=label or spec.name,
        peaks={**(spec.peaks if spec else {}), **described.peaks},
        memory_gib=described.memory_gib or spec.memory_gib,
        mem_bw_gbs=described.mem_bw_gbs or spec.mem_bw_gbs,
        generation=described.generation if described.generation is not None else (spec.generation if spec else ""))
    return label or base, spec, usual, described, sources


def _usual_links(short: str, usual: _Usual, described: GpuDescription | None, flagged: set[str],
                 sources: list[str]) -> tuple[Link, Link, int, float]:
    """(intra, inter, NICs per node or 0 for the link's own default, host GB/s) before probes
    and flags; `flagged` names the links that --intra / --inter will replace anyway."""
    intra_link, inter_link = LINKS[usual.intra], LINKS[usual.inter]
    nics, host_gbs = usual.nics_per_node, usual.host_gbs
    if described is None:
        return intra_link, inter_link, nics, host_gbs
    if described.intra:
        intra_link = parse_link(described.intra, f"{described.origin['intra']}: intra", intra_link)
        sources.append(f"intra-node link {described.intra}: {described.origin['intra']}")
    if described.inter:
        inter_link, nics = parse_link(described.inter, f"{described.origin['inter']}: inter", inter_link), 0
        sources.append(f"inter-node link {described.inter}: {described.origin['inter']}")
    if described.host_link_gbs:
        host_gbs = described.host_link_gbs
    if usual is _CUSTOM_USUAL:  # a GPU known only by its numbers: say what was assumed
        for key, value, flag in (("intra", usual.intra, "--intra"), ("inter", usual.inter, "--inter"),
                                 ("host_link_gbs", f"{usual.host_gbs:g} GB/s", "")):
            if not getattr(described, key) and key not in flagged:
                fix = f" or {flag}" if flag else ""
                sources.append(f"GPU {short}: no {key} given, assumed {value} (the table's default for a PCIe "
                               f"card); set {key} in the GPU file{fix}")
    return intra_link, inter_link, nics, host_gbs


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


# Two probe files may measure the same thing (a single-node probe and a multi-node one both time
# the intra-node ring). Repeated nccl-tests runs on one machine agree within a few percent; a
# different link or GPU is 2x or more apart. 25 % keeps noise apart from a real contradiction.
PROBE_AGREEMENT = 0.25


def _check_machine(data: dict, path: str, short: str, spec: GpuSpec | None, seen: dict[str, str]) -> None:
    """Refuse a probe from another kind of machine: a CPU for a GPU plan, another GPU model, or
    a device other than the one an earlier probe file measured."""
    machine = data.get("machine") or {}
    on_cpu = str(machine.get("device", "")).startswith("cpu")
    if on_cpu != (short == CPU):
        raise UserError(f"probe file {path} was measured on {'a CPU' if on_cpu else 'a GPU'} but --gpus asks for "
                        f"{short}; probe the machine you plan for, or drop --probe.")
    compute = data["sections"].get("compute") or {}
    device = str(machine.get("device_name") or compute.get("datasheet") or "")
    if spec is not None and short != CPU:
        probed = lookup_gpu(device)
        if probed is not None and probed.name != spec.name:
            raise UserError(f"probe file {path} was measured on {probed.name} but --gpus asks for {spec.name}; "
                            "probe the GPU you plan for, or drop --probe.")
    if device:
        for other_path, other in seen.items():
            if other != device:
                raise UserError(f"probe files {other_path} and {path} were measured on different devices ({other!r} "
                                f"and {device!r}); pass probes of the machine you plan for only.")
        seen[path] = device


def _read_probes(paths: Sequence[str], per_node: int, short: str, spec: GpuSpec | None,
                 sources: list[str]) -> dict[str, ProbeFact]:
    """The facts of every probe file, merged: each from the first file that has it; a fact two
    files measured more than PROBE_AGREEMENT apart is a contradiction and refused."""
    facts: dict[str, ProbeFact] = {}
    seen: dict[str, str] = {}
    peaks = spec.peaks if spec is not None and short != CPU else {}
    for path in paths:
        data = read_probe(path)
        _check_machine(data, path, short, spec, seen)
        for key, fact in probe_facts(data, path, per_node, sources, peaks).items():
            first = facts.setdefault(key, fact)
            if first is fact:
                continue
            low, high = sorted((first.value, fact.value))
            if high > low * (1 + PROBE_AGREEMENT):
                raise UserError(f"probe files {first.path} and {path} disagree on the {key}: {first.value:.4g} vs "
                                f"{fact.value:.4g}, more than {PROBE_AGREEMENT:.0%} apart. They measured different "
                                "hardware or one run was disturbed: re-probe, or pass only one of them.")
            sources.append(f"{key}: probe file {path} agrees with {first.path} ({fact.value:.4g} vs "
                           f"{first.value:.4g}); the first is used")
    return facts


def make_cluster(gpus: str, nodes: int = 1, intra: str | None = None, inter: str | None = None,
                 probe: str | Sequence[str] | None = None, memory_gib: float | None = None,
                 cpu: CpuFacts | None = None, *, gpu: GpuDescription | None = None,
                 nics_per_node: int | None = None) -> Cluster:
    """A Cluster for `--gpus NxNAME` (N per node) times `nodes`; see the module doc.

    gpus: NAME is a known short name, FILE.toml (plan.gpus.read_gpu_file), or a new name whose
        numbers all come from `gpu` (plan.gpus.gpu_from_flags); `gpu` also changes a known one.
    intra, inter: a link name or a bandwidth (parse_link). nics_per_node: the NICs of a node;
        the inter link (one NIC's bandwidth) is then shared by the node's GPUs.
    probe: one probe file or several (merged; contradictions refused).
    cpu: observe.peaks.this_cpu(), needed for a `cpu` cluster only and ignored otherwise.
    """
    per_node, name = parse_gpus(gpus)
    short, spec, usual, described, sources = _resolve_gpu(name, gpu)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise UserError(f"--nodes must be a whole number >= 1, got {nodes!r}.")
    limit = MAX_CPU_PROCESSES if short == CPU else MAX_GPUS_PER_NODE
    if per_node > limit:
        if nodes == 1 and short != CPU and per_node % MAX_GPUS_PER_NODE == 0:
            nodes, per_node = per_node // MAX_GPUS_PER_NODE, MAX_GPUS_PER_NODE
            sources.insert(0, f"--gpus {gpus}: more than {limit} per node, read as {nodes} nodes of {per_node}")
        else:
            raise UserError(f"--gpus {gpus}: {per_node} per node is more than the {limit} a node holds. The "
                            f"count is per node: write e.g. --gpus {limit}x{name} --nodes {max(2, nodes)}.")
    if nics_per_node is not None and (isinstance(nics_per_node, bool) or not isinstance(nics_per_node, int)
                                      or not 1 <= nics_per_node <= MAX_NICS_PER_NODE):
        raise UserError(f"--nics-per-node must be a whole number from 1 to {MAX_NICS_PER_NODE}, got "
                        f"{nics_per_node!r}.")

    paths = [probe] if isinstance(probe, str) else list(probe or ())
    facts = _read_probes(paths, per_node, short, spec, sources)
    measured = {key.split()[0]: fact for key, fact in facts.items() if key.endswith(" matmul")}

    if short == CPU:
        spec = _cpu_spec(per_node, {k: f.value for k, f in measured.items() if k in ("fp32", "bf16", "fp16")}, cpu)
        efficiency = dict.fromkeys(spec.peaks, 1.0)  # measured rates already are achievable rates
        reserve_gib = CPU_MEMORY_RESERVE_GIB
        sources.append(f"cpu peaks: measured matmul rates of this machine / {per_node} process(es)")
    else:
        efficiency = {k: DEFAULT_MATMUL_EFFICIENCY.get(k, 0.75) for k in spec.peaks}
        reserve_gib = GPU_MEMORY_RESERVE_GIB
        for key, fact in measured.items():
            if key in spec.peaks:
                efficiency[key] = fact.value / spec.peaks[key]
                sources.append(f"{key} matmul {efficiency[key]:.2f} of peak ({fact.value:.1f} TFLOP/s): "
                               f"probe file {fact.path}")

    flagged = {key for key, value in (("intra", intra), ("inter", inter)) if value is not None}
    intra_link, inter_link, nics, host_gbs = _usual_links(short, usual, described, flagged, sources)
    inter_measured = False
    for key, level in (("intra-node link", "intra"), ("inter-node link", "inter")):
        if key in facts:
            ring, path = facts[key].detail, facts[key].path
            base = intra_link if level == "intra" else inter_link
            link = replace(base, bandwidth_gbs=ring["bandwidth"], latency_us=ring["latency"],
                           description=f"{base.description} (measured)")
            how = "the smallest's time per ring step"
            if ring.get("backend") == "nccl" and base.fabric in NCCL_FABRICS:
                # NCCL ran the smallest message LL, past its base latency: the ring Simple step
                # under which NCCL's model (plan/collectives.py) times it as measured
                from slipstream.plan.collectives import link_latency_from_time

                nodes, ranks = (1, ring["world"]) if level == "intra" else (ring["world"], 1)
                link = replace(link, latency_us=link_latency_from_time(
                    "all_reduce", ring["small_bytes"], ring["small_seconds"], link, intra_link, nodes, ranks,
                    spec.generation if spec is not None else ""))
                how = "NCCL's model timing the smallest as measured"
            sources.append(f"{key} {link.bandwidth_gbs:.1f} GB/s, {link.latency_us:.1f} us/step ({how}): all_reduce "
                           f"of {ring['bytes']} B over {ring['world']} ranks, probe file {path}")
            groups = ring.get("groups")
            if level == "inter" and isinstance(groups, int) and groups != per_node:
                sources.append(f"{key}: measured with {groups} rank(s) per node sharing the NICs, planned with "
                               f"{per_node}; re-probe with {per_node} per node for this share")
            if level == "intra":
                intra_link = link
            else:
                inter_link, inter_measured = link, True
    if intra is not None:
        intra_link = parse_link(intra, "--intra", intra_link)
        sources.append(f"intra-node link {intra}: --intra")
    if inter is not None:
        inter_link, nics, inter_measured = parse_link(inter, "--inter", inter_link), 0, False
        sources.append(f"inter-node link {inter}: --inter")
    if nics_per_node is not None:
        if inter_measured:
            raise UserError("--nics-per-node shares a network link given by name or bandwidth among a node's GPUs; "
                            "the probe's inter-node measurement already is per GPU. Drop --nics-per-node, or "
                            "give --inter as well.")
        nics = nics_per_node
        sources.append(f"{nics_per_node} NIC(s) per node: --nics-per-node")
    if not inter_measured:
        nics = nics or (1 if inter_link.name in PER_NODE_LINKS else per_node)
        inter_link = _inter_per_gpu(inter_link, per_node, nics)

    if "host<->device" in facts:
        fact = facts["host<->device"]
        host_gbs = fact.value
        sources.append(f"host<->device {host_gbs:.1f} GB/s ({fact.detail['kind']}): probe file {fact.path}")
    if short == CPU and "memory copy" in facts:
        fact = facts["memory copy"]
        spec = replace(spec, mem_bw_gbs=fact.value)
        host_gbs = fact.value  # "offload" on a CPU is a copy within RAM
        sources.append(f"memory bandwidth {fact.value:.1f} GB/s: probe file {fact.path}")

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
