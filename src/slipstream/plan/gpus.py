"""GPU datasheet facts: dense peak TFLOP/s per dtype, memory size and memory bandwidth.

A blocks-layer table, read by the planner (plan/hardware.py) and by the MFU peak of a
training run (observe/peaks.py), and the reader of a user's own GPU description (a small
TOML file or flags, see read_gpu_file). Pure data and parsing: no torch, no measurement.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from slipstream.errors import UserError

# The dtype keys of a peak: bf16/fp16 tensor cores, tf32 (fp32 matmuls on tensor cores), fp32, fp8.
DTYPE_KEYS = ("bf16", "fp16", "tf32", "fp32", "fp8")
# Architecture families (GpuSpec.generation); "" is an unknown one.
GENERATIONS = ("volta", "turing", "ampere", "ada", "hopper", "blackwell", "cdna2", "cdna3", "cpu", "")


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
    generation: the architecture family (one of GENERATIONS; "" when unknown): what the
        planner's achievable-rate constants are kept per (plan/efficiency.py).
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
    # H800: the export variant of the H100 (same GH100 silicon and clocks, same tensor-core and memory figures;
    # NVLink cut to 8 links = 400 GB/s bidirectional, FP64 to 1 TFLOP/s). NVIDIA H800 datasheets (SXM5 and PCIe),
    # read here through https://www.philisun.com/technical-analysis/nvidia-h800-vs-h100-a-technical-deep-dive-into-
    # politically-defined-ai-chips ("memory capacity and bandwidth (e.g., 3.35 TB/s) largely consistent") and
    # https://aiwiki.ai/wiki/nvidia_h800 (same GH100 silicon); the rates are the H100 rows' dense figures.
    ((r"\bH800\b", r"\bPCIE\b"), GpuSpec("NVIDIA H800 PCIe", _peaks(bf16=756, fp16=756, tf32=378, fp32=51, fp8=1513), 80, 2000, "hopper")),
    ((r"\bH800\b",), GpuSpec("NVIDIA H800 SXM", _peaks(bf16=989, fp16=989, tf32=494.5, fp32=67, fp8=1979), 80, 3350, "hopper")),
    # H20: no public NVIDIA datasheet; the figures are NVIDIA's partner spec sheet as reported by the press, and
    # they agree across the pages read here: https://zangshuxian.com/new/674733024499207168 ("FP16 dense 148
    # TFLOPS", INT8 296, TF32 74, FP32 44), https://willitrunai.com/es/gpus/h20-96gb (96 GB HBM3, 4.0 TB/s,
    # NVLink 900 GB/s). Hopper's FP8 rate equals its INT8 rate (H100: 1979 both), hence fp8 296. The word
    # boundary keeps "H20" from matching "H200" or "GH200".
    ((r"\bH20\b",), GpuSpec("NVIDIA H20", _peaks(bf16=148, fp16=148, tf32=74, fp32=44, fp8=296), 96, 4000, "hopper")),
    # Ampere data center
    ((r"\bA100\b", r"\bPCIE\b", r"\b80\s*GB\b"), GpuSpec("NVIDIA A100 PCIe 80GB", _peaks(bf16=312, fp16=312, tf32=156, fp32=19.5), 80, 1935, "ampere")),
    ((r"\bA100\b", r"\bPCIE\b"), GpuSpec("NVIDIA A100 PCIe 40GB", _peaks(bf16=312, fp16=312, tf32=156, fp32=19.5), 40, 1555, "ampere")),
    ((r"\bA100\b", r"\b80\s*GB\b"), GpuSpec("NVIDIA A100 SXM 80GB", _peaks(bf16=312, fp16=312, tf32=156, fp32=19.5), 80, 2039, "ampere")),
    ((r"\bA100\b",), GpuSpec("NVIDIA A100 SXM 40GB", _peaks(bf16=312, fp16=312, tf32=156, fp32=19.5), 40, 1555, "ampere")),
    # A800: the export variant of the A100 with NVLink cut to 400 GB/s bidirectional (8 of 12 links); tensor-core
    # rates and memory as the A100 80GB. NVIDIA A800 datasheet (nvidia.cn), read here through
    # https://tweakers.net/nieuws/203182 ("the listed performance is the same as the A100 series ... up to 80GB
    # HBM2e", NVLink 400 GB/s). Only the 80 GB parts: a 40 GB A800 is unknown here rather than wrong.
    ((r"\bA800\b", r"\bPCIE\b", r"\b80\s*GB\b"), GpuSpec("NVIDIA A800 PCIe 80GB", _peaks(bf16=312, fp16=312, tf32=156, fp32=19.5), 80, 1935, "ampere")),
    ((r"\bA800\b", r"\b80\s*GB\b"), GpuSpec("NVIDIA A800 SXM 80GB", _peaks(bf16=312, fp16=312, tf32=156, fp32=19.5), 80, 2039, "ampere")),
    ((r"\bA10G\b",), GpuSpec("NVIDIA A10G", _peaks(bf16=70, fp16=70, tf32=35, fp32=31.2), 24, 600, "ampere")),
    ((r"\bA10\b",), GpuSpec("NVIDIA A10", _peaks(bf16=125, fp16=125, tf32=62.5, fp32=31.2), 24, 600, "ampere")),
    # Ada data center
    ((r"\bL40S\b",), GpuSpec("NVIDIA L40S", _peaks(bf16=362.05, fp16=362.05, tf32=183, fp32=91.6, fp8=733), 48, 864, "ada")),
    ((r"\bL40\b",), GpuSpec("NVIDIA L40", _peaks(bf16=181.05, fp16=181.05, tf32=90.5, fp32=90.5, fp8=362), 48, 864, "ada")),
    ((r"\bL4\b",), GpuSpec("NVIDIA L4", _peaks(bf16=121, fp16=121, tf32=60, fp32=30.3, fp8=242.5), 24, 300, "ada")),
    # AMD Instinct (ROCm reports them through torch.cuda). Source: ROCm documentation, github.com/ROCm/ROCm
    # (commit e396b48, March 2025): docs/conceptual/gpu-arch/mi300.md, table "Peak-performance capabilities of
    # the MI300X" (Matrix FP16/BF16 1307.4, Matrix FP8 2614.9, TF32 653.7, Matrix/Vector FP32 163.4 TFLOP/s,
    # dense; "peak memory bandwidth ... 5.3 TB per second"); docs/reference/gpu-arch-specs.rst (192 GiB VRAM).
    # tf32: what fp32 matmuls reach when hipBLASLt's TF32 (XF32) path is used; on ROCm builds without it they
    # run at the fp32 rate, which `slipstream probe` shows.
    ((r"\bMI300X\b",), GpuSpec("AMD Instinct MI300X", _peaks(bf16=1307.4, fp16=1307.4, tf32=653.7, fp32=163.4, fp8=2614.9), 192, 5300, "cdna3")),
    # MI250X / MI250: each of the two GCDs of the package is its own device in torch (64 GB each), so a row is
    # ONE GCD. docs/conceptual/gpu-arch/mi250.md gives FLOPs per clock per CU (Matrix FP16/BF16 1024, Matrix FP32
    # 256), the 1.7 GHz peak clock and 1.6 TB/s of HBM2e per GCD; gpu-arch-specs.rst the CUs (MI250X 220 = 110
    # per GCD; MI250 104 per GCD) and 128 GiB per package. bf16 = 1024 x 110 x 1.7e9 = 191.5 TFLOP/s (MI250: 181.0,
    # the table's 362.1 per package / 2). No TF32: fp32 matmuls run on the matrix cores (Matrix FP32 = 256 x
    # 110 x 1.7e9 = 47.9), which is what "fp32" and "tf32" hold here. MI250X before MI250 ("MI250X/MI250").
    ((r"\bMI250X\b",), GpuSpec("AMD Instinct MI250X (one GCD)", _peaks(bf16=191.5, fp16=191.5, tf32=47.9, fp32=47.9), 64, 1600, "cdna2")),
    ((r"\bMI250\b",), GpuSpec("AMD Instinct MI250 (one GCD)", _peaks(bf16=181.0, fp16=181.0, tf32=45.3, fp32=45.3), 64, 1600, "cdna2")),
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


# ------------------------------------------------------------------ a user's own GPU

# A GPU description is a dozen lines; anything bigger is the wrong file, and reading it whole
# would let a stray multi-GB file exhaust memory.
GPU_FILE_MAX_BYTES = 64 * 1024
# Plausibility ceilings, far above any real part (a B200 is 4,500 dense fp8 TFLOP/s, 180 GB,
# 8 TB/s): they catch unit slips such as FLOP/s for TFLOP/s or bytes for GiB, not real GPUs.
MAX_PEAK_TFLOPS = 100_000.0
MAX_MEMORY_GIB = 10_000.0
MAX_MEM_BW_GBS = 100_000.0
MAX_HOST_LINK_GBS = 10_000.0

GPU_FILE_EXAMPLE = """name = "Acme X1"         # optional; default: the file name
generation = "hopper"      # optional: one of volta, turing, ampere, ada, hopper, blackwell, cdna2, cdna3
memory_gib = 64            # datasheet memory per GPU
mem_bw_gbs = 2000          # memory bandwidth, GB/s
intra = "nvlink4"          # optional: link between GPUs of a node (a name or e.g. "300GB/s")
inter = "ib:400Gb/s"       # optional: network per GPU (a name or a bandwidth)
host_link_gbs = 48         # optional: host<->device copies, GB/s
# base = "H100"            # optional: a known GPU whose numbers fill what is not given

[peak_tflops]              # DENSE (not sparse) TFLOP/s; at least the precision you plan in
bf16 = 400
fp8 = 800"""

_FILE_NUMBERS = {  # key -> (what it is, ceiling)
    "memory_gib": ("memory in GiB", MAX_MEMORY_GIB),
    "mem_bw_gbs": ("memory bandwidth in GB/s", MAX_MEM_BW_GBS),
    "host_link_gbs": ("host<->device bandwidth in GB/s", MAX_HOST_LINK_GBS),
}
_FILE_STRINGS = ("name", "base", "generation", "intra", "inter")
_FILE_KEYS = (*_FILE_STRINGS, *_FILE_NUMBERS, "peak_tflops")


@dataclass(frozen=True)
class GpuDescription:
    """What a user says about a GPU, from a TOML file (read_gpu_file) or flags: any subset of a
    GpuSpec's numbers, plus the links it usually has. plan.hardware.make_cluster turns it into a
    GpuSpec (filling gaps from `base`, a known short name) and checks that nothing is missing.

    peaks: dense TFLOP/s per DTYPE_KEYS key. intra / inter: link names or bandwidths, parsed by
    plan.hardware. origin: where each given field came from ("peak_tflops.bf16" -> "my_gpu.toml"),
    so that Cluster.sources can name the source of every number.
    """

    name: str = ""
    base: str = ""
    peaks: dict[str, float] = field(default_factory=dict)
    memory_gib: float | None = None
    mem_bw_gbs: float | None = None
    generation: str | None = None
    intra: str | None = None
    inter: str | None = None
    host_link_gbs: float | None = None
    origin: dict[str, str] = field(default_factory=dict)

    def given(self) -> bool:
        return bool(self.origin)

    def merged(self, later: GpuDescription) -> GpuDescription:
        """This description with every field `later` gives replaced (flags over a file)."""
        if not later.given():
            return self
        changes = {name: getattr(later, name) for name in ("name", "base", "memory_gib", "mem_bw_gbs",
                                                           "generation", "intra", "inter", "host_link_gbs")
                   if name in later.origin}
        return replace(self, **changes, peaks={**self.peaks, **later.peaks},
                       origin={**self.origin, **later.origin})


def check_positive(value: object, where: str, fix: str, ceiling: float = math.inf) -> float:
    """A positive finite number (not a bool), at most `ceiling`; else a UserError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise UserError(f"{where} must be a positive number, got {value!r}; {fix}.")
    if value > ceiling:
        raise UserError(f"{where} = {value:g} is implausibly large (more than {ceiling:g}); check the unit: {fix}.")
    return float(value)


def check_generation(value: object, where: str) -> str:
    if not isinstance(value, str) or value.lower() not in GENERATIONS:
        raise UserError(f"{where} {value!r} is not a GPU generation; use one of "
                        f"{', '.join(g for g in GENERATIONS if g)} (or leave it out).")
    return value.lower()


def _peaks_from(table: dict, where: str) -> dict[str, float]:
    unknown = [k for k in table if k not in DTYPE_KEYS]
    if unknown:
        raise UserError(f"{where}: unknown dtype key(s) {', '.join(map(repr, unknown))}; the keys are "
                        f"{', '.join(DTYPE_KEYS)}.")
    return {key: check_positive(value, f"{where}.{key}", "give DENSE TFLOP/s from the datasheet, e.g. "
                                "bf16 = 989 for an H100", MAX_PEAK_TFLOPS)
            for key, value in table.items()}


def parse_peak_tflops(text: str, flag: str = "--peak-tflops") -> dict[str, float]:
    """"bf16=400,fp8=800" -> {"bf16": 400.0, "fp8": 800.0} (dense TFLOP/s)."""
    table: dict[str, float] = {}
    for part in str(text).split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        try:
            number = float(value) if sep else None
        except ValueError:
            number = None
        if not key or number is None:
            raise UserError(f"{flag} {text!r}: write DTYPE=TFLOPS pairs separated by commas, e.g. "
                            f"{flag} bf16=400,fp8=800 (dtypes: {', '.join(DTYPE_KEYS)}).")
        if key in table:
            raise UserError(f"{flag} {text!r}: {key} is given twice; give each dtype once.")
        table[key] = number
    return _peaks_from(table, flag)


def gpu_from_flags(peak_tflops: str | None = None, memory_gib: float | None = None,
                   mem_bw_gbs: float | None = None, generation: str | None = None) -> GpuDescription:
    """The GpuDescription of the custom-GPU flags (each None when not given)."""
    origin: dict[str, str] = {}
    peaks = parse_peak_tflops(peak_tflops) if peak_tflops is not None else {}
    origin.update({f"peak_tflops.{key}": "--peak-tflops" for key in peaks})
    if memory_gib is not None:
        memory_gib = check_positive(memory_gib, "--gpu-memory-gib", "give the datasheet GiB, e.g. 80",
                                    MAX_MEMORY_GIB)
        origin["memory_gib"] = "--gpu-memory-gib"
    if mem_bw_gbs is not None:
        mem_bw_gbs = check_positive(mem_bw_gbs, "--gpu-mem-bw", "give GB/s, e.g. 3350 for an H100",
                                    MAX_MEM_BW_GBS)
        origin["mem_bw_gbs"] = "--gpu-mem-bw"
    if generation is not None:
        generation = check_generation(generation, "--gpu-generation")
        origin["generation"] = "--gpu-generation"
    return GpuDescription(peaks=peaks, memory_gib=memory_gib, mem_bw_gbs=mem_bw_gbs, generation=generation,
                          origin=origin)


def read_gpu_file(path: str) -> GpuDescription:
    """A GPU described by a small TOML file (GPU_FILE_EXAMPLE). Untrusted input: the read is
    bounded, every key must be known and every value checked; errors name the field and the fix."""
    how = f"a GPU file looks like:\n{GPU_FILE_EXAMPLE}"
    try:
        with open(path, "rb") as f:
            raw = f.read(GPU_FILE_MAX_BYTES + 1)
    except OSError as e:
        raise UserError(f"cannot read GPU file {path}: {e.strerror or e}; pass an existing TOML file "
                        f"(--gpus 8x{Path(path).name}).") from None
    if len(raw) > GPU_FILE_MAX_BYTES:
        raise UserError(f"GPU file {path} is larger than {GPU_FILE_MAX_BYTES // 1024} KiB: not a GPU "
                        f"description; {how}")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"GPU file {path} is not valid TOML ({e}); {how}") from None
    unknown = [k for k in data if k not in _FILE_KEYS]
    if unknown:
        raise UserError(f"GPU file {path}: unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
                        f"{', '.join(_FILE_KEYS)}. {how}")
    origin = {key: path for key in data if key != "peak_tflops"}
    values: dict = {}
    for key in _FILE_STRINGS:
        if key in data:
            value = data[key]
            if not isinstance(value, str) or not value.strip() or len(value) > 100 or not value.isprintable():
                raise UserError(f"GPU file {path}: {key} must be a short text, got {value!r}.")
            values[key] = value.strip()
    if "generation" in values:
        values["generation"] = check_generation(values["generation"], f"GPU file {path}: generation")
    for key, (what, ceiling) in _FILE_NUMBERS.items():
        if key in data:
            values[key] = check_positive(data[key], f"GPU file {path}: {key}", f"give the {what}", ceiling)
    peaks: dict[str, float] = {}
    if "peak_tflops" in data:
        table = data["peak_tflops"]
        if not isinstance(table, dict) or not table:
            raise UserError(f"GPU file {path}: peak_tflops must be a table of dense TFLOP/s per dtype, e.g. "
                            "[peak_tflops] with bf16 = 400 under it.")
        peaks = _peaks_from(table, f"GPU file {path}: peak_tflops")
        origin.update({f"peak_tflops.{key}": path for key in peaks})
    return GpuDescription(name=values.get("name", ""), base=values.get("base", ""), peaks=peaks,
                          memory_gib=values.get("memory_gib"), mem_bw_gbs=values.get("mem_bw_gbs"),
                          generation=values.get("generation"), intra=values.get("intra"),
                          inter=values.get("inter"), host_link_gbs=values.get("host_link_gbs"), origin=origin)
