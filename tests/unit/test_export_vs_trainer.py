"""Checkpoint export checked against the model the Trainer holds in memory, read back with
the formats' own readers (torch.load(weights_only=True), safetensors, transformers), never
through slipstream's checkpoint loader: an export that drops, renames, reties or recasts a
weight cannot hide behind a matching reload."""

from __future__ import annotations

import json

import pytest
import torch

from slipstream.checkpoint.export import export_checkpoint

VOCAB = 257  # byte tokenizer; the model pads its rows to a multiple of 64


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir):
    """A tiny GPT-2-shaped LM trained 3 steps by the Trainer; (trainer, run dir, token batch)."""
    from slipstream.config import load_config
    from slipstream.train.lm import build_lm_trainer

    run = tmp_path_factory.mktemp("export-vs-trainer") / "run"
    cfg = load_config(None, [
        "--model.preset=tiny", f"--data.dir={data_dir}", f"--run.dir={run}",
        "--train.max_steps=3", "--train.micro_batch_size=2", "--train.seq_len=16", "--train.eval_steps=0",
        "--optim.warmup_steps=1", "--optim.lr=1e-2", "--logging.progress=false", "--logging.tensorboard=false",
        "--metrics.memory_breakdown=false", "--checkpoint.async_save=false",
    ])
    trainer = build_lm_trainer(cfg)
    initial = _trainer_state(trainer.model)
    trainer.fit()
    model = trainer.model.eval()
    # the comparisons below would also pass for an export of the initial weights otherwise
    assert all(not torch.equal(initial[k], v) for k, v in model.state_dict().items() if k.endswith(".weight"))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, run, ids


def _trainer_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _logits_with(model, state: dict[str, torch.Tensor], ids) -> torch.Tensor:
    """The trainer's architecture, fresh, with exactly `state` loaded (strict: no key missing or extra)."""
    from slipstream.models.transformer import Transformer

    fresh = Transformer(model.cfg)
    fresh.load_state_dict(state, strict=True)
    with torch.no_grad():
        return fresh.eval()(ids)


def test_torch_export_equals_the_trainers_model(trained, tmp_path):
    model, run, ids = trained
    out = export_checkpoint(run, "torch", tmp_path / "pt")
    (weights,) = [p for p in out.iterdir() if p.suffix in (".pt", ".pth", ".bin")]
    loaded = torch.load(weights, weights_only=True, map_location="cpu")
    expected = _trainer_state(model)
    assert sorted(loaded) == sorted(expected)
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    with torch.no_grad():
        assert torch.equal(_logits_with(model, loaded, ids), model(ids))


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_safetensors_export_equals_the_trainers_model(trained, tmp_path, dtype):
    from safetensors import safe_open
    from safetensors.torch import load_file

    model, run, ids = trained
    out = export_checkpoint(run, "safetensors", tmp_path / "st", dtype=dtype)
    (weights,) = list(out.glob("*.safetensors"))
    loaded = load_file(str(weights))
    with safe_open(str(weights), "pt") as f:
        ties = json.loads(f.metadata()["tied"])
    expected = _trainer_state(model)
    # every key is stored once; the tied head names the embedding it shares its tensor with
    assert ties == {"lm_head.weight": "tok_emb.weight"}
    assert model.lm_head.weight is model.tok_emb.weight
    assert sorted([*loaded, *ties]) == sorted(expected)
    want = torch.bfloat16 if dtype else torch.float32
    for key, value in expected.items():
        got = loaded[ties.get(key, key)]
        assert got.dtype == want and torch.equal(got, value.to(want)), key
    state = {k: loaded[ties.get(k, k)].float() for k in expected}
    with torch.no_grad():
        if dtype is None:
            assert torch.equal(_logits_with(model, state, ids), model(ids))
        else:  # bf16 weights: logits close, not equal
            torch.testing.assert_close(_logits_with(model, state, ids)[..., :VOCAB], model(ids)[..., :VOCAB],
                                       rtol=0.05, atol=0.05)


def test_hf_export_gives_the_trainers_logits_in_transformers(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    model, run, ids = trained
    out = export_checkpoint(run, "hf", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    with torch.no_grad():
        ours = model(ids)[..., :VOCAB]
        theirs = hf(ids).logits[..., :VOCAB]
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    # and weight by weight: HF's token embedding is the trainer's, its head tied to it
    assert torch.equal(hf.transformer.wte.weight[:VOCAB], model.state_dict()["tok_emb.weight"][:VOCAB])
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
