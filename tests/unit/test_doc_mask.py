"""Document packing (data.packing = document): attention never crosses a document boundary and
positions restart per document, so a packed row computes each document exactly as if alone."""

import json

import pytest
import torch
import torch.nn.functional as F

from slipstream.config.load import load_config
from slipstream.config.schema import ModelConfig
from slipstream.errors import UserError
from slipstream.models.doc_mask import DocumentMask, doc_ids_after, positions_in_document
from slipstream.models.transformer import build_model
from slipstream.train.lm import check_document_packing
from slipstream.train.lm_loss import fused_lm_loss_fn, lm_loss_fn, lm_sequence_losses

VOCAB, EOT = 50, 49
CONFIGS = {
    "gpt2": dict(position="learned"),
    "llama": dict(position="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, bias=False, tie_embeddings=False),
}


def tiny(kind: str, **extra) -> torch.nn.Module:
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, max_seq_len=64, **CONFIGS[kind], **extra)
    return build_model(cfg, seed=3)


def packed_batch() -> torch.Tensor:
    x = torch.randint(0, EOT, (3, 40), generator=torch.Generator().manual_seed(0))
    x[0, 9] = x[0, 25] = EOT  # three documents
    x[1, 30] = x[1, 31] = EOT  # a one-token document (the second eot) and one cut at the row's end
    x[2, 39] = EOT  # one document filling the row
    return x


def separately(model, x: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """Each document of each row through the model on its own (positions from 0, nothing else to see)."""
    out = None
    for b in range(x.shape[0]):
        for i in doc[b].unique():
            where = (doc[b] == i).nonzero().squeeze(1)
            piece = model(x[b:b + 1, where])[0]
            if out is None:
                out = piece.new_zeros(x.shape + piece.shape[-1:])
            out[b, where] = piece
    return out


def test_doc_ids_and_positions_from_eot():
    x = torch.tensor([[5, EOT, 7, 8, EOT, 9], [EOT, EOT, 1, 2, 3, 4]])
    doc = doc_ids_after(x, EOT)
    assert doc.tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]
    assert positions_in_document(doc).tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]]


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_packed_row_equals_each_document_alone(kind):
    model = tiny(kind)
    x = packed_batch()
    doc = doc_ids_after(x, EOT)
    expected = separately(model, x, doc)[..., :VOCAB]
    dense = model(x, doc_ids=DocumentMask(doc, "dense"))[..., :VOCAB]
    assert (dense - expected).abs().max() < 1e-5
    assert not torch.allclose(model(x)[..., :VOCAB], expected, atol=1e-3)  # the mask does change something
    with torch.no_grad():  # torch's FlexAttention has no backward on CPU: forward only
        flex = model(x, doc_ids=DocumentMask(doc, "flex"))[..., :VOCAB]
    assert (flex - dense).abs().max() < 1e-5
    # A plain tensor of doc ids picks the kernel itself (dense on CPU) and gives the same.
    assert torch.equal(model(x, doc_ids=doc)[..., :VOCAB], dense)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_gradients_equal_each_document_alone(kind):
    x = packed_batch()
    doc = doc_ids_after(x, EOT)
    weights = torch.randn(x.shape + (VOCAB,), generator=torch.Generator().manual_seed(1))
    grads = []
    for packed in (True, False):
        model = tiny(kind)
        out = model(x, doc_ids=doc) if packed else separately(model, x, doc)
        (out[..., :VOCAB] * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4), name


def test_kernel_choice_and_refusals():
    doc = torch.zeros(2, 8, dtype=torch.long)
    assert DocumentMask(doc).kernel == "dense"  # auto on CPU
    with pytest.raises(UserError, match="no backward on CPU"):
        DocumentMask(doc, "flex", needs_grad=True)
    with pytest.raises(UserError, match="kernel 'bogus' is unknown"):
        DocumentMask(doc, "bogus")
    model = tiny("gpt2")
    with pytest.raises(UserError, match="exclusive"):
        model(torch.zeros(1, 8, dtype=torch.long), positions=torch.arange(8), doc_ids=doc[:1])
    cfg = load_config(None, ["--data.packing=document", "--parallel.cp=2"])
    with pytest.raises(UserError, match="parallel.cp = 2"):
        check_document_packing(cfg)
    with pytest.raises(UserError, match="parallel.pp = 2"):
        check_document_packing(load_config(None, ["--data.packing=document", "--parallel.pp=2"]))
    check_document_packing(load_config(None, ["--data.packing=eos", "--parallel.cp=2"]))
    learned_sp = ["--data.packing=document", "--parallel.tp=2", "--parallel.sequence_parallel=true", "--train.seq_len=64"]
    with pytest.raises(UserError, match="sequence_parallel=false"):
        check_document_packing(load_config(None, learned_sp + ["--model.preset=tiny"]))
    check_document_packing(load_config(None, learned_sp + ["--model.preset=llama-tiny"]))


def test_eos_packing_calls_the_causal_kernel_unchanged():
    """Without doc ids the attention kernel is called exactly as before (is_causal, no mask), so
    packing = eos and context parallelism's kernel replacement are untouched."""
    model = tiny("llama")
    calls = []

    def attend(q, k, v, **kwargs):
        calls.append(kwargs)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    x = packed_batch()
    before = model(x)
    for block in model.blocks:
        block.attn.attend = attend
    assert torch.equal(model(x), before)
    assert calls and all(c["is_causal"] and "attn_mask" not in c for c in calls)
    with pytest.raises(UserError, match="replaced attention kernel"):
        model(x, doc_ids=doc_ids_after(x, EOT))


def test_loss_fns_pass_doc_ids():
    model = tiny("llama")
    x = packed_batch()
    y = torch.roll(x, -1, dims=1)
    doc = doc_ids_after(x, EOT)
    logits = model(x, doc_ids=doc)
    expected = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
    assert torch.allclose(lm_loss_fn(model, (x, y), eot_id=EOT), expected)
    assert torch.allclose(fused_lm_loss_fn(model, (x, y), chunk_size=16, eot_id=EOT), expected, atol=1e-5)
    assert not torch.allclose(lm_loss_fn(model, (x, y)), expected)
    per_row = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)
    assert torch.allclose(lm_sequence_losses(model, x, y, eot_id=EOT), per_row, atol=1e-6)
    assert torch.allclose(lm_sequence_losses(model, x, y, fused_chunk=16, eot_id=EOT), per_row, atol=1e-5)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_generation_sees_only_the_current_document(kind):
    """A document-packed model was trained with attention inside each document and positions from 0
    at each: generation after an end-of-text token must continue the new document as if it were
    alone, as training saw it (no earlier document attended to, positions restarted)."""
    from slipstream.models.transformer import generate

    model = tiny(kind, init_std=0.5)  # large weights: the context decides the samples, not the prior
    earlier = torch.randint(0, EOT, (1, 12), generator=torch.Generator().manual_seed(5))
    prompt = torch.tensor([[3, 14, 15, 9]])
    packed = torch.cat([earlier, torch.tensor([[EOT]]), prompt], dim=1)
    alone = generate(model, prompt, 8, temperature=0, eot_id=EOT)
    assert torch.equal(generate(model, packed, 8, temperature=0, eot_id=EOT)[:, 13:], alone)
    assert not torch.equal(generate(model, packed, 8, temperature=0)[:, 13:], generate(model, prompt, 8, temperature=0))
    # The logits behind each choice are those of the document alone (without the mask they are not).
    with torch.no_grad():
        doc = model(packed, doc_ids=doc_ids_after(packed, EOT))[:, 13:, :VOCAB]
        assert (doc - model(prompt)[..., :VOCAB]).abs().max() < 1e-5
        assert (model(packed)[:, 13:, :VOCAB] - model(prompt)[..., :VOCAB]).abs().max() > 1e-3
    sampled = generate(model, packed, 8, eot_id=EOT, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled[:, 13:], generate(model, prompt, 8, eot_id=EOT, generator=torch.Generator().manual_seed(0)))


@pytest.fixture(scope="module")
def many_docs_dir(tmp_path_factory):
    """A byte-level corpus of many short documents (JSONL), so every 32-token window crosses some."""
    from slipstream.data import prepare_dataset

    root = tmp_path_factory.mktemp("docs")
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    lines = [json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(1 + i % 4))})
             for i in range(1500)]
    (root / "docs.jsonl").write_text("\n".join(lines), encoding="utf-8")
    prepare_dataset([str(root / "docs.jsonl")], "byte", str(root / "prepared"), val_fraction=0.1, num_workers=1,
                    progress=False)
    return root / "prepared"


def train_args(data_dir) -> list[str]:
    return ["train", "--model.preset=llama-tiny", f"--data.dir={data_dir}", "--train.max_steps=3",
            "--train.micro_batch_size=2", "--train.seq_len=32", "--train.eval_interval=0", "--train.eval_tokens=256",
            "--logging.progress=false", "--logging.log_interval=1", "--optim.warmup_steps=1",
            "--train.deterministic=true"]


def final_loss(run) -> float:
    return json.loads((run / "summary.json").read_text())["final_loss"]


def test_train_cli_document_packing(many_docs_dir, tmp_path):
    from slipstream.cli import main

    for packing in ("eos", "document"):
        assert main([*train_args(many_docs_dir), f"--run.dir={tmp_path / packing}", f"--data.packing={packing}"]) == 0
    finals = {packing: final_loss(tmp_path / packing) for packing in ("eos", "document")}
    assert all(v == v for v in finals.values())  # finite, not nan
    assert finals["eos"] != finals["document"]  # the switch took effect
    # `slipstream eval` scores a document-packed checkpoint as training evaluated it: within documents.
    from slipstream.train.evaluate import evaluate_checkpoint

    for packing in ("eos", "document"):
        summary = json.loads((tmp_path / packing / "summary.json").read_text())
        scored = evaluate_checkpoint(str(tmp_path / packing), max_tokens=256, device="cpu")
        assert scored["loss"] == pytest.approx(summary["val_loss"], abs=1e-5), packing
    # `slipstream generate` continues the current document alone, as training saw documents.
    import slipstream.models.transformer as transformer
    from slipstream.train.lm import generate_text

    seen = []
    real = transformer.generate

    def recording(*args, **kwargs):
        seen.append(kwargs.get("eot_id"))
        return real(*args, **kwargs)

    transformer.generate = recording
    try:
        for packing in ("eos", "document"):
            generate_text(str(tmp_path / packing), "alpha beta", max_new_tokens=3, temperature=0, device="cpu")
    finally:
        transformer.generate = real
    assert seen == [None] * 3 + [256] * 3  # the byte tokenizer's end-of-text id


def test_tensor_parallel_document_packing_equals_one_process(many_docs_dir, tmp_path):
    """tp splits heads; the (B, 1, T, T) mask and per-row RoPE tables serve every rank's heads
    (sequence parallel on: the default)."""
    import subprocess
    import sys

    from slipstream.cli import main

    args = [*train_args(many_docs_dir), "--data.packing=document"]
    assert main([*args, f"--run.dir={tmp_path / 'one'}"]) == 0
    done = subprocess.run([sys.executable, "-m", "slipstream", "launch", "local", "--nproc", "2", "--", *args,
                           f"--run.dir={tmp_path / 'tp2'}", "--parallel.tp=2", "--parallel.dp_shard=1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert abs(final_loss(tmp_path / "tp2") - final_loss(tmp_path / "one")) < 1e-5


def test_bench_packing_smoke(tmp_path):
    from slipstream.cli import main

    out = tmp_path / "packing.json"
    assert main(["bench", "packing", "--size", "ci", "--rounds", "1", "--steps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["training"]) == {"eos", "dense"} and result["training"]["eos"]["vs_eos"] == 1.0
    assert "flex" in result["not_run"] and "flex-eager" in result["evaluation"]
    assert result["documents_per_row"] > 2 and result["env"]["torch_version"] == torch.__version__
