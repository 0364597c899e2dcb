"""Tests for slipstream.perf.probe (and probe_comm) on CPU: compute, memory, storage, and a real world-2 comm run."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from slipstream.errors import UserError
from slipstream.observe import peaks
from slipstream.perf import probe, probe_comm
from slipstream.plan.hardware import CpuFacts, make_cluster

SRC = str(Path(__file__).resolve().parents[2] / "src")
SMALL_SIZES = [64, 128]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    # Never touch the developer's real ~/.cache/slipstream.
    path = tmp_path / "cache"
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(path))
    return path


def test_compute_on_cpu_measures_fp32_bf16_and_skips_tf32_fp8(cache_dir):
    result = probe.run_probe(["compute"], device="cpu", sizes=SMALL_SIZES, show=False)
    dtypes = result["sections"]["compute"]["dtypes"]
    for key in ("fp32", "bf16"):
        assert dtypes[key]["status"] == "ok"
        assert dtypes[key]["best_tflops"] > 0
        assert set(dtypes[key]["tflops_by_size"]) == {"64", "128"}
        assert all(v > 0 for v in dtypes[key]["tflops_by_size"].values())
    for key in ("tf32", "fp8"):
        assert dtypes[key]["status"] == "skipped"
        assert "CUDA" in dtypes[key]["reason"]
    assert result["machine"]["device"] == "cpu"
    assert "torch_version" in result["env"]


def test_small_sizes_never_set_the_mfu_peak(cache_dir):
    probe.run_probe(["compute"], device="cpu", sizes=[8], show=False)
    assert not (cache_dir / peaks.CACHE_FILE_NAME).exists()


def test_probe_writes_the_cpu_peak_cache_that_peaks_reads(cache_dir, monkeypatch):
    # Treat the test sizes as the full-size probe (the real one takes seconds).
    monkeypatch.setattr(probe, "CPU_MATMUL_SIZES", tuple(SMALL_SIZES))
    result = probe.run_probe(["compute"], device="cpu", sizes=SMALL_SIZES, show=False)
    dtypes = result["sections"]["compute"]["dtypes"]

    # peaks must now answer from the cache, without measuring again.
    def no_measuring(dtype):
        raise AssertionError("cpu_peak_flops measured although the probe filled the cache")

    monkeypatch.setattr(peaks, "_measure_matmul_flops", no_measuring)
    for key in ("fp32", "bf16"):
        assert peaks.cpu_peak_flops(key) == pytest.approx(dtypes[key]["best_tflops"] * 1e12)
    _, source = peaks.device_peak_flops("cpu", "fp32")
    assert "cached" in source
    assert (cache_dir / peaks.CACHE_FILE_NAME).exists()


def test_memory_on_cpu(cache_dir):
    memory = probe.memory_section(torch.device("cpu"), copy_bytes=16 * 2**20)
    assert memory["copy"]["gbs"] > 0
    for key in ("h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable"):
        assert memory[key] == "n/a (no accelerator)"


def test_json_output_and_report(tmp_path, cache_dir, capsys):
    out = tmp_path / "probe.json"
    probe.run_probe(["compute", "memory"], device="cpu", sizes=[64], out=str(out))
    data = json.loads(out.read_text())
    assert set(data["sections"]) == {"compute", "memory"}
    assert data["sections"]["memory"]["copy"]["gbs"] > 0
    assert "git_sha" in data and "cpu_model" in data["machine"]
    printed = capsys.readouterr().out
    assert "TFLOP/s" in printed and "n/a (no accelerator)" in printed


def test_storage_reads_prepared_shards(tmp_path):
    from slipstream.data import prepare_dataset

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 2000, encoding="utf-8")
    data_dir = tmp_path / "data"
    prepare_dataset([str(corpus)], "byte", str(data_dir), shard_tokens=20_000, progress=False)

    result = probe.run_probe(["storage"], device="cpu", data_dir=str(data_dir), show=False)
    storage = result["sections"]["storage"]
    expected = sum(p.stat().st_size for p in data_dir.glob("*.bin"))
    assert storage["bytes"] == expected > 0
    assert storage["files"] >= 2
    assert storage["gbs"] > 0
    assert "page cache" in storage["note"]


def test_storage_errors(tmp_path):
    with pytest.raises(UserError, match="no such folder"):
        probe.storage_section(str(tmp_path / "missing"))
    with pytest.raises(UserError, match=r"\*\.bin"):
        probe.storage_section(str(tmp_path))
    with pytest.raises(UserError, match="--data-dir"):
        probe.run_probe(["storage"], device="cpu", show=False)


def test_bad_input_is_a_user_error():
    with pytest.raises(UserError, match="section"):
        probe.run_probe(["gpu"], device="cpu", show=False)
    with pytest.raises(UserError, match="device"):
        probe.run_probe(["memory"], device="not-a-device", show=False)
    with pytest.raises(UserError, match="sizes"):
        probe.run_probe(["compute"], device="cpu", sizes=[0], show=False)


def test_comm_without_distributed_launch_is_a_user_error(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UserError, match="torchrun --standalone --nproc-per-node N -m slipstream probe"):
        probe.run_probe(["comm"], device="cpu", show=False)


def test_bus_bandwidth_formulas():
    # nccl-tests definitions.
    assert probe_comm.bus_bandwidth("all_reduce", 10.0, 4) == pytest.approx(10.0 * 2 * 3 / 4)
    assert probe_comm.bus_bandwidth("all_gather", 10.0, 4) == pytest.approx(7.5)
    assert probe_comm.bus_bandwidth("reduce_scatter", 10.0, 8) == pytest.approx(10.0 * 7 / 8)
    assert probe_comm.bus_bandwidth("all_to_all", 10.0, 2) == pytest.approx(5.0)
    assert probe_comm.bus_bandwidth("broadcast", 10.0, 8) == pytest.approx(10.0)
    # A single process moves nothing over the bus (except a broadcast's buffer "once").
    assert probe_comm.bus_bandwidth("all_reduce", 10.0, 1) == 0.0
    with pytest.raises(ValueError):
        probe_comm.bus_bandwidth("gather", 1.0, 2)
    with pytest.raises(ValueError):
        probe_comm.bus_bandwidth_factor("all_reduce", 0)


COMM_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from slipstream.perf.probe import run_probe

# One machine, but each rank says it is a node of its own (as torchrun --nnodes 2 would with one
# process per node): the probe then also times the intra/inter levels, here 2 nodes x 1 rank.
os.environ["LOCAL_WORLD_SIZE"] = "1"
os.environ["GROUP_RANK"] = os.environ["RANK"]
result = run_probe(["comm"], device="cpu", comm_sizes=[1024, 65536], show=False)
# The probe created the process group, so it must also have torn it down.
assert not dist.is_initialized()
if os.environ["RANK"] == "0":
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
"""


def test_comm_world_2_with_torchrun(tmp_path):
    script = tmp_path / "comm_probe.py"
    script.write_text(textwrap.dedent(COMM_SCRIPT))
    out = tmp_path / "comm.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(out)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    comm = result["sections"]["comm"]
    assert comm["world_size"] == 2 and comm["backend"] == "gloo"
    # The faked 2-node layout: one rank per node, so no intra-node group; one rail of both ranks.
    assert (comm["nodes"], comm["ranks_per_node"]) == (2, 1) and "intra" not in comm
    inter = comm["inter"]
    assert (inter["world_size"], inter["groups"]) == (2, 1)
    assert [row["bytes"] for row in inter["collectives"]["all_reduce"]] == [1024, 65536]
    for row in inter["collectives"]["all_reduce"]:
        assert row["busbw_gbs"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9 * probe_comm.bus_bandwidth_factor(
            "all_reduce", 2))
    # The planner reads that file's inter level as the link between nodes.
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(result))
    cluster = make_cluster("1xcpu", nodes=2, probe=str(path), cpu=CpuFacts("test cpu", lambda key: 1e11))
    largest = inter["collectives"]["all_reduce"][-1]
    assert cluster.inter.bandwidth_gbs == pytest.approx(largest["busbw_gbs"])
    assert cluster.inter.latency_us == pytest.approx(inter["collectives"]["all_reduce"][0]["seconds"] * 1e6 / 2)
    assert cluster.intra.name == "shm" and "(measured)" not in cluster.intra.description
    assert set(comm["collectives"]) == set(probe_comm.COLLECTIVES)
    for name, rows in comm["collectives"].items():
        assert [row["bytes"] for row in rows] == [1024, 65536]
        for row in rows:
            assert row["seconds"] > 0 and row["algbw_gbs"] > 0
            assert row["algbw_gbs"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
            assert row["busbw_gbs"] == pytest.approx(row["algbw_gbs"] * probe_comm.bus_bandwidth_factor(name, 2))
            assert row["busbw_gbs"] > 0
