"""Published nccl-tests (and rccl-tests) figures the collective model (plan/collectives.py) is
checked against: tests/unit/test_plan_collectives_nccl.py, docs/planner-collectives.md.

Each figure is quoted from its source as stated there; nothing is read off a plot. A figure that
also set a constant of the link table (plan/links.py) is marked `sets_constant`: the model
meets it by construction, so it checks the model's wiring, not its prediction. The others are
predictions: NCCL's tuning constants and the link table meet a measurement they were not made from.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NcclTestsFigure:
    name: str
    source: str                  # URL, who and when
    quote: str                   # the words or the table row the figure comes from
    gpus: str                    # make_cluster's --gpus for the machine
    nodes: int
    kind: str                    # the collective
    nbytes: int                  # nccl-tests' size (B)
    seconds: float | None = None     # time per call, where the source gives it
    busbw_gbs: float | None = None   # bus bandwidth (nccl-tests' definition), where the source gives it
    nics_per_node: int | None = None
    sets_constant: bool = False
    tolerance: float = 0.25      # the |relative error| the model is held to on this figure
    note: str = ""


FIGURES: tuple[NcclTestsFigure, ...] = (
    NcclTestsFigure(
        name="a100x2-nvlink-allreduce-32B",
        source="https://github.com/NVIDIA/nccl/issues/583 (elevenxiang, 2021-10-18)",
        quote="nThread 1 nGpus 2 ... NVIDIA A100-SXM4-40GB ... 32  8  float  sum  10.14  0.00  0.00 (out-of-place)",
        gpus="2xA100-40GB", nodes=1, kind="all_reduce", nbytes=32, seconds=10.14e-6, tolerance=0.30,
        note="a latency figure: NCCL's model (LL ring: 6.6 us base + 2 steps x 0.6 us) leaves out the kernel "
             "launch that nccl-tests' time includes"),
    NcclTestsFigure(
        name="a100x2-nvlink-allreduce-64B",
        source="https://github.com/NVIDIA/nccl/issues/583 (elevenxiang, 2021-10-18)",
        quote="64  16  float  sum  10.14  0.01  0.01 (out-of-place)",
        gpus="2xA100-40GB", nodes=1, kind="all_reduce", nbytes=64, seconds=10.14e-6, tolerance=0.30),
    NcclTestsFigure(
        name="a100x24-3nodes-4hdr-allreduce-peak",
        source="https://github.com/NVIDIA/nccl-tests/issues/119 (Yujaeseo, 2022-11-17)",
        quote="3x servers, each ... 8x NVIDIA A100 SXM4 40G GPU, and 4x Mellanox HDR Infiniband cards ... the "
              "average performance is about 84.8GB/s and peak performance reaches about 96GB/s "
              "(mpirun -np 24 ... all_reduce_perf -b 8 -e 128M)",
        gpus="8xA100-40GB", nodes=3, nics_per_node=4, kind="all_reduce", nbytes=128 * 2**20, busbw_gbs=96.0,
        tolerance=0.25,
        note="the peak over sizes up to 128 MiB, compared at 128 MiB; the IB fraction 0.88 of the link table "
             "was read from the same thread (85-96 of 100 GB/s), the size dependence was not"),
    NcclTestsFigure(
        name="h100x8-nvls-allreduce-peak",
        source="https://github.com/NVIDIA/nccl-tests/issues/212 (sjeaugey, NCCL maintainer, 2024-05-06)",
        quote="allreduce uses NVLink SHARP by default ... On 8 GPUs, you should reach a peak busBw of ~480GB/s "
              "(algbw ~275GB/s). You need to run on larger sizes though; 256M is too small",
        gpus="8xH100", nodes=1, kind="all_reduce", nbytes=8 * 2**30, busbw_gbs=480.0, sets_constant=True,
        tolerance=0.10),
    NcclTestsFigure(
        name="h100x8-ring-allgather-peak",
        source="https://github.com/NVIDIA/nccl-tests/issues/212 (sjeaugey, NCCL maintainer, 2024-05-06)",
        quote="With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s, which you "
              "can observe as \"BusBw\" when running non-allreduce operations",
        gpus="8xH100", nodes=1, kind="all_gather", nbytes=8 * 2**30, busbw_gbs=370.0, sets_constant=True,
        tolerance=0.10),
    NcclTestsFigure(
        name="mi300x8-rccl-allreduce-8B",
        source="ROCm docs, how-to/rocm-for-ai: rccl-tests on 8 MI300X (docs/data/how-to/rocm-for-ai/"
               "rccl-tests-8-gpu.png; https://github.com/ROCm/ROCm)",
        quote="all_reduce 8 B: 40.9 us; 309-316 GB/s busbw from 512 MiB to 8 GiB",
        gpus="8xMI300X", nodes=1, kind="all_reduce", nbytes=8, seconds=40.9e-6, sets_constant=True,
        tolerance=0.10, note="RCCL: planned as a plain ring (Link.fabric \"\"), 14 steps x 3 us"),
    NcclTestsFigure(
        name="mi300x8-rccl-allreduce-8GiB",
        source="ROCm docs, how-to/rocm-for-ai: rccl-tests on 8 MI300X (docs/data/how-to/rocm-for-ai/"
               "rccl-tests-8-gpu.png; https://github.com/ROCm/ROCm)",
        quote="all_reduce 309-316 GB/s busbw from 512 MiB to 8 GiB",
        gpus="8xMI300X", nodes=1, kind="all_reduce", nbytes=8 * 2**30, busbw_gbs=312.5, sets_constant=True,
        tolerance=0.05),
)
