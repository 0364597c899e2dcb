"""Trainer: grad-accumulation equivalence, exact resume, schedules, run directory contract,
and the generic Python API on a non-transformer model."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from slipstream import Trainer
from slipstream.checkpoint import manager as ckpt
from slipstream.config import load_config
from slipstream.config.schema import OptimConfig
from slipstream.errors import UserError
from slipstream.models.transformer import build_model, lm_loss
from slipstream.train.lm import build_lm_trainer, train_lm
from slipstream.train.schedule import lr_multiplier

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "step_time_s", "data_wait_s", "tokens_per_s", "mfu", "mem_peak_bytes"}


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


# --- gradient accumulation -------------------------------------------------------------------

def _token_dataset(n=16, seq=16, vocab=257, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _grads_after_accumulation(micro_batch, accum, tmp_path):
    cfg = load_config(None, ["--model.preset=tiny", "--train.seq_len=16", f"--train.micro_batch_size={micro_batch}",
                             f"--train.grad_accum_steps={accum}", f"--run.dir={tmp_path}"])
    model_cfg = dataclasses.replace(cfg.model, vocab_size=257)
    model = build_model(model_cfg, "cpu", seed=3)
    # shuffle=False via val-style loader semantics: a plain DataLoader in order is enough here
    trainer = Trainer(model, _token_dataset(), lambda m, b: lm_loss(m(b[0]), b[1]), config=cfg)
    ordered = iter(torch.utils.data.DataLoader(_token_dataset(), batch_size=micro_batch, shuffle=False))
    trainer.accumulate_gradients(ordered)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_grad_accumulation_equals_big_batch(tmp_path):
    big = _grads_after_accumulation(8, 1, tmp_path / "a")
    accumulated = _grads_after_accumulation(2, 4, tmp_path / "b")
    for name in big:
        torch.testing.assert_close(accumulated[name], big[name], rtol=1e-5, atol=1e-7, msg=name)


# --- the LM run: contract and exact resume ---------------------------------------------------

def test_run_directory_contract(tiny_overrides, tmp_path):
    cfg = load_config(None, tiny_overrides)
    summary = train_lm(cfg)
    run = tmp_path / "run"
    for name in ("config.toml", "env.json", "metrics.jsonl", "summary.json"):
        assert (run / name).is_file(), name
    assert any((run / "tensorboard").iterdir())
    records = read_metrics(run)
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == list(range(1, 13))
    for r in train_records:
        assert METRIC_KEYS <= r.keys()
        assert r["tokens_per_s"] > 0 and r["mem_peak_bytes"] > 0 and r["step_time_s"] > 0
        assert r["mfu"] is None or 0 < r["mfu"] < 1
    assert [r["step"] for r in records if "val_loss" in r] == [6, 12]
    assert summary["checkpoint"] and ckpt.is_complete(ckpt.resolve_checkpoint(run))
    resolved = load_config(run / "config.toml")
    assert resolved.model.vocab_size == 257  # the resolved config records the data's vocabulary
    env = json.loads((run / "env.json").read_text())
    assert "torch" in json.dumps(env)
    assert train_records[-1]["loss"] < train_records[0]["loss"]
    # step 2 is measured by phase and category (issue: memory breakdown in metrics and summary)
    measured = [r for r in train_records if "mem_step_peak_bytes" in r]
    assert [r["step"] for r in measured] == [2]
    m = measured[0]
    assert m["mem_params_bytes"] == 4 * sum(p.numel() for p in build_lm_trainer(cfg).model.parameters())
    assert m["mem_optim_state_bytes"] >= 2 * m["mem_params_bytes"] and m["mem_activations_bytes"] > 0
    assert summary["memory"]["step"] == 2 and set(summary["memory"]["phases"]) == {"forward", "backward", "optimizer"}


class Crash(RuntimeError):
    pass


@pytest.mark.parametrize("log_interval, ckpt_interval, crash_step", [(1, 5, 8), (5, 4, 9)])
def test_resume_is_bitwise_identical(tiny_overrides, tmp_path, log_interval, ckpt_interval, crash_step):
    """Kill a run mid-step, resume it: it logs the same losses as the uninterrupted run,
    also when the checkpoint falls inside a logging interval."""
    extra = [f"--logging.log_interval={log_interval}", f"--checkpoint.interval={ckpt_interval}"]
    straight = tmp_path / "straight"
    train_lm(load_config(None, tiny_overrides + extra + [f"--run.dir={straight}"]))

    crashed = tmp_path / "crashed"
    cfg = load_config(None, tiny_overrides + extra + [f"--run.dir={crashed}"])
    trainer = build_lm_trainer(cfg)
    calls = {"n": 0}
    real_loss = trainer.loss_fn

    def crashing_loss(model, batch):
        calls["n"] += model.training  # count training micro-batches only (not eval)
        if calls["n"] == crash_step and model.training:
            raise Crash()
        return real_loss(model, batch)

    trainer.loss_fn = crashing_loss
    with pytest.raises(Crash):
        trainer.fit()
    last_saved = (crash_step - 1) // ckpt_interval * ckpt_interval
    assert ckpt.list_checkpoints(crashed / "checkpoints")[-1].name == f"step_{last_saved:08d}"

    resumed = train_lm(load_config(None, tiny_overrides + extra + [f"--run.dir={crashed}",
                                                                   "--checkpoint.resume=auto"]))
    assert resumed["steps_this_run"] == 12 - last_saved
    a, b = train_losses(straight), train_losses(crashed)
    assert a.keys() == b.keys() and max(a) == 12
    assert all(a[s] == b[s] for s in a), {s: (a[s], b[s]) for s in a if a[s] != b[s]}
    final_a = ckpt.resolve_checkpoint(straight)
    final_b = ckpt.resolve_checkpoint(crashed)
    model_a, model_b = build_lm_trainer(load_config(None, tiny_overrides)).model, build_lm_trainer(
        load_config(None, tiny_overrides)).model
    ckpt.load_checkpoint(final_a, model_a)
    ckpt.load_checkpoint(final_b, model_b)
    for (name, pa), pb in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert torch.equal(pa, pb), name


def test_resume_edge_cases(tiny_overrides, tmp_path):
    run = tmp_path / "run"
    train_lm(load_config(None, tiny_overrides + ["--checkpoint.interval=4"]))  # checkpoints 4, 8, 12
    # nothing left to train: a clear error, not a silent no-op
    with pytest.raises(UserError, match="not below train.max_steps"):
        train_lm(load_config(None, tiny_overrides + ["--checkpoint.resume=auto"]))
    # resuming an older checkpoint inside the same run would interleave two histories
    with pytest.raises(UserError, match="newer than 'step_00000008'"):
        train_lm(load_config(None, tiny_overrides + [f"--checkpoint.resume={run}/checkpoints/step_00000008"]))
    # a crash can leave a cut-off last line in metrics.jsonl: resume skips it
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "lo')
    summary = train_lm(load_config(None, tiny_overrides + ["--checkpoint.resume=auto", "--train.max_steps=14"]))
    assert summary["steps_this_run"] == 2
    assert max(train_losses(run)) == 14


def test_moved_bpe_tokenizer_does_not_break_training(tmp_path, corpus_file):
    """prepare copies a bpe tokenizer into the data folder: the original file may move."""
    from slipstream.data import prepare_dataset, train_bpe

    tok = tmp_path / "tok.json"
    train_bpe([str(corpus_file)], str(tok), vocab_size=300)
    prepare_dataset([str(corpus_file)], f"bpe:{tok}", str(tmp_path / "data"), val_fraction=0.1, progress=False)
    tok.rename(tmp_path / "moved.json")
    summary = train_lm(load_config(None, [
        "--model.preset=tiny", f"--data.dir={tmp_path / 'data'}", f"--run.dir={tmp_path / 'run'}",
        "--train.max_steps=2", "--train.micro_batch_size=2", "--train.seq_len=16", "--logging.progress=false"]))
    assert (Path(summary["checkpoint"]) / "tokenizer.json").is_file()
    assert load_config(tmp_path / "run" / "config.toml").data.tokenizer == f"bpe:{tok}"


def test_bad_run_dir_fails_before_any_work(tiny_overrides, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="not a folder"):
        train_lm(load_config(None, tiny_overrides + [f"--run.dir={blocker}"]))


def test_existing_checkpoints_need_resume(tiny_overrides, tmp_path):
    train_lm(load_config(None, tiny_overrides + ["--train.max_steps=2"]))
    with pytest.raises(UserError, match="resume=auto"):
        train_lm(load_config(None, tiny_overrides + ["--train.max_steps=3"]))
    summary = train_lm(load_config(None, tiny_overrides + ["--train.max_steps=3", "--checkpoint.resume=auto"]))
    assert summary["steps_this_run"] == 1


def test_keep_last_and_incomplete_checkpoints_ignored(tiny_overrides, tmp_path):
    run = tmp_path / "run"
    train_lm(load_config(None, tiny_overrides + ["--checkpoint.interval=2", "--checkpoint.keep_last=2"]))
    names = [p.name for p in ckpt.list_checkpoints(run / "checkpoints")]
    assert names == ["step_00000010", "step_00000012"]
    # A save interrupted before its COMPLETE marker is invisible to resume.
    broken = run / "checkpoints" / "step_00000099"
    broken.mkdir()
    (broken / "meta.json").write_text("{}")
    assert ckpt.resolve_checkpoint(run).name == "step_00000012"
    with pytest.raises(UserError, match="incomplete"):
        ckpt.resolve_checkpoint(broken)


def test_damaged_checkpoint_is_a_clear_error(tiny_overrides, tmp_path):
    run = tmp_path / "run"
    train_lm(load_config(None, tiny_overrides + ["--train.max_steps=2"]))
    path = ckpt.resolve_checkpoint(run)
    for shard in (path / "model_optim").glob("*.distcp"):
        shard.write_bytes(b"garbage")
    with pytest.raises(UserError, match="damaged"):
        train_lm(load_config(None, tiny_overrides + ["--train.max_steps=3", f"--checkpoint.resume={path}"]))


def test_bf16_autocast_trains_close_to_fp32(tiny_overrides, tmp_path):
    fp32 = train_lm(load_config(None, tiny_overrides + [f"--run.dir={tmp_path / 'fp32'}"]))
    bf16 = train_lm(load_config(None, tiny_overrides + [f"--run.dir={tmp_path / 'bf16'}", "--precision.autocast=bf16"]))
    assert abs(fp32["final_loss"] - bf16["final_loss"]) < 0.05 * fp32["final_loss"]


# --- schedules -------------------------------------------------------------------------------------

def test_schedules():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert lr_multiplier(0, cfg, 100) == pytest.approx(0.1)
    assert lr_multiplier(9, cfg, 100) == pytest.approx(1.0)
    assert lr_multiplier(10, cfg, 100) == pytest.approx(1.0)
    assert lr_multiplier(55, cfg, 100) == pytest.approx(0.55)
    assert lr_multiplier(100, cfg, 100) == pytest.approx(0.1)
    wsd = dataclasses.replace(cfg, schedule="wsd", decay_fraction=0.2)
    assert lr_multiplier(50, wsd, 100) == 1.0 and lr_multiplier(79, wsd, 100) == 1.0
    assert lr_multiplier(99, wsd, 100) == pytest.approx(0.1)
    assert 0.1 < lr_multiplier(90, wsd, 100) < 1.0
    const = dataclasses.replace(cfg, schedule="constant")
    assert lr_multiplier(99, const, 100) == 1.0


def test_weight_decay_groups():
    from slipstream.train.setup import param_groups

    model = build_model(dataclasses.replace(load_config(None, ["--model.preset=tiny", "--train.seq_len=16"]).model,
                                            vocab_size=257), "cpu", seed=0)
    decay, no_decay = param_groups(model, 0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


# --- the Python API on a user's own model -------------------------------------------------------

class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.head = nn.Linear(8 * 4 * 4, 3)

    def forward(self, x):
        return self.head(F.max_pool2d(F.relu(self.conv(x)), 2).flatten(1))


def _image_dataset(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (n,), generator=g)
    images = torch.randn(n, 1, 8, 8, generator=g) * 0.3
    for i, label in enumerate(labels):  # each class lights up its own row band: learnable
        images[i, 0, 2 * label: 2 * label + 2] += 1.0
    return torch.utils.data.TensorDataset(images, labels)


def test_trainer_trains_a_users_cnn(tmp_path):
    cfg = load_config(None, ["--train.max_steps=40", "--train.micro_batch_size=16", f"--run.dir={tmp_path / 'cnn'}",
                             "--optim.lr=0.01", "--optim.warmup_steps=2", "--logging.log_interval=5",
                             "--logging.progress=false", "--train.eval_interval=20", "--train.eval_steps=2"])
    model = SmallCNN()
    trainer = Trainer(model, _image_dataset(), lambda m, b: F.cross_entropy(m(b[0]), b[1]), config=cfg,
                      val_data=_image_dataset(n=32, seed=1))
    summary = trainer.fit()
    records = read_metrics(tmp_path / "cnn")
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < 0.5 * losses[0]
    assert summary["val_loss"] is not None and summary["val_loss"] < 1.0
    assert summary["mfu"] is None  # no FLOPs given: never a made-up number
    assert ckpt.is_complete(ckpt.resolve_checkpoint(tmp_path / "cnn"))

    # and it resumes: a second fit continues from the final checkpoint
    cfg2 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=45),
                               checkpoint=dataclasses.replace(cfg.checkpoint, resume="auto"))
    more = Trainer(SmallCNN(), _image_dataset(), lambda m, b: F.cross_entropy(m(b[0]), b[1]), config=cfg2).fit()
    assert more["steps"] == 45 and more["steps_this_run"] == 5


def test_non_finite_loss_stops_with_clear_error(tmp_path):
    cfg = load_config(None, ["--train.max_steps=5", "--train.micro_batch_size=8", f"--run.dir={tmp_path}",
                             "--logging.log_interval=1", "--logging.progress=false", "--train.eval_steps=0"])
    trainer = Trainer(SmallCNN(), _image_dataset(), lambda m, b: m(b[0]).sum() * math.inf, config=cfg)
    with pytest.raises(UserError, match="loss became"):
        trainer.fit()


def test_host_syncs_only_at_logging_interval(tiny_overrides, monkeypatch):
    """Reading a tensor's value on the host (.item/.tolist/float) is a device sync on GPUs;
    the loop may do that only when it logs (and evaluates), never inside a plain step."""
    cfg = load_config(None, tiny_overrides + ["--train.max_steps=10", "--logging.log_interval=5",
                                              "--train.eval_steps=0", "--checkpoint.save_final=false"])
    trainer = build_lm_trainer(cfg)
    reads = []
    for name in ("item", "tolist", "__float__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *a, _original=original, _name=name, **k):
            reads.append((trainer.step, _name))
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counting)
    trainer.fit()
    assert reads, "the loop must read the loss at the logging interval"
    assert {step for step, _ in reads} <= {5, 10}, reads
