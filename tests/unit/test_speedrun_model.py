"""The model switches of the speed-run track: ReLU² MLP (model.mlp = relu2), soft-capped logits
(model.logit_softcap) on every path that makes logits or a loss, and zero-initialized output
projections (model.zero_init_proj). Each test fails when its switch is silently ignored: the
expected values are computed here, independently of the model code."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from slipstream.config import load_config
from slipstream.config.presets import PRESETS
from slipstream.config.schema import ModelConfig
from slipstream.errors import UserError
from slipstream.models.transformer import build_model

VOCAB = 300  # pads to 320: the padded columns must stay -inf under the cap
CAP = 0.5    # below the raw logits of LOUD models: the cap bites


def _cfg(preset: str = "tiny", **changes) -> ModelConfig:
    return ModelConfig(**{**PRESETS[preset], "preset": preset, "vocab_size": VOCAB, **changes})


def _loud(model):
    """Scale the token table (the tied head) so raw logits reach several units, well past CAP."""
    with torch.no_grad():
        model.tok_emb.weight.mul_(40)
    return model


def _capped(raw: torch.Tensor) -> torch.Tensor:
    """The expected logits: CAP * tanh(raw / CAP) on the real vocabulary, -inf on the padding."""
    out = torch.full_like(raw, float("-inf"))
    out[..., :VOCAB] = CAP * torch.tanh(raw[..., :VOCAB] / CAP)
    return out


def _pair(**changes):
    """The same weights without and with the cap (the cap changes no parameter)."""
    raw, capped = (_loud(build_model(_cfg(**changes, logit_softcap=cap), seed=3)) for cap in (0.0, CAP))
    return raw, capped


def _batch(B=2, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, VOCAB, (B, T), generator=g), torch.randint(0, VOCAB, (B, T), generator=g)
    y[0, :3] = -100  # masked targets too
    return x, y


# --- ReLU² -----------------------------------------------------------------------------------------

def test_relu2_mlp_is_down_of_squared_relu_of_up():
    model = build_model(_cfg(mlp="relu2"), seed=1)
    mlp = model.blocks[0].mlp
    assert mlp.gate_proj is None and mlp.up_proj.out_features == 4 * 64  # two matrices, 4 d wide
    x = torch.randn(2, 5, 64)
    up = x @ mlp.up_proj.weight.T + mlp.up_proj.bias
    expected = torch.clamp(up, min=0) ** 2 @ mlp.down_proj.weight.T + mlp.down_proj.bias
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-6)
    gelu = build_model(_cfg(mlp="gelu"), seed=1).blocks[0].mlp  # same weights, other activation
    assert not torch.allclose(gelu(x), expected, atol=1e-4)


@pytest.mark.parametrize("gemm", ["loop", "grouped"])
def test_relu2_moe_experts_square_the_relu(gemm):
    from slipstream.models.moe import grouped_mm_supported

    if gemm == "grouped" and not grouped_mm_supported(torch.device("cpu"), torch.float32):
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    model = build_model(_cfg("moe-tiny", mlp="relu2", moe_gemm=gemm, moe_shared_experts=1), seed=1)
    experts, shared = model.blocks[0].mlp.experts, model.blocks[0].mlp.shared
    assert experts.w_gate is None and shared.gate_proj is None
    counts = torch.tensor([3, 0, 5, 4])
    x = torch.randn(int(counts.sum()), 64)
    rows = torch.split(x, counts.tolist())
    expected = torch.cat([torch.clamp(r @ experts.w_up[e].T, min=0) ** 2 @ experts.w_down[e].T
                          for e, r in enumerate(rows)])
    torch.testing.assert_close(experts(x, counts), expected, rtol=1e-4, atol=1e-5)
    # The shared experts are a dense MLP of the same kind.
    expected = torch.clamp(x @ shared.up_proj.weight.T, min=0) ** 2 @ shared.down_proj.weight.T
    torch.testing.assert_close(shared(x), expected, rtol=1e-4, atol=1e-5)


def test_relu2_counts_as_gelu_in_flops_parameters_and_planned_memory():
    from slipstream.models.flops import flops_per_token, param_count
    from slipstream.optimize.activations import activation_memory_bytes
    from slipstream.plan.memory import estimate_memory
    from slipstream.plan.memory_activations import block_activation_bytes
    from slipstream.plan.space import PlanModel, Strategy

    relu2, gelu = _cfg(mlp="relu2"), _cfg(mlp="gelu")
    assert flops_per_token(relu2, 64) == flops_per_token(gelu, 64)
    assert param_count(relu2) == param_count(gelu)
    assert param_count(relu2).total == sum(p.numel() for p in build_model(relu2).parameters())
    s = Strategy(precision="fp32")
    assert estimate_memory(PlanModel("r", relu2), s, 64) == estimate_memory(PlanModel("g", gelu), s, 64)
    # What one relu2 block really keeps for backward (2 blocks minus 1) is the planner's number.
    idx = torch.randint(0, VOCAB, (4, 64))
    kept = [activation_memory_bytes(build_model(_cfg(mlp="relu2", n_layer=n)), lambda: idx) for n in (1, 2)]
    assert block_activation_bytes(PlanModel("r", relu2), 4 * 64, s) == pytest.approx(kept[1] - kept[0], rel=0.01)


# --- soft-capped logits ------------------------------------------------------------------------

def test_softcap_caps_the_models_logits_and_keeps_the_padding_out():
    raw_model, model = _pair()
    x, _ = _batch()
    raw, logits = raw_model(x), model(x)
    assert raw[..., :VOCAB].abs().max() > 4 * CAP  # the cap has something to do
    torch.testing.assert_close(logits, _capped(raw), rtol=1e-5, atol=1e-6)
    assert logits[..., :VOCAB].abs().max() <= CAP
    assert torch.isneginf(logits[..., VOCAB:]).all()


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_softcap_fused_loss_equals_unfused_loss_and_gradients():
    from slipstream.train.lm_loss import fused_lm_loss_fn, lm_loss_fn

    raw_model, model = _pair()
    x, y = _batch()
    plain = lm_loss_fn(model, (x, y))
    expected = F.cross_entropy(_capped(raw_model(x)).view(-1, 320), y.view(-1))  # from the uncapped model
    torch.testing.assert_close(plain, expected, rtol=1e-5, atol=1e-6)
    plain_grads = _grads(model, plain)
    fused = fused_lm_loss_fn(model, (x, y), chunk_size=7)  # several chunks, the last one short
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    fused_grads = _grads(model, fused)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # Without the cap the same weights give another loss: the fused op does cap.
    assert abs(fused_lm_loss_fn(raw_model, (x, y), chunk_size=7).item() - fused.item()) > 0.1


def test_softcap_evaluation_losses_plain_and_fused():
    from slipstream.train.lm_loss import lm_sequence_losses

    raw_model, model = _pair()
    x, y = _batch()
    with torch.no_grad():
        per_token = F.cross_entropy(_capped(raw_model(x)).transpose(1, 2), y, reduction="none")
        expected = per_token.sum(dim=1) / (y != -100).sum(dim=1)
        for chunk in (None, 5):
            got = lm_sequence_losses(model, x, y, fused_chunk=chunk)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert (lm_sequence_losses(raw_model, x, y) - expected).abs().min() > 0.1


def test_softcap_in_the_fused_ops_triton_path(monkeypatch):
    """The cap runs in torch around the Triton kernels; a torch stand-in for the kernels (their
    own equivalence is tests/unit/test_ops_fused_ce.py's) checks that wrapping on CPU."""
    from slipstream.ops import fused_ce

    def ce_forward(logits, targets, ignore_index):
        valid = targets != ignore_index
        lse = logits.float().logsumexp(dim=1)
        picked = logits.float().gather(1, torch.where(valid, targets, 0)[:, None]).squeeze(1)
        return lse, torch.where(valid, lse - picked, 0.0)

    def ce_backward_(logits, targets, lse, scale, ignore_index):
        valid = targets != ignore_index
        grad = (logits.float() - lse[:, None]).exp()
        grad[torch.arange(len(targets))[valid], targets[valid]] -= 1
        return logits.copy_(grad * torch.where(valid, scale, 0.0)[:, None])

    fake = types.SimpleNamespace(ce_forward=ce_forward, ce_backward_=ce_backward_)
    monkeypatch.setitem(sys.modules, "slipstream.ops.triton_ce", fake)
    monkeypatch.setattr(sys.modules["slipstream.ops"], "triton_ce", fake, raising=False)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(13, 8, generator=g, requires_grad=True)
    w = (torch.randn(40, 8, generator=g) * 2).requires_grad_()
    t = torch.randint(0, 40, (13,), generator=g)
    t[::4] = -100
    loss, _ = fused_ce.fused_linear_cross_entropy_op(h, w, t, 5, -100, "triton", CAP)
    ref = fused_ce.linear_cross_entropy_reference(h, w, t, softcap=CAP)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_softcap_in_the_pipelines_last_stage():
    from slipstream.distributed.pipeline_stages import split_layers, split_stages

    raw_model, model = _pair()
    first, last = split_stages(model, [0, 1], split_layers(2, 2))
    x, _ = _batch()
    assert last.is_last and not last.is_first
    torch.testing.assert_close(last(first(x)), _capped(raw_model(x)), rtol=1e-5, atol=1e-6)


def test_softcap_on_the_vocabulary_parallel_head(tmp_path):
    """One process, a tp mesh of 1: VocabParallelHead caps its shard (the model leaves the logits
    to it), with the logits gathered and with loss parallel (a Shard(-1) DTensor)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from slipstream.distributed.tensor_parallel import apply_tensor_parallel

    x, y = _batch()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        for parallel_loss in ("false", "true"):
            cfg = load_config(None, ["--model.preset=tiny", f"--model.vocab_size={VOCAB}", "--train.seq_len=64",
                                     f"--model.logit_softcap={CAP}", f"--parallel.loss_parallel={parallel_loss}"])
            raw = _loud(build_model(dataclasses.replace(cfg.model, logit_softcap=0.0), seed=3))
            model = apply_tensor_parallel(_loud(build_model(cfg.model, seed=3)), mesh, cfg)
            logits = model(x)
            expected = _capped(raw(x))
            torch.testing.assert_close(logits.full_tensor() if hasattr(logits, "full_tensor") else logits, expected,
                                       rtol=1e-5, atol=1e-6)
            if parallel_loss == "true":
                with loss_parallel():
                    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
                torch.testing.assert_close(loss.full_tensor(), F.cross_entropy(expected.view(-1, 320), y.view(-1)))
    finally:
        dist.destroy_process_group()


def test_softcap_in_the_planned_logits_memory():
    """The cap keeps its tanh (tokens x vocabulary) for backward: measured and planned alike."""
    from slipstream.optimize.activations import activation_memory_bytes
    from slipstream.plan.memory import estimate_memory
    from slipstream.plan.space import PlanModel, Strategy

    x = torch.randint(0, VOCAB, (4, 64))
    kept = [activation_memory_bytes(build_model(_cfg(logit_softcap=cap)), lambda: x) for cap in (0.0, CAP)]
    assert kept[1] - kept[0] == 4 * 64 * 320 * 4
    s = Strategy(micro_batch=4, precision="fp32")
    planned = [estimate_memory(PlanModel("t", _cfg(logit_softcap=cap)), s, 64).peak_bytes for cap in (0.0, CAP)]
    assert planned[1] - planned[0] == 4 * 64 * 320 * 4

def test_softcap_costs_the_fused_op_one_more_chunk_measured_and_planned():
    """The cap's derivative is the one extra chunk-sized buffer of the fused backward (the planner's
    number): building 1 - tanh^2 out of place held two more chunks for a moment."""
    from slipstream.ops.fused_ce import fused_linear_cross_entropy
    from slipstream.perf.fused_ce_bench import peak_memory_bytes
    from slipstream.plan.memory import estimate_memory
    from slipstream.plan.space import PlanModel, Strategy

    n_rows, d, vocab, chunk = 128, 16, 4096, 64
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n_rows, d, generator=g, requires_grad=True)
    w = torch.randn(vocab, d, generator=g, requires_grad=True)
    t = torch.randint(0, vocab, (n_rows,), generator=g)

    def peak(cap):
        return peak_memory_bytes(lambda: torch.autograd.grad(
            fused_linear_cross_entropy(h, w, t, chunk_size=chunk, backend="torch", softcap=cap), (h, w)), "cpu")

    chunk_bytes = chunk * vocab * 4
    extra = (peak(CAP) - peak(0.0)) / chunk_bytes
    assert 0.9 < extra < 1.1, extra
    s = Strategy(micro_batch=4, precision="fp32", fused_loss=True, loss_chunk=64)
    # A vocabulary large enough that the loss's backward is the planned peak.
    planned = [estimate_memory(PlanModel("t", _cfg(logit_softcap=cap, vocab_size=32000)), s, 64).peak_bytes
               for cap in (0.0, CAP)]
    assert planned[1] - planned[0] == 64 * 32000 * 4



# --- zero-initialized projections --------------------------------------------------------------

ZEROED = ("o_proj.weight", "down_proj.weight", "experts.w_down")


@pytest.mark.parametrize("preset,tied", [("tiny", True), ("tiny", False), ("moe-tiny", False)])
def test_zero_init_proj_zeroes_exactly_the_output_projections(preset, tied):
    plain = dict(build_model(_cfg(preset, tie_embeddings=tied), seed=5).named_parameters())
    model = build_model(_cfg(preset, tie_embeddings=tied, zero_init_proj=True), seed=5)
    zeroed = ZEROED + (() if tied else ("lm_head.weight",))
    names = dict(model.named_parameters())
    assert "lm_head.weight" in names or tied
    assert any(n.endswith("experts.w_down") for n in names) == (preset == "moe-tiny")
    for name, param in names.items():
        if name.endswith(zeroed):
            assert not param.any(), name
        else:  # drawn as without the switch: the generator's stream is unchanged
            assert torch.equal(param, plain[name]), name
            assert param.any() or name.endswith(".bias"), name
    if tied:
        assert model.lm_head.weight is model.tok_emb.weight and model.lm_head.weight.any()


def test_zero_init_proj_in_pipeline_stages_built_from_meta():
    from slipstream.distributed.pipeline_stages import build_stage_modules, split_layers

    cfg = _cfg(zero_init_proj=True, tie_embeddings=False)
    stages = build_stage_modules(cfg, [0, 1], split_layers(2, 2), seed=5)
    params = {n: p for s in stages for n, p in s.named_parameters()}
    assert not params["lm_head.weight"].any() and not params["blocks.1.mlp.down_proj.weight"].any()
    assert params["blocks.0.attn.q_proj.weight"].any()


def test_zero_init_proj_still_learns_in_one_step():
    from slipstream.train.lm_loss import lm_loss_fn

    model = build_model(_cfg(zero_init_proj=True, tie_embeddings=False), seed=5)
    assert not model.lm_head.weight.any()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch(4, 32)
    loss = lm_loss_fn(model, (x, y))
    loss.backward()
    # A zero head passes no gradient down at first, but takes one itself: (softmax - onehot)^T h.
    assert model.lm_head.weight.grad.abs().sum() > 0
    optimizer.step()
    optimizer.zero_grad()
    after = lm_loss_fn(model, (x, y))
    assert after.item() < loss.item() - 0.01
    after.backward()  # from the second step on the zero projections get gradients too
    for block in model.blocks:
        assert block.attn.o_proj.weight.grad.abs().sum() > 0 and block.mlp.down_proj.weight.grad.abs().sum() > 0


# --- what cannot express them ------------------------------------------------------------------

@pytest.mark.parametrize("changes,switch", [
    (dict(mlp="relu2"), "model.mlp = relu2"),
    (dict(logit_softcap=30.0), "model.logit_softcap = 30"),
    (dict(position="rope", norm="rmsnorm", mlp="swiglu", logit_softcap=15.0), "model.logit_softcap = 15"),
    (dict(preset="moe-tiny", mlp="relu2"), "model.mlp = relu2"),
])
def test_hugging_face_export_refuses_the_switches(changes, switch):
    from slipstream.models.hf import hf_family

    preset = changes.pop("preset", "tiny")
    with pytest.raises(UserError, match=switch):
        hf_family(_cfg(preset, **changes))


def test_relu2_experts_under_expert_parallelism_dispatch(tmp_path):
    """Expert parallelism's dispatch computes the experts with the model's activation: on a 1-rank
    group (the all-to-alls are identities) it equals the local relu2 experts, not gelu ones."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from slipstream.distributed.expert_parallel import ExpertDispatch
    from slipstream.models.moe import expert_ffn

    load_config(None, ["--model.preset=moe-tiny", "--model.mlp=relu2", "--parallel.ep=2", "--train.seq_len=64"])
    experts, d, h = 4, 8, 16
    g = torch.Generator().manual_seed(0)
    x, w_up, w_down = torch.randn(10, d, generator=g), torch.randn(experts, h, d, generator=g), torch.randn(experts, d, h, generator=g)
    counts = torch.tensor([3, 0, 5, 2])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
        sharded = [distribute_tensor(w, mesh, [Shard(0)]) for w in (w_up, w_down)]
        dispatch = ExpertDispatch(mesh.get_group(), ep=1, n_experts=experts)
        y = dispatch(x, counts, sharded[0], None, sharded[1], "loop", activation="relu2")
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(y, expert_ffn(x, counts, w_up, None, w_down, "loop", activation="relu2"))
    assert not torch.allclose(y, expert_ffn(x, counts, w_up, None, w_down, "loop"))


def test_negative_softcap_is_refused():
    with pytest.raises(UserError, match="logit_softcap"):
        load_config(None, ["--model.logit_softcap=-1"])


# --- QK-norm -----------------------------------------------------------------------------------------

def test_qk_norm_normalizes_each_heads_queries_and_keys_before_rope():
    """Attention with model.qk_norm equals the formula written here: RMS-normalize each head's
    queries and keys (times their own weights), then RoPE, causal attention, output projection."""
    from slipstream.models.transformer import apply_rope, rope_tables

    cfg = _cfg("llama-tiny", qk_norm=True)
    attn = build_model(cfg, seed=1).blocks[0].attn
    with torch.no_grad():  # weights away from 1, so a norm that skipped its weight shows
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    B, T, hd = 2, 16, attn.head_dim
    x = torch.randn(B, T, cfg.d_model, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_tables(hd, T, cfg.rope_theta)

    def heads(t):
        return t.view(B, T, -1, hd).transpose(1, 2)

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    q = apply_rope(rms(heads(attn.q_proj(x)), attn.q_norm.weight), cos, sin)
    k = apply_rope(rms(heads(attn.k_proj(x)), attn.k_norm.weight), cos, sin)
    v = heads(attn.v_proj(x))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=attn.n_kv_head != attn.n_head)
    expected = attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))
    torch.testing.assert_close(attn(x, rope=(cos, sin)), expected, rtol=1e-5, atol=1e-6)
    plain = build_model(_cfg("llama-tiny"), seed=1).blocks[0].attn  # the switch off: no norms, other output
    assert plain.q_norm is None and not torch.allclose(plain(x, rope=(cos, sin)), expected, atol=1e-3)
