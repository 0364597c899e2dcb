"""Regression tests from the review of `tune lr`, `tune batch` and the noise scale: each one
failed before its fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from slipstream.config import load_config
from slipstream.tune import batch_finder, lr_finder
from slipstream.tune.noise_scale import measure_lm_noise_scale, measure_noise_scale

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")


@pytest.fixture
def one_thread(monkeypatch, request):
    """Overrides for one thread per process (two cores, often shared); this process's own thread
    count, which the in-process trainers set, comes back afterwards."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    request.addfinalizer(lambda threads=torch.get_num_threads(): torch.set_num_threads(threads))
    return ["--train.threads=1", "--train.device=cpu"]


# --- tune lr ---------------------------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_diverged_sweep_leaves_no_checkpoint_in_its_run_dir(tiny_overrides, one_thread, tmp_path):
    """The watcher stops a diverged sweep with SIGTERM. The training took that for a preemption and
    saved its diverged weights as a checkpoint in run.dir: `--checkpoint.resume=auto` would have
    continued from them, and the next sweep in that folder was refused ("already has checkpoints")."""
    # The loss breaks near lr 1, a sixth of the way: the training is still running when the watcher
    # stops it (a short sweep may end on its own before the watcher reads the divergence).
    steps = 400
    result = lr_finder.tune_lr(TINY, [*tiny_overrides, *one_thread], steps=steps, min_lr=0.3, max_lr=1e4)
    assert result["stopped_early"] and result["steps_run"] < steps, result["stop_reason"]
    run_dir = tmp_path / "run"
    assert (run_dir / "metrics.jsonl").is_file() and not list(run_dir.glob("checkpoints/step_*"))


def test_ctrl_c_during_a_sweep_stops_the_training_and_removes_the_temporary_folder(monkeypatch, tmp_path):
    """Ctrl-C while the sweep is watched: the training process is stopped and tune lr's temporary
    folder (logs, run directory) goes too (it stayed in /tmp)."""
    monkeypatch.setattr(lr_finder.tempfile, "tempdir", str(tmp_path))
    # A stand-in for the training: a process that would run for a minute.
    monkeypatch.setattr(lr_finder, "train_command", lambda args, nproc: [sys.executable, "-c",
                                                                         "import time; time.sleep(60)"])
    started = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(lr_finder.subprocess, "Popen", popen)
    polls = iter(range(100))
    real_inode = lr_finder._inode

    def interrupted(path):  # read once per poll of metrics.jsonl: Ctrl-C at the third
        if next(polls) == 3:
            raise KeyboardInterrupt
        return real_inode(path)

    monkeypatch.setattr(lr_finder, "_inode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lr_finder.tune_lr(TINY, ["--train.device=cpu"], steps=20)
    assert started and started[0].poll() is not None  # stopped, not left running
    assert not list(tmp_path.glob("slipstream-tune-lr-*"))


# --- tune batch --------------------------------------------------------------------------------------------------------

def _fake_trials(peak_bytes):
    """subprocess_trials' stand-in: loads the config exactly as the trial's `slipstream train` would
    (the overrides tune batch passes, then the trial settings) and reports `peak_bytes(micro_batch)`."""
    from slipstream.errors import UserError
    from slipstream.tune.process import override as _arg
    from slipstream.tune.system import TRIAL_SETTINGS

    def make(config_path, overrides, nproc, steps, work_dir):
        def run_trial(layout, timeout_s):
            settings = {**layout, **TRIAL_SETTINGS, "train.max_steps": steps, "run.dir": work_dir / "trial"}
            try:
                load_config(config_path, [*overrides, *(_arg(k, v) for k, v in settings.items())])
            except UserError as e:
                return {"error": f"error: {e}"}
            return peak_bytes(layout["train.micro_batch_size"])

        return run_trial

    return make


def test_tune_batch_works_with_a_config_that_stops_early(tiny_overrides, one_thread, monkeypatch):
    """A config with train.early_stop_patience: the trials and the noise measurement turn evaluation
    off, which the config rules refuse with early stopping on, so every trial "failed"."""
    monkeypatch.setattr(batch_finder, "subprocess_trials", _fake_trials(lambda mb: {"peak_bytes": 1}))
    result = batch_finder.tune_batch(TINY, [*tiny_overrides, *one_thread, "--train.early_stop_patience=2"],
                                     memory_gib=0.01, max_micro_batch=8, noise_rounds=2, noise_k=2)
    assert [t["status"] for t in result["tries"]] == ["ok"], result["tries"]
    assert result["micro_batch"] == 8 and result["noise"]["rounds"] == 2


def test_tune_batch_says_why_when_no_real_step_fits(tiny_overrides, one_thread, monkeypatch):
    monkeypatch.setattr(batch_finder, "subprocess_trials",
                        _fake_trials(lambda mb: {"error": "torch.OutOfMemoryError: CUDA out of memory"}))
    result = batch_finder.tune_batch(TINY, [*tiny_overrides, *one_thread], memory_gib=0.01, max_micro_batch=4,
                                     noise_rounds=0)
    assert [t["micro_batch"] for t in result["tries"]] == [4, 2, 1] and result["micro_batch"] is None
    assert any("even at micro-batch 1" in note for note in result["notes"]), result["notes"]
    assert "even at micro-batch 1" in batch_finder.format_batch_report(result)


def test_tune_batch_json_is_the_only_thing_on_stdout(tiny_overrides, one_thread, monkeypatch, capsys):
    """ensure_data prints notes (e.g. that a large data folder's shards are only size-checked) to
    stdout, in front of --json's object."""
    import json

    from slipstream.cli import main
    from slipstream.data import ensure

    real_ensure = ensure.ensure_data

    def noisy_ensure(cfg, check=True):
        print("note: data/big holds 40.0 GiB of shards; sizes checked only")
        return real_ensure(cfg, check)

    monkeypatch.setattr(ensure, "ensure_data", noisy_ensure)
    monkeypatch.setattr(batch_finder, "subprocess_trials", _fake_trials(lambda mb: {"peak_bytes": 1}))
    code = main(["tune", "batch", "--config", TINY, "--memory-gib", "0.01", "--max-micro-batch", "2",
                 "--noise-rounds", "0", "--json", *tiny_overrides, *one_thread])
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out)["micro_batch"] == 2, out


# --- the noise scale -------------------------------------------------------------------------------------------------

def _regression(n=2048, d=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    return torch.utils.data.TensorDataset(x, x @ torch.randn(d, generator=g) + torch.randn(n, generator=g))


def _mse(model, batch):
    return 0.5 * F.mse_loss(model(batch[0]).squeeze(-1), batch[1])


def test_noise_scale_with_the_optimizer_in_backward(one_thread):
    """optim.in_backward steps every parameter inside backward and frees its gradient: the
    measurement read no gradient (B_simple None) and moved the weights it was measuring."""
    base = ["--train.micro_batch_size=8", "--train.device=cpu", "--optim.grad_clip=0"]
    results, weights = [], []
    for extra in ([], ["--optim.in_backward=true"]):
        torch.manual_seed(0)
        model = nn.Linear(8, 1, bias=False)
        before = model.weight.detach().clone()
        results.append(measure_noise_scale(model, _regression(), _mse, load_config(None, [*base, *extra]),
                                           rounds=4, k=4))
        weights.append(torch.equal(model.weight.detach(), before))
    assert weights == [True, True]
    # Same weights, same batches: the same norms, whichever way the optimizer would step.
    assert results[1]["b_simple"] == pytest.approx(results[0]["b_simple"], rel=1e-5)


@pytest.mark.timeout(120)
def test_lm_noise_scale_of_a_multi_process_layout_is_measured_in_one_process(tiny_overrides, one_thread):
    """`tune batch --nproc 2` on a tensor-parallel config confirmed its micro-batch with real
    2-process steps, then failed measuring the noise in this one process ("tp x pp x cp = 2 does
    not divide the world size 1"; an FSDP config with its parameter dtype: an AssertionError).
    The model is whole in one process: the same numbers as the plain layout."""
    base = [*tiny_overrides, *one_thread, "--train.micro_batch_size=2"]
    plain = measure_lm_noise_scale(load_config(None, base), rounds=2, k=2)
    for layout in (["--parallel.tp=2"], ["--parallel.dp_strategy=fsdp", "--parallel.param_dtype=bf16"]):
        measured = measure_lm_noise_scale(load_config(None, [*base, *layout]), rounds=2, k=2)
        assert measured["small_sq_norm"] == pytest.approx(plain["small_sq_norm"], rel=1e-5), layout
        assert measured["big_sq_norm"] == pytest.approx(plain["big_sq_norm"], rel=1e-5), layout
