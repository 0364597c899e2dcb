"""Tests for slipstream.plan.hardware (with plan.links and plan.probe_files): GPU names, links, probe
overrides, the cpu cluster."""

import json
import math

import pytest

from slipstream.errors import UserError
from slipstream.observe import peaks
from slipstream.plan import gpus, hardware
from slipstream.plan.hardware import CpuFacts, known_gpus, make_cluster, parse_gpus
from slipstream.plan.links import LINKS, LOCAL

H100_PROBE_NAME = "NVIDIA H100 80GB HBM3"


def _refuse(dtype_key):
    raise AssertionError("a GPU cluster asked for this CPU's peak")


def test_gpu_clusters_never_ask_for_the_cpu_peak():
    """The planner measures nothing: a GPU cluster ignores the CPU facts it is given."""
    assert make_cluster("8xH100", cpu=CpuFacts("x", _refuse)).gpu.name == "NVIDIA H100 SXM"


@pytest.mark.parametrize("text, expected", [
    ("8xH100", (8, "H100")),
    ("H100", (1, "H100")),
    ("8 x a100-80gb", (8, "a100-80gb")),
    ("4X L4", (4, "L4")),
    ("2*cpu", (2, "cpu")),
    ("  16xB200 ", (16, "B200")),
])
def test_parse_gpus_forms(text, expected):
    assert parse_gpus(text) == expected


@pytest.mark.parametrize("text", ["", "8", "8x", "0xH100", "-1xH100", "8H100", "8 H100", "8x(H100)"])
def test_parse_gpus_errors(text):
    with pytest.raises(UserError, match="8xH100"):
        parse_gpus(text)


@pytest.mark.parametrize("name, spec_name", [
    ("H100", "NVIDIA H100 SXM"),
    ("h100-sxm", "NVIDIA H100 SXM"),
    ("H100-PCIe", "NVIDIA H100 PCIe"),
    ("h100_nvl", "NVIDIA H100 NVL"),
    ("H200", "NVIDIA H200 SXM"),
    ("A100", "NVIDIA A100 SXM 80GB"),
    ("a100-80gb", "NVIDIA A100 SXM 80GB"),
    ("A100-40GB", "NVIDIA A100 SXM 40GB"),
    ("A100-PCIe", "NVIDIA A100 PCIe 80GB"),
    ("V100", "NVIDIA V100 SXM2 16GB"),
    ("v100-pcie-32gb", "NVIDIA V100 PCIe 32GB"),
    ("rtx4090", "NVIDIA GeForce RTX 4090"),
    ("A10G", "NVIDIA A10G"),
])
def test_alias_resolves_to_table_spec(name, spec_name):
    cluster = make_cluster(name)
    assert cluster.gpu.name == spec_name
    assert cluster.world == 1


def test_h100_numbers_come_from_the_peaks_table():
    cluster = make_cluster("8xH100", nodes=2)
    assert cluster.gpu is gpus.lookup_gpu("NVIDIA H100 SXM")
    assert cluster.peak_flops("bf16") == 989e12
    assert cluster.achievable_flops("bf16") == pytest.approx(989e12 * 0.75)
    assert cluster.world == 16 and cluster.short_name == "H100"
    assert cluster.intra.name == "nvlink4" and cluster.inter.name == "ib-ndr"
    assert cluster.memory_bytes == int((80 - hardware.GPU_MEMORY_RESERVE_GIB) * 2**30)
    assert cluster.host_link_gbs == 48.0
    assert cluster.sources == ()  # nothing but table defaults


def test_default_links_per_gpu_family():
    assert (make_cluster("A100").intra.name, make_cluster("A100").inter.name) == ("nvlink3", "ib-hdr")
    assert make_cluster("B200").intra.name == "nvlink5"
    assert make_cluster("L40S").intra.name == "pcie4"
    assert make_cluster("T4").intra.name == "pcie3"


def test_every_known_gpu_builds():
    for name in known_gpus():
        if name != "cpu":
            cluster = make_cluster(f"8x{name}")
            assert set(cluster.matmul_efficiency) == set(cluster.gpu.peaks)


def test_unknown_gpu_lists_names_and_suggests():
    with pytest.raises(UserError) as info:
        make_cluster("8xH10")
    message = str(info.value)
    assert "Did you mean H100?" in message
    for name in ("B200", "A100-40GB", "L4", "cpu"):
        assert name in message


def test_missing_dtype_names_the_ones_there():
    with pytest.raises(UserError, match="fp16"):
        make_cluster("V100").peak_flops("bf16")


def test_more_than_eight_per_node_splits_into_nodes():
    cluster = make_cluster("16xH100")
    assert (cluster.gpus_per_node, cluster.nodes, cluster.world) == (8, 2, 16)
    assert any("2 nodes of 8" in line for line in cluster.sources)
    with pytest.raises(UserError, match="per node"):
        make_cluster("12xH100")
    with pytest.raises(UserError, match="per node"):
        make_cluster("16xH100", nodes=2)
    with pytest.raises(UserError, match="--nodes"):
        make_cluster("8xH100", nodes=0)


def test_link_for_intra_vs_inter():
    cluster = make_cluster("8xH100", nodes=8)
    assert cluster.link_for(1) is LOCAL and math.isinf(LOCAL.bandwidth_gbs)
    assert cluster.link_for(8) == cluster.intra
    assert cluster.link_for(2, stride=4) == cluster.intra  # ranks 0 and 4: same node
    assert cluster.link_for(8, stride=8) == cluster.inter  # one rank per node
    # 16 consecutive ranks: 8 per node, 8 NICs side by side, capped by NVLink.
    wide = cluster.link_for(16)
    assert wide.name == "ib-ndr" and wide.bandwidth_gbs == min(370.0, 8 * 44.0)
    assert wide.latency_us == cluster.inter.latency_us
    # Stride 4 across nodes: 2 members per node.
    assert cluster.link_for(4, stride=4).bandwidth_gbs == 2 * 44.0
    with pytest.raises(UserError, match="parallel sizes"):
        cluster.link_for(0)
    with pytest.raises(UserError, match="64"):
        cluster.link_for(16, stride=8)


def test_per_node_nic_is_shared_by_the_gpus():
    cluster = make_cluster("8xL4", nodes=2)
    assert cluster.inter.name == "ethernet-100g"
    assert cluster.inter.bandwidth_gbs == pytest.approx(10.0 / 8)
    assert cluster.link_for(2, stride=8).bandwidth_gbs == pytest.approx(10.0 / 8)
    assert cluster.link_for(16).bandwidth_gbs == pytest.approx(10.0)  # the whole NIC


def test_link_overrides():
    cluster = make_cluster("8xH100", nodes=2, intra="pcie5", inter="roce-400g")
    assert cluster.intra == LINKS["pcie5"] and cluster.inter == LINKS["roce-400g"]
    assert any("--intra" in line for line in cluster.sources)
    assert any("--inter" in line for line in cluster.sources)
    with pytest.raises(UserError) as info:
        make_cluster("8xH100", inter="ib-xdr")
    assert "ib-xdr" in str(info.value) and "ib-ndr" in str(info.value) and "nvlink4" in str(info.value)


def test_memory_override():
    cluster = make_cluster("A100", memory_gib=70)
    assert cluster.memory_bytes == 70 * 2**30
    assert any("--memory-gib" in line for line in cluster.sources)
    assert make_cluster("A100-40GB").memory_bytes == int(38 * 2**30)
    for bad in (0, -1, 81):
        with pytest.raises(UserError, match="memory-gib"):
            make_cluster("A100", memory_gib=bad)


def gpu_probe(device_name=H100_PROBE_NAME, comm_world=8):
    """A probe result in the format perf/probe.py writes (values made up)."""
    return {
        "machine": {"device": "cuda:0", "device_name": device_name, "cpu_model": "x", "torch_threads": 8,
                    "world_size": comm_world},
        "git_sha": None, "env": {},
        "sections": {
            "compute": {
                "device": "cuda:0", "sizes": [2048, 4096, 8192], "datasheet": "NVIDIA H100 SXM",
                "dtypes": {
                    "fp32": {"status": "ok", "tflops_by_size": {"2048": 40.0, "8192": 53.6}, "best_tflops": 53.6,
                             "seconds": 1.0, "datasheet_tflops": 67, "fraction_of_peak": 0.8},
                    "bf16": {"status": "ok", "tflops_by_size": {"2048": 500.0, "8192": 791.2}, "best_tflops": 791.2,
                             "seconds": 1.0, "datasheet_tflops": 989, "fraction_of_peak": 0.8},
                    "fp8": {"status": "skipped", "reason": "torch has no _scaled_mm"},
                },
            },
            "memory": {
                "device": "cuda:0",
                "copy": {"bytes": 2**30, "seconds": 0.001, "gbs": 2100.0, "counts": "read + write bytes"},
                "h2d_pinned": {"bytes": 2**28, "seconds": 0.005, "gbs": 53.0},
                "h2d_pageable": {"bytes": 2**28, "seconds": 0.02, "gbs": 13.0},
                "d2h_pinned": {"bytes": 2**28, "seconds": 0.005, "gbs": 50.0},
                "d2h_pageable": {"bytes": 2**28, "seconds": 0.02, "gbs": 12.0},
            },
            "comm": {
                "backend": "nccl", "world_size": comm_world, "device": "cuda:0", "dtype": "fp32",
                "time": "mean per call over iterations, slowest rank",
                "collectives": {
                    "all_reduce": [
                        {"bytes": 1024, "iters": 50, "seconds": 14e-6, "algbw_gbs": 0.07, "busbw_gbs": 0.13},
                        {"bytes": 67108864, "iters": 16, "seconds": 3.2e-4, "algbw_gbs": 205.0, "busbw_gbs": 360.0},
                    ],
                    "all_gather": [
                        {"bytes": 67108864, "iters": 16, "seconds": 2e-4, "algbw_gbs": 330.0, "busbw_gbs": 290.0},
                    ],
                },
            },
        },
    }


def write(tmp_path, data, name="probe.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_probe_overrides_efficiency_links_and_host(tmp_path):
    path = write(tmp_path, gpu_probe())
    cluster = make_cluster("8xH100", nodes=2, probe=path)
    assert cluster.matmul_efficiency["bf16"] == pytest.approx(0.8)
    assert cluster.matmul_efficiency["fp32"] == pytest.approx(0.8)
    assert cluster.matmul_efficiency["fp16"] == 0.75  # not measured: default kept
    assert cluster.matmul_efficiency["fp8"] == 0.65  # skipped in the probe: default kept
    assert cluster.achievable_flops("bf16") == pytest.approx(791.2e12)
    assert cluster.intra.bandwidth_gbs == 360.0
    # NCCL ran the 1 KiB all_reduce LL: 6.6 us base + 14 steps x 0.6 us x (step / 3.4) + bytes at
    # Hopper's LL ceiling 141 GB/s x 8/14; the ring Simple step that makes it 14 us (collectives.py)
    assert cluster.intra.latency_us == pytest.approx((14.0 - 6.6 - 1024 / (141e3 * 8 / 14)) * 3.4 / (14 * 0.6))
    assert cluster.inter == LINKS["ib-ndr"]
    assert cluster.host_link_gbs == 50.0  # the slower pinned direction
    text = "\n".join(cluster.sources)
    assert "bf16 matmul 0.80 of peak" in text and path in text
    assert "360.0 GB/s" in text and "host<->device 50.0 GB/s" in text


def test_probe_comm_over_several_nodes_keeps_link_defaults(tmp_path):
    cluster = make_cluster("8xH100", nodes=2, probe=write(tmp_path, gpu_probe(comm_world=16)))
    assert cluster.intra == LINKS["nvlink4"]
    assert any("link defaults kept" in line for line in cluster.sources)


def test_probe_from_another_gpu_is_refused(tmp_path):
    with pytest.raises(UserError, match="NVIDIA A100 SXM 80GB"):
        make_cluster("8xH100", probe=write(tmp_path, gpu_probe("NVIDIA A100-SXM4-80GB")))


@pytest.mark.parametrize("content", ["{not json", json.dumps({"sections": {"storage": {}}}), json.dumps([1, 2])])
def test_bad_probe_file(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(UserError) as info:
        make_cluster("H100", probe=str(path))
    assert str(path) in str(info.value) and "slipstream probe --out FILE" in str(info.value)


def test_missing_probe_file(tmp_path):
    with pytest.raises(UserError, match="slipstream probe --out FILE"):
        make_cluster("H100", probe=str(tmp_path / "nope.json"))


def test_bad_value_in_probe(tmp_path):
    data = gpu_probe()
    data["sections"]["compute"]["dtypes"]["bf16"]["best_tflops"] = -3
    with pytest.raises(UserError, match="best_tflops"):
        make_cluster("H100", probe=write(tmp_path, data))


@pytest.fixture
def fake_cpu(monkeypatch):
    measured = {"fp32": 1e11, "bf16": 2e11, "fp16": 5e10}
    calls = []

    def fake_peak(dtype_key="fp32", cache_dir=None, force=False):
        calls.append(dtype_key)
        return measured[dtype_key]

    monkeypatch.setattr(peaks, "cpu_peak_flops", fake_peak)
    real_sysconf = hardware.os.sysconf
    sizes = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 16 * 2**30 // 4096}  # 16 GiB of RAM
    monkeypatch.setattr(hardware.os, "sysconf", lambda name: sizes[name] if name in sizes else real_sysconf(name))
    return calls


def test_cpu_cluster(fake_cpu):
    cluster = make_cluster("2xcpu", cpu=peaks.this_cpu())
    assert cluster.world == 2 and cluster.short_name == "cpu"
    assert cluster.gpu.name == f"CPU {peaks.cpu_model()}"
    assert cluster.peak_flops("fp32") == pytest.approx(0.5e11)  # two processes share the cores
    assert cluster.peak_flops("bf16") == pytest.approx(1e11)
    assert cluster.peak_flops("tf32") == cluster.peak_flops("fp32")
    assert cluster.achievable_flops("fp16") == pytest.approx(2.5e10)  # efficiency 1.0
    assert cluster.intra.name == "shm"
    assert cluster.memory_bytes == int((16 - hardware.CPU_MEMORY_RESERVE_GIB) / 2 * 2**30)
    assert sorted(fake_cpu) == ["bf16", "fp16", "fp32"]
    with pytest.raises(UserError, match="fp32"):
        cluster.peak_flops("fp8")
    with pytest.raises(UserError, match="16"):
        make_cluster("17xcpu", cpu=peaks.this_cpu())


def test_cpu_cluster_needs_the_callers_cpu_facts(fake_cpu):
    """plan/ is below observe/: the measured peak and the CPU name are passed in, never fetched."""
    with pytest.raises(ValueError, match="this_cpu"):
        make_cluster("2xcpu")
    cluster = make_cluster("1xcpu", cpu=CpuFacts("Test CPU", lambda key: {"fp32": 4e11}.get(key, 1e11)))
    assert cluster.gpu.name == "CPU Test CPU" and cluster.peak_flops("fp32") == pytest.approx(4e11)
    assert not fake_cpu  # peaks.cpu_peak_flops was not reached


def test_cpu_probe_replaces_measurement(tmp_path, fake_cpu):
    data = {
        "machine": {"device": "cpu", "device_name": "Some CPU", "world_size": 2},
        "sections": {
            "compute": {"device": "cpu", "sizes": [512, 1024, 2048], "dtypes": {
                "fp32": {"status": "ok", "tflops_by_size": {"2048": 0.3}, "best_tflops": 0.3, "seconds": 1.0},
                "tf32": {"status": "skipped", "reason": "TF32 is an NVIDIA tensor-core mode (CUDA only)"},
            }},
            "memory": {"device": "cpu", "copy": {"bytes": 2**28, "seconds": 0.02, "gbs": 27.0},
                       "h2d_pinned": "n/a (no accelerator)", "h2d_pageable": "n/a (no accelerator)",
                       "d2h_pinned": "n/a (no accelerator)", "d2h_pageable": "n/a (no accelerator)"},
            "comm": {"backend": "gloo", "world_size": 2, "device": "cpu", "dtype": "fp32", "collectives": {
                "all_reduce": [{"bytes": 1024, "iters": 50, "seconds": 1e-4, "algbw_gbs": 0.01, "busbw_gbs": 0.01},
                               {"bytes": 16777216, "iters": 8, "seconds": 0.01, "algbw_gbs": 1.7, "busbw_gbs": 1.7}],
            }},
        },
    }
    cluster = make_cluster("2xcpu", probe=write(tmp_path, data), cpu=peaks.this_cpu())
    assert cluster.peak_flops("fp32") == pytest.approx(0.15e12)
    assert "fp32" not in fake_cpu  # measured by the probe, not again
    assert cluster.intra.bandwidth_gbs == 1.7 and cluster.intra.latency_us == pytest.approx(50.0)
    assert cluster.gpu.mem_bw_gbs == 27.0 and cluster.host_link_gbs == 27.0
    with pytest.raises(UserError, match="CPU"):
        make_cluster("H100", probe=write(tmp_path, data, "cpu.json"))
