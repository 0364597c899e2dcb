"""CUDA-only code paths, checked for equivalence on a real GPU (skipped without one).

Run by `slipstream bench gpu` (item cuda-tests); on a CPU machine every test here skips.
TF32 and fp8 train like fp32 / bf16 within a stated tolerance and really change the
matmuls; the pinned-memory prefetch thread hands out the same batches as the CPU loader,
pinned, on the device, and resumes exactly; a training step's memory phases come from the
CUDA allocator's statistics and the allocator snapshot is written.
"""

import json

import pytest
import torch

from slipstream.config import load_config
from slipstream.data import TokenLoader
from slipstream.train.lm import build_lm_trainer, train_lm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (run `slipstream bench gpu` on a GPU machine)")

BATCH, SEQ = 4, 32


@pytest.fixture(autouse=True)
def _restore_tf32():
    """The trainer sets TF32 process-wide: every test leaves the flags as it found them."""
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def cuda_run(tiny_overrides, run_dir, *extra):
    """The conftest's tiny run on CUDA (not in deterministic mode: that is a CPU-exactness switch)."""
    keep = [o for o in tiny_overrides if not o.startswith(("--run.dir=", "--train.deterministic="))]
    return keep + [f"--run.dir={run_dir}", "--train.device=cuda", "--train.deterministic=false", *extra]


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def assert_close_losses(got, want, rel):
    assert got.keys() == want.keys()
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= rel, f"largest relative loss difference {worst:.2e} > {rel:g}"


def test_tf32_switch_changes_fp32_matmuls_and_trains_like_fp32(tiny_overrides, tmp_path):
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("TF32 tensor cores need compute capability >= 8.0")
    train_lm(load_config(None, cuda_run(tiny_overrides, tmp_path / "fp32", "--precision.tf32=false")))
    assert torch.backends.cuda.matmul.allow_tf32 is False
    train_lm(load_config(None, cuda_run(tiny_overrides, tmp_path / "tf32", "--precision.tf32=true")))
    assert torch.backends.cuda.matmul.allow_tf32 is True and torch.backends.cudnn.allow_tf32 is True
    assert_close_losses(losses(tmp_path / "tf32"), losses(tmp_path / "fp32"), 1e-2)

    # The switch reaches cuBLAS: a TF32 matmul (10-bit mantissa) is measurably less exact than fp32.
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(1024, 1024, device="cuda", generator=g)
    b = torch.randn(1024, 1024, device="cuda", generator=g)
    exact = (a.double() @ b.double())
    errors = {}
    for enabled in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = enabled
        errors[enabled] = ((a @ b).double() - exact).abs().max().item()
    assert errors[True] > 10 * errors[False], errors


def test_fp8_linears_train_like_bf16(tiny_overrides, tmp_path):
    pytest.importorskip("torchao", reason="fp8 training uses torchao, not installed here")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 matmuls need compute capability >= 8.9")
    bf16 = ("--precision.autocast=bf16",)
    train_lm(load_config(None, cuda_run(tiny_overrides, tmp_path / "bf16", *bf16)))
    cfg = load_config(None, cuda_run(tiny_overrides, tmp_path / "fp8", *bf16, "--precision.fp8=true"))
    trainer = build_lm_trainer(cfg)
    converted = [name for name, m in trainer.model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert converted, "no nn.Linear was converted to float8"
    assert not any(name.endswith("lm_head") for name in converted)  # the head stays in high precision
    trainer.fit()
    assert_close_losses(losses(tmp_path / "fp8"), losses(tmp_path / "bf16"), 5e-2)


def _take(loader, n):
    it = iter(loader)
    return [tuple(t.cpu() for t in next(it)) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


def test_pinned_prefetch_gives_the_cpu_batches_and_resumes(data_dir):
    reference = _take(TokenLoader(data_dir, "train", BATCH, SEQ, seed=3), 8)
    first = TokenLoader(data_dir, "train", BATCH, SEQ, seed=3, device="cuda", pin_memory=True, prefetch=2)
    assert first._prefetch and first._pin  # the CUDA path: read-ahead thread + pinned host batches
    assert first._host_batch(0).is_pinned()
    x, y = next(iter(first))
    assert x.is_cuda and y.is_cuda and x.shape == (BATCH, SEQ)
    first.close()
    loader = TokenLoader(data_dir, "train", BATCH, SEQ, seed=3, device="cuda", pin_memory=True, prefetch=2)
    assert _same(_take(loader, 4), reference[:4])
    state = loader.state_dict()
    assert _same(_take(loader, 2), reference[4:6])
    loader.load_state_dict(state)  # drops the batches read ahead
    assert _same(_take(loader, 4), reference[4:8])
    loader.close()
    unpinned = TokenLoader(data_dir, "train", BATCH, SEQ, seed=3, device="cuda", pin_memory=False, prefetch=0)
    assert _same(_take(unpinned, 8), reference)
    unpinned.close()


def test_memory_phases_come_from_the_cuda_allocator_and_the_snapshot_is_written(tiny_overrides, tmp_path):
    run = tmp_path / "mem"
    trainer = build_lm_trainer(load_config(None, cuda_run(
        tiny_overrides, run, "--train.max_steps=4", "--train.eval_interval=0", "--metrics.memory_breakdown=true",
        "--metrics.memory_snapshot=true")))
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    summary = trainer.fit()
    memory = summary["memory"]
    assert memory["method"] == "cuda_stats"
    phases = memory["phases"]
    assert set(phases) == {"forward", "backward", "optimizer"}
    assert all(p["peak_bytes"] > 0 for p in phases.values())
    assert memory["peak_bytes"] == max(p["peak_bytes"] for p in phases.values())
    # Parameters, gradients and Adam state live on the device: the step's peak holds at least them.
    assert memory["peak_bytes"] >= 3 * params
    snapshots = list(run.glob("memory_snapshot*.pickle"))
    assert len(snapshots) == 1 and snapshots[0].stat().st_size > 0
    assert snapshots[0].read_bytes()[:1] == b"\x80"  # a pickle (protocol >= 2), for pytorch.org/memory_viz


def test_a_meta_model_initialized_on_the_host_trains_on_the_gpu(tiny_overrides, tmp_path):
    """parallelize moves a replicated model to the rank's device after init_model, wherever the
    init function allocated it (here: on the host)."""
    from slipstream import Trainer
    from slipstream.models.transformer import Transformer, lm_loss, materialize

    # A user's model and data: the vocabulary is the caller's, not resolved from prepared shards.
    cfg = load_config(None, cuda_run(tiny_overrides, tmp_path / "run", "--train.max_steps=2", "--model.vocab_size=256"))
    with torch.device("meta"):
        model = Transformer(cfg.model)
    data = torch.utils.data.TensorDataset(torch.randint(0, cfg.model.vocab_size, (16, SEQ + 1)))
    trainer = Trainer(model, data, lambda m, b: lm_loss(m(b[0][:, :-1]), b[0][:, 1:].contiguous()), config=cfg,
                      init_model=lambda m: materialize(m, "cpu", seed=3))
    assert all(p.device.type == "cuda" for p in trainer.model.parameters())
    trainer.fit()
