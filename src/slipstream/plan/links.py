"""The links a plan's collectives cross: the table of named links (achievable bus bandwidth per
GPU, latency per ring step, the fabric NCCL's tuning model calls it) and parse_link, a link given
by its numbers. Apart from the cluster (plan/hardware.py), which picks each GPU's usual links and
shares a node's NICs among its GPUs (hardware._inter_per_gpu).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from slipstream.errors import UserError

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
#   table entry or nics_per_node (--nics-per-node) can say otherwise (see hardware._inter_per_gpu).
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
# Plausibility ceilings of a link, given (parse_link) or measured (a probe file): 100 TB/s per
# GPU is a unit slip (B for b, or T for G), not a real link (NVLink 5 is 0.9 TB/s per direction);
# a second per ring step is no network.
MAX_LINK_GBS = 100_000.0
MAX_LINK_LATENCY_US = 1e6
# A group of one rank communicates with nobody: infinite bandwidth, no latency.
LOCAL = Link("local", math.inf, 0.0, "no communication (group of one rank)")


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
