"""The metrics contract (issue 12): every logged number is what its name says, with a known peak.

With a patched peak (metrics.peak_tflops, or the device-peak function) every training record of
metrics.jsonl satisfies
    mfu            == tokens_per_s * flops_per_token / peak          (world 1: per device = job)
    tokens         == the tokens counter: micro-batch tokens x steps so far
    tokens_per_s   == the interval's tokens / the interval's wall time == tokens / (step_time_s x steps)
and the wall time is real: the loss function sleeps a known time per step, so step_time_s can
neither be shorter than that nor much longer than the fit. The summary agrees with the records,
and the run's env.json carries the torch version that ran.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from slipstream import Trainer
from slipstream.config import load_config
from slipstream.models.transformer import build_model, lm_loss

MICRO, SEQ, STEPS, LOG_EVERY = 2, 16, 4, 2
SLEEP_S = 0.02  # per training step, inside the loss function: a floor for the measured step time
TINY = ["--model.preset=tiny", "--model.vocab_size=64", f"--train.seq_len={SEQ}", f"--train.max_steps={STEPS}",
        f"--train.micro_batch_size={MICRO}", "--train.eval_steps=0", "--logging.progress=false",
        f"--logging.log_interval={LOG_EVERY}", "--logging.tensorboard=false", "--metrics.memory_breakdown=false",
        "--checkpoint.save_final=false", "--optim.warmup_steps=1"]


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (32, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:])


def _slow_loss(model, batch):
    if model.training:
        time.sleep(SLEEP_S)
    return lm_loss(model(batch[0]), batch[1])


def _run(tmp_path, *extra):
    cfg = load_config(None, TINY + list(extra) + [f"--run.dir={tmp_path / 'run'}"])
    model = build_model(cfg.model, "cpu", seed=0)
    fpt = 6.0 * sum(p.numel() for p in model.parameters())  # any value: the contract is about the arithmetic
    trainer = Trainer(model, _data(), _slow_loss, config=cfg,
                      tokens_per_batch=MICRO * SEQ, flops_per_token=fpt)
    t0 = time.perf_counter()
    summary = trainer.fit()
    fit_s = time.perf_counter() - t0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "loss" in r]
    return summary, records, fpt, fit_s


def _check_contract(summary, records, fpt, peak_flops, fit_s):
    assert [r["step"] for r in records] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    prev_step, prev_tokens, timed = 0, 0, 0.0
    for r in records:
        steps = r["step"] - prev_step
        tokens = r["tokens"] - prev_tokens
        assert r["tokens"] == r["step"] * MICRO * SEQ, r
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / peak_flops, rel=1e-12), r
        interval_s = r["step_time_s"] * steps
        assert r["tokens_per_s"] == pytest.approx(tokens / interval_s, rel=1e-9), r
        assert r["step_time_s"] >= SLEEP_S, r  # the sleeps are inside the timed step
        prev_step, prev_tokens, timed = r["step"], r["tokens"], timed + interval_s
    assert timed <= fit_s, (timed, fit_s)  # the intervals' wall times fit inside the fit() call
    # The summary: speed over all timed intervals, the mean of the logged MFU values, the counters.
    assert summary["tokens"] == records[-1]["tokens"] == STEPS * MICRO * SEQ
    assert summary["tokens_per_s"] == pytest.approx(summary["tokens"] / timed, rel=1e-9)
    assert summary["mfu"] == pytest.approx(sum(r["mfu"] for r in records) / len(records), rel=1e-12)


def test_records_follow_the_contract_with_a_configured_peak(tmp_path):
    summary, records, fpt, fit_s = _run(tmp_path, "--metrics.peak_tflops=0.25")
    _check_contract(summary, records, fpt, 0.25e12, fit_s)
    env = json.loads((tmp_path / "run" / "env.json").read_text())
    assert env["torch_version"] == torch.__version__
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["mfu"] == pytest.approx(summary["mfu"], rel=1e-12) and saved["tokens"] == summary["tokens"]


def test_records_follow_the_contract_with_the_device_peak(tmp_path, monkeypatch):
    """Without metrics.peak_tflops the device's own peak (here patched: no CPU probe) is the denominator."""
    asked = []

    def fake_peak(device, dtype_key, user_peak_tflops=None, cache_dir=None):
        asked.append((torch.device(device).type, dtype_key, user_peak_tflops))
        return 3.5e11, "test"

    monkeypatch.setattr("slipstream.observe.peaks.device_peak_flops", fake_peak)
    summary, records, fpt, fit_s = _run(tmp_path)
    assert asked == [("cpu", "fp32", None)]
    _check_contract(summary, records, fpt, 3.5e11, fit_s)
