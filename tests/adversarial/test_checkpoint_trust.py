"""A checkpoint from someone else never runs code and never makes slipstream read a file outside it.

The attacker writes every file of the checkpoint: a `.metadata` pickle (or a non-tensor value
blob) whose unpickling would create a marker file, then a manifest with matching checksums,
so the integrity check passes. Every command that reads a checkpoint must refuse it: the
marker never appears, one `error:` line names the file and says it is refused, no traceback,
nothing outside the command's own outputs changes.
"""

from __future__ import annotations

import json
import pickle
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from slipstream.errors import UserError

from .conftest import assert_unchanged, assert_user_error, run_cli, tree_snapshot


class _Exec:
    """What an attacker pickles: unpickling it calls exec(code)."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return (exec, (self.code,))


def _touch_code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').write('pwned')"


def _reseal(ckpt: Path) -> None:
    """Recompute the manifest as an attacker would: every listed file, its real size and CRC32."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in manifest:
        data = (ckpt / name).read_bytes()
        manifest[name] = [len(data), zlib.crc32(data)]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _edit_meta(ckpt: Path, **changes) -> None:
    meta = json.loads((ckpt / "meta.json").read_text())
    meta.update(changes)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    _reseal(ckpt)


@pytest.fixture(scope="module")
def genuine(tmp_path_factory, data_dir) -> Path:
    """A real tiny checkpoint (model and AdamW state) at step 4 of an 8-step run."""
    from slipstream.config import load_config
    from slipstream.train.lm import train_lm

    run = tmp_path_factory.mktemp("trust") / "run"
    train_lm(load_config(None, [
        "--model.preset=tiny", f"--data.dir={data_dir}", f"--run.dir={run}", "--train.max_steps=4",
        "--train.micro_batch_size=2", "--train.seq_len=16", "--train.eval_steps=0", "--optim.warmup_steps=2",
        "--logging.progress=false", "--logging.tensorboard=false", "--train.deterministic=true",
        "--checkpoint.save_final=true",
    ]))
    return run / "checkpoints" / "step_00000004"


def _copy(genuine: Path, tmp_path: Path) -> Path:
    """A copy of the genuine run directory (resume=auto needs one); returns its checkpoint."""
    shutil.copytree(genuine.parent.parent, tmp_path / "theirs", symlinks=True)
    return tmp_path / "theirs" / "checkpoints" / genuine.name


def _hostile_metadata(genuine: Path, tmp_path: Path, marker: Path) -> Path:
    ckpt = _copy(genuine, tmp_path)
    (ckpt / "model_optim" / ".metadata").write_bytes(pickle.dumps(_Exec(_touch_code(marker))))
    _reseal(ckpt)
    return ckpt


# A non-tensor value of the checkpoint: the learning rate of the table's group (the optimizer
# state is saved flat, keyed by parameter name: checkpoint/manager.state_payload).
LR_KEY = "optim.param_groups.tok_emb.weight.lr"


def _hostile_value(genuine: Path, tmp_path: Path, marker: Path) -> Path:
    """Genuine metadata, except that the learning rate's blob (DCP stores non-tensor values as
    torch.save'd pickles) now points at an attacker's pickle appended to the shard."""
    from slipstream.checkpoint.untrusted import read_dcp_metadata

    ckpt = _copy(genuine, tmp_path)
    folder = ckpt / "model_optim"
    metadata = read_dcp_metadata(folder)
    (index, info), = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == LR_KEY]
    shard = folder / info.relative_path
    payload = pickle.dumps(_Exec(_touch_code(marker)))
    info.offset, info.length = shard.stat().st_size, len(payload)
    with open(shard, "ab") as f:
        f.write(payload)
    metadata.storage_meta = None
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))  # only DCP's own classes in it
    _reseal(ckpt)
    return ckpt


def _train_args(data_dir, run: Path, *extra) -> list[str]:
    return ["train", "--model.preset=tiny", f"--data.dir={data_dir}", f"--run.dir={run}", "--train.max_steps=6",
            "--train.micro_batch_size=2", "--train.seq_len=16", "--train.eval_steps=0", "--optim.warmup_steps=2",
            "--logging.progress=false", "--logging.tensorboard=false", *extra]


# command name -> (CLI arguments, paths under tmp_path the command may write); {ckpt}, {run}, {out}
COMMANDS = {
    "inspect": (["checkpoint", "inspect", "{ckpt}"], []),
    "export torch": (["checkpoint", "export", "{ckpt}", "--format", "torch", "--out", "{out}"], ["out"]),
    "export safetensors": (["checkpoint", "export", "{ckpt}", "--format", "safetensors", "--out", "{out}"], ["out"]),
    "export hf": (["checkpoint", "export", "{ckpt}", "--format", "hf", "--out", "{out}"], ["out"]),
    "generate": (["generate", "--checkpoint", "{ckpt}", "--prompt", "def", "--max-new-tokens", "4"], []),
    "eval": (["eval", "--checkpoint", "{ckpt}", "--data.dir", "{data}", "--tokens", "64"], []),
    "train resume=PATH": (["{train}", "--checkpoint.resume={ckpt}"], ["mine", "runs"]),
    # resume=auto trains in the attacker's run directory: its own files there are outputs,
    # the checkpoint itself is checked separately (_run_and_check)
    "train resume=auto": (["{train_auto}", "--checkpoint.resume=auto"], ["theirs", "runs"]),
    "train rollback policy": (["{train}", "--checkpoint.resume={ckpt}", "--stability.policy=rollback",
                               "--checkpoint.interval=2"], ["mine", "runs"]),
}


def _expand(args: list[str], ckpt: Path, tmp_path: Path, data_dir) -> list[str]:
    out: list[str] = []
    for a in args:
        if a == "{train}":
            out += _train_args(data_dir, tmp_path / "mine")
        elif a == "{train_auto}":
            out += _train_args(data_dir, ckpt.parent.parent)
        else:
            out.append(a.format(ckpt=ckpt, out=tmp_path / "out", data=data_dir))
    return out


def _assert_refused(proc, command: str, *fragments: str) -> None:
    code = 1 if command.startswith("inspect") else 2  # inspect reports a damaged checkpoint with exit 1
    line = assert_user_error(proc, "refused", *fragments, code=code)
    assert "integrity    ok" not in proc.stdout and '"ok": true' not in proc.stdout, line


def _run_and_check(command: str, ckpt: Path, tmp_path: Path, data_dir, marker: Path, *fragments: str):
    args, outputs = COMMANDS[command]
    before = tree_snapshot(tmp_path, exclude=tuple(outputs)), tree_snapshot(ckpt.parent)
    proc = run_cli(*_expand(args, ckpt, tmp_path, data_dir), cwd=tmp_path)
    assert not marker.exists(), f"the checkpoint ran code ({command}):\n{proc.stdout}\n{proc.stderr}"
    _assert_refused(proc, command, *fragments)
    assert_unchanged(before[0], tree_snapshot(tmp_path, exclude=tuple(outputs)))
    assert_unchanged(before[1], tree_snapshot(ckpt.parent))  # the checkpoints folder, also under resume=auto
    assert not (tmp_path / "out").exists()  # no export of a refused checkpoint


@pytest.mark.parametrize("command", list(COMMANDS))
def test_crafted_metadata_pickle_is_refused_everywhere(command, genuine, tmp_path, data_dir):
    marker = tmp_path / "pwned"
    ckpt = _hostile_metadata(genuine, tmp_path, marker)
    _run_and_check(command, ckpt, tmp_path, data_dir, marker, ".metadata", "builtins.exec")


@pytest.mark.parametrize("command", ["train resume=PATH", "train resume=auto"])
def test_crafted_value_blob_is_refused_on_resume(command, genuine, tmp_path, data_dir):
    marker = tmp_path / "pwned"
    ckpt = _hostile_value(genuine, tmp_path, marker)
    _run_and_check(command, ckpt, tmp_path, data_dir, marker, LR_KEY, str(ckpt))


def test_rollback_reloads_through_the_same_guard(genuine, tmp_path):
    """stability.policy=rollback reloads through Trainer.resume -> load_checkpoint_state: the
    same load, so a crafted checkpoint is refused there too (in-process, no trainer needed)."""
    from slipstream.checkpoint import manager as ckpt_lib
    from slipstream.config.load import config_from_toml_text
    from slipstream.models.transformer import Transformer
    from slipstream.train.resume import LAYOUT_DEFAULTS, load_checkpoint_state

    marker = tmp_path / "pwned"
    ckpt = _hostile_metadata(genuine, tmp_path, marker)
    cfg = config_from_toml_text((ckpt / "config.toml").read_text())
    model = Transformer(cfg.model)
    layout = {**LAYOUT_DEFAULTS, **ckpt_lib.read_meta(ckpt).get("optimizer_layout", {})}
    with pytest.raises(UserError, match=r"\.metadata' is refused"):
        load_checkpoint_state(ckpt, model, torch.optim.AdamW(model.parameters()), cfg, layout,
                              {"tokenizer": "byte"}, {})
    assert not marker.exists()


@pytest.mark.parametrize("module, name", [
    ("builtins", "exec"),                                   # a callable that is not DCP's
    ("torch", "os.system"),                                 # torch is allowed for dtypes, not for this
    ("torch.distributed.checkpoint.filesystem", "os.system"),  # a dotted path through an allowed module
])
def test_restricted_unpickler_refuses_every_other_global(module, name, genuine, tmp_path):
    from slipstream.checkpoint.untrusted import RefusedFile, read_dcp_metadata

    marker = tmp_path / "pwned"
    ckpt = _copy(genuine, tmp_path)
    # protocol 4: STACK_GLOBAL with the module/name pair the attacker chooses, called on one string
    def text(s: str) -> bytes:
        return pickle.SHORT_BINUNICODE + bytes([len(s.encode())]) + s.encode()

    arg = f"touch {marker}" if name.endswith("system") else _touch_code(marker)
    data = (pickle.PROTO + b"\x04" + text(module) + text(name) + pickle.STACK_GLOBAL + text(arg)
            + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)
    (ckpt / "model_optim" / ".metadata").write_bytes(data)
    with pytest.raises(RefusedFile, match="is refused"):
        read_dcp_metadata(ckpt / "model_optim")
    assert not marker.exists()


def test_metadata_pointing_outside_the_folder_is_refused(genuine, tmp_path):
    """Genuine classes, but a shard location of '../../secret': DCP would read that file."""
    from slipstream.checkpoint.untrusted import RefusedFile, read_dcp_metadata

    ckpt = _copy(genuine, tmp_path)
    folder = ckpt / "model_optim"
    metadata = read_dcp_metadata(folder)
    (tmp_path / "secret").write_bytes(b"s" * 100_000)
    next(iter(metadata.storage_data.values())).relative_path = "../../../../secret"
    metadata.storage_meta = None
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(RefusedFile, match="not a shard file"):
        read_dcp_metadata(folder)


def test_a_linked_shard_folder_never_loads_another_checkpoint(genuine, tmp_path):
    """model_optim as a symbolic link to another DCP folder (with a manifest listing nothing):
    its tensors would load as this checkpoint's. Refused on every load path (they share load_dcp)."""
    from slipstream.checkpoint.untrusted import RefusedFile, read_dcp_metadata

    other = _copy(genuine, tmp_path / "other")
    ckpt = _copy(genuine, tmp_path / "linked")
    shutil.rmtree(ckpt / "model_optim")
    (ckpt / "model_optim").symlink_to(other / "model_optim", target_is_directory=True)
    with pytest.raises(RefusedFile, match="symbolic link"):
        read_dcp_metadata(ckpt / "model_optim")


def test_undecodable_or_deeply_nested_config_is_damage_not_a_traceback(genuine, tmp_path):
    from slipstream.checkpoint.export import inspect_checkpoint
    from slipstream.checkpoint.manager import read_text_inside
    from slipstream.config.load import config_from_toml_text
    from slipstream.errors import UserError

    ckpt = _copy(genuine, tmp_path)
    (ckpt / "config.toml").write_bytes(b"[model]\nn_layer = 2 \xff\xfe\n")
    with pytest.raises(UserError, match="not UTF-8"):
        read_text_inside(ckpt, "config.toml")
    inspect_checkpoint(ckpt)  # reports the damage; never a UnicodeDecodeError
    with pytest.raises(UserError, match="nested too deeply"):
        config_from_toml_text("a = " + "[" * 50_000)


# --- the tokenizer: only the copy inside the checkpoint ---------------------------------------

SECRET = '{"secret": "the content of a file outside the checkpoint"}'


@pytest.fixture
def secret(tmp_path) -> Path:
    path = tmp_path / "elsewhere" / "secret.json"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


def _tokenizer_outside(genuine: Path, tmp_path: Path, secret: Path, how: str) -> Path:
    ckpt = _copy(genuine, tmp_path)
    if how == "absolute":
        _edit_meta(ckpt, tokenizer=f"bpe:{secret}")
    elif how == "relative":
        _edit_meta(ckpt, tokenizer=f"bpe:{Path('..') / '..' / '..' / 'elsewhere' / 'secret.json'}")
    else:  # a link inside the folder that points out of it
        (ckpt / "tokenizer.json").symlink_to(secret)
        _edit_meta(ckpt, tokenizer="bpe:tokenizer.json")
    return ckpt


def _no_secret_in(folder: Path) -> None:
    for path in folder.rglob("*") if folder.exists() else []:
        if path.is_file():
            assert "the content of a file outside" not in path.read_text(errors="replace"), path


@pytest.mark.parametrize("how", ["absolute", "relative", "symlink"])
@pytest.mark.parametrize("fmt", ["torch", "hf"])
def test_export_never_copies_a_tokenizer_from_outside(how, fmt, genuine, tmp_path, secret):
    ckpt = _tokenizer_outside(genuine, tmp_path, secret, how)
    before = tree_snapshot(tmp_path, exclude=("out",))
    proc = run_cli("checkpoint", "export", ckpt, "--format", fmt, "--out", tmp_path / "out", cwd=tmp_path)
    _no_secret_in(tmp_path / "out")
    assert_user_error(proc, "outside the checkpoint folder", "refused")
    assert_unchanged(before, tree_snapshot(tmp_path, exclude=("out",)))


@pytest.mark.parametrize("how", ["absolute", "symlink"])
def test_generate_never_reads_a_tokenizer_from_outside(how, genuine, tmp_path, secret):
    from slipstream.train.lm import generate_text

    ckpt = _tokenizer_outside(genuine, tmp_path, secret, how)
    with pytest.raises(UserError, match="outside the checkpoint folder; refused"):
        generate_text(str(ckpt), "def", max_new_tokens=2, device="cpu")


def test_generate_cli_refuses_a_tokenizer_outside(genuine, tmp_path, secret):
    ckpt = _tokenizer_outside(genuine, tmp_path, secret, "absolute")
    proc = run_cli("generate", "--checkpoint", ckpt, "--prompt", "def", "--max-new-tokens", "2", cwd=tmp_path)
    assert_user_error(proc, "outside the checkpoint folder", "refused", "secret.json")
    assert "the content of a file outside" not in proc.stdout + proc.stderr


def test_manifest_naming_a_file_outside_is_a_problem_not_a_read(genuine, tmp_path, secret):
    from slipstream.checkpoint.manager import verify_checkpoint

    ckpt = _copy(genuine, tmp_path)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["../../../elsewhere/secret.json"] = [len(SECRET), zlib.crc32(SECRET.encode())]
    manifest[str(secret)] = [len(SECRET), zlib.crc32(SECRET.encode())]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    problems = verify_checkpoint(ckpt)
    assert len(problems) == 2 and all("outside the checkpoint folder" in p for p in problems), problems


# --- older formats and the genuine case ---------------------------------------------------------

def test_format_1_is_never_reported_intact_and_loads_under_the_same_rule(genuine, tmp_path, capsys):
    from slipstream.cli import main

    ckpt = _copy(genuine, tmp_path)
    (ckpt / "manifest.json").unlink()
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "format_version": 1}))
    assert main(["checkpoint", "inspect", str(ckpt)]) == 1
    captured = capsys.readouterr()
    assert "NOT VERIFIED" in captured.out and "integrity    ok" not in captured.out
    assert "error:" in captured.err and "no manifest" in captured.err

    marker = tmp_path / "pwned"
    (ckpt / "model_optim" / ".metadata").write_bytes(pickle.dumps(_Exec(_touch_code(marker))))
    assert main(["checkpoint", "export", str(ckpt), "--format", "torch", "--out", str(tmp_path / "o")]) == 2
    assert "is refused" in capsys.readouterr().err and not marker.exists() and not (tmp_path / "o").exists()


def test_genuine_checkpoint_loads_with_its_optimizer_values(genuine):
    """The guarded load reads a real checkpoint completely: weights and non-tensor values."""
    from slipstream.checkpoint import manager as ckpt_lib
    from slipstream.config.load import config_from_toml_text
    from slipstream.models.transformer import Transformer

    cfg = config_from_toml_text((genuine / "config.toml").read_text())
    model = Transformer(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=123.0)
    state = ckpt_lib.load_checkpoint(genuine, model, optimizer)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(state["scheduler"]["_last_lr"][0])
    assert all(len(optimizer.state[p]) for p in model.parameters())


def test_tune_system_never_resumes_a_checkpoint():
    from slipstream.tune.system import TRIAL_SETTINGS

    assert TRIAL_SETTINGS["checkpoint.resume"] == "none"
