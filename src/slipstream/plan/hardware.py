"""The cluster a plan runs on: GPU model, how many, and the links between them.

`make_cluster("8xH100", nodes=4)` builds a Cluster from these sources, in rising priority:
  1. the datasheet table in plan/gpus.py (peak TFLOP/s, memory, memory bandwidth), or the
     user's own GPU description (`--gpus 8xmy_gpu.toml`, and/or `gpu=gpus.gpu_from_flags(...)`
     for a GPU named by flags or a known GPU with some numbers changed),
  2. documented defaults here (link bandwidths, matmul efficiency, memory reserve),
  3. `slipstream probe --out FILE` results (one or several files, merged),
  4. explicit overrides: `memory_gib`, `intra` / `inter` (a link name or a bandwidth such as
     "12.5GB/s", "ib:400Gb/s@5us", see parse_link), `nics_per_node`.
Every number that did not come from 1's table or 2 is listed in Cluster.sources, so a plan
can say what it assumed. `cpu` plans for this machine: its peaks are measured (cached) rates,
which the caller reads and passes in (`cpu=observe.peaks.this_cpu()`; this module measures
nothing).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from slipstream.errors import UserError
from slipstream.plan.gpus import (DTYPE_KEYS, MAX_HOST_LINK_GBS, MAX_MEM_BW_GBS, MAX_PEAK_TFLOPS, GpuDescription,
                                   GpuSpec, lookup_gpu, read_gpu_file)


@dataclass(frozen=True)
class Link:
    name: str             # e.g. "nvlink4", "ib-ndr", "pcie5", "shm"
    bandwidth_gbs: float  # achievable bus bandwidth per GPU of large ring collectives, GB/s, one direction
    latency_us: float     # per-step latency of a ring collective (NCCL's Simple protocol) over this link
    description: str
    # What NCCL's tuning model calls this link (plan/collectives.py): "nvlink", "pcie" or "net";
    # "" for links NCCL does not run (gloo between processes, AMD Infinity Fabric under RCCL),
    # which are planned as a plain ring at latency_us per step.
    fabric: str = ""
    # NVLink SHARP (NVLS): the NVSwitch reduces an all-reduce in the switch. The bus bandwidth
    # nccl-tests reports for it on a full node (0: the switch has none, NCCL runs rings and trees).
    nvls_busbw_gbs: float = 0.0


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
# - Export NVLink (400 GB/s bidirectional = 8 links, 200 GB/s per direction): A800 = NVLink 3,
#   NCCL's model 8 x 20 = 160 times the A100's measured/model ratio (230/240) = 153; H800 =
#   NVLink 4, NCCL's model 8 x 20.6 = 165, and DeepEP measured 153-158 GB/s of NVLink traffic
#   on H800 ("~160 GB/s NVLink maximum bandwidth", github.com/deepseek-ai/DeepEP docs/legacy.md).
# - AMD Infinity Fabric (xGMI): 8 MI300X are fully connected by 7 links each (ROCm docs,
#   docs/conceptual/gpu-arch/mi300.md; 128 GB/s bidirectional per link, 448 GB/s per direction
#   in all); AMD's own rccl-tests all_reduce on 8 MI300X reaches 309-316 GB/s busbw from 512 MiB
#   to 8 GiB, and an 8-byte all_reduce takes 40.9 us = 2.9 us per ring step (ROCm docs image
#   docs/data/how-to/rocm-for-ai/rccl-tests-8-gpu.png). MI250X: the 8 GCDs of a node are joined
#   by single or double 50 GB/s-per-direction links between packages (4 between the two GCDs of
#   one package, mi250.md), so a ring over all 8 is bounded by one 50 GB/s link: an ESTIMATE of
#   80 % of it (the NVLink fraction), not a measurement.
# - Networks: ~88 % of the wire rate for InfiniBand (nccl-tests#119: 4xHDR per 8 A100 gave
#   85-96 of 100 GB/s), ~80 % for RoCE and TCP Ethernet (and HPE Slingshot, Ethernet-based).
#   A network link's bandwidth is ONE NIC's. ib-*, roce-* and slingshot-* default to one NIC per
#   GPU (rail-optimised HGX/DGX); ethernet-* to one NIC per NODE, shared by its GPUs; a GPU's
#   table entry or nics_per_node (--nics-per-node) can say otherwise (see _inter_per_gpu).
# Latencies are per ring step of NCCL's Simple protocol: NCCL's own tuning model, hwLat[.][Ring][Simple]
# in src/graph/tuning.cc (NCCL v2.27.7-1, lines 143-156): NVLink 3.4 us, PCI 5.7 us, network 14.0 us;
# plan/collectives.py scales NCCL's other protocol and algorithm latencies by latency_us over these,
# so a measured or given latency moves them all. TCP Ethernet (25 us) and gloo (50 us) are our
# estimates (sockets add tens of us; `slipstream probe --sections comm` measures them).
# NVLink SHARP (nvls_busbw_gbs): the NVSwitch of HGX/DGX H100 and H200 (NVLink 4 with the third-
# generation NVSwitch) reduces in the switch; NCCL's maintainers quote a peak all_reduce busBw of
# ~480 GB/s on 8 H100 (nccl-tests#212, sjeaugey 2024-05-06: "On 8 GPUs, you should reach a peak
# busBw of ~480GB/s (algbw ~275GB/s)"; GTC S62129 quotes the same 480, nccl#1374). Not set for
# NVLink 5 (B200) or the 400 GB/s export parts: no quoted figure here.
LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        Link("nvlink2", 120.0, 3.4, "NVLink 2 (V100 SXM2): 6 links x 25 GB/s, hybrid cube-mesh", "nvlink"),
        Link("nvlink3", 230.0, 3.4, "NVLink 3 (A100 SXM): 600 GB/s bidirectional = 300 per direction", "nvlink"),
        Link("nvlink4", 370.0, 3.4, "NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional = 450 per direction", "nvlink",
             nvls_busbw_gbs=480.0),
        Link("nvlink5", 720.0, 3.4, "NVLink 5 (B200): 1800 GB/s bidirectional = 900 per direction", "nvlink"),
        Link("nvlink3-400", 150.0, 3.4, "NVLink 3 at 400 GB/s bidirectional (A800): 8 links, 200 per direction",
             "nvlink"),
        Link("nvlink4-400", 155.0, 3.4, "NVLink 4 at 400 GB/s bidirectional (H800): 8 links, 200 per direction",
             "nvlink"),
        Link("xgmi-mi300x", 315.0, 3.0, "AMD Infinity Fabric, 8 MI300X fully connected (7 links per GPU)"),
        Link("xgmi-mi250x", 40.0, 3.0, "AMD Infinity Fabric between the 8 GCDs of 4 MI250X (estimate)"),
        Link("pcie3", 10.0, 5.7, "PCIe gen3 x16 (~16 GB/s raw per direction)", "pcie"),
        Link("pcie4", 20.0, 5.7, "PCIe gen4 x16 (~32 GB/s raw per direction)", "pcie"),
        Link("pcie5", 40.0, 5.7, "PCIe gen5 x16 (~64 GB/s raw per direction)", "pcie"),
        Link("ib-hdr", 22.0, 14.0, "InfiniBand HDR, one 200 Gb/s NIC per GPU", "net"),
        Link("ib-ndr", 44.0, 14.0, "InfiniBand NDR, one 400 Gb/s NIC per GPU", "net"),
        Link("roce-400g", 40.0, 14.0, "RoCE, one 400 Gb/s NIC per GPU", "net"),
        Link("slingshot-200g", 20.0, 14.0, "HPE Slingshot, a 200 Gb/s NIC", "net"),
        Link("ethernet-100g", 10.0, 25.0, "TCP Ethernet, one 100 Gb/s NIC per node", "net"),
        Link("ethernet-25g", 2.5, 25.0, "TCP Ethernet, one 25 Gb/s NIC per node", "net"),
        # gloo between processes of one machine (TCP over loopback / shared memory). A rough
        # figure for a CPU development box; `slipstream probe --sections comm` measures it.
        Link("shm", 3.0, 50.0, "gloo between processes of one machine"),
    )
}
# These NICs serve a whole node by default: each GPU's share is the bandwidth / GPUs per node.
PER_NODE_LINKS = frozenset({"ethernet-100g", "ethernet-25g"})

# The fabrics NCCL's tuning model knows (Link.fabric; plan/collectives.py).
NCCL_FABRICS = ("nvlink", "pcie", "net")

# A link given by its number instead of its name (parse_link): "KIND:RATE" is a WIRE rate, of
# which the kind's achievable fraction applies; a bare rate is an achievable bus bandwidth.
# Fractions from the figures above: InfiniBand 0.88, RoCE / Ethernet 0.80 (the network note);
# NVLink 0.80 (H100 370 of 450, B200 720 of 900, A100 230 of 300 GB/s per direction); PCIe 0.65;
# xGMI 0.70 (MI300X 315 of 448). Latencies per ring step as the named links of each kind.
WIRE_KINDS: dict[str, tuple[float, float, str]] = {  # kind -> (achievable fraction, latency us, what)
    "ib": (0.88, 14.0, "InfiniBand"),
    "roce": (0.80, 14.0, "RoCE"),
    "eth": (0.80, 25.0, "TCP Ethernet"),
    "slingshot": (0.80, 14.0, "HPE Slingshot"),
    "nvlink": (0.80, 3.4, "NVLink"),
    "pcie": (0.65, 5.7, "PCIe"),
    "xgmi": (0.70, 3.0, "AMD Infinity Fabric"),
}
# The fabric (Link.fabric) of a link given by kind: what NCCL's tuning model calls it.
_KIND_FABRIC = {"ib": "net", "roce": "net", "eth": "net", "slingshot": "net", "nvlink": "nvlink", "pcie": "pcie",
                "xgmi": ""}
_KIND_ALIASES = {"infiniband": "ib", "ethernet": "eth", "tcp": "eth"}
_UNIT_SCALE = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_LATENCY_SCALE = {"ns": 1e-3, "us": 1.0, "µs": 1.0, "ms": 1e3}
_NUMBER = r"(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
_LINK_SPEC = re.compile(
    rf"\s*(?:(?P<kind>[A-Za-z]+)\s*:\s*)?(?P<value>{_NUMBER})\s*(?P<prefix>[kKMGT]?)(?P<unit>[Bb])(?:/s|ps)"
    rf"(?:\s*@\s*(?P<latency>{_NUMBER})\s*(?P<latency_unit>ns|us|µs|ms))?\s*")
MAX_NICS_PER_NODE = 64
# Plausibility ceilings of a link, given (parse_link) or measured (a probe file): 100 TB/s per
# GPU is a unit slip (B for b, or T for G), not a real link (NVLink 5 is 0.9 TB/s per direction);
# a second per ring step is no network.
MAX_LINK_GBS = 100_000.0
MAX_LINK_LATENCY_US = 1e6
# A group of one rank communicates with nobody: infinite bandwidth, no latency.
LOCAL = Link("local", math.inf, 0.0, "no communication (group of one rank)")


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


def parse_link(text: str, flag: str, replaces: Link | None = None) -> Link:
    """A link by name (LINKS) or by its numbers.

    "12.5GB/s", "100Gb/s": an ACHIEVABLE bus bandwidth per GPU (what nccl-tests' busbw and
        `slipstream probe --sections comm` report), used as given; GB = 10^9 bytes, Gb = 10^9
        bits (so 100Gb/s is 12.5 GB/s); k, M, T prefixes and "Gbps" spellings work too.
    "ib:400Gb/s": a WIRE rate (per direction) of a kind in WIRE_KINDS; its achievable fraction
        applies (ib 0.88: 400Gb/s -> 44 GB/s, as the named ib-ndr).
    "...@5us": the latency per ring step (ns, us, ms). Default: the kind's; for a bare bandwidth
        the latency of the link it replaces (`replaces`, the GPU's usual one), else 5 us.
    """
    text = str(text)
    if text.strip() in LINKS:
        return LINKS[text.strip()]
    how = (f"give a link name ({', '.join(LINKS)}), an achievable bus bandwidth such as 12.5GB/s or "
           f"100Gb/s (GB = bytes, Gb = bits), or a wire rate with its kind such as ib:400Gb/s "
           f"({', '.join(f'{k} x{f:g}' for k, (f, _, _) in WIRE_KINDS.items())}); add @5us for the latency "
           "per ring step")
    match = _LINK_SPEC.fullmatch(text)
    if not match:
        raise UserError(f"{flag} {text!r}: not a link; {how}.")
    kind = match["kind"]
    if kind is not None:
        kind = _KIND_ALIASES.get(kind.lower(), kind.lower())
        if kind not in WIRE_KINDS:
            raise UserError(f"{flag} {text!r}: unknown link kind {match['kind']!r}; {how}.")
    rate = float(match["value"]) * _UNIT_SCALE[match["prefix"]] / 1e9 / (8 if match["unit"] == "b" else 1)
    if not 0 < rate < math.inf:
        raise UserError(f"{flag} {text!r}: the bandwidth must be greater than 0; {how}.")
    if rate > MAX_LINK_GBS:
        raise UserError(f"{flag} {text!r} is {rate:g} GB/s per GPU, implausibly fast; check the unit: {how}.")
    if kind is None:
        bandwidth, what = rate, f"{rate:.4g} GB/s achievable bus bandwidth"
    else:
        fraction, _, kind_name = WIRE_KINDS[kind]
        bandwidth, what = rate * fraction, f"{kind_name} wire rate {rate:.4g} GB/s x {fraction:g} achievable"
    if match["latency"] is not None:
        latency = float(match["latency"]) * _LATENCY_SCALE[match["latency_unit"]]
        said = "given"
        if latency > MAX_LINK_LATENCY_US:
            raise UserError(f"{flag} {text!r}: a latency of {latency:g} us per step is implausible; give e.g. @5us.")
    elif kind is not None:
        latency, said = WIRE_KINDS[kind][1], f"the usual {WIRE_KINDS[kind][2]} one"
    elif replaces is not None:
        latency, said = replaces.latency_us, f"that of {replaces.name}"
    else:
        latency, said = 5.0, "assumed"
    fabric = _KIND_FABRIC[kind] if kind is not None else (replaces.fabric if replaces is not None else "")
    # a link given by its numbers has no NVLink SHARP: the user's bandwidth is the one planned
    return Link(re.sub(r"\s+", "", text), bandwidth, latency,
                f"{flag} {text.strip()}: {what}, {latency:g} us per step ({said})", fabric)


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


# A probe file is a few KB (our own JSON); the cap keeps a wrong or hostile file from exhausting memory.
PROBE_MAX_BYTES = 16 * 2**20
# Two probe files may measure the same thing (a single-node probe and a multi-node one both time
# the intra-node ring). Repeated nccl-tests runs on one machine agree within a few percent; a
# different link or GPU is 2x or more apart. 25 % keeps noise apart from a real contradiction.
PROBE_AGREEMENT = 0.25
PROBE_HOW = "make one with `slipstream probe --out FILE` (add --sections comm under torchrun for links)"


class _Fact(NamedTuple):
    value: float   # the number compared when two probe files measure the same thing
    detail: dict
    path: str


PROBE_REDO = "re-run `slipstream probe --out FILE` (add --sections comm under torchrun for links)"
# A measured matmul rate cannot beat the datasheet's dense peak, which already is the boost-clock
# rate; 20 % above it leaves room for timer noise and a rounded datasheet figure. More is a unit
# slip, another GPU, or a broken timer, and would plan with an efficiency above 1.
PROBE_MAX_OF_PEAK = 1.2


def _read_probe(path: str) -> dict:
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


def _probe_facts(data: dict, path: str, per_node: int, notes: list[str], peaks: dict[str, float]) -> dict[str, _Fact]:
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
        facts[f"{key} matmul"] = _Fact(_number(entry.get("best_tflops"), path, f"{where}.best_tflops", ceiling, unit),
                                       {}, path)
    memory = sections.get("memory")
    if memory is not None:
        host = _host_gbs(memory, path)
        if host is not None:
            facts["host<->device"] = _Fact(host[0], {"kind": host[1]}, path)
        copy = _table(memory, "copy", path, "sections.memory.copy")
        if copy is not None:
            facts["memory copy"] = _Fact(_number(copy.get("gbs"), path, "sections.memory.copy.gbs", MAX_MEM_BW_GBS,
                                                 " GB/s"), {}, path)
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
                facts[label] = _Fact(ring["bandwidth"], ring | {"backend": backend}, path)
        return facts
    # One group over the whole launch (older probes): a node's link only if it fits in one node.
    ring = _ring(comm, path, "sections.comm")
    if ring is not None:
        ring["backend"] = backend
    if ring is not None and ring["world"] <= per_node:
        facts["intra-node link"] = _Fact(ring["bandwidth"], ring, path)
    elif ring is not None:
        notes.append(f"probe file {path}: comm over {ring['world']} rank(s) does not measure one node of "
                     f"{per_node}; link defaults kept (probe under torchrun on several nodes to measure both "
                     "levels)")
    return facts


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
                 sources: list[str]) -> dict[str, _Fact]:
    """The facts of every probe file, merged: each from the first file that has it; a fact two
    files measured more than PROBE_AGREEMENT apart is a contradiction and refused."""
    facts: dict[str, _Fact] = {}
    seen: dict[str, str] = {}
    peaks = spec.peaks if spec is not None and short != CPU else {}
    for path in paths:
        data = _read_probe(path)
        _check_machine(data, path, short, spec, seen)
        for key, fact in _probe_facts(data, path, per_node, sources, peaks).items():
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
