"""Adversarial: damaged or lying data, a model that cannot hold the data's ids, resuming into
another model, a dangling runs/latest, and generate with bad prompts or lengths.

Data cases copy the session's prepared folder before damaging it. Each CLI case checks the
exit code, the one `error:` line (no traceback) and that nothing outside the command's own
outputs changed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from slipstream.config import load_config
from slipstream.data import TokenLoader, get_tokenizer, prepare_dataset, train_bpe
from slipstream.data.prepare import verify_data
from slipstream.errors import UserError
from slipstream.train.lm import MAX_NEW_TOKENS, TextStream, generate_text, train_lm
from tests.adversarial.conftest import ROOT, assert_unchanged, assert_user_error, run_cli, tree_snapshot

TINY = ["--model.preset=tiny", "--train.micro_batch_size=2", "--train.seq_len=16", "--optim.warmup_steps=1",
        "--logging.progress=false", "--train.eval_steps=0", "--checkpoint.async_save=false"]


def _copy(data_dir, tmp_path, name="data"):
    out = tmp_path / name
    shutil.copytree(data_dir, out)
    return out


def _manifest(folder):
    return json.loads((folder / "manifest.json").read_text())


def _write_manifest(folder, manifest):
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))


def _flip_byte(path, offset=100):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _plant_id(folder, token_id, fix_checksum=True, fix_max_id=False):
    """Overwrite the whole first train shard with `token_id`, as an attacker would: the sha256
    fixed up to match (and optionally max_id too), so only the ids themselves give it away."""
    m = _manifest(folder)
    shard = m["splits"]["train"]["shards"][0]
    path = folder / shard["file"]
    path.write_bytes(np.full(shard["tokens"], token_id, dtype="<u2").tobytes())
    if fix_checksum:
        shard["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    if fix_max_id:
        shard["max_id"] = token_id
    _write_manifest(folder, m)
    return path


# ----------------------------------------------------------------------------- damaged shards

def test_data_verify_names_the_flipped_shard(data_dir, tmp_path):
    folder = _copy(data_dir, tmp_path)
    assert [problem for _, _, problem in verify_data(str(folder))[1]] == [None, None]
    shard = folder / "train_000000.bin"
    _flip_byte(shard)
    before = tree_snapshot(tmp_path)
    proc = run_cli("data", "verify", "--dir", folder, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "BAD train train_000000.bin: fails its sha256 checksum" in proc.stdout
    assert "ok  val val_000000.bin" in proc.stdout  # every shard is listed, not just the first bad one
    assert "1 of 2 shards damaged (train_000000.bin)" in proc.stderr
    assert_unchanged(before, tree_snapshot(tmp_path))  # verify only reads


def test_prepare_rerun_does_not_call_a_damaged_folder_cached(corpus_file, tmp_path):
    """Decision: the folder is ours (its manifest says so) and the inputs are unchanged, so
    preparing it again is the fix; `data prepare` says why and rebuilds it."""
    out = tmp_path / "out"
    prepare_dataset([str(corpus_file)], "byte", str(out), val_fraction=0.1, num_workers=1, progress=False)
    intact = (tmp_path / "out" / "train_000000.bin").read_bytes()
    _flip_byte(tmp_path / "out" / "train_000000.bin")
    before = tree_snapshot(tmp_path, exclude=("out",))
    proc = run_cli("data", "prepare", "--input", corpus_file, "--out", "out", "--workers", "1", "--val-fraction", "0.1",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cached" not in proc.stdout
    assert "train shard train_000000.bin fails its sha256 checksum" in proc.stdout and "preparing it again" in proc.stdout
    assert (tmp_path / "out" / "train_000000.bin").read_bytes() == intact
    assert [problem for _, _, problem in verify_data(str(out))[1]] == [None, None]
    assert_unchanged(before, tree_snapshot(tmp_path, exclude=("out",)))


def test_training_refuses_a_flipped_shard(data_dir, tmp_path):
    folder = _copy(data_dir, tmp_path)
    _flip_byte(folder / "train_000000.bin")
    before = tree_snapshot(tmp_path)
    proc = run_cli("train", *TINY, f"--data.dir={folder}", "--run.dir=run", "--train.max_steps=2", cwd=tmp_path)
    assert_user_error(proc, "train_000000.bin", "sha256", "data prepare")
    assert_unchanged(before, tree_snapshot(tmp_path))  # no run directory, nothing written


# ----------------------------------------------------------------------------- ids outside the vocabulary

def test_lying_manifest_is_refused_before_training(data_dir, tmp_path):
    """id 5000 planted with the sha256 fixed up: the default check (data small enough to hash)
    reads the ids and refuses before any step; no IndexError from the embedding."""
    folder = _copy(data_dir, tmp_path)
    _plant_id(folder, 5000)
    before = tree_snapshot(tmp_path)
    proc = run_cli("train", *TINY, f"--data.dir={folder}", "--run.dir=run", "--train.max_steps=2", cwd=tmp_path)
    assert_user_error(proc, "train_000000.bin", "token id 5000", "vocabulary of 257")
    assert "IndexError" not in proc.stdout + proc.stderr
    assert_unchanged(before, tree_snapshot(tmp_path))
    assert verify_data(str(folder))[1][0] == ("train", "train_000000.bin", "holds token id 5000, outside the vocabulary of 257")


def test_lying_manifest_without_hashing_stops_at_the_first_batch(data_dir, tmp_path):
    """data.verify=size reads no shard at start: the loader's per-read guard still refuses the
    id before it reaches the embedding."""
    folder = _copy(data_dir, tmp_path)
    _plant_id(folder, 5000)
    cfg = load_config(None, TINY + [f"--data.dir={folder}", f"--run.dir={tmp_path / 'run'}", "--train.max_steps=2",
                                    "--data.verify=size"])
    with pytest.raises(UserError, match=r"train_000000.bin holds token id 5000 at token \d+, outside the vocabulary of 257"):
        train_lm(cfg)  # an IndexError from the embedding without the guard


def test_recorded_max_id_is_checked_when_data_is_opened(data_dir, tmp_path):
    folder = _copy(data_dir, tmp_path)
    _plant_id(folder, 5000, fix_max_id=True)
    with pytest.raises(UserError, match=r"token id 5000 \(its max_id\), outside the vocabulary of 257"):
        TokenLoader(str(folder), "train", 2, 16)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_guard_names_the_shard_and_position(data_dir, tmp_path, num_workers):
    folder = _copy(data_dir, tmp_path)
    m = _manifest(folder)
    shard = folder / m["splits"]["train"]["shards"][0]["file"]
    tokens = np.fromfile(shard, dtype="<u2")
    tokens[37] = 5000
    tokens.tofile(shard)  # max_id and sha256 left as they were: only reading the ids can tell
    loader = TokenLoader(str(folder), "train", 4, 64, mode="sequential", num_workers=num_workers)
    with pytest.raises(UserError) as e:
        for _ in range(len(tokens) // 256 + 2):
            next(loader)
    loader.close()
    message = str(e.value)
    assert f"shard {shard} holds token id 5000 at token 37" in message
    assert "Traceback" not in message and "\n" not in message  # a worker's error arrives as its message only


@pytest.mark.parametrize("vocab, message", [
    (200, "holds token id 256 (its max_id), outside the vocabulary of 200"),  # eot (256) no longer fits
    (300, "declares vocab_size 300, but its tokenizer byte has 257 tokens"),  # ids fit; the claim is still false
])
def test_manifest_vocab_that_is_not_its_tokenizers(data_dir, tmp_path, vocab, message):
    folder = _copy(data_dir, tmp_path)
    m = _manifest(folder)
    m["vocab_size"], m["eot_id"] = vocab, min(m["eot_id"], vocab - 1)
    _write_manifest(folder, m)
    with pytest.raises(UserError, match=re.escape(message)):
        train_lm(load_config(None, TINY + [f"--data.dir={folder}", f"--run.dir={tmp_path / 'run'}", "--data.verify=size"]))
    assert not (tmp_path / "run").exists()


def test_model_vocab_smaller_than_data_vocab(data_dir, tmp_path):
    cfg = load_config(None, TINY + [f"--data.dir={data_dir}", f"--run.dir={tmp_path / 'run'}", "--model.vocab_size=100"])
    with pytest.raises(UserError, match=re.escape("model.vocab_size = 100 is smaller than the vocabulary of")) as e:
        train_lm(cfg)
    assert "(257, from its manifest)" in str(e.value)
    assert not (tmp_path / "run").exists()


def test_malformed_manifest_fields(data_dir, tmp_path):
    folder = _copy(data_dir, tmp_path)
    m = _manifest(folder)
    m["splits"]["train"]["shards"][0]["file"] = "../../etc/passwd"
    _write_manifest(folder, m)
    with pytest.raises(UserError, match="malformed shard entry"):
        verify_data(str(folder))


# ----------------------------------------------------------------------------- resume into another model

@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory, corpus_file):
    work = tmp_path_factory.mktemp("bpe")
    tok = train_bpe([str(corpus_file)], str(work / "tok.json"), vocab_size=300)
    prepare_dataset([str(corpus_file)], f"bpe:{tok.path}", str(work / "data"), val_fraction=0.1, num_workers=1,
                    progress=False)
    return work


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, data_dir):
    """A finished 2-step tiny run (its final checkpoint) to resume and generate from."""
    work = tmp_path_factory.mktemp("trained")
    proc = run_cli("train", *TINY, f"--data.dir={data_dir}", "--run.dir=run", "--train.max_steps=2", cwd=work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return work


def test_resume_with_another_model_names_every_difference(trained_run, bpe_data, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run / "run", run, symlinks=True)
    before = tree_snapshot(tmp_path)
    proc = run_cli("train", *TINY, f"--data.dir={bpe_data / 'data'}", "--run.dir=run", "--train.max_steps=4",
                   "--checkpoint.resume=auto", "--model.n_layer=3", "--model.d_model=96", cwd=tmp_path)
    line = assert_user_error(proc, "different model", "model.n_layer: 2 -> 3", "model.d_model: 64 -> 96",
                             "model.vocab_size: 257 -> 300", "data.tokenizer: 'byte' -> 'bpe:")
    assert "model.dropout" not in line
    assert_unchanged(before, tree_snapshot(tmp_path))


def test_resume_with_the_same_model_still_works(trained_run, tmp_path, data_dir):
    shutil.copytree(trained_run / "run", tmp_path / "run", symlinks=True)
    summary = train_lm(load_config(None, TINY + [f"--data.dir={data_dir}", f"--run.dir={tmp_path / 'run'}",
                                                 "--train.max_steps=3", "--checkpoint.resume=auto",
                                                 "--model.dropout=0.1"]))  # dropout: training-only
    assert summary["steps_this_run"] == 1


def test_dangling_latest_with_resume_auto_says_what_it_does(data_dir, tmp_path, monkeypatch, capsys):
    (tmp_path / "runs").mkdir()
    os.symlink("gone-20240101-000000", tmp_path / "runs" / "latest")
    before = tree_snapshot(tmp_path, exclude=("runs",))
    monkeypatch.chdir(tmp_path)
    train_lm(load_config(None, TINY + [f"--data.dir={data_dir}", "--train.max_steps=1", "--checkpoint.save_final=false",
                                       "--checkpoint.resume=auto"]))
    out = capsys.readouterr().out
    assert "note: runs/latest points to 'gone-20240101-000000', which does not exist" in out
    assert "starts a new run in runs/" in out
    new = os.readlink(tmp_path / "runs" / "latest")
    assert new != "gone-20240101-000000" and (tmp_path / "runs" / new / "metrics.jsonl").is_file()
    assert_unchanged(before, tree_snapshot(tmp_path, exclude=("runs",)))


# ----------------------------------------------------------------------------- generate

def test_generate_refuses_a_non_utf8_prompt(trained_run):
    before = tree_snapshot(trained_run)
    # A lone surrogate in argv is how Python hands over a raw 0xff byte (surrogateescape).
    proc = run_cli("generate", "--checkpoint", "run", "--prompt", "abc\udcffdef", cwd=trained_run)
    assert_user_error(proc, "not valid UTF-8", "byte 0xff at byte 3")
    assert_unchanged(before, tree_snapshot(trained_run))


def test_generate_refuses_a_huge_max_new_tokens(trained_run):
    before = tree_snapshot(trained_run)
    proc = run_cli("generate", "--checkpoint", "run", "--max-new-tokens", str(10**9), cwd=trained_run)
    assert_user_error(proc, "1,000,000,000", f"limit of {MAX_NEW_TOKENS:,}")
    assert_unchanged(before, tree_snapshot(trained_run))


def test_generate_streams_its_output(trained_run):
    """Text reaches stdout while generation is still running: read the first bytes, then see
    the process is alive (it has thousands of tokens to go), then stop it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "slipstream", "generate", "--checkpoint", "run", "--prompt", "def",
                             "--max-new-tokens", str(MAX_NEW_TOKENS), "--device", "cpu"],
                            cwd=trained_run, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = proc.stdout.read(16)  # blocks until 16 bytes arrive
        assert first.startswith(b"def") and len(first) == 16
        assert proc.poll() is None, "generation finished before its output was read: not streamed"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_streamed_pieces_are_the_text(trained_run, monkeypatch):
    import torch

    from slipstream.models.transformer import generate
    from slipstream.train.lm import load_lm_from_checkpoint

    # One thread: the two generations below must see bitwise equal logits (a threaded BLAS may
    # split its sums differently from call to call on a loaded machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pieces = []
        text = generate_text(str(trained_run / "run"), "é€", max_new_tokens=40, temperature=1.0, top_k=None,
                             seed=3, device="cpu", on_text=pieces.append)
        # The same tokens as one call of the model's own generate (the stream changes nothing).
        model, tok, _ = load_lm_from_checkpoint(trained_run / "run", "cpu")
        gen = torch.Generator().manual_seed(3)
        out = generate(model, torch.tensor([tok.encode("é€")]), 40, temperature=1.0, top_k=None, generator=gen)
    finally:
        torch.set_num_threads(threads)
    assert "".join(pieces) == text and text.startswith("é€"), pieces
    assert len(pieces) > 10, pieces  # piece by piece, not all at the end
    assert tok.decode(out[0].tolist()) == text


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_text_stream_decodes_split_characters(kind, bpe_data):
    tok = get_tokenizer("byte" if kind == "byte" else f"bpe:{bpe_data / 'tok.json'}")
    text = "naïve café — 東京 🎉 done"
    ids = tok.encode(text) + [tok.eot_id] + tok.encode("ü")
    pieces = []
    stream = TextStream(tok, pieces.append)
    stream.feed(ids)
    stream.close()
    assert "".join(pieces) == tok.decode(ids)
    assert "\ufffd" not in "".join(pieces)  # no character was cut in half
    assert len(pieces) > 5
    # Incomplete UTF-8 at the end is flushed (as U+FFFD), never lost.
    if kind == "byte":
        pieces.clear()
        stream = TextStream(tok, pieces.append)
        stream.feed([0x61, 0xE2, 0x82])
        assert pieces == ["a"]
        stream.close()
        assert "".join(pieces) == tok.decode([0x61, 0xE2, 0x82])
