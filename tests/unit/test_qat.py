"""quant.qat: torchao fake quantization in training (optimize/qat.py), the switch at
quant.qat_start_step, the parallelize chain, resume, and `checkpoint export --quantize`."""

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn as nn

from slipstream.config import load_config
from slipstream.config.schema import QuantConfig
from slipstream.errors import UserError

pytest.importorskip("torchao")

SCHEMES = ["int8-dynact-int4-weight", "int8-weight"]


def tiny_model(seed=0):
    from slipstream.models.transformer import Transformer

    cfg = load_config(None, ["--model.preset=tiny", "--model.vocab_size=256", "--train.seq_len=32"])
    torch.manual_seed(seed)
    return Transformer(cfg.model).eval()


def tokens(n=2, t=32, seed=1):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def prepared(scheme, start_step=0, seed=0):
    from slipstream.optimize.qat import apply_qat

    fp32 = tiny_model(seed)
    model = apply_qat(tiny_model(seed), QuantConfig(qat=scheme, qat_start_step=start_step))
    return fp32, model


@pytest.mark.parametrize("scheme", SCHEMES)
def test_blocks_linears_are_fake_quantized_and_change_the_logits(scheme):
    from torchao.quantization.qat import FakeQuantizedLinear

    fp32, model = prepared(scheme)
    linears = [n for n, m in fp32.named_modules() if isinstance(m, nn.Linear)]
    swapped = {n for n, m in model.named_modules() if isinstance(m, FakeQuantizedLinear)}
    assert swapped == {n for n in linears if n.startswith("blocks.")} and len(swapped) >= 6
    assert type(model.lm_head) is nn.Linear and type(model.tok_emb) is nn.Embedding  # kept in full precision
    assert model.state_dict().keys() == fp32.state_dict().keys()  # a QAT checkpoint is a plain one
    x = tokens()
    with torch.no_grad():
        ref, fq = fp32(x), model(x)
    diff = (fq - ref).abs().max().item()
    # Measured on the tiny preset: max |logit difference| 8da4w 1.09 (2.0 % relative), int8 weights 0.056 (0.12 %).
    assert diff > 1e-3, diff
    # The rounding is torchao's: the int8-weight model equals fp32 run on weights rounded per row.
    if scheme == "int8-weight":
        rounded = tiny_model()
        with torch.no_grad():
            for name, m in rounded.named_modules():
                if name in swapped:
                    # symmetric int8 over [-128, 127]: scale = max|w| / 127.5 per output row; torchao
                    # divides by multiplying with 1/scale (quant_primitives._quantize_affine_no_dtype_cast)
                    scale = m.weight.abs().amax(dim=1, keepdim=True) / 127.5
                    m.weight.copy_((m.weight * (1.0 / scale)).round().clamp(-128, 127) * scale)
            assert torch.equal(rounded(x), fq), (rounded(x) - fq).abs().max()


def test_before_the_start_step_the_forward_is_fp32_exactly_then_it_differs():
    from slipstream.optimize.qat import FakeQuantSwitch

    fp32, model = prepared("int8-dynact-int4-weight", start_step=3)
    x = tokens()
    switch = FakeQuantSwitch.attach(model, QuantConfig(qat="int8-dynact-int4-weight", qat_start_step=3))
    with torch.no_grad():
        ref = fp32(x)
        assert torch.equal(model(x), ref)  # apply_qat leaves it off before step 3
        for step in range(3):
            switch.update(step)
            assert torch.equal(model(x), ref)
        switch.update(3)
        assert (model(x) - ref).abs().max() > 1e-3
    assert FakeQuantSwitch.attach(model, QuantConfig()) is None


@pytest.mark.parametrize("scheme", SCHEMES)
def test_converted_model_matches_the_fake_quantized_one(scheme):
    """torchao's tolerance for these two schemes is none at all: its test_qat.py
    (test_quantize_api_int8_intx, test_quantize_api_intx) requires SQNR = inf between prepare,
    convert and the PTQ model."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    from slipstream.optimize.qat import convert_qat

    _fp32, model = prepared(scheme)
    x = tokens()
    with torch.no_grad():
        fq = model(x)
        convert_qat(model, scheme, 32)
        converted = model(x)
    w = model.blocks[0].attn.q_proj.weight
    assert isinstance(w, IntxUnpackedToInt8Tensor) and w.qdata.dtype == torch.int8
    if scheme == "int8-dynact-int4-weight":
        assert w.qdata.min() >= -8 and w.qdata.max() <= 7  # int4 values, one per byte
    assert torch.equal(converted, fq), (converted - fq).abs().max()


def test_refusals():
    from slipstream.optimize.qat import apply_qat

    with pytest.raises(UserError, match="qat_group_size = 48 does not divide"):
        apply_qat(tiny_model(), QuantConfig(qat="int8-dynact-int4-weight", qat_group_size=48))
    with pytest.raises(UserError, match="`blocks`"):
        apply_qat(nn.Sequential(nn.Linear(32, 32)), QuantConfig(qat="int8-weight"))
    with pytest.raises(UserError, match="precision.fp8"):
        load_config(None, ["--quant.qat=int8-weight", "--precision.fp8=true"])
    with pytest.raises(UserError, match="tensor parallelism"):
        load_config(None, ["--quant.qat=int8-weight", "--parallel.tp=2"])
    # steps run 0 .. max_steps - 1: a switch at max_steps would never fake-quantize
    with pytest.raises(UserError, match="qat_start_step <= train.max_steps - 1 = 9"):
        load_config(None, ["--quant.qat=int8-weight", "--train.max_steps=10", "--quant.qat_start_step=10"])
    assert load_config(None, ["--quant.qat=int8-weight", "--train.max_steps=10",
                              "--quant.qat_start_step=9"]).quant.qat_start_step == 9
    with pytest.raises(UserError, match="mixture-of-experts"):
        load_config(None, ["--quant.qat=int8-weight", "--model.moe_experts=4"])


def test_generate_quantize_refuses_moe():
    """Only the router is an nn.Linear in an MoE block: quantizing it alone would leave the experts
    (most of the weights) fp32 while reporting a quantized model."""
    from slipstream.models.transformer import Transformer
    from slipstream.optimize.weight_quant import quantize_weights

    cfg = load_config(None, ["--model.preset=tiny", "--model.vocab_size=256", "--train.seq_len=32",
                             "--model.moe_experts=4"])
    model = Transformer(cfg.model)
    with pytest.raises(UserError, match="mixture-of-experts"):
        quantize_weights(model, "int8")
    assert type(model.blocks[0].mlp.router.weight) is nn.Parameter  # left alone
    # and QAT applied directly (not through the config's check) refuses it too
    from slipstream.optimize.qat import apply_qat

    with pytest.raises(UserError, match="mixture-of-experts"):
        apply_qat(model, dataclasses.replace(cfg.quant, qat="int8-weight"))
    assert type(model.blocks[0].mlp.router) is nn.Linear


def test_torchao_missing_is_a_user_error(monkeypatch):
    import sys

    from slipstream.optimize.qat import import_torchao_qat

    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(UserError, match="pip install torchao"):
        import_torchao_qat()


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.fixture(scope="module")
def qat_runs(tmp_path_factory, data_dir):
    """The default job (tiny) with QAT from step 2: 4 steps straight, and the same with a
    checkpoint at step 2 that a second run resumes; plus a plain fp32 run for comparison."""
    from slipstream.train.lm import train_lm

    tmp = tmp_path_factory.mktemp("qat")
    base = ["--model.preset=tiny", f"--data.dir={data_dir}", "--train.max_steps=4", "--train.micro_batch_size=2",
            "--train.seq_len=32", "--train.eval_steps=0", "--optim.warmup_steps=1", "--logging.log_interval=1",
            "--logging.progress=false", "--train.deterministic=true", "--logging.tensorboard=false",
            "--checkpoint.interval=2"]
    qat = base + ["--quant.qat=int8-dynact-int4-weight", "--quant.qat_start_step=2"]
    straight, resumed, fp32 = tmp / "straight", tmp / "resumed", tmp / "fp32"
    train_lm(load_config(None, qat + [f"--run.dir={straight}"]))
    train_lm(load_config(None, base + [f"--run.dir={fp32}"]))
    shutil.copytree(straight, resumed, symlinks=True)
    _step_2, *later = sorted((resumed / "checkpoints").glob("step_*"))
    for checkpoint in later:
        shutil.rmtree(checkpoint)  # as if the run had died after the step-2 checkpoint
    (resumed / "metrics.jsonl").unlink()
    train_lm(load_config(None, qat + [f"--run.dir={resumed}", "--checkpoint.resume=auto"]))
    return straight, resumed, fp32


def test_default_job_trains_with_qat_and_resumes_exactly(qat_runs):
    straight, resumed, fp32 = qat_runs
    qat_losses, fp32_losses = losses(straight), losses(fp32)
    # Steps 1-2 are before quant.qat_start_step: bit for bit the fp32 run; steps 3-4 fake-quantize.
    assert [qat_losses[s] for s in (1, 2)] == [fp32_losses[s] for s in (1, 2)]
    assert all(qat_losses[s] != fp32_losses[s] for s in (3, 4)), (qat_losses, fp32_losses)
    assert losses(resumed) == {s: loss for s, loss in qat_losses.items() if s > 2}  # bitwise


def test_export_plain_writes_float_weights_and_quantize_converts(qat_runs, tmp_path, capsys):
    from torchao.quantization import IntxUnpackedToInt8Tensor

    from slipstream.cli import main
    from slipstream.optimize.qat import apply_qat, convert_qat
    from slipstream.train.lm import load_lm_from_checkpoint

    straight, _, _ = qat_runs
    plain, quant = tmp_path / "plain", tmp_path / "int4"
    assert main(["checkpoint", "export", str(straight), "--format", "torch", "--out", str(plain)]) == 0
    assert main(["checkpoint", "export", str(straight), "--format", "torch", "--out", str(quant),
                 "--quantize", "int8-dynact-int4-weight"]) == 0
    printed = capsys.readouterr().out
    size = (quant / "model.pt").stat().st_size
    assert f"quantized int8-dynact-int4-weight: model.pt is" in printed and f"({size:,} bytes)" in printed
    assert size < (plain / "model.pt").stat().st_size
    float_sd = torch.load(plain / "model.pt", weights_only=True)
    q_sd = torch.load(quant / "model.pt", weights_only=True)
    assert float_sd["blocks.0.attn.q_proj.weight"].dtype == torch.float32  # plain export: the float weights
    assert isinstance(q_sd["blocks.0.attn.q_proj.weight"], IntxUnpackedToInt8Tensor)
    assert q_sd["lm_head.weight"].dtype == torch.float32  # head and embedding stay in full precision
    assert json.loads((quant / "export.json").read_text())["quantize"] == "int8-dynact-int4-weight"
    # The file's model computes what the checkpoint's fake-quantized model computed.
    model, _tok, cfg = load_lm_from_checkpoint(straight, "cpu")
    model = apply_qat(model.eval(), cfg.quant, start_step=4)  # trained to step 4: past qat_start_step
    x = tokens(t=16)
    with torch.no_grad():
        fq = model(x)
        convert_qat(model, "int8-dynact-int4-weight", 32)
        model.load_state_dict(q_sd, assign=True)
        assert torch.equal(model(x), fq)
    assert main(["checkpoint", "export", str(straight), "--format", "safetensors", "--out", str(tmp_path / "s"),
                 "--quantize", "int8-weight"]) != 0
    assert "only --format torch" in capsys.readouterr().err and not (tmp_path / "s").exists()
