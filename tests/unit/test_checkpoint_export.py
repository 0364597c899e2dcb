"""`slipstream checkpoint inspect|export` on a real (tiny) checkpoint trained once per module."""

import json
import shutil

import pytest
import torch

from slipstream.checkpoint.export import export_checkpoint, inspect_checkpoint
from slipstream.cli import main
from slipstream.errors import UserError


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_dir):
    from slipstream.config import load_config
    from slipstream.train.lm import train_lm

    run = tmp_path_factory.mktemp("export") / "run"
    train_lm(load_config(None, [
        "--model.preset=tiny", f"--data.dir={data_dir}", f"--run.dir={run}",
        "--train.max_steps=3", "--train.micro_batch_size=2", "--train.seq_len=16", "--train.eval_steps=0",
        "--optim.warmup_steps=2", "--logging.progress=false", "--train.deterministic=true",
    ]))
    return run


@pytest.fixture(scope="module")
def reference(run_dir):
    from slipstream.train.lm import load_lm_from_checkpoint

    model, _tok, cfg = load_lm_from_checkpoint(run_dir, "cpu")
    return model.eval(), cfg


def test_inspect_text_and_json(run_dir, reference, capsys):
    assert main(["checkpoint", "inspect", str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert "step_00000003" in text and "tiny" in text and "integrity    ok" in text
    assert "world size 1" in text and "TokenLoader" in text

    assert main(["checkpoint", "inspect", str(run_dir / "checkpoints"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["step"] == 3 and r["format_version"] == 2 and r["world_size"] == 1
    assert r["has_optimizer"] is True and r["per_rank_model"] is False and r["per_rank_optimizer"] is False
    assert r["tokenizer"] == "byte" and r["torch"] == torch.__version__ and r["time_saved"]
    m = r["model"]
    assert (m["preset"], m["n_layer"], m["d_model"], m["vocab_size"]) == ("tiny", 2, 64, 257)
    t = r["trainer_state"]
    assert t["step"] == 3 and t["tokens_seen"] == 3 * 2 * 16 and t["learning_rate"] > 0
    assert t["data_loader"] == {"kind": "TokenLoader", "batch_index": 3}
    groups = r["sizes"]["groups"]
    assert list(groups) == ["model", "optim"]
    # model group: every parameter key (the tied head is listed under its own key too), fp32
    model_numel = sum(v.numel() for v in reference[0].state_dict().values())
    assert groups["model"]["bytes"] == 4 * model_numel == 4 * groups["model"]["elements"]
    assert r["sizes"]["tensors"] == groups["model"]["tensors"] + groups["optim"]["tensors"]
    assert r["sizes"]["on_disk_bytes"] > groups["model"]["bytes"]
    assert r["integrity"] == {"ok": True, "problems": []}


def test_inspect_damaged_checkpoint_exits_1(run_dir, tmp_path, capsys):
    src = next((run_dir / "checkpoints").iterdir())
    copy = tmp_path / src.name
    shutil.copytree(src, copy)
    shard = next((copy / "model_optim").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different contents
    shard.write_bytes(bytes(data))
    assert main(["checkpoint", "inspect", str(copy)]) == 1
    text = capsys.readouterr().out
    assert "DAMAGED" in text and f"model_optim/{shard.name} does not match its checksum" in text
    r = inspect_checkpoint(copy)
    assert not r["integrity"]["ok"] and r["sizes"]["groups"]  # metadata itself is intact: sizes still shown
    assert main(["checkpoint", "export", str(copy), "--format", "torch", "--out", str(tmp_path / "o")]) == 2
    assert "damaged" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_export_torch_is_bitwise_equal(run_dir, reference, tmp_path, capsys):
    model, _cfg = reference
    out = tmp_path / "torch"
    assert main(["checkpoint", "export", str(run_dir), "--format", "torch", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.toml", "export.json", "model.pt"]
    sd = torch.load(out / "model.pt", weights_only=True)
    expected = model.state_dict()
    assert set(sd) == set(expected)
    for key, value in expected.items():
        assert sd[key].dtype == value.dtype and torch.equal(sd[key], value), key
    assert sd["lm_head.weight"].data_ptr() == sd["tok_emb.weight"].data_ptr()  # still tied
    info = json.loads((out / "export.json").read_text())
    assert info["step"] == 3 and info["tied"] == {"lm_head.weight": "tok_emb.weight"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_export_safetensors_round_trip_and_bf16(run_dir, reference, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    model, _cfg = reference
    expected = model.state_dict()
    out = export_checkpoint(run_dir, "safetensors", tmp_path / "st")
    sd = load_file(str(out / "model.safetensors"))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["step"] == "3" and meta["preset"] == "tiny" and meta["dtype"] == "float32"
    ties = json.loads(meta["tied"])
    assert ties == {"lm_head.weight": "tok_emb.weight"} and "lm_head.weight" not in sd
    for dropped, kept in ties.items():
        sd[dropped] = sd[kept]
    assert set(sd) == set(expected)
    for key, value in expected.items():
        assert torch.equal(sd[key], value), key

    out16 = export_checkpoint(run_dir, "safetensors", tmp_path / "bf16", dtype="bf16")
    sd16 = load_file(str(out16 / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in sd16.values())
    assert torch.equal(sd16["blocks.0.attn.q_proj.weight"], expected["blocks.0.attn.q_proj.weight"].bfloat16())


def test_export_hf_matches_our_logits(run_dir, reference, tmp_path):
    transformers = pytest.importorskip("transformers")
    model, cfg = reference
    out = export_checkpoint(run_dir, "hf", tmp_path / "hf")
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    idx = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(idx)[..., :cfg.model.vocab_size]
        theirs = hf(idx).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


def test_overwrite_needs_force_and_spares_other_files(run_dir, tmp_path, capsys):
    out = tmp_path / "o"
    args = ["checkpoint", "export", str(run_dir), "--format", "torch", "--out", str(out)]
    assert main(args) == 0
    before = (out / "model.pt").stat().st_mtime_ns
    assert main(args) == 2
    assert "--force" in capsys.readouterr().err and (out / "model.pt").stat().st_mtime_ns == before
    assert main(args + ["--force", "--dtype", "fp16"]) == 0
    assert torch.load(out / "model.pt", weights_only=True)["tok_emb.weight"].dtype == torch.float16
    (out / "notes.txt").write_text("mine")
    assert main(args + ["--force"]) == 2
    assert "notes.txt" in capsys.readouterr().err and (out / "notes.txt").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a folder"):
        export_checkpoint(run_dir, "torch", tmp_path / "file", force=True)


@pytest.mark.parametrize("argv, message", [
    (["export", "{run}", "--format", "onnx", "--out", "{tmp}/o"], "--format 'onnx'"),
    (["export", "{run}", "--format", "torch", "--dtype", "int8", "--out", "{tmp}/o"], "--dtype 'int8'"),
    (["export", "{tmp}/missing", "--format", "torch", "--out", "{tmp}/o"], "does not exist"),
    (["inspect", "{tmp}/missing"], "does not exist"),
    (["inspect", "{tmp}"], "no complete checkpoint"),
    (["inspect", "{run}", "--bogus"], "unexpected arguments"),
])
def test_bad_arguments_exit_2(run_dir, tmp_path, capsys, argv, message):
    argv = [a.format(run=run_dir, tmp=tmp_path) for a in argv]
    assert main(["checkpoint", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_hf_refuses_shapes_without_hf_equivalent(run_dir, tmp_path):
    src = next((run_dir / "checkpoints").iterdir())
    copy = tmp_path / src.name
    shutil.copytree(src, copy)
    toml = (copy / "config.toml").read_text()
    (copy / "config.toml").write_text(toml.replace('norm = "layernorm"', 'norm = "rmsnorm"'))
    with pytest.raises(UserError, match="GPT-2-shaped .* Llama-shaped .* --format safetensors"):
        export_checkpoint(copy, "hf", tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_checkpoint_subcommand_hook(monkeypatch):
    import argparse
    import sys
    import types

    from slipstream.cli import checkpoint

    mod = types.ModuleType("fake_verify")

    def register(add_subcommand):
        add_subcommand("fake-verify", "test").set_defaults(func=lambda args, extra: 7)

    mod.register = register
    monkeypatch.setitem(sys.modules, "fake_verify", mod)
    monkeypatch.setitem(checkpoint.CHECKPOINT_COMMANDS, "fake-verify", "fake_verify:register")
    parser = argparse.ArgumentParser()
    checkpoint.add_commands(parser.add_subparsers())
    args = parser.parse_args(["checkpoint", "fake-verify"])
    assert args.func(args, []) == 7
    args = parser.parse_args(["checkpoint", "advise", "--save-cost", "30s", "--mtbf", "24h"])
    assert args.func is checkpoint.cmd_advise
