"""The architecture switches of issue 19 (BLOOM, MPT, GPT-J, GPT-NeoX, Pythia, OPT, Falcon): ALiBi
(model.position = alibi), partial rotary (model.rotary_fraction), a ReLU MLP (model.mlp = relu),
the parallel block (model.parallel_block) and the embedding norm (model.embedding_norm).

Each is checked against a hand-written computation, shown to change the logits (a switch that
is silently ignored fails), counted by models/flops.py exactly as the model holds it, split into
pipeline stages without changing the logits, and refused (with the fix) where it cannot run."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from slipstream.config import load_config
from slipstream.config.schema import ModelConfig
from slipstream.errors import UserError
from slipstream.models.doc_mask import DocumentMask
from slipstream.models.flops import param_count
from slipstream.models.transformer import alibi_slopes, build_model, generate

VOCAB = 50
BASE = ModelConfig(vocab_size=VOCAB, vocab_multiple=8, d_model=48, n_layer=2, n_head=6, max_seq_len=32)
# Every switch at once: BLOOM-like (ALiBi) and GPT-NeoX-like (partial rotary), both with GQA.
ALL_ALIBI = dict(position="alibi", embedding_norm=True, parallel_block=True, mlp="relu", n_kv_head=3)
ALL_ROPE = dict(position="rope", rotary_fraction=0.25, embedding_norm=True, parallel_block=True, mlp="relu",
                n_kv_head=3, norm="rmsnorm", bias=False, tie_embeddings=False)
SWITCHES = {
    "alibi": dict(position="alibi"),
    "partial_rotary": dict(position="rope", rotary_fraction=0.25),
    "relu": dict(mlp="relu"),
    "parallel_block": dict(parallel_block=True),
    "embedding_norm": dict(embedding_norm=True),
    "embedding_rmsnorm_no_bias": dict(embedding_norm=True, norm="rmsnorm", bias=False),
    "all_alibi": ALL_ALIBI,
    "all_rope": ALL_ROPE,
    "alibi_moe_relu": dict(position="alibi", mlp="relu", moe_experts=4, moe_top_k=2, parallel_block=True),
}


def config(**changes) -> ModelConfig:
    return dataclasses.replace(BASE, **changes)


def tokens(T: int = 12, B: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(SWITCHES))
def test_param_count_equals_the_model(name):
    cfg = config(**SWITCHES[name])
    model = build_model(cfg, seed=0)
    counted = param_count(cfg)
    assert counted.total == sum(p.numel() for p in model.parameters())  # tied weights once
    assert counted.matmul == sum(p.numel() for p in model.blocks.parameters()) + model.lm_head.weight.numel()
    norm = model.emb_norm
    assert counted.embedding_norm == (sum(p.numel() for p in norm.parameters()) if norm is not None else 0)
    # ALiBi has no position table; learned positions are max_seq_len x d_model of it
    table = cfg.max_seq_len * cfg.d_model if cfg.position == "learned" else 0
    assert counted.embedding == model.tok_emb.weight.numel() + table


def logits_with_shared_weights(on: dict, off: dict, T: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a model with the switch and one without, holding the same weights (the ones
    both have: the switch's own, e.g. the embedding norm, keep their init)."""
    with_switch, without = build_model(config(**on), seed=1), build_model(config(**off), seed=1)
    shared = {k: v for k, v in without.state_dict().items() if k in with_switch.state_dict()}
    with_switch.load_state_dict(shared, strict=False)
    idx = tokens(T)
    with torch.no_grad():
        return with_switch(idx)[..., :VOCAB], without(idx)[..., :VOCAB]


@pytest.mark.parametrize("on, off", [
    (dict(position="rope", rotary_fraction=0.25), dict(position="rope")),
    (dict(mlp="relu"), dict(mlp="gelu")),
    (dict(parallel_block=True), dict()),
    (dict(embedding_norm=True), dict()),
], ids=["partial_rotary", "relu", "parallel_block", "embedding_norm"])
def test_each_switch_changes_the_logits(on, off):
    a, b = logits_with_shared_weights(on, off)
    assert (a - b).abs().max() > 1e-3


def test_alibi_changes_the_logits_of_a_model_without_positions():
    # A learned table of zeros carries no position: the model then differs from the ALiBi one
    # only by the bias.
    no_position, alibi = build_model(config(), seed=1), build_model(config(position="alibi"), seed=1)
    with torch.no_grad():
        no_position.pos_emb.weight.zero_()
    alibi.load_state_dict({k: v for k, v in no_position.state_dict().items() if k != "pos_emb.weight"})
    idx = tokens()
    with torch.no_grad():
        assert (alibi(idx)[..., :VOCAB] - no_position(idx)[..., :VOCAB]).abs().max() > 1e-3


def test_alibi_slopes_by_hand():
    # Press et al. 2022, section 3: 8 heads -> 1/2, 1/4, ..., 1/256.
    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]
    # 6 heads (not a power of two): the 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8, then every other one
    # of the 8-head slopes (2^-1, 2^-3), as BLOOM's build_alibi_tensor and MPT's gen_slopes give.
    assert alibi_slopes(6).tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    assert alibi_slopes(1).tolist() == [2.0 ** -8]
    # BLOOM-176B's 112 heads: 64 of 2^(-8/64 x k), then 48 of 2^(-8/128 x (2k - 1)).
    want = [2.0 ** (-k / 8) for k in range(1, 65)] + [2.0 ** (-(2 * k - 1) / 16) for k in range(1, 49)]
    assert torch.allclose(alibi_slopes(112), torch.tensor(want))


def capture_attention(model, layer: int = 0) -> dict:
    """The input and output of one attention module during the next forward."""
    seen = {}

    def hook(module, args, kwargs, output):
        seen["x"], seen["y"] = args[0].detach(), output.detach()

    model.blocks[layer].attn.register_forward_hook(hook, with_kwargs=True)
    return seen


def test_alibi_equals_a_hand_written_attention():
    cfg = config(position="alibi", n_kv_head=3)  # 6 heads (not a power of two), grouped-query
    model = build_model(cfg, seed=2)
    seen = capture_attention(model)
    idx = tokens(T=10)
    with torch.no_grad():
        model(idx)
        attn, x = model.blocks[0].attn, seen["x"]
        B, T, H, D = x.shape[0], x.shape[1], cfg.n_head, cfg.d_model // cfg.n_head
        q = attn.q_proj(x).view(B, T, H, D).transpose(1, 2)
        k = attn.k_proj(x).view(B, T, 3, D).transpose(1, 2).repeat_interleave(H // 3, dim=1)
        v = attn.v_proj(x).view(B, T, 3, D).transpose(1, 2).repeat_interleave(H // 3, dim=1)
        slopes = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
        want = torch.empty(B, H, T, D)
        for h in range(H):
            for i in range(T):
                # query i sees keys j <= i (causal), score q.k / sqrt(D) + slope x (j - i)
                scores = torch.stack([(q[:, h, i] * k[:, h, j]).sum(-1) for j in range(i + 1)], dim=-1)
                scores = scores / math.sqrt(D) + torch.tensor([slopes[h] * (j - i) for j in range(i + 1)])
                want[:, h, i] = torch.einsum("bj,bjd->bd", scores.softmax(-1), v[:, h, : i + 1])
        want = attn.o_proj(want.transpose(1, 2).reshape(B, T, H * D))
    torch.testing.assert_close(seen["y"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")  # eager flex on CPU: slow, exact
@pytest.mark.parametrize("kernel", ["dense", "flex"])
def test_alibi_with_documents_equals_each_document_alone(kernel):
    model = build_model(config(position="alibi"), seed=3)
    idx = tokens(T=16, B=2)
    doc = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    with torch.no_grad():
        mask = DocumentMask(doc, kernel=kernel, needs_grad=False, compiled=False)
        packed = model(idx, doc_ids=mask)[..., :VOCAB]
        for b in range(2):
            for d in doc[b].unique():
                where = (doc[b] == d).nonzero().squeeze(1)
                alone = model(idx[b:b + 1, where])[0, :, :VOCAB]
                torch.testing.assert_close(packed[b, where], alone, rtol=1e-5, atol=1e-5)
    assert mask.alibi_slopes is None  # the caller's mask is left as it was


def test_alibi_bias_in_the_autocast_dtype():
    model = build_model(config(position="alibi"), seed=3)
    idx = tokens()
    with torch.no_grad():
        want = model(idx)[..., :VOCAB]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(idx)[..., :VOCAB]
    assert (got.float() - want).abs().max() < 0.05


def test_partial_rotary_rotates_only_the_first_dims():
    cfg = config(position="rope", rotary_fraction=0.25, d_model=64, n_head=4)  # head 16: 4 dims rotate
    model = build_model(cfg, seed=4)
    attn, seen = model.blocks[0].attn, {}
    x_in = {}
    attn.q_proj.register_forward_hook(lambda m, a, out: x_in.__setitem__("q", out.detach()))

    def attend(q, k, v, **kwargs):
        seen["q"] = q.detach()
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    attn.attend = attend
    T = 10
    with torch.no_grad():
        model(tokens(T=T))
    B, D = 2, 16
    before = x_in["q"].view(B, T, 4, D).transpose(1, 2)
    after = seen["q"]
    assert torch.equal(after[..., 4:], before[..., 4:])  # 12 of 16 dims carry no position
    # The rotated 4: pairs (0, 2) and (1, 3) ("rotate half"), frequencies 1 and theta^(-2/4).
    theta = cfg.rope_theta
    for p in range(T):
        for first, freq in ((0, 1.0), (1, theta ** -0.5)):
            c, s = math.cos(p * freq), math.sin(p * freq)
            a, b = before[..., p, first], before[..., p, first + 2]
            torch.testing.assert_close(after[..., p, first], a * c - b * s, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(after[..., p, first + 2], b * c + a * s, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after[..., 1:, :4], before[..., 1:, :4])


def test_rotary_dims_are_even_and_at_least_two():
    from slipstream.models.transformer import rotary_dims

    assert rotary_dims(config(position="rope", d_model=256 * 4, n_head=4, rotary_fraction=0.25)) == 64  # GPT-J
    assert rotary_dims(config(position="rope", d_model=48, n_head=6, rotary_fraction=0.25)) == 2   # head 8
    assert rotary_dims(config(position="rope", d_model=48, n_head=6, rotary_fraction=0.01)) == 2
    assert rotary_dims(config(position="rope", d_model=60, n_head=6, rotary_fraction=0.5)) == 4    # head 10: 5 -> 4
    assert rotary_dims(config(position="rope", d_model=60, n_head=6, rotary_fraction=0.75)) == 8   # 7.5 -> 8
    assert rotary_dims(config(position="rope", d_model=60, n_head=6, rotary_fraction=0.95)) == 10  # 9.5 -> 10
    assert rotary_dims(config(position="rope", d_model=48, n_head=6)) == 8


def test_relu_mlp_by_hand():
    model = build_model(config(mlp="relu"), seed=5)
    mlp, x = model.blocks[0].mlp, torch.randn(2, 3, 48)
    with torch.no_grad():
        want = F.linear(torch.clamp(F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias), min=0),
                        mlp.down_proj.weight, mlp.down_proj.bias)
        torch.testing.assert_close(mlp(x), want)


def test_relu_experts_by_hand():
    from slipstream.models.moe import expert_ffn

    w_up, w_down = torch.randn(2, 8, 4), torch.randn(2, 4, 8)
    x, counts = torch.randn(5, 4), torch.tensor([2, 3])
    got = expert_ffn(x, counts, w_up, None, w_down, gemm="loop", activation="relu")
    want = torch.cat([torch.relu(x[:2] @ w_up[0].T) @ w_down[0].T, torch.relu(x[2:] @ w_up[1].T) @ w_down[1].T])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("position", ["learned", "alibi", "rope"])
def test_parallel_block_by_hand(position):
    model = build_model(config(parallel_block=True, position=position), seed=6)
    block, x, T = model.blocks[0], torch.randn(2, 7, 48), 7
    rope = None if model.rope_cos is None else (model.rope_cos[:T], model.rope_sin[:T])
    from slipstream.models.transformer import alibi_bias

    mask = None if model.alibi_slopes is None else alibi_bias(model.alibi_slopes, T, torch.float32)
    with torch.no_grad():
        block.attn.o_proj.weight.mul_(20)  # an attention output as large as the MLP's: the orders differ clearly
        want = x + block.attn(block.attn_norm(x), rope=rope, mask=mask) + block.mlp(block.mlp_norm(x))
        torch.testing.assert_close(block(x, rope, mask), want)
        mid = x + block.attn(block.attn_norm(x), rope=rope, mask=mask)  # the sequential block differs
        assert (mid + block.mlp(block.mlp_norm(mid)) - want).abs().max() > 1e-3


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_embedding_norm_is_applied(norm):
    model = build_model(config(embedding_norm=True, norm=norm), seed=7)
    with torch.no_grad():  # gains (and biases) away from their init, so a norm left out or misplaced shows
        model.emb_norm.weight.uniform_(0.5, 1.5)
        if getattr(model.emb_norm, "bias", None) is not None:
            model.emb_norm.bias.uniform_(-0.5, 0.5)
    seen = {}
    model.blocks[0].register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0].detach()))
    idx, T = tokens(), 12
    with torch.no_grad():
        model(idx)
        e = model.tok_emb(idx) + model.pos_emb(torch.arange(T))
        w = model.emb_norm.weight
        if norm == "layernorm":
            want = (e - e.mean(-1, keepdim=True)) / torch.sqrt(e.var(-1, unbiased=False, keepdim=True) + 1e-5)
            want = want * w + model.emb_norm.bias
        else:
            want = e / torch.sqrt(e.square().mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(seen["x"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("switches", [ALL_ALIBI, ALL_ROPE], ids=["alibi", "rope"])
def test_pipeline_stages_equal_the_whole_model(switches):
    from slipstream.distributed.pipeline_stages import build_stage_modules, split_layers, split_stages

    cfg = config(**switches, n_layer=3)
    model = build_model(cfg, seed=8)
    idx = tokens()
    with torch.no_grad():
        want = model(idx)[..., :VOCAB]
        splits = split_layers(3, 3)
        for stages in (build_stage_modules(cfg, [0, 1, 2], splits, seed=8), split_stages(model, [0, 1, 2], splits)):
            x = idx
            for stage in stages:
                x = stage(x)
            torch.testing.assert_close(x[..., :VOCAB], want, rtol=1e-5, atol=1e-5)
    assert hasattr(stages[0], "emb_norm") and not hasattr(stages[1], "emb_norm")


@pytest.mark.parametrize("switches", [ALL_ALIBI, ALL_ROPE], ids=["alibi", "rope"])
def test_greedy_generation_follows_the_model(switches):
    model = build_model(config(**switches), seed=9)
    out = generate(model, tokens(T=4, B=1), max_new_tokens=4, temperature=0)
    with torch.no_grad():
        predicted = model(out[:, :-1])[0, 3:, :VOCAB].argmax(-1)
    assert out[0, 4:].tolist() == predicted.tolist()


def test_tensor_parallel_takes_each_ranks_alibi_slopes():
    from slipstream.models.transformer import keep_alibi_heads

    model = build_model(config(position="alibi"), seed=0)
    keep_alibi_heads(model, slice(3, 6))  # tp rank 1 of 2: heads 3..5
    assert model.alibi_slopes.tolist() == alibi_slopes(6)[3:].tolist()
    model.init_weights(0)  # after to_empty(): recomputed for the same heads
    assert model.alibi_slopes.tolist() == alibi_slopes(6)[3:].tolist()


@pytest.mark.parametrize("overrides, message", [
    (["--model.rotary_fraction=0.25"], "model.rotary_fraction = 0.25 .* model.position = learned; set "
                                       "--model.position=rope, or --model.rotary_fraction=1"),
    (["--model.position=alibi", "--parallel.cp=2"], "model.position = alibi with parallel.cp = 2 is not supported.*"
                                                    "use --parallel.cp=1"),
])
def test_refused_combinations_name_the_fix(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, ["--model.preset=tiny", "--train.seq_len=64", *overrides])


def test_context_parallel_refuses_alibi():
    from slipstream.distributed.context_parallel import check_context_parallel

    cfg = load_config(None, ["--model.preset=tiny", "--train.seq_len=64", "--model.position=alibi"])
    with pytest.raises(UserError, match="alibi with parallel.cp = 2"):
        check_context_parallel(cfg, cp=2, tp=1)


@pytest.mark.parametrize("switches", [dict(position="alibi"), dict(position="rope", rotary_fraction=0.5),
                                      dict(mlp="relu"), dict(parallel_block=True), dict(embedding_norm=True)])
def test_hugging_face_export_refuses_what_it_cannot_express(switches):
    from slipstream.models.hf import hf_family

    with pytest.raises(UserError, match="no equivalent in the Hugging Face architectures"):
        hf_family(config(**switches))
