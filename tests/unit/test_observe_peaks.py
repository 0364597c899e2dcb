"""Tests for slipstream.observe.peaks: GPU table rules (plan/gpus.py; no GPU needed) and the cached CPU probe."""

import json
import time
import warnings

import pytest
import torch

from slipstream.errors import UserError
from slipstream.observe import peaks
from slipstream.plan import gpus  # the datasheet table (the blocks layer); peaks reads it


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
        ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
        ("NVIDIA H100 NVL", "NVIDIA H100 NVL"),
        ("NVIDIA H200", "NVIDIA H200 SXM"),
        ("NVIDIA H200 NVL", "NVIDIA H200 NVL"),
        ("NVIDIA GH200 480GB", "NVIDIA GH200 96GB HBM3"),
        ("NVIDIA GH200 144G HBM3e", "NVIDIA GH200 144GB HBM3e"),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 SXM 80GB"),
        ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 SXM 40GB"),
        ("NVIDIA A100-PCIE-40GB", "NVIDIA A100 PCIe 40GB"),
        ("NVIDIA A100 80GB PCIe", "NVIDIA A100 PCIe 80GB"),
        ("NVIDIA B200", "NVIDIA B200"),
        ("NVIDIA B100", "NVIDIA B100"),
        ("NVIDIA L40S", "NVIDIA L40S"),
        ("NVIDIA L40", "NVIDIA L40"),
        ("NVIDIA L4", "NVIDIA L4"),
        ("NVIDIA A10", "NVIDIA A10"),
        ("NVIDIA A10G", "NVIDIA A10G"),
        ("Tesla V100-SXM2-16GB", "NVIDIA V100 SXM2 16GB"),
        ("Tesla V100-SXM2-32GB", "NVIDIA V100 SXM2 32GB"),
        ("Tesla V100-PCIE-16GB", "NVIDIA V100 PCIe 16GB"),
        ("Tesla T4", "NVIDIA T4"),
        ("NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 3090"),
        ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090"),
        ("NVIDIA RTX A6000", "NVIDIA RTX A6000"),
        ("NVIDIA RTX 6000 Ada Generation", "NVIDIA RTX 6000 Ada"),
    ],
)
def test_lookup_real_device_names(name, expected):
    spec = gpus.lookup_gpu(name)
    assert spec is not None and spec.name == expected


def test_pcie_and_sxm_are_told_apart():
    sxm, pcie = gpus.lookup_gpu("NVIDIA H100 80GB HBM3"), gpus.lookup_gpu("NVIDIA H100 PCIe")
    assert sxm.peaks["bf16"] == 989 and pcie.peaks["bf16"] == 756
    assert sxm.mem_bw_gbs > pcie.mem_bw_gbs
    a100_pcie_80 = gpus.lookup_gpu("NVIDIA A100 80GB PCIe")
    a100_sxm_80 = gpus.lookup_gpu("NVIDIA A100-SXM4-80GB")
    assert a100_pcie_80.mem_bw_gbs == 1935 and a100_sxm_80.mem_bw_gbs == 2039


def test_near_miss_names_are_unknown_not_wrong():
    # GB200/GH200 must not be read as B200/H200, nor a Turing Quadro as the Ada RTX 6000.
    assert gpus.lookup_gpu("NVIDIA GB200") is None
    assert gpus.lookup_gpu("NVIDIA GH200 480GB").name.startswith("NVIDIA GH200")
    assert gpus.lookup_gpu("Quadro RTX 6000") is None
    assert gpus.lookup_gpu("NVIDIA A100-SXM4-80GB").name != "NVIDIA A10"


def test_table_is_dense_and_consistent():
    for _, spec in gpus._GPU_TABLE:
        assert set(spec.peaks) <= set(gpus.DTYPE_KEYS)
        assert spec.peaks["fp32"] > 0 and spec.memory_gib > 0 and spec.mem_bw_gbs > 0
        if "bf16" in spec.peaks:
            assert spec.peaks["bf16"] >= spec.peaks["tf32"] >= spec.peaks["fp32"] * 0.99
    # Dense datasheet numbers, not the "with sparsity" ones.
    assert gpus.lookup_gpu("NVIDIA A100-SXM4-80GB").peaks["bf16"] == 312
    assert gpus.lookup_gpu("NVIDIA H200").peaks["bf16"] == 989
    assert gpus.lookup_gpu("NVIDIA B200").peaks["bf16"] == 2250


def test_gpu_peak_flops_known():
    flops, source = peaks.gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert flops == 989e12
    assert "H100" in source


def test_unknown_gpu_warns_and_returns_none():
    with pytest.warns(UserWarning, match=r"--metrics\.peak_tflops"):
        flops, source = peaks.gpu_peak_flops("NVIDIA Imaginary X9000", "bf16")
    assert flops is None
    assert "unknown gpu" in source and "X9000" in source


def test_missing_dtype_on_known_gpu_warns_and_returns_none():
    with pytest.warns(UserWarning, match="bf16"):
        flops, _ = peaks.gpu_peak_flops("Tesla V100-SXM2-16GB", "bf16")
    assert flops is None


def test_device_peak_flops_cuda_uses_device_name(monkeypatch):
    # No CUDA here: stand in for the one torch.cuda call the CUDA path makes.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    flops, source = peaks.device_peak_flops("cuda:0", "bf16")
    assert flops == 989e12 and "H200" in source


def test_user_peak_wins_and_is_validated():
    assert peaks.device_peak_flops("cpu", "bf16", user_peak_tflops=100.0) == (100e12, "user")
    with pytest.raises(UserError, match="peak_tflops"):
        peaks.device_peak_flops("cpu", "bf16", user_peak_tflops=0.0)
    with pytest.raises(UserError, match="dtype"):
        peaks.device_peak_flops("cpu", "int4")


def test_other_device_type_warns_and_returns_none():
    with pytest.warns(UserWarning, match="peak_tflops"):
        flops, _ = peaks.device_peak_flops("meta", "fp32")
    assert flops is None


# ------------------------------------------------------------------------ CPU probe


@pytest.fixture
def fake_measure(monkeypatch):
    calls = []

    def measure(dtype):
        calls.append(dtype)
        return 1.5e11

    monkeypatch.setattr(peaks, "_measure_matmul_flops", measure)
    return calls


def test_cpu_probe_real_measurement_is_plausible(tmp_path):
    flops = peaks.cpu_peak_flops("fp32", cache_dir=str(tmp_path), force=True)
    # Anything from a slow laptop core to a big server socket.
    assert 1e9 < flops < 1e15


def test_cpu_probe_is_cached(tmp_path, fake_measure):
    first = peaks.cpu_peak_flops("fp32", cache_dir=str(tmp_path))
    second = peaks.cpu_peak_flops("fp32", cache_dir=str(tmp_path))
    assert first == second == 1.5e11
    assert len(fake_measure) == 1
    peaks.cpu_peak_flops("fp32", cache_dir=str(tmp_path), force=True)
    assert len(fake_measure) == 2
    # A different dtype is a different cache entry.
    peaks.cpu_peak_flops("bf16", cache_dir=str(tmp_path))
    assert fake_measure[-1] == torch.bfloat16

    data = json.loads((tmp_path / peaks.CACHE_FILE_NAME).read_text())
    keys = list(data["entries"])
    assert any(f"threads={torch.get_num_threads()}" in k and torch.__version__ in k for k in keys)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_device_peak_flops_cpu_reports_source(tmp_path, fake_measure):
    flops, source = peaks.device_peak_flops("cpu", "fp32", cache_dir=str(tmp_path))
    assert flops == 1.5e11 and "measured" in source
    _, source = peaks.device_peak_flops(torch.device("cpu"), "fp32", cache_dir=str(tmp_path))
    assert "cached" in source


def test_corrupt_cache_is_ignored_and_rewritten(tmp_path, fake_measure):
    cache = tmp_path / peaks.CACHE_FILE_NAME
    cache.write_text("{ this is not json")
    assert peaks.cpu_peak_flops("fp32", cache_dir=str(tmp_path)) == 1.5e11
    assert len(fake_measure) == 1
    assert json.loads(cache.read_text())["version"] == peaks.CACHE_VERSION

    # A well-formed file with a nonsense entry is re-measured too.
    data = json.loads(cache.read_text())
    for entry in data["entries"].values():
        entry["flops"] = -1
    cache.write_text(json.dumps(data))
    peaks.cpu_peak_flops("fp32", cache_dir=str(tmp_path))
    assert len(fake_measure) == 2


def test_cache_dir_from_environment(tmp_path, monkeypatch, fake_measure):
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "c"))
    peaks.cpu_peak_flops("fp32")
    assert (tmp_path / "c" / peaks.CACHE_FILE_NAME).exists()


def test_tf32_measures_fp32_and_unsupported_fp16_falls_back(tmp_path, fake_measure, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tf32 -> fp32 on CPU is expected, not worth a warning
        peaks.cpu_peak_flops("tf32", cache_dir=str(tmp_path))
    assert fake_measure[-1] == torch.float32

    monkeypatch.setattr(peaks, "_supports_matmul", lambda dtype: dtype == torch.float32)
    with pytest.warns(UserWarning, match="fp32"):
        peaks.cpu_peak_flops("fp16", cache_dir=str(tmp_path))
    assert fake_measure[-1] == torch.float32


def test_unwritable_cache_still_returns_measurement(tmp_path, fake_measure):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the cache directory should be
    with pytest.warns(UserWarning, match="cache"):
        assert peaks.cpu_peak_flops("fp32", cache_dir=str(blocker / "sub")) == 1.5e11


def test_probe_stays_within_budget_on_a_slow_cpu(monkeypatch):
    real_mm = torch.mm

    def slow_mm(*args, **kwargs):
        time.sleep(0.1)
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", slow_mm)
    monkeypatch.setattr(peaks, "PROBE_BUDGET_S", 0.5)
    t0 = time.perf_counter()
    flops = peaks._measure_matmul_flops(torch.float32)
    assert flops > 0
    assert time.perf_counter() - t0 < 0.75  # skipped the 2048 size instead of spending 8x longer
