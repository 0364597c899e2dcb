"""How fast each kind of work runs on each GPU generation: the planner's achievable rates.

A training step is three kinds of work, each limited by something else (plan/timing_compute.py):

    gemm        projections, MLP, output head: FLOP/s, a fraction of the dense datasheet peak
    attention   the attention kernel (QK^T, softmax, AV): FLOP/s, a fraction of the peak that
                depends on the implementation (flash, efficient; materialized scores run as
                batched GEMMs plus memory traffic, so they use `gemm` and `pointwise`)
    pointwise   norms, activations, rope, residual adds, dropout, the loss, materialized
                softmax passes: bytes/s, a fraction of the memory bandwidth

plus the host's costs: per eager op, per op under selective AC, per checkpointed block. Each generation (GpuSpec.generation) has sourced priors
(PRIORS). The published runs (plan/published.py, published_more.py) then fit a few free constants
(plan/report.fit_constants: the GEMM fraction of each generation the runs cover, one scale on
the attention fractions and one on the pointwise fraction, shared by the GPU generations):
FITTED holds the result of that fit, which `rates()` returns. A generation without published
runs keeps its priors, scaled by the fitted / prior ratio of the generations that have them.

The `cpu` generation is fitted instead to step times measured on this CPU
(perf/recompute_bench.py, benchmarks/planner-recompute-cpu.json): its matmul peak is already
a measured rate (observe.peaks), so its gemm fraction is 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


# Host seconds that torch's selective activation checkpointing adds per forward op of a block
# (create_selective_checkpoint_contexts runs a Python dispatch mode over every op, in the forward
# and again in the recompute, caching the saved outputs): fitted to the selective steps of
# benchmarks/planner-recompute-cpu.json (`slipstream bench recompute`), on this CPU.
SELECTIVE_DISPATCH_S = 8.8744e-05

# A GPU host's costs, fitted to benchmarks/gpu-planner.json (H200, torch 2.11): single-GPU eager
# steps of GPT-2 small and medium (seq 1024, bf16, micro-batch 4 / 8 / 16, AC none / selective /
# full; the two fused-loss rows left out: their chunk loop's device time is not modelled).
# Least squares of log(planned / measured) over the 15 rows, the three constants together
# (docs/planner.md "On a GPU": leave-one-case-out median |error| 7.1 %, worst 28 %).
# launch_s: host seconds per eager op (autograd + autocast dispatch and the launch), the whole
#   step's ops over their count: flat steps from micro-batch 4 to 8 say the host is the limit.
GPU_LAUNCH_S = 2.41e-05
# selective_dispatch_s: per block forward op under selective AC (the dispatch mode above, on the
#   GPU host; counted once per forward op, as for the CPU): selective steps ~3x those without AC.
GPU_SELECTIVE_DISPATCH_S = 1.67e-04
# checkpoint_s: per checkpointed block and micro-batch, full and selective AC alike
#   (torch.utils.checkpoint's non-reentrant frame: saved-tensor hooks, RNG state saved and
#   restored, the recompute's autograd graph): what full AC costs beyond re-launching the
#   forward's ops. Fitted as one number; its parts were not measured apart.
GPU_CHECKPOINT_S = 2.06e-03


@dataclass(frozen=True)
class Rates:
    """Achievable fractions of one GPU generation, per operation class."""

    gemm: float        # of the dense bf16/fp16 peak, large training GEMMs
    flash: float       # of the dense peak, a fused flash-attention kernel (FLOPs it runs: the causal half)
    efficient: float   # of the dense peak, a memory-efficient fused kernel (xFormers / cutlass style)
    pointwise: float   # of the memory bandwidth, memory-bound elementwise and reduction kernels
    launch_s: float    # host seconds per eager op (its dispatch and kernel launch)
    # True: the host enqueues kernels ahead of the device (CUDA streams), so a pass takes the
    # longer of its device time and its launches; False (CPU): the one thread does both, they add.
    launch_overlaps: bool = True
    selective_dispatch_s: float = SELECTIVE_DISPATCH_S   # host seconds per block forward op under selective AC
    checkpoint_s: float = 0.0   # host seconds per checkpointed block and micro-batch (full or selective AC)

    def attention(self, implementation: str) -> float:
        """The fraction of peak of a fused attention kernel (flash / efficient)."""
        return self.efficient if implementation == "efficient" else self.flash


# ---- priors, with their sources --------------------------------------------------------------
# gemm: measured best-shape bf16 "maximum achievable matmul FLOPS" (stas00/ml-engineering,
#   compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table"): A100 SXM
#   86.9 %, H100 SXM 80.3 %, B200 77.6 % of the dense peak. Training shapes are smaller and less
#   regular than the best shape; the fit below says by how much.
# flash: FlashAttention-2 (Dao 2023, arXiv 2307.08691, abstract and Sec. 4.1): 50-73 % of the A100
#   peak forward, lower backward: 0.60 is the middle of that range. FlashAttention-3 (Shah et al.
#   2024, arXiv 2407.08608, abstract): FlashAttention-2 reaches only 35 % of the H100 peak, FA3
#   75 % (fp16 forward): 0.50, between the kernels that training stacks ran (torch SDPA's FA2,
#   cuDNN, FA3). Both papers count the FLOPs a causal kernel runs (half the square), as timing.py does.
# efficient: the FA2 paper (Sec. 1 and Fig. 4-7): FlashAttention-1 reaches 25-40 % of the A100 peak
#   and xFormers' cutlass kernel runs about as fast as FlashAttention-1: 0.33, 0.55 of the flash
#   fraction. No published figure on later GPUs was readable here: they keep that 0.55 of their flash
#   fraction (an assumption).
# pointwise: a device-to-device copy on an A100 40GB measures 1355 of the 1555 GB/s datasheet
#   bandwidth, 87 % (PTsolvers/gpu-workshop-JuliaCon23#7, the maintainer's measured memcopy);
#   taken for every GPU generation (an assumption: HBM controllers of the same design era).
# launch_s, selective_dispatch_s, checkpoint_s: the GPU host's, fitted on an H200 host (above);
#   taken for every GPU generation (an assumption: host cost is the host CPU's and torch's, not the GPU's).
_HOST = dict(launch_s=GPU_LAUNCH_S, selective_dispatch_s=GPU_SELECTIVE_DISPATCH_S, checkpoint_s=GPU_CHECKPOINT_S)
PRIORS: dict[str, Rates] = {
    "ampere": Rates(gemm=0.869, flash=0.60, efficient=0.33, pointwise=0.87, **_HOST),
    "hopper": Rates(gemm=0.803, flash=0.50, efficient=0.275, pointwise=0.87, **_HOST),
    "blackwell": Rates(gemm=0.776, flash=0.50, efficient=0.275, pointwise=0.87, **_HOST),
    # No published GEMM fractions were readable here for these: the A100's (same tensor-core
    # design for ada and turing; volta's first-generation tensor cores and MI300X's stack are
    # assumptions until a probe file gives the measured rate).
    "ada": Rates(gemm=0.869, flash=0.60, efficient=0.33, pointwise=0.87, **_HOST),
    "turing": Rates(gemm=0.869, flash=0.60, efficient=0.33, pointwise=0.87, **_HOST),
    "volta": Rates(gemm=0.869, flash=0.60, efficient=0.33, pointwise=0.87, **_HOST),
    "cdna3": Rates(gemm=0.869, flash=0.60, efficient=0.33, pointwise=0.87, **_HOST),
    # cpu: the matmul "peak" is this machine's measured rate (observe.peaks), so gemm is 1; the
    # rest has no source and is fitted to measured step times (CPU_FITTED below; launch_s 5 us is
    # only the fit's starting point, the planner's earlier estimate).
    "cpu": Rates(gemm=1.0, flash=1.0, efficient=1.0, pointwise=1.0, launch_s=5e-6, launch_overlaps=False),
}
# A GPU whose generation the table does not know plans as an A100.
UNKNOWN_GENERATION = "ampere"


@dataclass(frozen=True)
class Fit:
    """The free constants fitted to the published runs (plan/report.fit_constants)."""

    gemm: dict[str, float]    # generation -> GEMM fraction of peak
    attention_scale: float    # x every prior attention fraction (flash and efficient)
    pointwise_scale: float    # x the prior pointwise fraction
    cpu: Rates | None = None  # the cpu generation's rates (None: CPU_FITTED); perf/recompute_bench.py fits them

    def rates(self, generation: str) -> Rates:
        """The fitted rates of a GPU generation; one without runs gets its prior GEMM fraction
        times the geometric mean fitted / prior ratio of the generations with runs."""
        prior = PRIORS.get(generation) or PRIORS[UNKNOWN_GENERATION]
        if generation in self.gemm:
            gemm = self.gemm[generation]
        else:
            ratios = [g / PRIORS[gen].gemm for gen, g in self.gemm.items()]
            gemm = prior.gemm * (math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else 1.0)
        return replace(prior, gemm=min(1.0, gemm), flash=min(1.0, prior.flash * self.attention_scale),
                       efficient=min(1.0, prior.efficient * self.attention_scale),
                       pointwise=min(1.0, prior.pointwise * self.pointwise_scale))


# The fit over the published runs, as `slipstream bench planner` prints it and writes it to
# benchmarks/planner-accuracy-cpu.json (tests/unit/test_planner_accuracy_pins.py checks that a
# fresh fit gives these values).
FITTED = Fit(gemm={"ampere": 0.72, "hopper": 0.63}, attention_scale=0.85, pointwise_scale=0.55)

# cpu, fitted to this machine's measured step times without activation checkpointing
# (benchmarks/planner-recompute-cpu.json, `slipstream bench recompute`); the ratios with AC are
# then predictions. On another CPU they are a starting point: `slipstream tune system` measures.
CPU_FITTED = replace(PRIORS["cpu"], pointwise=0.3137, flash=0.2952, efficient=0.2952, launch_s=6.275e-6)


def rates(generation: str, fit: Fit | None = None) -> Rates:
    """The achievable rates the planner uses for a GPU generation ("" = unknown: an A100's)."""
    if generation == "cpu":
        return fit.cpu if fit is not None and fit.cpu is not None else CPU_FITTED
    return (fit or FITTED).rates(generation or UNKNOWN_GENERATION)
