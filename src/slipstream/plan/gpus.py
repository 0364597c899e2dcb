"""GPU datasheet facts: dense peak TFLOP/s per dtype, memory size and memory bandwidth.

A blocks-layer table, read by the planner (plan/hardware.py) and by the MFU peak of a
training run (observe/peaks.py). Pure data and a name lookup: no torch, no measurement.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The dtype keys of a peak: bf16/fp16 tensor cores, tf32 (fp32 matmuls on tensor cores), fp32, fp8.
DTYPE_KEYS = ("bf16", "fp16", "tf32", "fp32", "fp8")


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet numbers for one GPU model.

    peaks: DENSE (no structured sparsity) peak TFLOP/s per dtype key. A key is missing
        when the GPU has no fast path for that dtype (e.g. bf16 on V100, fp8 on A100).
        "fp32" is the non-tensor-core FP32 rate; "tf32" is the tensor-core rate used for
        fp32 matmuls when TF32 is allowed (equal to "fp32" on GPUs without TF32).
        fp16/bf16 are the rates with FP32 accumulation, which is what PyTorch uses.
    memory_gib: nominal datasheet memory size; the usable size torch reports is slightly lower.
    mem_bw_gbs: peak memory bandwidth in GB/s.
    generation: the architecture family ("volta", "turing", "ampere", "ada", "hopper",
        "blackwell", "cdna3", "cpu", or "" when unknown): what the planner's achievable-rate
        constants are kept per (plan/efficiency.py).
    """

    name: str
    peaks: dict[str, float]
    memory_gib: float
    mem_bw_gbs: float
    generation: str = ""


def _peaks(bf16=None, fp16=None, tf32=None, fp32=None, fp8=None) -> dict[str, float]:
    given = {"bf16": bf16, "fp16": fp16, "tf32": tf32, "fp32": fp32, "fp8": fp8}
    return {k: v for k, v in given.items() if v is not None}


# Sources: NVIDIA product datasheets / architecture whitepapers (A100, H100, H100 NVL,
# H200, H200 NVL, GH200, HGX B200/B100, L40S, L40, L4, A10, V100, T4, Ampere GA102 and
# Ada AD102 whitepapers for the RTX cards, RTX A6000 and RTX 6000 Ada datasheets).
# Datasheets quote tensor-core numbers "with sparsity"; every number here is the dense
# one, i.e. half of the sparse figure. GeForce cards use the "FP32 accumulate" rates.
# A10G is an AWS-only part without a public NVIDIA datasheet: its numbers are the
# commonly quoted ones (about half the A10's tensor rate) and are approximate.
#
# Each row: (regexes that must ALL match the device name, case-insensitive, spec).
# ORDER MATTERS: the first matching row wins, so specific variants come before the
# generic name ("H100 PCIe" and "H100 NVL" before "H100", "A100 80GB" before "A100").
# Word boundaries keep "A10" from matching "A100"/"A10G", "L40" from matching "L40S",
# and "H200"/"B200" from matching "GH200"/"GB200" (which are then unknown, not wrong).
_GPU_TABLE: list[tuple[tuple[str, ...], GpuSpec]] = [
    # Blackwell
    ((r"\bB200\b",), GpuSpec("NVIDIA B200", _peaks(bf16=2250, fp16=2250, tf32=1100, fp32=75, fp8=4500), 180, 8000, "blackwell")),
    ((r"\bB100\b",), GpuSpec("NVIDIA B100", _peaks(bf16=1750, fp16=1750, tf32=900, fp32=60, fp8=3500), 192, 8000, "blackwell")),
    # Hopper
    ((r"\bGH200\b", r"\b144\s*G"), GpuSpec("NVIDIA GH200 144GB HBM3e", _peaks(bf16=989, fp16=989, tf32=494.5, fp32=67, fp8=1979), 144, 4900, "hopper")),
    ((r"\bGH200\b",), GpuSpec("NVIDIA GH200 96GB HBM3", _peaks(bf16=989, fp16=989, tf32=494.5, fp32=67, fp8=1979), 96, 4000, "hopper")),
    ((r"\bH200\b", r"\bNVL\b"), GpuSpec("NVIDIA H200 NVL", _peaks(bf16=835.5, fp16=835.5, tf32=417.5, fp32=60, fp8=1670.5), 141, 4800, "hopper")),
    ((r"\bH200\b",), GpuSpec("NVIDIA H200 SXM", _peaks(bf16=989, fp16=989, tf32=494.5, fp32=67, fp8=1979), 141, 4800, "hopper")),
    ((r"\bH100\b", r"\bNVL\b"), GpuSpec("NVIDIA H100 NVL", _peaks(bf16=835.5, fp16=835.5, tf32=417.5, fp32=60, fp8=1670.5), 94, 3900, "hopper")),
    ((r"\bH100\b", r"\bPCIE\b"), GpuSpec("NVIDIA H100 PCIe", _peaks(bf16=756, fp16=756, tf32=378, fp32=51, fp8=1513), 80, 2000, "hopper")),
    ((r"\bH100\b",), GpuSpec("NVIDIA H100 SXM", _peaks(bf16=989, fp16=989, tf32=494.5, fp32=67, fp8=1979), 80, 3350, "hopper")),
    # Ampere data center
    ((r"\bA100\b", r"\bPCIE\b", r"\b80\s*GB\b"), GpuSpec("NVIDIA A100 PCIe 80GB", _peaks(bf16=312, fp16=312, tf32=156, fp32=19.5), 80, 1935, "ampere")),
    ((r"\bA100\b", r"\bPCIE\b"), GpuSpec("NVIDIA A100 PCIe 40GB", _peaks(bf16=312, fp16=312, tf32=156, fp32=19.5), 40, 1555, "ampere")),
    ((r"\bA100\b", r"\b80\s*GB\b"), GpuSpec("NVIDIA A100 SXM 80GB", _peaks(bf16=312, fp16=312, tf32=156, fp32=19.5), 80, 2039, "ampere")),
    ((r"\bA100\b",), GpuSpec("NVIDIA A100 SXM 40GB", _peaks(bf16=312, fp16=312, tf32=156, fp32=19.5), 40, 1555, "ampere")),
    ((r"\bA10G\b",), GpuSpec("NVIDIA A10G", _peaks(bf16=70, fp16=70, tf32=35, fp32=31.2), 24, 600, "ampere")),
    ((r"\bA10\b",), GpuSpec("NVIDIA A10", _peaks(bf16=125, fp16=125, tf32=62.5, fp32=31.2), 24, 600, "ampere")),
    # Ada data center
    ((r"\bL40S\b",), GpuSpec("NVIDIA L40S", _peaks(bf16=362.05, fp16=362.05, tf32=183, fp32=91.6, fp8=733), 48, 864, "ada")),
    ((r"\bL40\b",), GpuSpec("NVIDIA L40", _peaks(bf16=181.05, fp16=181.05, tf32=90.5, fp32=90.5, fp8=362), 48, 864, "ada")),
    ((r"\bL4\b",), GpuSpec("NVIDIA L4", _peaks(bf16=121, fp16=121, tf32=60, fp32=30.3, fp8=242.5), 24, 300, "ada")),
    # Volta / Turing: no bf16 or TF32 tensor cores, so fp32 matmuls run at the fp32 rate.
    ((r"\bV100\b", r"\bPCIE\b", r"\b32\s*GB\b"), GpuSpec("NVIDIA V100 PCIe 32GB", _peaks(fp16=112, tf32=14, fp32=14), 32, 900, "volta")),
    ((r"\bV100\b", r"\bPCIE\b"), GpuSpec("NVIDIA V100 PCIe 16GB", _peaks(fp16=112, tf32=14, fp32=14), 16, 900, "volta")),
    ((r"\bV100\b", r"\b32\s*GB\b"), GpuSpec("NVIDIA V100 SXM2 32GB", _peaks(fp16=125, tf32=15.7, fp32=15.7), 32, 900, "volta")),
    ((r"\bV100\b",), GpuSpec("NVIDIA V100 SXM2 16GB", _peaks(fp16=125, tf32=15.7, fp32=15.7), 16, 900, "volta")),
    ((r"\bT4\b",), GpuSpec("NVIDIA T4", _peaks(fp16=65, tf32=8.1, fp32=8.1), 16, 320, "turing")),
    # Workstation / consumer
    ((r"\bRTX 6000 ADA\b",), GpuSpec("NVIDIA RTX 6000 Ada", _peaks(bf16=364.2, fp16=364.2, tf32=182.1, fp32=91.1, fp8=728.5), 48, 960, "ada")),
    ((r"\bRTX A6000\b",), GpuSpec("NVIDIA RTX A6000", _peaks(bf16=154.8, fp16=154.8, tf32=77.4, fp32=38.7), 48, 768, "ampere")),
    ((r"\bRTX 4090\b",), GpuSpec("NVIDIA GeForce RTX 4090", _peaks(bf16=165.2, fp16=165.2, tf32=82.6, fp32=82.6, fp8=330.3), 24, 1008, "ada")),
    ((r"\bRTX 3090\b",), GpuSpec("NVIDIA GeForce RTX 3090", _peaks(bf16=71, fp16=71, tf32=35.6, fp32=35.6), 24, 936, "ampere")),
]


def lookup_gpu(name: str) -> GpuSpec | None:
    """The table entry for a device name as reported by torch.cuda.get_device_name()."""
    for patterns, spec in _GPU_TABLE:
        if all(re.search(p, name, flags=re.IGNORECASE) for p in patterns):
            return spec
    return None
