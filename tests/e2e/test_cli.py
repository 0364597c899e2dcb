"""End to end through the real CLI (subprocesses): prepare, train, resume, generate,
config show, and user errors (exit 2, one clear line, no traceback)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def slipstream(*args, cwd, check=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-m", "slipstream", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)
    if check and proc.returncode != 0:
        raise AssertionError(f"slipstream {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, corpus_file):
    work = tmp_path_factory.mktemp("e2e")
    docs = work / "docs"
    docs.mkdir()
    text = corpus_file.read_text()
    for i in range(4):
        (docs / f"part{i}.txt").write_text(text[i * len(text) // 4:(i + 1) * len(text) // 4])
    return work


def test_prepare_train_resume_generate(workspace):
    w = workspace
    slipstream("data", "train-tokenizer", "--input", "docs", "--vocab-size", "512", "--out", "tok.json", cwd=w)
    assert (w / "tok.json").is_file()
    slipstream("data", "prepare", "--input", "docs", "--tokenizer", "bpe:tok.json", "--out", "prepared",
               "--quiet", cwd=w)
    manifest = json.loads((w / "prepared" / "manifest.json").read_text())
    assert manifest["vocab_size"] == 512

    common = ["--config", ROOT / "configs" / "tiny.toml", "--data.dir=prepared", "--run.dir=run",
              "--logging.progress=false", "--checkpoint.interval=4"]
    out = slipstream("train", *common, "--train.max_steps=8", cwd=w).stdout
    assert "run summary" in out and "run" in out
    records = [json.loads(line) for line in (w / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 8

    # resume: same run directory, more steps, continues from the step-8 checkpoint
    out = slipstream("train", *common, "--train.max_steps=12", "--checkpoint.resume=auto", cwd=w).stdout
    assert "resumed from" in out and "step_00000008" in out
    records = [json.loads(line) for line in (w / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 12

    # eval: the checkpoint scored on every val window reproduces the run's own final evaluation
    summary = json.loads((w / "run" / "summary.json").read_text())
    assert summary["val_tokens"] > 0 and summary["val_loss_stderr"] > 0
    scored = json.loads(slipstream("eval", "--checkpoint", "run", "--json", cwd=w).stdout)
    assert scored["tokens"] == summary["val_tokens"] and not scored["sampled"]
    assert abs(scored["loss"] - summary["val_loss"]) < 1e-5
    sample = json.loads(slipstream("eval", "--checkpoint", "run", "--tokens", "2000", "--json", cwd=w).stdout)
    assert sample["sampled"] and sample["tokens"] <= 2000 and abs(sample["loss"] - scored["loss"]) < 3 * sample["stderr"]
    assert "val loss" in slipstream("eval", "--checkpoint", "run", cwd=w).stdout

    # generate from the run directory: the BPE tokenizer travels inside the checkpoint
    (w / "tok.json").rename(w / "tok-moved.json")
    gen = slipstream("generate", "--checkpoint", "run", "--prompt", "def main(", "--max-new-tokens", "20",
                     "--temperature", "0", cwd=w).stdout
    assert gen.startswith("def main(") and len(gen) > len("def main(")
    again = slipstream("generate", "--checkpoint", "run", "--prompt", "def main(", "--max-new-tokens", "20",
                       "--temperature", "0", cwd=w).stdout
    assert gen == again  # greedy decoding is deterministic


def test_config_show_prints_resolved_toml(workspace):
    out = slipstream("config", "show", "--config", ROOT / "configs" / "llama-tiny.toml", "--train.max_steps=77",
                     cwd=workspace).stdout
    import tomllib

    data = tomllib.loads(out)
    assert data["train"]["max_steps"] == 77
    assert data["model"]["position"] == "rope" and data["model"]["n_kv_head"] == 2


@pytest.mark.parametrize("args, message", [
    (["train", "--train.max_step=3"], "did you mean 'max_steps'"),
    (["train", "--optim.lr=-1"], "optim.lr"),
    (["train", "--config", "missing.toml"], "does not exist"),
    (["train", "--data.dir=nowhere"], "slipstream data prepare"),
    (["generate", "--checkpoint", "nowhere", "--prompt", "x"], "does not exist"),
    (["data", "prepare", "--input", "no-such-file.txt", "--out", "o"], "no-such-file.txt"),
    (["train", "stray"], "unexpected argument"),
])
def test_user_errors_exit_2_without_traceback(workspace, args, message):
    proc = slipstream(*args, cwd=workspace, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message.lower() in proc.stderr.lower()
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: ")
