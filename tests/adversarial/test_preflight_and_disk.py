"""Absurd sizes are refused before anything is allocated; a full disk is named, not a traceback.

Pre-flight: each absurd config runs the real CLI under RLIMIT_AS = 4 GiB (so an allocation the
check missed fails loudly instead of swapping), and must answer with one `error:` line naming
the estimate and the limit, in a few CPU seconds, with a small peak RSS.

Disk full: a real small filesystem, a tmpfs mounted for the test (we run as root here and in
CI; without the privilege the tests skip and say why) and unmounted in a finalizer.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from slipstream.checkpoint.manager import list_checkpoints, verify_checkpoint
from slipstream.checkpoint.writer import MANIFEST, file_crc32
from tests.adversarial.conftest import ROOT, assert_unchanged, assert_user_error, run_cli, tree_snapshot

GIB = 2**30
ADDRESS_SPACE = 4 * GIB
TINY = ["--model.preset=tiny", "--train.max_steps=2", "--train.micro_batch_size=4", "--train.seq_len=32",
        "--train.eval_steps=0", "--logging.progress=false", "--logging.tensorboard=false",
        "--metrics.memory_breakdown=false"]


def run_limited(*args, cwd, timeout=240):
    """run_cli's command under RLIMIT_AS; returns (CompletedProcess, CPU seconds, peak RSS bytes)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="2")
    env.pop("SLIPSTREAM_INJECT_FAULT", None)

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    cmd = [sys.executable, "-m", "slipstream", *map(str, args)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, preexec_fn=limit)
        deadline = time.monotonic() + timeout
        while True:  # wait4: this child's own CPU time and peak RSS, not every child's so far
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                proc.returncode = -9
                pytest.fail(f"{' '.join(map(str, args))} still running after {timeout} s")
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        done = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
    return done, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


# --- pre-flight memory check -------------------------------------------------------------------

def _gib(match) -> float:
    assert match, "the error names no size"
    return float(match.group(1).replace(",", ""))


ABSURD = {
    "vocab 10^12": ["--model.vocab_size=1000000000000"],
    "d_model 10^6": ["--model.d_model=1000000", "--model.n_head=1"],   # vocabulary from the data's manifest
    "micro-batch 10^8": ["--train.micro_batch_size=100000000"],
    "n_layer 10^6": ["--model.n_layer=1000000"],
}


@pytest.mark.parametrize("overrides", ABSURD.values(), ids=ABSURD.keys())
def test_absurd_sizes_are_refused_before_any_allocation(overrides, data_dir, tmp_path):
    run = tmp_path / "run"
    before, data_before = tree_snapshot(tmp_path), tree_snapshot(data_dir)
    proc, cpu_s, peak_rss = run_limited("train", *TINY, f"--data.dir={data_dir}", f"--run.dir={run}", *overrides,
                                        cwd=tmp_path)
    line = assert_user_error(proc, "cannot fit", "GiB for one training step", "available on cpu",
                             "train.preflight_memory=false")
    estimate = _gib(re.search(r"estimates ([\d,.]+) GiB", line))
    limit = _gib(re.search(r"the ([\d,.]+) GiB available", line))
    assert estimate > limit > 0
    assert "MemAvailable" in line or "memory limit" in line  # where the limit comes from
    # Shape arithmetic only: the time and memory of starting Python with torch, nothing more.
    assert cpu_s < 30, f"{cpu_s:.1f} CPU seconds"
    assert peak_rss < 1.5 * GIB, f"peak RSS {peak_rss / GIB:.2f} GiB"
    assert not run.exists()
    assert_unchanged(before, tree_snapshot(tmp_path))
    assert_unchanged(data_before, tree_snapshot(data_dir))


def test_the_estimate_is_constant_time_for_absurd_shapes():
    from slipstream.config.load import load_config
    from slipstream.plan.preflight import plan_training_memory

    # (One call first: the planner's modules load lazily, which is not the estimate's time.)
    plan_training_memory(load_config(None, ["--model.preset=tiny", "--model.vocab_size=257", "--train.seq_len=32"]),
                         1, "none", 0, "cpu")
    for overrides in [*ABSURD.values(), ["--model.n_layer=1000000000"]]:
        cfg = load_config(None, ["--model.preset=tiny", "--model.vocab_size=257", "--train.seq_len=32", *overrides])
        t0 = time.perf_counter()
        estimate = plan_training_memory(cfg, 1, "none", 0, "cpu")
        assert time.perf_counter() - t0 < 0.05
        assert estimate.total_bytes > 100 * GIB


def test_preflight_memory_false_starts_anyway_with_a_warning(data_dir, tmp_path):
    """The user may know better: the refusal becomes a warning (here the allocation it predicted
    then fails, under the address-space limit)."""
    proc, _, _ = run_limited("train", *TINY, f"--data.dir={data_dir}", f"--run.dir={tmp_path / 'run'}",
                             "--model.vocab_size=1000000000000", "--train.preflight_memory=false", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "starting anyway (train.preflight_memory = false)" in out
    assert not any(line.startswith("error: this run cannot fit") for line in out.splitlines())


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, data_dir) -> Path:
    """A 4-step tiny run with its checkpoint at step 4."""
    run = tmp_path_factory.mktemp("trained") / "run"
    proc = run_cli("train", *TINY, "--train.max_steps=4", "--checkpoint.interval=4", f"--data.dir={data_dir}",
                   f"--run.dir={run}", cwd=run.parent)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000004"]
    return run


def _craft(checkpoint: Path, **model) -> None:
    """Rewrite the model section of a checkpoint's config and its manifest entry, as an attacker would."""
    config = checkpoint / "config.toml"
    text = config.read_text()
    for key, value in model.items():
        text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text, count=1)
        assert n == 1, key
    config.write_text(text)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["config.toml"] = [config.stat().st_size, file_crc32(config)]
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_checkpoint_describing_a_huge_model_is_refused_before_building_it(command, trained_run, tmp_path):
    crafted = tmp_path / "crafted"
    shutil.copytree(trained_run / "checkpoints" / "step_00000004", crafted)
    _craft(crafted, n_layer=1_000_000)
    before = tree_snapshot(tmp_path)
    args = (["generate", "--checkpoint", crafted, "--prompt", "hi", "--device", "cpu"] if command == "generate" else
            ["checkpoint", "export", crafted, "--format", "torch", "--out", tmp_path / "out"])
    proc, cpu_s, peak_rss = run_limited(*args, cwd=tmp_path)
    assert_user_error(proc, str(crafted), "n_layer 1000000", "weights alone need", "available on cpu")
    assert cpu_s < 30 and peak_rss < 1.5 * GIB, (cpu_s, peak_rss)
    assert_unchanged(before, tree_snapshot(tmp_path))


# --- a full disk -------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """small_disk(size) -> a folder on a fresh tmpfs of `size` (mount syntax: 64k, 3m); resize it
    later with small_disk.resize(folder, size). Unmounted at teardown."""
    mounted: list[Path] = []

    def mount(size: str, name: str = "disk") -> Path:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("a small filesystem needs `mount -t tmpfs` as root; not available here")
        path = tmp_path / name
        path.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}): needs root with CAP_SYS_ADMIN")
        mounted.append(path)
        return path

    def resize(path: Path, size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True, capture_output=True)

    mount.resize = resize
    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _free(path: Path) -> int:
    return shutil.disk_usage(path).free


@pytest.mark.timeout(400)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full_during_a_checkpoint_save(async_save, trained_run, data_dir, small_disk):
    disk = small_disk("16m")
    run = disk / "run"
    shutil.copytree(trained_run, run)
    last_good = run / "checkpoints" / "step_00000004"
    shards = sum(p.stat().st_size for p in (last_good / "model_optim").iterdir())
    # Room for the resumed run's logs, not for another checkpoint.
    used = shutil.disk_usage(disk).used
    small_disk.resize(disk, used + shards // 2)
    outputs = ("run/metrics.jsonl", "run/env.json", "run/config.toml", "run/summary.json", "run/.slipstream-lock",
               "run/.slipstream-run")
    before, data_before = tree_snapshot(disk, exclude=outputs), tree_snapshot(data_dir)
    proc = run_cli("train", *TINY, "--train.max_steps=8", "--checkpoint.interval=4", "--checkpoint.resume=auto",
                   f"--checkpoint.async_save={str(async_save).lower()}", f"--data.dir={data_dir}", f"--run.dir={run}",
                   cwd=disk.parent)
    line = assert_user_error(proc, "no space left on device", "checkpoint step 8",
                             str(run / "checkpoints" / "step_00000008"), f"'{last_good}' is intact",
                             "bytes are free")
    needed = int(re.search(r"needs about ([\d,]+) bytes", line).group(1).replace(",", ""))
    assert 0.8 * shards < needed <= shards  # the tensors' bytes: the shards hold them plus a little framing
    free = int(re.search(r"([\d,]+) bytes are free", line).group(1).replace(",", ""))
    assert free < needed and abs(free - _free(disk)) < 64 * 1024
    assert verify_checkpoint(last_good) == [] and list_checkpoints(run / "checkpoints") == [last_good]
    assert not list((run / "checkpoints").glob(".*")), "the partial save is removed"
    assert_unchanged(before, tree_snapshot(disk, exclude=outputs))
    assert_unchanged(data_before, tree_snapshot(data_dir))


def test_disk_full_during_data_prepare(corpus_file, small_disk, tmp_path):
    """A fresh folder, then one holding earlier data: the partial output goes, the old data stays."""
    disk = small_disk("64k")
    small = tmp_path / "small.txt"
    small.write_text(corpus_file.read_text()[:4000])
    proc = run_cli("data", "prepare", "--input", small, "--out", disk / "data", "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before = tree_snapshot(tmp_path, exclude=("small.txt",))
    for out in (disk / "fresh", disk / "data"):
        proc = run_cli("data", "prepare", "--input", corpus_file, "--out", out, "--quiet", cwd=tmp_path)
        line = assert_user_error(proc, "no space left on device", f"'{out}'", "bytes are free",
                                 "the partial output was removed")
        needed = int(re.search(r"needs about ([\d,]+) bytes", line).group(1).replace(",", ""))
        assert needed >= corpus_file.stat().st_size  # one token (2 bytes here) per input byte at most
        assert ("is unchanged" in line) == (out.name == "data")
        assert_unchanged(before, tree_snapshot(tmp_path, exclude=("small.txt",)))


def test_disk_full_while_writing_metrics(small_disk):
    """metrics.jsonl keeps whole records only; the error names the file and the sizes."""
    from slipstream.diskspace import DiskFullError
    from slipstream.observe.loggers import JsonlLogger

    disk = small_disk("16k")
    logger = JsonlLogger(disk / "metrics.jsonl")
    with pytest.raises(DiskFullError) as raised:
        for step in range(10_000):
            logger.log({"loss": 1.0 / (step + 1), "note": "x" * 100}, step)
    logger.close()
    message = str(raised.value)
    assert "no space left on device" in message and str(disk / "metrics.jsonl") in message
    assert re.search(r"needs about [\d,]+ bytes, [\d,]+ bytes are free there", message)
    lines = (disk / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(len(lines))) and len(lines) > 10


def test_disk_full_is_found_behind_dcp_and_zip_writer_wrappers(tmp_path):
    """The shapes a full disk takes: ENOSPC inside DCP's CheckpointException, and torch.save's
    errno-less 'unexpected pos' (then the free space decides)."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from slipstream.diskspace import is_disk_full

    enospc = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(CheckpointException("save failed", {0: (enospc, None)}))
    try:
        try:
            raise enospc
        except OSError as e:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from e
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)
    zip_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert is_disk_full(zip_error, tmp_path, needed=2**62)      # more than any disk has free
    assert not is_disk_full(zip_error, tmp_path, needed=1)      # plenty of room: some other failure
    assert not is_disk_full(ValueError("bad shape"))
