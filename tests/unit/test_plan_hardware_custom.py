"""Any cluster: a GPU of one's own (TOML file or flags), more datasheet rows, links given by
bandwidth and latency, NICs per node, and two-level / several probe files (plan/hardware.py,
plan/links.py, plan/probe_files.py, plan/gpus.py, cli/hardware_args.py,
perf/probe_comm.comm_groups)."""

import argparse
import json

import pytest

from slipstream.cli.hardware_args import add_hardware_arguments, cluster_from_args, hardware_input_files
from slipstream.errors import UserError
from slipstream.perf.probe_comm import comm_groups
from slipstream.plan import gpus
from slipstream.plan.gpus import gpu_from_flags, read_gpu_file
from slipstream.plan.hardware import GPU_MEMORY_RESERVE_GIB, known_gpus, make_cluster
from slipstream.plan.links import LINKS, parse_link

GIB = 2**30

ACME = """
name = "Acme X1"
generation = "hopper"
memory_gib = 64
mem_bw_gbs = 2000
intra = "300GB/s@2us"
inter = "ib:400Gb/s"
host_link_gbs = 40

[peak_tflops]
bf16 = 400
fp8 = 800
"""


def gpu_file(tmp_path, text=ACME, name="acme.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------ a GPU of one's own


def test_gpu_from_a_toml_file_sets_every_number_and_names_its_source(tmp_path):
    path = gpu_file(tmp_path)
    cluster = make_cluster(f"8x{path}", nodes=2)
    assert cluster.gpu == gpus.GpuSpec("Acme X1", {"bf16": 400.0, "fp8": 800.0}, 64.0, 2000.0, "hopper")
    assert cluster.short_name == "Acme X1" and cluster.world == 16
    assert cluster.peak_flops("bf16") == 400e12 and cluster.peak_flops("fp8") == 800e12
    assert cluster.achievable_flops("bf16") == pytest.approx(400e12 * 0.75)  # the default matmul efficiency
    assert cluster.memory_bytes == int((64 - GPU_MEMORY_RESERVE_GIB) * GIB)
    assert cluster.host_link_gbs == 40.0
    # intra "300GB/s" is an achievable bus bandwidth, used as given; inter "ib:400Gb/s" a wire rate x 0.88.
    assert (cluster.intra.bandwidth_gbs, cluster.intra.latency_us) == (300.0, 2.0)
    assert cluster.inter.bandwidth_gbs == pytest.approx(400 / 8 * 0.88)
    with pytest.raises(UserError, match="bf16, fp8"):
        cluster.peak_flops("fp16")  # not described: no silent stand-in
    text = "\n".join(cluster.sources)
    for line in ("peak bf16 400 TFLOP/s", "peak fp8 800 TFLOP/s", "GPU memory 64 GiB", "memory bandwidth 2000 GB/s",
                 "host<->device 40 GB/s", "generation hopper", "intra-node link 300GB/s@2us", "inter-node link ib:400"):
        assert any(s.startswith(line) and s.endswith(path) for s in cluster.sources), (line, text)


def test_gpu_named_by_flags(tmp_path):
    described = gpu_from_flags("bf16=400,fp8=800", memory_gib=64, mem_bw_gbs=2000, generation="Hopper")
    cluster = make_cluster("4xacme", gpu=described)
    assert cluster.gpu == gpus.GpuSpec("acme", {"bf16": 400.0, "fp8": 800.0}, 64.0, 2000.0, "hopper")
    assert cluster.memory_bytes == int(62 * GIB)
    assert "peak bf16 400 TFLOP/s (dense): --peak-tflops" in cluster.sources
    assert "GPU memory 64 GiB: --gpu-memory-gib" in cluster.sources
    assert "memory bandwidth 2000 GB/s: --gpu-mem-bw" in cluster.sources
    # No links were described: the conservative PCIe-card defaults, and the plan says it assumed them.
    assert (cluster.intra.name, cluster.host_link_gbs) == ("pcie4", 24.0)
    assert any("no intra given, assumed pcie4" in s for s in cluster.sources)
    flagged = make_cluster("4xacme", gpu=described, intra="nvlink4")
    assert flagged.intra == LINKS["nvlink4"] and not any("no intra given" in s for s in flagged.sources)
    # Flags win over the file's numbers; the file gives the rest.
    both = make_cluster(f"8x{gpu_file(tmp_path)}", gpu=gpu_from_flags("bf16=500", memory_gib=96))
    assert (both.gpu.peaks, both.gpu.memory_gib, both.gpu.mem_bw_gbs) == ({"bf16": 500.0, "fp8": 800.0}, 96.0, 2000.0)
    assert "peak bf16 500 TFLOP/s (dense): --peak-tflops" in both.sources


def test_known_gpu_with_numbers_changed():
    plain = make_cluster("8xH100")
    changed = make_cluster("8xH100", gpu=gpu_from_flags("bf16=500", memory_gib=96, mem_bw_gbs=4000))
    assert changed.peak_flops("bf16") == 500e12 and changed.peak_flops("fp8") == plain.peak_flops("fp8")
    assert changed.memory_bytes - plain.memory_bytes == 16 * GIB
    assert (changed.gpu.mem_bw_gbs, changed.gpu.name, changed.short_name) == (4000.0, "NVIDIA H100 SXM", "H100")
    assert changed.intra == plain.intra and changed.inter == plain.inter
    assert len(changed.sources) == 3 and plain.sources == ()


def test_file_with_a_base_fills_the_gaps(tmp_path):
    path = gpu_file(tmp_path, 'base = "H100"\nmemory_gib = 96\n', "h100_96.toml")
    cluster = make_cluster(f"8x{path}")
    spec = gpus.lookup_gpu("NVIDIA H100 SXM")
    assert cluster.gpu.peaks == spec.peaks and cluster.gpu.memory_gib == 96.0
    assert (cluster.intra.name, cluster.inter.name, cluster.short_name) == ("nvlink4", "ib-ndr", "h100_96")


@pytest.mark.parametrize("text, message", [
    ('memory_gib = 64\nmem_bw_gbs = 2000\ncolour = "red"\n[peak_tflops]\nbf16 = 1\n', "unknown key.*'colour'"),
    ("memory_gib = 64\nmem_bw_gbs = 2000\n[peak_tflops]\nbf16 = -400\n", r"peak_tflops\.bf16 must be a positive"),
    ("memory_gib = 64\nmem_bw_gbs = 2000\n[peak_tflops]\nbf32 = 400\n", "unknown dtype key.*'bf32'"),
    ("memory_gib = 64\nmem_bw_gbs = 2000\n[peak_tflops]\nbf16 = 4e14\n", "implausibly large.*check the unit"),
    ("mem_bw_gbs = 2000\n[peak_tflops]\nbf16 = 400\n", "needs memory_gib"),
    ("memory_gib = 64\n[peak_tflops]\nbf16 = 400\n", "needs mem_bw_gbs"),
    ("memory_gib = 64\nmem_bw_gbs = 2000\n", "needs peak_tflops"),
    ("memory_gib = true\nmem_bw_gbs = 2000\n[peak_tflops]\nbf16 = 1\n", "memory_gib must be a positive"),
    ('generation = "kepler"\nmemory_gib = 64\nmem_bw_gbs = 2000\n[peak_tflops]\nbf16 = 1\n', "not a GPU generation"),
    ('base = "H10"\n', "base 'H10' is not a known GPU"),
    ("peak_tflops = 400\n", "must be a table"),
    ("memory_gib = [64\n", "not valid TOML"),
    ('inter = "fast"\nbase = "H100"\n', "inter 'fast': not a link"),
])
def test_bad_gpu_files_name_the_problem(tmp_path, text, message):
    path = gpu_file(tmp_path, text, "bad.toml")
    with pytest.raises(UserError, match=message) as info:
        make_cluster(f"8x{path}")
    assert path in str(info.value)


def test_huge_or_missing_gpu_file_is_refused_before_parsing(tmp_path):
    path = tmp_path / "huge.toml"
    path.write_bytes(b"#" * (gpus.GPU_FILE_MAX_BYTES + 1))
    with pytest.raises(UserError, match="larger than 64 KiB"):
        read_gpu_file(str(path))
    with pytest.raises(UserError, match="cannot read GPU file"):
        make_cluster(f"8x{tmp_path / 'absent.toml'}")


def test_bad_gpu_flags():
    with pytest.raises(UserError, match="DTYPE=TFLOPS"):
        gpu_from_flags("bf16:400")
    with pytest.raises(UserError, match="bf16 is given twice"):
        gpu_from_flags("bf16=1,bf16=2")
    with pytest.raises(UserError, match="--gpu-memory-gib must be a positive"):
        gpu_from_flags(memory_gib=-1)
    with pytest.raises(UserError, match="needs memory_gib, mem_bw_gbs"):
        make_cluster("8xacme", gpu=gpu_from_flags("bf16=400"))
    with pytest.raises(UserError, match="Did you mean H100"):  # no numbers: still a typo, not a new GPU
        make_cluster("8xH10", gpu=gpu_from_flags())
    with pytest.raises(UserError, match="cpu cluster measures this machine"):
        make_cluster("2xcpu", gpu=gpu_from_flags(memory_gib=8))


# ------------------------------------------------------------------ the datasheet table


@pytest.mark.parametrize("short, name, bf16, memory, bandwidth, generation, intra, inter", [
    ("A800", "NVIDIA A800 SXM 80GB", 312, 80, 2039, "ampere", "nvlink3-400", "ib-hdr"),
    ("a800_80gb", "NVIDIA A800 SXM 80GB", 312, 80, 2039, "ampere", "nvlink3-400", "ib-hdr"),
    ("A800-PCIe", "NVIDIA A800 PCIe 80GB", 312, 80, 1935, "ampere", "pcie4", "ethernet-100g"),
    ("H800", "NVIDIA H800 SXM", 989, 80, 3350, "hopper", "nvlink4-400", "ib-ndr"),
    ("H20", "NVIDIA H20", 148, 96, 4000, "hopper", "nvlink4", "ib-ndr"),
    ("L40S", "NVIDIA L40S", 362.05, 48, 864, "ada", "pcie4", "ethernet-100g"),
    ("MI300X", "AMD Instinct MI300X", 1307.4, 192, 5300, "cdna3", "xgmi-mi300x", "roce-400g"),
    ("MI250X", "AMD Instinct MI250X (one GCD)", 191.5, 64, 1600, "cdna2", "xgmi-mi250x", "slingshot-200g"),
    ("B200", "NVIDIA B200", 2250, 180, 8000, "blackwell", "nvlink5", "ib-ndr"),
    ("GH200", "NVIDIA GH200 96GB HBM3", 989, 96, 4000, "hopper", "nvlink4", "ib-ndr"),
    ("H100-NVL", "NVIDIA H100 NVL", 835.5, 94, 3900, "hopper", "pcie5", "ethernet-100g"),
])
def test_table_gpus_by_short_name(short, name, bf16, memory, bandwidth, generation, intra, inter):
    cluster = make_cluster(f"8x{short}", nodes=2)
    assert cluster.gpu.name == name and cluster.gpu.generation == generation
    assert cluster.peak_flops("bf16") == pytest.approx(bf16 * 1e12)
    assert (cluster.gpu.memory_gib, cluster.gpu.mem_bw_gbs) == (memory, bandwidth)
    assert (cluster.intra.name, cluster.inter.name) == (intra, inter)
    assert cluster.sources == ()


def test_new_rows_sourced_numbers_and_device_names():
    mi300x = gpus.lookup_gpu("AMD Instinct MI300X")
    assert mi300x.peaks == {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4, "fp8": 2614.9}
    # MI250X: one GCD = 1024 FLOPs/clock/CU x 110 CUs x 1.7 GHz (ROCm docs), half the package's memory.
    assert gpus.lookup_gpu("AMD Instinct MI250X / MI250").peaks["bf16"] == pytest.approx(1024 * 110 * 1.7e9 / 1e12, 0.01)
    assert gpus.lookup_gpu("AMD Instinct MI250").peaks["bf16"] == pytest.approx(362.1 / 2, 0.01)
    assert gpus.lookup_gpu("NVIDIA A800-SXM4-80GB").name == "NVIDIA A800 SXM 80GB"
    assert gpus.lookup_gpu("NVIDIA A800 80GB PCIe").name == "NVIDIA A800 PCIe 80GB"
    assert gpus.lookup_gpu("NVIDIA A800 40GB Active") is None  # unknown, not read as the 80 GB part
    assert gpus.lookup_gpu("NVIDIA H800 PCIe").mem_bw_gbs == 2000
    # "H20" must not swallow the H200 or the GH200, nor they it.
    assert gpus.lookup_gpu("NVIDIA H20").peaks["bf16"] == 148
    assert gpus.lookup_gpu("NVIDIA H200").name == "NVIDIA H200 SXM"
    assert gpus.lookup_gpu("NVIDIA GH200 480GB").name == "NVIDIA GH200 96GB HBM3"
    assert all(spec.generation in gpus.GENERATIONS for _, spec in gpus._GPU_TABLE)
    for name in ("A800", "H800", "H20", "MI300X", "MI250X", "GH200", "B200", "L40S"):
        assert name in known_gpus()


def test_link_defaults_of_the_new_gpus():
    # 8 MI250X GCDs share 4 Slingshot NICs of 200 Gb/s x 0.80: 4 x 20 / 8 = 10 GB/s per GCD.
    mi250x = make_cluster("8xMI250X", nodes=2)
    assert mi250x.inter.bandwidth_gbs == pytest.approx(4 * 200 / 8 * 0.80 / 8)
    assert mi250x.link_for(16).bandwidth_gbs == pytest.approx(min(40.0, 8 * 10.0))
    assert make_cluster("8xH800").intra.bandwidth_gbs == 155.0  # DeepEP: 153-158 GB/s on H800 NVLink
    assert make_cluster("8xMI300X").intra.bandwidth_gbs == 315.0  # AMD's rccl-tests: 309-316 GB/s
    assert make_cluster("GH200").host_link_gbs == pytest.approx(450 * 0.75)


# ------------------------------------------------------------------ links by number


@pytest.mark.parametrize("text, bandwidth, latency", [
    ("12.5GB/s", 12.5, 5.0),              # achievable bus bandwidth, GB = bytes
    ("100Gb/s", 12.5, 5.0),               # bits!
    ("100 Gbps", 12.5, 5.0),
    ("400Gb/s@5us", 50.0, 5.0),
    ("ib:400Gb/s", 50 * 0.88, 14.0),      # a wire rate of a kind: x its achievable fraction; NCCL's net step
    ("roce:400Gb/s@2.5us", 50 * 0.80, 2.5),
    ("eth:25Gb/s", 3.125 * 0.80, 25.0),
    ("nvlink:450GB/s@1000ns", 450 * 0.80, 1.0),
    ("300GB/s@0.002ms", 300.0, 2.0),
    ("1.5TB/s", 1500.0, 5.0),
    ("800MB/s", 0.8, 5.0),
])
def test_parse_link(text, bandwidth, latency):
    link = parse_link(text, "--inter")
    assert link.bandwidth_gbs == pytest.approx(bandwidth) and link.latency_us == pytest.approx(latency)
    assert parse_link("ib-ndr", "--inter") is LINKS["ib-ndr"]


@pytest.mark.parametrize("text, message", [
    ("12.5", "not a link"), ("12.5GB", "not a link"), ("-5GB/s", "not a link"), ("0GB/s", "greater than 0"),
    ("quantum:5GB/s", "unknown link kind 'quantum'"), ("5GB/s@5parsecs", "not a link"),
    ("400GB/s@2s", "not a link"), ("5e6TB/s", "implausibly fast"), ("ib-xdr", "ib-ndr"),
])
def test_bad_links_name_the_problem(text, message):
    with pytest.raises(UserError, match=message) as info:
        make_cluster("8xH100", inter=text)
    assert "--inter" in str(info.value) and "Gb = bits" in str(info.value)


def test_a_bare_bandwidth_keeps_the_latency_of_the_link_it_replaces():
    assert make_cluster("8xH100", nodes=2, inter="12.5GB/s").inter.latency_us == LINKS["ib-ndr"].latency_us
    assert make_cluster("8xL4", nodes=2, inter="12.5GB/s").inter.latency_us == LINKS["ethernet-100g"].latency_us
    assert make_cluster("8xH100", intra="300GB/s").intra.latency_us == LINKS["nvlink4"].latency_us


def test_links_by_number_and_nics_per_node_reach_link_for():
    cluster = make_cluster("8xH100", nodes=4, intra="300GB/s", inter="ib:400Gb/s@3us", nics_per_node=4)
    nic = 400 / 8 * 0.88                       # one NIC, achievable
    assert cluster.intra.bandwidth_gbs == 300.0 and cluster.link_for(8) == cluster.intra
    assert cluster.inter.bandwidth_gbs == pytest.approx(4 * nic / 8)   # 4 NICs shared by 8 GPUs
    assert cluster.inter.latency_us == 3.0
    assert cluster.link_for(4, stride=8) == cluster.inter             # one rank per node
    assert cluster.link_for(32).bandwidth_gbs == pytest.approx(min(300.0, 8 * 4 * nic / 8))  # 8 rings at once
    assert "4 NIC(s) per node: --nics-per-node" in cluster.sources
    # Without --nics-per-node a bandwidth is one NIC per GPU; an ethernet-* name one NIC per node.
    assert make_cluster("8xH100", nodes=2, inter="100Gb/s").inter.bandwidth_gbs == 12.5
    assert make_cluster("8xH100", nodes=2, inter="ethernet-100g").inter.bandwidth_gbs == pytest.approx(10 / 8)
    assert make_cluster("8xL4", nodes=2, nics_per_node=2).inter.bandwidth_gbs == pytest.approx(2 * 10 / 8)
    for bad in (0, -1, 65, 1.5, True):
        with pytest.raises(UserError, match="--nics-per-node"):
            make_cluster("8xH100", nics_per_node=bad)


# ------------------------------------------------------------------ probes


def ring_rows(busbw, small_seconds):
    return [{"bytes": 1024, "iters": 50, "seconds": small_seconds, "algbw_gbs": 0.1, "busbw_gbs": 0.1},
            {"bytes": 2**26, "iters": 16, "seconds": 4e-4, "algbw_gbs": busbw / 2, "busbw_gbs": busbw}]


def probe_file(tmp_path, name, comm=None, compute=None, device_name="NVIDIA H100 80GB HBM3"):
    sections = {}
    if comm is not None:
        sections["comm"] = {"backend": "nccl", "device": "cuda:0", "dtype": "fp32", **comm}
    if compute is not None:
        sections["compute"] = {"device": "cuda:0", "dtypes": {
            key: {"status": "ok", "best_tflops": tflops} for key, tflops in compute.items()}}
    path = tmp_path / name
    path.write_text(json.dumps({"machine": {"device": "cuda:0", "device_name": device_name}, "sections": sections}))
    return str(path)


def two_level(intra_busbw=360.0, inter_busbw=40.0, per_node=8, nodes=2):
    return {"world_size": per_node * nodes, "nodes": nodes, "ranks_per_node": per_node,
            "collectives": {"all_reduce": ring_rows(30.0, 1e-4)},
            "intra": {"world_size": per_node, "groups": nodes, "collectives": {"all_reduce": ring_rows(intra_busbw, 14e-6)}},
            "inter": {"world_size": nodes, "groups": per_node, "collectives": {"all_reduce": ring_rows(inter_busbw, 12e-6)}}}


def test_two_level_probe_sets_both_links(tmp_path):
    path = probe_file(tmp_path, "net.json", two_level())
    cluster = make_cluster("8xH100", nodes=2, probe=path)
    # the ring Simple steps under which NCCL's model times the 1 KiB all_reduces as measured (LL rings):
    # 8 ranks on NVLink, 6.6 + 14 x 0.6 x step / 3.4 us; 2 nodes, one rank each, 6.6 + 2 x 5.0 x
    # step / 14 us (one rank per node: NCCL charges the tree's network hop), LL at half of 40 GB/s
    intra = (14.0 - 6.6 - 1024 / (141e3 * 8 / 14)) * 3.4 / (14 * 0.6)
    inter = (12.0 - 6.6 - 1024 / (0.5 * 40e3)) * 14.0 / (2 * 5.0)
    assert cluster.intra.bandwidth_gbs == 360.0 and cluster.intra.latency_us == pytest.approx(intra)
    assert cluster.inter.bandwidth_gbs == 40.0 and cluster.inter.latency_us == pytest.approx(inter)
    assert cluster.inter.name == "ib-ndr" and "(measured)" in cluster.inter.description
    assert cluster.link_for(16).bandwidth_gbs == pytest.approx(min(360.0, 8 * 40.0))
    assert any(s.startswith("inter-node link 40.0 GB/s") and s.endswith(path) for s in cluster.sources)
    # The measurement is per GPU already: NICs per node would count them twice; --inter is the user's word.
    with pytest.raises(UserError, match="already is per GPU"):
        make_cluster("8xH100", nodes=2, probe=path, nics_per_node=4)
    assert make_cluster("8xH100", nodes=2, probe=path, inter="ib-hdr").inter == LINKS["ib-hdr"]
    # Measured with 4 ranks per node, planned with 8: used, and the plan says so.
    other = make_cluster("8xH100", nodes=2, probe=probe_file(tmp_path, "n4.json", two_level(per_node=4, nodes=4)))
    assert other.inter.bandwidth_gbs == 40.0 and any("4 rank(s) per node" in s for s in other.sources)


def test_old_single_group_probe_still_reads(tmp_path):
    one_node = probe_file(tmp_path, "old8.json", {"world_size": 8, "collectives": {"all_reduce": ring_rows(350.0, 14e-6)}})
    cluster = make_cluster("8xH100", nodes=2, probe=one_node)
    assert cluster.intra.bandwidth_gbs == 350.0 and cluster.inter == LINKS["ib-ndr"]
    spanning = probe_file(tmp_path, "old16.json", {"world_size": 16, "collectives": {"all_reduce": ring_rows(30.0, 1e-4)}})
    cluster = make_cluster("8xH100", nodes=2, probe=spanning)
    assert cluster.intra == LINKS["nvlink4"] and any("link defaults kept" in s for s in cluster.sources)


def test_several_probe_files_merge(tmp_path):
    node = probe_file(tmp_path, "node.json", {"world_size": 8, "collectives": {"all_reduce": ring_rows(350.0, 14e-6)}},
                      compute={"bf16": 791.2})
    net = probe_file(tmp_path, "net.json", two_level(intra_busbw=370.0, inter_busbw=42.0))
    cluster = make_cluster("8xH100", nodes=2, probe=[node, net])
    assert cluster.matmul_efficiency["bf16"] == pytest.approx(0.8)       # from node.json only
    assert cluster.intra.bandwidth_gbs == 350.0                           # both measured it, within 25 %: the first
    assert cluster.inter.bandwidth_gbs == 42.0                            # from net.json only
    assert any("intra-node link: probe file" in s and "agrees" in s for s in cluster.sources)


def test_contradicting_probe_files_are_refused(tmp_path):
    node = probe_file(tmp_path, "node.json", {"world_size": 8, "collectives": {"all_reduce": ring_rows(350.0, 14e-6)}})
    pcie = probe_file(tmp_path, "pcie.json", two_level(intra_busbw=40.0))
    with pytest.raises(UserError, match="disagree on the intra-node link: 350 vs 40") as info:
        make_cluster("8xH100", nodes=2, probe=[node, pcie])
    assert node in str(info.value) and pcie in str(info.value)
    a100 = probe_file(tmp_path, "a100.json", compute={"bf16": 250.0}, device_name="NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError, match="NVIDIA A100 SXM 80GB"):
        make_cluster("8xH100", probe=[node, a100])
    odd = probe_file(tmp_path, "odd.json", compute={"bf16": 250.0}, device_name="Some Accelerator")
    with pytest.raises(UserError, match="different devices"):
        make_cluster("8xH100", probe=[node, odd])


def test_huge_probe_file_is_refused(tmp_path, monkeypatch):
    from slipstream.plan import probe_files

    monkeypatch.setattr(probe_files, "PROBE_MAX_BYTES", 100)
    with pytest.raises(UserError, match="larger than"):
        make_cluster("8xH100", probe=probe_file(tmp_path, "big.json", two_level()))


def write_json(tmp_path, data, name="probe.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


ONE_RING = {"world_size": 2, "collectives": {"all_reduce": ring_rows(40.0, 1e-5)}}


@pytest.mark.parametrize("data, field", [
    ({"sections": {"compute": {"dtypes": [1, 2]}}}, "sections.compute.dtypes should be an object, got a list"),
    ({"sections": {"compute": {"dtypes": {"bf16": [1]}}}}, "sections.compute.dtypes.bf16 should be an object"),
    ({"sections": {"compute": [1]}}, "sections.compute should be an object"),
    ({"sections": {"memory": {"copy": 3}}}, "sections.memory.copy should be an object, got a number"),
    ({"sections": {"comm": {"world_size": 2, "collectives": "x"}}}, "sections.comm.collectives should be an object"),
    ({"sections": {"comm": {"world_size": 2, "collectives": {"all_reduce": [1]}}}},
     "sections.comm.collectives.all_reduce should be a list of rows"),
    ({"sections": {"comm": {"world_size": 2, "collectives": {"all_reduce": {"bytes": 8}}}}},
     "sections.comm.collectives.all_reduce should be a list of rows"),
    ({"sections": {"comm": {"world_size": 2.5, "collectives": {}}}}, "sections.comm.world_size should be a whole"),
    ({"sections": {"comm": {"intra": [ONE_RING]}}}, "sections.comm.intra should be an object"),
    ({"machine": "cuda", "sections": {"comm": ONE_RING}}, "machine should be an object, got a string"),
])
def test_probe_of_the_wrong_shape_is_refused(tmp_path, data, field):
    """Valid JSON of another shape: a UserError naming the file, the field and the fix, not a crash
    (a list where an object belongs used to raise AttributeError) nor silence."""
    path = write_json(tmp_path, data)
    with pytest.raises(UserError, match=field) as info:
        make_cluster("8xH100", probe=path)
    assert path in str(info.value) and "slipstream probe --out FILE" in str(info.value)


def test_deeply_nested_probe_is_invalid_json(tmp_path):
    # 100,000 levels (200 KB, well under the size cap) overflow the JSON decoder's stack.
    path = write_json(tmp_path, '{"sections": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(UserError, match="is not valid JSON") as info:
        make_cluster("8xH100", probe=path)
    assert path in str(info.value) and "slipstream probe --out FILE" in str(info.value)


def test_probe_matmul_rate_is_bounded_by_the_datasheet(tmp_path):
    # H100 SXM dense bf16 989 TFLOP/s (plan/gpus.py): up to 1.2 x 989 = 1186.8 is a measurement.
    ok = make_cluster("8xH100", probe=probe_file(tmp_path, "ok.json", compute={"bf16": 1180.0}))
    assert ok.matmul_efficiency["bf16"] == pytest.approx(1180.0 / 989)
    for tflops in (1190.0, 1e9):
        with pytest.raises(UserError, match=r"best_tflops = .* implausibly large \(more than 1186.8 TFLOP/s = "
                                            r"1.2 x the datasheet's 989") as info:
            make_cluster("8xH100", probe=probe_file(tmp_path, "fast.json", compute={"bf16": tflops}))
        assert "sections.compute.dtypes.bf16.best_tflops" in str(info.value)
    # A custom GPU's peak bounds it too: 400 given, 700 measured is another GPU or a wrong peak.
    custom = gpu_from_flags(peak_tflops="bf16=400", memory_gib=64, mem_bw_gbs=2000)
    with pytest.raises(UserError, match="--peak-tflops"):
        make_cluster("8xacme", gpu=custom, probe=probe_file(tmp_path, "acme.json", compute={"bf16": 700.0},
                                                             device_name="Acme X1"))


def test_cpu_probe_matmul_rate_has_only_a_sanity_bound(tmp_path):
    from slipstream.plan.hardware import CpuFacts

    cpu = CpuFacts("test cpu", lambda key: 1e11)
    fast = probe_file(tmp_path, "cpu.json", compute={"fp32": 50.0}, device_name="Some CPU")
    data = json.loads(open(fast).read())
    data["machine"]["device"] = "cpu"
    cluster = make_cluster("1xcpu", probe=write_json(tmp_path, data, "cpu.json"), cpu=cpu)
    assert cluster.peak_flops("fp32") == pytest.approx(50e12)  # its measured peak, no datasheet ceiling
    data["sections"]["compute"]["dtypes"]["fp32"]["best_tflops"] = 1e9
    with pytest.raises(UserError, match="fp32.best_tflops = 1e.09 is implausibly large"):
        make_cluster("1xcpu", probe=write_json(tmp_path, data, "cpu.json"), cpu=cpu)


def test_probe_link_and_copy_numbers_are_bounded(tmp_path):
    from slipstream.plan.links import MAX_LINK_GBS

    def ring(busbw=40.0, seconds=1e-5, nbytes=1024):
        rows = ring_rows(busbw, seconds)
        rows[0]["bytes"] = nbytes
        return {"world_size": 8, "collectives": {"all_reduce": rows}}

    assert make_cluster("8xH100", probe=probe_file(tmp_path, "top.json", ring(busbw=MAX_LINK_GBS))
                        ).intra.bandwidth_gbs == MAX_LINK_GBS
    with pytest.raises(UserError, match=r"all_reduce.busbw_gbs = 1e\+30 is implausibly large"):
        make_cluster("8xH100", probe=probe_file(tmp_path, "fast.json", ring(busbw=1e30)))
    # parse_link's ceiling, the same for a link given by number.
    with pytest.raises(UserError, match="implausibly fast"):
        parse_link(f"{2 * MAX_LINK_GBS:g}GB/s", "--intra")
    with pytest.raises(UserError, match="all_reduce should be a list of rows"):  # true is not a byte count
        make_cluster("8xH100", probe=probe_file(tmp_path, "bool.json", ring(nbytes=True)))
    # 14 steps of an 8-rank ring: 20 s is over a second per step.
    with pytest.raises(UserError, match="all_reduce.seconds = 20 is implausibly large"):
        make_cluster("8xH100", probe=probe_file(tmp_path, "slow.json", ring(seconds=20.0)))
    for field in ("copy", "h2d_pinned"):
        data = {"sections": {"memory": {"copy": {"gbs": 100.0}, "h2d_pinned": {"gbs": 50.0},
                                        "d2h_pinned": {"gbs": 50.0}}}}
        data["sections"]["memory"][field]["gbs"] = 1e12
        with pytest.raises(UserError, match=f"sections.memory.{field}.gbs = 1e.12 is implausibly large"):
            make_cluster("8xH100", probe=write_json(tmp_path, data))
    data["sections"]["memory"]["h2d_pinned"]["gbs"] = True
    with pytest.raises(UserError, match="h2d_pinned.gbs should be a positive number, got True"):
        make_cluster("8xH100", probe=write_json(tmp_path, data))


@pytest.mark.parametrize("node_of_rank, nodes, rails", [
    ([0, 0, 1, 1], [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    ([0] * 4, [[0, 1, 2, 3]], [[0], [1], [2], [3]]),
    ([0, 1], [[0], [1]], [[0, 1]]),
    ([0, 0, 0, 1, 1, 1, 2, 2, 2], [[0, 1, 2], [3, 4, 5], [6, 7, 8]], [[0, 3, 6], [1, 4, 7], [2, 5, 8]]),
    ([1, 0, 1, 0], [[1, 3], [0, 2]], [[1, 0], [3, 2]]),  # nodes in order of their number, not of their ranks
])
def test_probe_groups_of_a_launch(node_of_rank, nodes, rails):
    assert comm_groups(node_of_rank) == (nodes, rails)


def test_probe_groups_need_equal_nodes():
    assert comm_groups([0, 0, 1]) is None


# ------------------------------------------------------------------ the flags


def test_hardware_flags(tmp_path):
    parser = argparse.ArgumentParser()
    add_hardware_arguments(parser)
    node = probe_file(tmp_path, "node.json", compute={"bf16": 791.2})
    net = probe_file(tmp_path, "net.json", two_level())
    args = parser.parse_args(["--gpus", "8xH100", "--nodes", "2", "--probe", node, "--probe", net,
                              "--peak-tflops", "fp8=1800", "--gpu-memory-gib", "96", "--intra", "350GB/s"])
    cluster = cluster_from_args(args)
    assert (cluster.world, cluster.gpu.peaks["fp8"], cluster.gpu.memory_gib) == (16, 1800.0, 96.0)
    assert cluster.intra.bandwidth_gbs == 350.0 and cluster.inter.bandwidth_gbs == 40.0
    assert cluster.matmul_efficiency["bf16"] == pytest.approx(0.8)
    assert hardware_input_files(args) == [node, net]
    path = gpu_file(tmp_path)
    args = parser.parse_args(["--gpus", f"8x{path}", "--inter", "100Gb/s", "--nics-per-node", "2"])
    cluster = cluster_from_args(args)
    assert cluster.gpu.name == "Acme X1" and cluster.inter.bandwidth_gbs == pytest.approx(2 * 12.5 / 8)
    assert hardware_input_files(args) == [path]
