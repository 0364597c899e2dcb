"""Weight-only int8 / int4 quantization for inference (optimize/weight_quant.py) and
`slipstream generate --quantize` (its printed weight bytes and tokens/s)."""

import re

import pytest
import torch
import torch.nn as nn

from slipstream.config import load_config
from slipstream.errors import UserError

pytest.importorskip("torchao")

# Tolerances on the logits of the trained tiny checkpoint below (relative error = ||q - fp32|| / ||fp32||
# over every position and vocabulary entry). Measured: int8 0.23 %, int4 3.4 %; the bounds leave
# 2-4x headroom while an int4 model would still fail the int8 bound.
REL_TOL = {"int8": 0.01, "int4": 0.08}
# The blocks' linears, hand-computed below from numel and the rows/groups, vs the bytes measured:
# the zip container's per-tensor overhead is a few hundred bytes on megabytes.
BYTES_TOL = 0.01


def tiny_model(d_model=64, seed=0):
    from slipstream.models.transformer import Transformer

    cfg = load_config(None, ["--model.preset=tiny", "--model.vocab_size=256", "--train.seq_len=32",
                             f"--model.d_model={d_model}"])
    torch.manual_seed(seed)
    return Transformer(cfg.model).eval()


def block_linears(model):
    return {name: m for name, m in model.blocks.named_modules() if type(m) is nn.Linear}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, data_dir):
    """The tiny default job, a few steps on the byte corpus: a real checkpoint for generate."""
    from slipstream.train.lm import train_lm

    run = tmp_path_factory.mktemp("wq") / "run"
    train_lm(load_config(None, [
        "--model.preset=tiny", f"--data.dir={data_dir}", f"--run.dir={run}", "--train.max_steps=6",
        "--train.micro_batch_size=2", "--train.seq_len=32", "--train.eval_steps=0", "--optim.warmup_steps=2",
        "--logging.progress=false", "--logging.tensorboard=false", "--checkpoint.interval=6"]))
    return run


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_linears_become_torchao_tensors_rounded_to_the_grid(kind):
    from torchao.quantization import Int8Tensor, IntxUnpackedToInt8Tensor

    from slipstream.optimize.weight_quant import INT4_GROUP_SIZE, quantize_weights

    fp32, model = tiny_model(), tiny_model()
    originals = {name: m.weight.detach().clone() for name, m in block_linears(fp32).items()}
    quantize_weights(model, kind)
    linears = block_linears(model)
    assert linears.keys() == originals.keys() and len(linears) == 12  # 2 layers x (q, k, v, o, up, down)
    for name, m in linears.items():
        assert type(m.weight) is (Int8Tensor if kind == "int8" else IntxUnpackedToInt8Tensor), name
        # Symmetric rounding: |w - dequant(w)| <= half a step, step = max|w| / 127 over a row (int8)
        # or / 7 over a group of 32 inputs (int4). An unquantized weight has error 0; a 4-bit
        # grid breaks the 8-bit bound (checked below), so each scheme is the one named.
        w, deq = originals[name], m.weight.dequantize()
        groups = w.shape[1] if kind == "int8" else INT4_GROUP_SIZE
        amax = w.reshape(w.shape[0], -1, groups).abs().amax(dim=-1, keepdim=True)
        err = (w - deq).reshape(w.shape[0], -1, groups).abs()
        qmax = 127 if kind == "int8" else 7
        assert (err <= amax / qmax / 2 * 1.001).all(), name
        assert err.max() > 0, name
        if kind == "int4":
            assert (err > amax / 127 / 2 * 1.001).any(), "int4 is no coarser than int8: not 4-bit"
    # The embedding and the tied head stay in full precision, still one tensor.
    assert model.lm_head.weight is model.tok_emb.weight and model.tok_emb.weight.dtype == torch.float32
    assert torch.equal(model.tok_emb.weight, fp32.tok_emb.weight)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_bytes_shrink_as_hand_computed(kind):
    from slipstream.optimize.weight_quant import INT4_GROUP_SIZE, quantize_weights, weight_bytes

    model = tiny_model(d_model=256)  # wide enough that the weights, not the file's overhead, dominate
    before = weight_bytes(model)
    assert weight_bytes(model.blocks) < before  # the embedding is in the file too
    fp32_bytes = q_bytes = 0
    for m in block_linears(model).values():
        rows, cols = m.weight.shape
        scales = rows if kind == "int8" else rows * cols // INT4_GROUP_SIZE
        fp32_bytes += rows * cols * 4
        # int8 values (int4 ones unpacked, one per byte: torchao 0.18 on CPU) + an fp32 scale and
        # an int8 zero point per row (int8) or per group (int4)
        q_bytes += rows * cols * 1 + scales * (4 + 1)
    blocks_before = weight_bytes(model.blocks)
    quantize_weights(model, kind)
    after, blocks_after = weight_bytes(model), weight_bytes(model.blocks)
    assert abs((before - after) - (fp32_bytes - q_bytes)) <= BYTES_TOL * (fp32_bytes - q_bytes), (before, after)
    # Measured: the blocks' file 3.86x smaller with int8, 3.40x with int4 (scale per 32 weights);
    # the linears alone: 4 / (1 + 5/256) = 3.92x and 4 / (1 + 5/32) = 3.46x.
    ratio = blocks_before / blocks_after
    assert (3.8 < ratio < 3.95) if kind == "int8" else (3.3 < ratio < 3.5), ratio
    assert after < before


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_trained_model_logits_stay_close(trained_run, kind):
    from slipstream.optimize.weight_quant import quantize_weights
    from slipstream.train.lm import load_lm_from_checkpoint

    fp32, _tok, _cfg = load_lm_from_checkpoint(trained_run, "cpu")
    model, _tok, _cfg = load_lm_from_checkpoint(trained_run, "cpu")
    quantize_weights(model.eval(), kind)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    vocab = model.cfg.vocab_size  # the padded rows past it are masked out (-inf): never sampled
    with torch.no_grad():
        ref, q = fp32.eval()(x)[..., :vocab], model(x)[..., :vocab]
    rel = ((q - ref).norm() / ref.norm()).item()
    assert 1e-5 < rel < REL_TOL[kind], rel  # really quantized, and close
    agree = (q.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree  # measured: all 64 next-token picks agree (int8 and int4)


def test_int4_group_must_divide_the_width_and_kinds_are_checked():
    from slipstream.optimize.weight_quant import quantize_weights

    with pytest.raises(UserError, match="groups of 32.*--quantize int8"):
        quantize_weights(tiny_model(d_model=48), "int4")
    with pytest.raises(UserError, match="choose one of: int8, int4"):
        quantize_weights(tiny_model(), "int2")
    with pytest.raises(UserError, match="blocks"):
        quantize_weights(nn.Sequential(nn.Linear(32, 32)), "int8")


STATS = re.compile(r"weights: ([\d,]+) -> ([\d,]+) bytes \(([\d.]+)x smaller, (int\d) weight-only\); "
                   r"generation: ([\d.]+) tokens/s \((\d+) tokens in ([\d.]+) s after a warm-up token, on cpu\)")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_cli_generate_quantize_prints_bytes_and_tokens_per_s(trained_run, kind, capsys):
    from slipstream.cli import main
    from slipstream.optimize.weight_quant import quantize_weights, weight_bytes
    from slipstream.train.lm import load_lm_from_checkpoint

    common = ["generate", "--checkpoint", str(trained_run), "--prompt", "def ", "--max-new-tokens", "6",
              "--temperature", "0", "--device", "cpu"]
    assert main(common + ["--quantize", kind]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def ") and len(out) > len("def \n")  # the text, alone on stdout
    match = STATS.search(err)
    assert match, err
    before, after = (int(g.replace(",", "")) for g in match.group(1, 2))
    model, _tok, _cfg = load_lm_from_checkpoint(trained_run, "cpu")
    assert before == weight_bytes(model)
    assert after == weight_bytes(quantize_weights(model, kind)) and after < before  # --quantize was applied
    assert match.group(4) == kind and float(match.group(3)) == pytest.approx(before / after, abs=0.005)
    tokens, seconds = int(match.group(6)), float(match.group(7))
    # tokens/s is tokens / seconds; seconds is printed rounded to the millisecond
    assert tokens == 5 and tokens / (seconds + 5e-4) - 0.05 <= float(match.group(5)) <= tokens / max(seconds - 5e-4, 1e-9) + 0.05
    if kind == "int4":
        return
    # Without --quantize: the same size line, unchanged bytes.
    assert main(common) == 0
    err = capsys.readouterr().err
    assert f"weights: {before:,} bytes; generation: " in err and "tokens/s" in err


def test_cli_bad_quantize_is_an_argparse_error(trained_run, capsys):
    from slipstream.cli import main
    from slipstream.train.lm import generate_text

    with pytest.raises(SystemExit) as e:
        main(["generate", "--checkpoint", str(trained_run), "--prompt", "x", "--quantize", "int2"])
    assert e.value.code == 2 and "invalid choice: 'int2'" in capsys.readouterr().err
    with pytest.raises(UserError, match="--quantize must be one of int8, int4"):
        generate_text(str(trained_run), "x", max_new_tokens=1, quantize="fp4", device="cpu")
