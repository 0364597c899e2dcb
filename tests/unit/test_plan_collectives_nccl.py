"""The planner's collectives as NCCL runs them (plan/collectives.py, issue 23 part 1): ring and tree
with NCCL's tuning constants, the protocol crossover, hierarchical steps, NVLink SHARP, the
stacks' gradient buckets and ZeRO collectives in plan/timing_comm.py, and the comparisons with measured
gloo collectives (benchmarks/collectives-gloo-cpu.json) and published nccl-tests figures
(plan/nccl_tests.py). Pure arithmetic: well under a second each."""

import dataclasses
import json
import math
import statistics
from pathlib import Path

import pytest

from slipstream.errors import UserError
from slipstream.models.flops import param_count
from slipstream.plan import collectives as C
from slipstream.plan.collectives import Span, bus_factor, call_time, candidates, choice, link_span, span
from slipstream.plan.hardware import make_cluster
from slipstream.plan.links import LINKS, Link
from slipstream.plan.probe_files import _ring
from slipstream.plan.model import resolve_model
from slipstream.plan.nccl_tests import FIGURES
from slipstream.plan.space import Strategy, Workload
from slipstream.plan.timing import estimate_time
from slipstream.plan.timing_comm import (DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, DEEPSPEED_BUCKET_ELEMENTS,
                                         MEGATRON_BUCKET_PARAMS, gradient_buckets, step_collectives)

GLOO = Path(__file__).resolve().parents[2] / "benchmarks" / "collectives-gloo-cpu.json"
MIB = 2**20


@pytest.fixture(scope="module")
def a100():
    return make_cluster("8xA100")


@pytest.fixture(scope="module")
def a100_4nodes():
    return make_cluster("8xA100", nodes=4)


@pytest.fixture(scope="module")
def gpt2():
    return resolve_model("gpt2")


# ---------------------------------------------------------------- NCCL's model, hand-computed


def test_ring_all_reduce_hand_computed(a100):
    where = span(a100, 8)
    assert (where.nodes, where.per_node) == (1, 8) and a100.intra.nvls_busbw_gbs == 0   # A100: no NVLink SHARP
    n = 25 * MIB
    # Simple: base 8.4 us + 14 steps x 3.4 us (NVLink ring Simple); algbw = busbw x n / 2(n-1)
    simple = (8.4 + 14 * 3.4) * 1e-6 + n / (230e9 * 8 / 14)
    # LL128: base 14 us + 14 x 1.9 us, bus bandwidth x 0.92
    ll128 = (14.0 + 14 * 1.9) * 1e-6 + n / (230e9 * 0.92 * 8 / 14)
    # LL: base 6.6 + 14 x 0.6 us, half the bus bandwidth (115 GB/s, above Ampere's 87.7 ceiling)
    ll = (6.6 + 14 * 0.6) * 1e-6 + n / (87.7e9 * 8 / 14)
    times = candidates("all_reduce", n, where)
    assert times["ring", "Simple"] == pytest.approx(simple, rel=1e-12)
    assert times["ring", "LL128"] == pytest.approx(ll128, rel=1e-12)
    assert times["ring", "LL"] == pytest.approx(ll, rel=1e-12)
    assert call_time("all_reduce", n, where) == min(times.values())


def test_tree_all_reduce_hand_computed(a100_4nodes):
    where = span(a100_4nodes, 32)
    assert (where.nodes, where.per_node) == (4, 8)
    n = 2**30                              # above the tree correction's sizes (64 B .. 256 MiB)
    bus = min(230.0, 8 * 22.0)             # the node's 8 HDR NICs (Cluster.link_for)
    # base 8.4 + 2 x (7 intra hops x 4.0 us + log2(4) = 2 network hops x 14 us); algbw = bus x 0.92 / 2
    expected = (8.4 + 2 * (7 * 4.0 + 2 * 14.0)) * 1e-6 + n / (bus * 0.92 * 0.5 * 1e9)
    assert candidates("all_reduce", n, where)["tree", "Simple"] == pytest.approx(expected, rel=1e-12)
    # the tree's bandwidth correction at 1 MiB (log2(1 MiB / 64) = 14: Simple 0.5)
    small = 2**20
    expected = (8.4 + 2 * (7 * 4.0 + 2 * 14.0)) * 1e-6 + small / (bus * 0.92 * 0.5 * 0.5 * 1e9)
    assert candidates("all_reduce", small, where)["tree", "Simple"] == pytest.approx(expected, rel=1e-12)


def test_tree_latency_grows_with_log2_nodes_and_the_ring_linearly():
    cluster = make_cluster("8xA100", nodes=64)
    tree, ring = {}, {}
    for nodes in (2, 4, 8, 16, 32, 64):
        where = span(cluster, nodes, 8)            # one rank per node: every hop crosses the network
        assert (where.nodes, where.per_node) == (nodes, 1)
        times = candidates("all_reduce", 8, where)
        tree[nodes], ring[nodes] = times["tree", "LL"], times["ring", "LL"]
    # each doubling of the nodes adds 2 network hops (5.0 us, tree LL) to the tree ...
    for nodes in (2, 4, 8, 16, 32):
        assert tree[2 * nodes] - tree[nodes] == pytest.approx(2 * 5.0e-6, rel=1e-9)
    # ... and 2 x nodes ring steps (one rank per node: NCCL charges the tree's hop, 5.0 us) to the ring
    # (abs: LL's bandwidth ceiling moves the 8 bytes' nanosecond a little)
    for nodes in (2, 4, 8, 16, 32):
        assert ring[2 * nodes] - ring[nodes] == pytest.approx(2 * nodes * 5.0e-6, abs=1e-9)
    assert choice("all_reduce", 8, span(cluster, 64, 8)) == ("tree", "LL")


def test_protocol_crossover_ll_for_tiny_simple_for_large(a100):
    where = span(a100, 8)
    assert choice("all_reduce", 64, where) == ("ring", "LL")
    assert choice("all_reduce", 2**30, where) == ("ring", "Simple")
    picks = [choice("all_reduce", 2**k, where)[1] for k in range(6, 31)]
    # LL, then LL128, then Simple, each once, in that order
    assert [p for i, p in enumerate(picks) if i == 0 or picks[i - 1] != p] == ["LL", "LL128", "Simple"]
    # the chosen time is continuous and rising with the size
    times = [call_time("all_reduce", 2**k, where) for k in range(6, 31)]
    assert all(b > a for a, b in zip(times, times[1:]))


def test_ll128_needs_nvlink_and_nvls_needs_the_table():
    pcie = span(make_cluster("8xL4"), 8)
    assert {p for _, p in candidates("all_reduce", 2**20, pcie)} == {"LL", "Simple"}
    h100 = span(make_cluster("8xH100"), 8)
    assert choice("all_reduce", 2**30, h100) == ("nvls", "Simple")
    assert choice("all_reduce", 2**30, span(make_cluster("8xA100"), 8)) == ("ring", "Simple")
    # NVLS: 25 us, then the switch's algorithm bandwidth (480 GB/s busbw on 8 GPUs = 480 x 8/14)
    assert candidates("all_reduce", 2**30, h100)["nvls", "Simple"] == pytest.approx(
        25e-6 + 2**30 / (480e9 * 8 / 14), rel=1e-12)
    # all-gather has no NVLS here: the ring
    assert choice("all_gather", 2**30, h100) == ("ring", "Simple")


def test_hierarchical_ring_steps_pay_their_own_link(a100):
    two = make_cluster("8xA100", nodes=2)
    where = span(two, 16)
    assert (where.nodes, where.per_node) == (2, 8)
    # 30 steps: 2 cross the network (14 us each), 28 stay on NVLink (3.4 us, above the 3 us
    # network overhead of Simple); the multi-node Simple ring plateau x 1.4
    latency = (8.4 + 28 * 3.4 + 2 * 14.0) * 1.4
    bus = min(230.0, 8 * 22.0)
    expected = latency * 1e-6 + 2**28 / (bus * 16 / 30 * 1e9)
    assert candidates("all_reduce", 2**28, where)["ring", "Simple"] == pytest.approx(expected, rel=1e-12)
    # a flat ring over the same 16 ranks where every step crossed the network pays more
    flat = Span(where.link, two.inter, two.inter, 16, 1, "ampere")
    assert candidates("all_reduce", 8, flat)["ring", "LL"] > candidates("all_reduce", 8, where)["ring", "LL"]


def test_links_nccl_does_not_run_are_plain_rings():
    shm = LINKS["shm"]
    assert call_time("all_reduce", 2**20, shm, 4) == pytest.approx(
        6 * 50e-6 + 2**20 * 1.5 / 3e9, rel=1e-12)
    # a CPU cluster runs gloo even over a network fabric
    cpu = Span(LINKS["ethernet-25g"], shm, LINKS["ethernet-25g"], 2, 1, "", nccl=False)
    assert call_time("all_reduce", 2**20, cpu) == pytest.approx(2 * 25e-6 + 2**20 / 2.5e9, rel=1e-12)
    assert call_time("all_reduce", 2**20, shm, 1) == 0.0


def test_ring_plateau_only_once_each_channel_gets_64_bytes_per_rank():
    """tuning.cc line 570: the x1.4 ring plateau applies when nBytes / (nChannels x nRanks) >= 64;
    with the assumed 16 channels, 16 ranks on 2 nodes: from 16 KiB on."""
    cluster = make_cluster("8xH100", nodes=2)
    where = span(cluster, 16)
    n, edge = 16, C.NCCL_CHANNELS * 16 * C.RING_PLATEAU_MIN_BYTES
    assert (C.NCCL_CHANNELS, edge) == (16, 16384)
    algbw = where.link.bandwidth_gbs * 1e9 * n / (2 * (n - 1))

    def latency(nbytes):
        return C.candidates("all_reduce", nbytes, where)["ring", "Simple"] - nbytes / algbw

    below, at = latency(edge - 1), latency(edge)
    assert at / below == pytest.approx(C.RING_PLATEAU, rel=1e-9)
    assert latency(edge // 4) == pytest.approx(below, rel=1e-9)      # no plateau on small messages
    assert latency(2**26) == pytest.approx(at, rel=1e-9)


def test_constants_are_ncclS_tuning_model():
    """A spot check that the quoted constants were copied right (src/graph/tuning.cc, v2.27.7-1)."""
    assert C.NCCL_RELEASE == "v2.27.7-1"
    assert C.BASE_LATENCY_US["ring"] == {"LL": 6.6, "LL128": 14.0, "Simple": 8.4}
    assert C.HW_LATENCY_US["net"]["tree"] == {"LL": 5.0, "LL128": 8.5, "Simple": 14}
    assert C.HW_LATENCY_US["nvlink"]["ring"]["Simple"] == LINKS["nvlink4"].latency_us
    assert C.HW_LATENCY_US["net"]["ring"]["Simple"] == LINKS["ib-ndr"].latency_us
    assert C.HW_LATENCY_US["pcie"]["ring"]["Simple"] == LINKS["pcie4"].latency_us
    assert len(C.TREE_CORRECTION["Simple"]) == 23


# ---------------------------------------------------------------- buckets and the stacks


def test_gradient_buckets_of_each_stack():
    grads = 300 * MIB
    torch = gradient_buckets(grads, 4, "torch", 8)
    assert torch[0] == DDP_FIRST_BUCKET_BYTES and torch[1] == DDP_BUCKET_BYTES and sum(torch) == grads
    assert torch[-1] == grads - MIB - 11 * 25 * MIB and len(torch) == 13
    # Megatron: max(40M, 1M x dp) parameters
    assert gradient_buckets(10e9, 4, "megatron", 8)[0] == MEGATRON_BUCKET_PARAMS * 4
    assert gradient_buckets(10e9, 4, "megatron", 64)[0] == 64e6 * 4
    assert gradient_buckets(10e9, 2, "deepspeed", 8)[0] == DEEPSPEED_BUCKET_ELEMENTS * 2
    assert gradient_buckets(grads, 4, "torch", 8, bucket_mb=100) == [MIB, 100 * MIB, 100 * MIB, 99 * MIB]
    assert gradient_buckets(0, 4, "torch", 8) == []


def test_bucket_size_changes_the_dp_time_by_the_buckets_it_makes(gpt2):
    s = Strategy("ddp", dp=2, micro_batch=1, grad_accum=1)
    work = Workload(128, 2)
    grads = param_count(gpt2.cfg).total * 4
    # a slow network: backward hides only part of the buckets before the last, so the exposed time
    # is all the buckets' time less backward's, and a bucket size moves it by its buckets' time
    slow = make_cluster("1xH100", nodes=2, inter="ethernet-25g")
    exposed, whole = {}, {}
    for mb in (5.0, 25.0, 100.0):
        t = estimate_time(gpt2, s, work, dataclasses.replace(slow, bucket_mb=mb))
        times = [call_time("all_reduce", b, span(slow, 2)) for b in gradient_buckets(grads, 4, "torch", 2, mb)]
        exposed[mb], whole[mb] = t.breakdown["dp_comm"], sum(times)
        assert times[-1] < exposed[mb] < whole[mb]
    for mb in (5.0, 100.0):
        assert exposed[mb] - exposed[25.0] == pytest.approx(whole[mb] - whole[25.0], rel=1e-9)
    assert exposed[5.0] > exposed[25.0]        # 5 MiB buckets: more calls, more latency
    # NVLink: backward hides every bucket but the last; the bucket size moves the last bucket
    fast = make_cluster("2xH100")
    for mb in (5.0, 100.0):
        t = estimate_time(gpt2, s, work, dataclasses.replace(fast, bucket_mb=mb))
        last = gradient_buckets(grads, 4, "torch", 2, mb)[-1]
        assert t.breakdown["dp_comm"] == pytest.approx(call_time("all_reduce", last, span(fast, 2)), rel=1e-12)


def test_zero_is_reduce_scatter_and_all_gather_in_the_compute_dtype_on_megatron_and_deepspeed(gpt2):
    work = Workload(1024, 64)
    s = Strategy("zero1", dp=8, micro_batch=8, grad_accum=1, precision="bf16")

    def dp_rows(stack, strategy=s):
        return {(r.kind, r.part): r for r in step_collectives(gpt2, strategy, work, stack) if r.dim == "dp"}

    torch = dp_rows("torch")
    params = torch["all_reduce", "gradients"].nbytes / 4
    assert set(torch) == {("all_reduce", "gradients"), ("broadcast", "parameters")}   # ZeroRedundancyOptimizer
    assert torch["broadcast", "parameters"].nbytes == params * 4
    megatron = dp_rows("megatron")
    assert set(megatron) == {("reduce_scatter", "gradients"), ("all_gather", "parameters")}
    assert megatron["reduce_scatter", "gradients"].nbytes == params * 4   # bf16: fp32 grads (Megatron forces it)
    assert megatron["all_gather", "parameters"].nbytes == params * 2      # the compute dtype
    deepspeed = dp_rows("deepspeed")
    assert deepspeed["reduce_scatter", "gradients"].nbytes == params * 2  # DeepSpeed reduces the 16-bit grads
    assert deepspeed["all_gather", "parameters"].nbytes == params * 2
    fp16 = dp_rows("megatron", s.replace(precision="fp16"))
    assert fp16["reduce_scatter", "gradients"].nbytes == params * 2
    # DeepSpeed ZeRO-2 reduces after each of the 4 micro-batches
    z2 = dp_rows("deepspeed", Strategy("zero2", dp=8, micro_batch=2, grad_accum=4))
    assert z2["reduce_scatter", "gradients"].nbytes == 4 * params * 2
    # the time model: the all-gather is exposed, no broadcast
    cluster = dataclasses.replace(make_cluster("8xH100"), stack="megatron", overlap_grad_reduce=True)
    t = estimate_time(gpt2, s, work, cluster)
    assert "zero1_broadcast" not in t.breakdown
    calls = len(gradient_buckets(params * 2, 2, "megatron", 8))    # in the grad buffer's buckets
    assert calls == 4 and megatron["all_gather", "parameters"].calls == calls
    assert t.breakdown["zero_all_gather"] == pytest.approx(
        calls * call_time("all_gather", params * 2 / calls, span(cluster, 8)), rel=1e-12)


def test_each_stacks_overlap_default_and_the_flag():
    """torch's DDP overlaps; Megatron Core's overlap_grad_reduce and DeepSpeed ZeRO-1/2's overlap_comm
    default to off (hardware.STACK_OVERLAPS_GRAD_REDUCE); --overlap-grad-reduce replaces the default."""
    cluster = make_cluster("8xH100")
    assert cluster.overlap_grad_reduce is None and cluster.overlaps_grad_reduce
    for stack in ("megatron", "deepspeed"):
        assert not dataclasses.replace(cluster, stack=stack).overlaps_grad_reduce
        assert dataclasses.replace(cluster, stack=stack, overlap_grad_reduce=True).overlaps_grad_reduce
    assert not dataclasses.replace(cluster, overlap_grad_reduce=False).overlaps_grad_reduce
    # Megatron without overlap: one bucket of every gradient, unless --bucket-mb sets one
    assert gradient_buckets(10e9, 4, "megatron", 8, overlap=False) == [10e9]
    assert len(gradient_buckets(10e9, 4, "megatron", 8, overlap=False, bucket_mb=100)) == 96


def test_overlap_off_exposes_every_bucket_and_on_hides_all_but_the_last(gpt2):
    """Off: the reduction after backward, all of it exposed (Megatron: one call of every gradient);
    on: every bucket but the last behind backward (NVLink hides them all)."""
    s, work = Strategy("ddp", dp=8, micro_batch=8, grad_accum=1), Workload(1024, 64)
    grads = param_count(gpt2.cfg).total * 4
    base = make_cluster("8xH100")
    where = span(base, 8)
    for stack in ("torch", "megatron"):
        on = estimate_time(gpt2, s, work, dataclasses.replace(base, stack=stack, overlap_grad_reduce=True))
        off = estimate_time(gpt2, s, work, dataclasses.replace(base, stack=stack, overlap_grad_reduce=False))
        buckets = gradient_buckets(grads, 4, stack, 8, overlap=True)
        assert on.breakdown["dp_comm"] == pytest.approx(call_time("all_reduce", buckets[-1], where), rel=1e-9)
        whole = gradient_buckets(grads, 4, stack, 8, overlap=False)
        assert off.breakdown["dp_comm"] == pytest.approx(sum(call_time("all_reduce", b, where) for b in whole),
                                                         rel=1e-9)
        assert off.breakdown["dp_comm"] > 2 * on.breakdown["dp_comm"]
    assert len(gradient_buckets(grads, 4, "megatron", 8, overlap=False)) == 1
    # the stack's default: Megatron's is off
    default = estimate_time(gpt2, s, work, dataclasses.replace(base, stack="megatron"))
    assert default.breakdown["dp_comm"] == off.breakdown["dp_comm"]


def test_megatron_gathers_parameters_in_its_gradient_buckets(gpt2):
    """Megatron all-gathers the updated parameters per bucket, the buckets its gradients were
    reduce-scattered in: the same count under --bucket-mb (bf16: 4-byte gradients, 2-byte parameters)."""
    work, s = Workload(1024, 64), Strategy("zero1", dp=8, micro_batch=8, grad_accum=1, precision="bf16")
    for mb in (None, 10.0, 40.0):
        rows = {(r.kind, r.part): r for r in step_collectives(gpt2, s, work, "megatron", mb) if r.dim == "dp"}
        assert rows["all_gather", "parameters"].calls == rows["reduce_scatter", "gradients"].calls
    rows = {(r.kind, r.part): r for r in step_collectives(gpt2, s, work, "megatron", 10.0) if r.dim == "dp"}
    assert rows["reduce_scatter", "gradients"].calls == math.ceil(rows["reduce_scatter", "gradients"].nbytes / (10 * MIB))


def test_stack_and_bucket_are_checked():
    cluster = make_cluster("8xH100")
    with pytest.raises(UserError, match="torch, megatron, deepspeed"):
        dataclasses.replace(cluster, stack="jax")
    with pytest.raises(UserError, match="--bucket-mb"):
        dataclasses.replace(cluster, bucket_mb=0)


def test_published_runs_are_planned_on_their_stack():
    from slipstream.plan.published_more import ALL_PUBLISHED_RUNS
    from slipstream.plan.report import _setup

    stacks = {run.name: run.stack for run in ALL_PUBLISHED_RUNS}
    assert stacks["megatron-gpt-1t-3072gpu"] == "megatron" and stacks["bloom-176b-384gpu"] == "deepspeed"
    assert stacks["torchtitan-llama3.1-8b-fsdp-8gpu"] == "torch"
    run = next(r for r in ALL_PUBLISHED_RUNS if r.name == "bloom-176b-384gpu")
    assert _setup(run)[3].stack == "deepspeed"


def _cli_plan(*flags: str):
    """The model and cluster `slipstream plan` builds from these flags, and the DeepSpeed ZeRO-2 layout's
    evaluation on them (time and memory)."""
    from slipstream.cli import build_parser
    from slipstream.cli.plan import _setup
    from slipstream.plan.search import evaluate

    args = build_parser().parse_args(["plan", "--model", "gpt2", "--gpus", "8xH100", "--seq", "1024",
                                      "--global-batch", "64", *flags])
    model, cluster = _setup(args, 1024)
    s = Strategy(dp_strategy="zero2", dp=8, micro_batch=8, precision="bf16")
    return cluster, evaluate(model, s, Workload(1024, 64), cluster)


def test_cli_flags_reach_the_plans_time_and_memory():
    """--bucket-mb moves both the exposed gradient reduction (bucket count: latency) and DeepSpeed's
    reduce buckets in memory; --overlap-grad-reduce on hides all but the last bucket and doubles
    DeepSpeed's buckets (overlap_comm's second one)."""
    cluster, small = _cli_plan("--stack", "deepspeed", "--bucket-mb", "40")
    assert (cluster.stack, cluster.bucket_mb, cluster.overlaps_grad_reduce) == ("deepspeed", 40.0, False)
    _, large = _cli_plan("--stack", "deepspeed", "--bucket-mb", "400")
    assert small.memory.buffers["reduce buckets (16-bit)"] == 40 * 2**20
    assert large.memory.buffers["reduce buckets (16-bit)"] == 400 * 2**20
    assert large.memory.peak_bytes > small.memory.peak_bytes
    # GPT-2's 124M 16-bit gradients: 6 buckets of 40 MiB against one, each paying NCCL's latency, all exposed
    assert small.time.breakdown["dp_comm"] > large.time.breakdown["dp_comm"]
    on_cluster, on = _cli_plan("--stack", "deepspeed", "--bucket-mb", "40", "--overlap-grad-reduce", "on")
    assert on_cluster.overlap_grad_reduce is True
    assert on.memory.buffers["reduce buckets (16-bit)"] == 2 * 40 * 2**20
    assert on.time.breakdown["dp_comm"] < small.time.breakdown["dp_comm"]


def _probe(tmp_path, backend, small_seconds, world=8, device="cuda:0", name="NVIDIA H100 80GB HBM3"):
    rows = [{"bytes": 1024, "seconds": small_seconds, "busbw_gbs": 0.1},
            {"bytes": 2**26, "seconds": 4e-4, "busbw_gbs": 300.0}]
    comm = {"backend": backend, "world_size": world, "collectives": {"all_reduce": rows}}
    path = tmp_path / f"{backend}.json"
    path.write_text(json.dumps({"machine": {"device": device, "device_name": name}, "sections": {"comm": comm}}))
    return str(path)


def test_a_probed_nccl_link_gives_back_the_measured_small_message(tmp_path):
    """An NCCL probe's smallest all_reduce ran LL past NCCL's base latency: the link's step is the
    one under which the model times it as measured (not its time / 2(n-1), which a gloo probe keeps)."""
    cluster = make_cluster("8xH100", probe=_probe(tmp_path, "nccl", 20e-6))
    assert cluster.intra.bandwidth_gbs == 300.0 and cluster.intra.fabric == "nvlink"
    assert call_time("all_reduce", 1024, span(cluster, 8)) == pytest.approx(20e-6, rel=1e-9)
    assert cluster.intra.latency_us > 20.0 / 14                 # more than the naive time per ring step
    # and the model then plans the other sizes from it: 64 KiB costs more, by its bytes
    assert call_time("all_reduce", 2**16, span(cluster, 8)) > 20e-6


# ---------------------------------------------------------------- validation


def _median_rows(runs: list[dict], kind: str) -> list[dict]:
    sizes = [row["bytes"] for row in runs[0][kind]]
    return [{"bytes": b, "seconds": statistics.median(run[kind][i]["seconds"] for run in runs)}
            for i, b in enumerate(sizes)]


def test_gloo_collectives_measured_on_this_cpu_match_the_model():
    """benchmarks/collectives-gloo-cpu.json: `slipstream probe --sections comm` under torchrun at
    world 2 and 4, repeated; per size the median. The link is what the planner reads from a probe
    (probe_files._ring: the largest all_reduce's busbw, the smallest one's time per ring step); the
    model is a plain ring (gloo). World 2: all_reduce and all_gather (rings in gloo) within 25 %
    except the listed points, each with its reason; broadcast and reduce_scatter (not rings in gloo)
    in their measured direction. World 4 (oversubscribed cores): recorded, sanity only. This checks
    the plain ring model, not NCCL's."""
    data = json.loads(GLOO.read_text())
    tolerance = data["tolerance"]
    hold, checked_world = tolerance["hold"], str(tolerance["checked_world"])
    assert hold == 0.25 and checked_world == "2"
    exceptions = {(e["kind"], str(e["bytes"])): e for e in data["tolerance_exceptions"]}
    checked = 0
    for world, entry in data["worlds"].items():
        w = int(world)
        median = {kind: _median_rows(entry["runs"], kind) for kind in data["checked_kinds"]}
        ring = _ring({"world_size": w, "collectives": {"all_reduce": [
            dict(r, busbw_gbs=r["bytes"] * bus_factor("all_reduce", w) / r["seconds"] / 1e9)
            for r in median["all_reduce"]]}}, str(GLOO), "comm")
        link = Link("shm", ring["bandwidth"], ring["latency"], "gloo, fitted")
        assert link_span(link, w).nccl and link.fabric == ""          # planned as a plain ring
        assert ring["bandwidth"] == pytest.approx(entry["fitted_link"]["bandwidth_gbs"], rel=1e-9)
        assert ring["latency"] == pytest.approx(entry["fitted_link"]["latency_us"], rel=1e-9)
        for kind, rows in median.items():
            for row, committed in zip(rows, entry["model"][kind]):
                predicted = call_time(kind, row["bytes"], link, w)
                error = predicted / row["seconds"] - 1
                assert committed["error"] == pytest.approx(error, abs=1e-4)
                size = str(row["bytes"])
                if world != checked_world:
                    sanity = tolerance["world_4_sanity"]
                    assert sanity["min"] < error < sanity["max"], (world, kind, size, error)
                elif kind in ("all_reduce", "all_gather"):
                    bound = tolerance[kind][size]
                    assert abs(error) <= bound, (kind, size, error)
                    # a point held looser than 25 % is listed, with its measured error and why
                    assert (bound > hold) == ((kind, size) in exceptions), (kind, size)
                    if bound > hold:
                        assert exceptions[kind, size]["error"] == pytest.approx(error, abs=1e-4)
                        assert exceptions[kind, size]["tolerance"] == bound and exceptions[kind, size]["why"]
                    else:
                        assert abs(error) <= hold
                else:   # not rings in gloo: the direction of the error
                    assert tolerance[kind]["min"] < error < tolerance[kind]["max"], (kind, size, error)
                checked += 1
    assert checked >= 2 * 4 * 6
    assert len(exceptions) == 4


@pytest.mark.parametrize("figure", FIGURES, ids=[f.name for f in FIGURES])
def test_published_nccl_tests_figures(figure):
    cluster = make_cluster(figure.gpus, nodes=figure.nodes, nics_per_node=figure.nics_per_node)
    where = span(cluster, cluster.world)
    seconds = call_time(figure.kind, figure.nbytes, where)
    if figure.seconds is not None:
        assert seconds == pytest.approx(figure.seconds, rel=figure.tolerance)
    if figure.busbw_gbs is not None:
        busbw = figure.nbytes * bus_factor(figure.kind, cluster.world) / seconds / 1e9
        assert busbw == pytest.approx(figure.busbw_gbs, rel=figure.tolerance)
    assert figure.source and figure.quote
