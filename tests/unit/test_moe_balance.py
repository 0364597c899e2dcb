"""The mixture-of-experts layer, continued: the auxiliary-loss-free balancing bias, the routing
statistics, the layer inside the whole model, and bad configurations. The reference and the
helpers are test_moe.py's."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from slipstream.config.load import load_config
from slipstream.errors import UserError
from slipstream.models.moe import MoE, is_moe_layer, moe_layer_count, moe_layers
from slipstream.models.transformer import MLP, Block, build_model, lm_loss
from test_moe import (_expert, _grads, _logit_layer, end_moe_step, make_cfg, make_layer, randn, reference, run_layer,
                      set_aux_grad_scale)


# --- the balancing bias -------------------------------------------------------------------------

TOKENS_3_2_0_0 = torch.tensor([[3.0, 0.0, 0.0, 0.0],
                               [2.0, 1.0, 0.0, -1.0],
                               [1.0, 0.0, -1.0, 0.0],
                               [0.0, 3.0, 1.0, 0.0],
                               [-1.0, 2.0, 0.0, 0.0]])  # top-1 -> experts 0, 0, 0, 1, 1


def test_bias_moves_toward_balance_by_exactly_the_rate():
    cfg = make_cfg(d_model=4, moe_top_k=1, moe_bias_rate=0.125)
    layer, x = _logit_layer(cfg, TOKENS_3_2_0_0)
    layer(x)  # counts [3, 2, 0, 0], mean 1.25
    assert torch.equal(layer.expert_bias, torch.zeros(4))  # only end_step moves it
    layer.end_step()
    assert layer.expert_bias.tolist() == [-0.125, -0.125, 0.125, 0.125]
    layer.end_step()  # no forward since: nothing to move by
    assert layer.expert_bias.tolist() == [-0.125, -0.125, 0.125, 0.125]
    # two micro-batches in one step: their counts add up; [3, 1, 0, 0] x 2 -> mean 2, expert 1 at the mean
    layer2, x2 = _logit_layer(cfg, TOKENS_3_2_0_0[[0, 1, 2, 3]])
    layer2(x2)
    layer2(x2)
    layer2.stats.take()  # a log interval in between does not lose the step's counts
    layer2.end_step()
    assert layer2.expert_bias.tolist() == [-0.125, 0.0, 0.125, 0.125]


def test_bias_not_moved_outside_training_or_when_rate_is_zero():
    cfg = make_cfg(d_model=4, moe_top_k=1, moe_bias_rate=0.125)
    layer, x = _logit_layer(cfg, TOKENS_3_2_0_0)
    layer.eval()
    layer(x)
    layer.train()
    with torch.no_grad():
        layer(x)
    layer.end_step()
    assert torch.equal(layer.expert_bias, torch.zeros(4))
    assert layer.stats.take() is None
    off, x = _logit_layer(dataclasses.replace(cfg, moe_bias_rate=0.0), TOKENS_3_2_0_0)
    off(x)
    off.end_step()
    assert torch.equal(off.expert_bias, torch.zeros(4))


def test_end_moe_step_on_a_model():
    cfg = load_config(None, ["--model.preset=moe-tiny", "--model.vocab_size=64", "--model.moe_bias_rate=0.01"]).model
    model = build_model(cfg, seed=0)
    model(torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))).sum().backward()
    end_moe_step(model)
    for _, layer in moe_layers(model):
        bias = layer.expert_bias
        counts = layer.stats.take()["load"]
        mean = sum(counts) / len(counts)
        # over-loaded experts went down by the rate, under-loaded ones up
        want = [0.01 if c < mean else -0.01 if c > mean else 0.0 for c in counts]
        assert bias.tolist() == pytest.approx(want, abs=1e-9) and bias.abs().sum() > 0


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_bias_changes_selection_not_weights(router):
    """A bias toward expert 3 makes it every token's top-1; its weight stays the unbiased score."""
    cfg = make_cfg(d_model=4, moe_top_k=1, moe_norm_topk=False, moe_router=router)
    layer, x = _logit_layer(cfg, TOKENS_3_2_0_0)
    y0 = run_layer(layer, x)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    y = run_layer(layer, x)
    P = dict(layer.named_parameters())
    ref = reference(cfg, P, x[0], bias=layer.expert_bias)
    assert all(c == [3] for c in ref.chosen)
    torch.testing.assert_close(y, ref.out.detach(), atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        if router == "softmax":
            w = torch.softmax(TOKENS_3_2_0_0, -1)[:, 3]
        else:
            w = torch.ones(5)  # sigmoid: normalized over the single chosen expert
        want = torch.stack([w[t] * _expert(cfg, P, 3, x[0, t]) for t in range(5)])
    torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(y, y0)
    # two experts, sigmoid: the weights are the unbiased sigmoids normalized over the chosen pair
    if router == "sigmoid":
        cfg2 = dataclasses.replace(cfg, moe_top_k=2)
        layer2, x2 = _logit_layer(cfg2, TOKENS_3_2_0_0)
        with torch.no_grad():
            layer2.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 10.5]))
            s = torch.sigmoid(TOKENS_3_2_0_0)
            P2 = dict(layer2.named_parameters())
            want2 = torch.stack([(s[t, 3] * _expert(cfg2, P2, 3, x2[0, t]) + s[t, 2] * _expert(cfg2, P2, 2, x2[0, t]))
                                 / (s[t, 2] + s[t, 3]) for t in range(5)])
        torch.testing.assert_close(run_layer(layer2, x2), want2, atol=1e-6, rtol=1e-5)


def test_reduce_counts_seam_sets_f_and_the_bias():
    """`reduce_counts` (data parallelism's all-reduce of the counts) decides f of the aux loss, the
    logged load and the bias update; P stays this process's mean probability."""
    cfg = make_cfg(d_model=4, moe_top_k=1, moe_aux_loss=1.0, moe_bias_rate=0.5)
    layer, x = _logit_layer(cfg, TOKENS_3_2_0_0)  # local counts [3, 2, 0, 0]
    other = torch.tensor([0, 0, 1, 6])            # "another rank's" counts
    layer.reduce_counts = lambda counts: counts + other
    x = x.requires_grad_()
    layer(x).sum().backward()
    f = [3 / 12, 2 / 12, 1 / 12, 6 / 12]
    probs = _softmax_rows(TOKENS_3_2_0_0.tolist())
    P = [sum(p[i] for p in probs) / 5 for i in range(4)]
    stats = layer.stats.take()
    assert stats["aux_loss"] == pytest.approx(4 * sum(a * b for a, b in zip(f, P)), rel=1e-6)
    assert stats["load"] == pytest.approx(f, abs=1e-6)
    layer.end_step()  # global counts [3, 2, 1, 6], mean 3: expert 0 at the mean
    assert layer.expert_bias.tolist() == [0.0, 0.5, 0.5, -0.5]
    # the aux gradient uses the global f: d/dlogits of 4 sum_i f_i mean_t p_ti
    logits = TOKENS_3_2_0_0.double().requires_grad_()
    aux = 4 * (torch.tensor(f, dtype=torch.float64) * torch.softmax(logits, -1).mean(0)).sum()
    (d_logits,) = torch.autograd.grad(aux, logits)
    layer2, x2 = _logit_layer(dataclasses.replace(cfg, moe_aux_loss=0.0), TOKENS_3_2_0_0)
    x2 = x2.requires_grad_()
    layer2(x2).sum().backward()  # the same parameters (seed 0), no aux: the output's gradient alone
    torch.testing.assert_close((x.grad - x2.grad)[0].double(), d_logits, atol=1e-6, rtol=1e-5)


# --- statistics ---------------------------------------------------------------------------------


def _softmax_rows(rows):
    out = []
    for r in rows:
        m = max(r)
        e = [math.exp(v - m) for v in r]
        out.append([v / sum(e) for v in e])
    return out


def test_stats_hand_computed():
    cfg = make_cfg(d_model=4, moe_top_k=1, moe_aux_loss=0.01, moe_z_loss=0.001)
    layer, x = _logit_layer(cfg, TOKENS_3_2_0_0)
    layer(x).sum().backward()
    rows = TOKENS_3_2_0_0.tolist()
    probs = _softmax_rows(rows)
    P = [sum(p[i] for p in probs) / 5 for i in range(4)]
    f = [3 / 5, 2 / 5, 0.0, 0.0]
    aux = 4 * sum(fi * pi for fi, pi in zip(f, P))
    z = sum(math.log(sum(math.exp(v) for v in r)) ** 2 for r in rows) / 5
    stats = layer.stats.take()
    assert stats["load"] == [0.6, 0.4, 0.0, 0.0]
    assert stats["imbalance"] == pytest.approx(3 / 1.25)
    assert stats["dropped"] == 0.0
    assert stats["aux_loss"] == pytest.approx(aux, rel=1e-6)
    assert stats["z_loss"] == pytest.approx(z, rel=1e-6)
    assert layer.stats.take() is None  # take() resets

    # two calls in one interval: counts add, losses average
    layer(x)
    layer(TOKENS_3_2_0_0[[3, 4]].reshape(1, 2, 4))  # experts 1, 1
    stats = layer.stats.take()
    probs2 = _softmax_rows(rows[3:])
    aux2 = 4 * (1.0 * sum(p[1] for p in probs2) / 2)  # f = [0, 1, 0, 0]
    z2 = sum(math.log(sum(math.exp(v) for v in r)) ** 2 for r in rows[3:]) / 2
    assert stats["load"] == pytest.approx([3 / 7, 4 / 7, 0.0, 0.0], abs=1e-6)
    assert stats["imbalance"] == pytest.approx(4 / (7 / 4))
    assert stats["aux_loss"] == pytest.approx((aux + aux2) / 2, rel=1e-6)
    assert stats["z_loss"] == pytest.approx((z + z2) / 2, rel=1e-6)


def test_stats_sigmoid_aux_uses_normalized_scores():
    cfg = make_cfg(d_model=4, moe_top_k=2, moe_router="sigmoid", moe_aux_loss=0.01)
    rows = [[3.0, 0.5, -1.0, 0.2], [2.0, 1.0, 0.1, -1.0], [1.0, 0.3, -1.0, 0.6],
            [0.0, 3.0, 1.0, -0.4], [-1.0, 2.0, 0.7, 0.1]]  # no ties in any top-2
    layer, x = _logit_layer(cfg, torch.tensor(rows))
    layer(x)
    sig = [[1 / (1 + math.exp(-v)) for v in r] for r in rows]
    norm = [[v / sum(r) for v in r] for r in sig]
    P = [sum(r[i] for r in norm) / 5 for i in range(4)]
    counts = [0] * 4
    for r in sig:
        for e in sorted(range(4), key=lambda i: -r[i])[:2]:
            counts[e] += 1
    aux = 4 * sum(c / 10 * p for c, p in zip(counts, P))
    stats = layer.stats.take()
    assert stats["load"] == [round(c / 10, 6) for c in counts]
    assert stats["aux_loss"] == pytest.approx(aux, rel=1e-6)


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "full-recompute"])
@pytest.mark.parametrize("wrap", ["layer", "block"])
def test_no_double_counting_under_activation_checkpointing(wrap, early_stop):
    """Without early stop, the recomputation in backward runs the whole forward again (with it,
    torch stops at the last saved tensor, before the layer records its statistics)."""
    cfg = make_cfg(moe_aux_loss=0.1, moe_z_loss=0.01, moe_bias_rate=0.01)
    x = randn(2, 6, cfg.d_model, seed=9)
    results = []
    for use_checkpoint in (False, True):
        torch.manual_seed(0)
        if wrap == "layer":
            module = make_layer(cfg, seed=2)
            layer = module
            fn = module
        else:
            module = Block(cfg, 0)
            gen = torch.Generator().manual_seed(2)
            with torch.no_grad():
                for p in module.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            module.mlp.reset_state()
            layer = module.mlp
            fn = lambda h: module(h, None)  # noqa: E731
        assert isinstance(layer, MoE)
        xi = x.clone().requires_grad_()
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            y = checkpoint(fn, xi, use_reentrant=False) if use_checkpoint else fn(xi)
            assert layer.stats.calls == 1
            y.square().sum().backward()
        assert layer.stats.calls == 1, "the recomputed forward in backward counted its tokens again"
        step_counts = layer.stats.step_counts.clone()
        stats = layer.stats.take()
        layer.end_step()
        results.append((stats, step_counts, _grads(module.named_parameters()), xi.grad, layer.expert_bias.clone()))
    (s0, c0, g0, x0, b0), (s1, c1, g1, x1, b1) = results
    assert s0 == s1
    assert torch.equal(c0, c1) and int(c0.sum()) == 12 * cfg.moe_top_k
    assert torch.equal(b0, b1)
    assert g0.keys() == g1.keys()
    for name in g0:  # the balancing losses' gradient is added once, checkpointed or not
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(x1, x0, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_model_checkpointing_counts_once(mode):
    from slipstream.optimize.activations import apply_activation_checkpointing

    cfg = load_config(None, ["--model.preset=moe-tiny", "--model.vocab_size=64", "--model.moe_z_loss=0.001"]).model
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    seen = []
    for wrapped in (False, True):
        model = build_model(cfg, seed=0)
        if wrapped:
            model = apply_activation_checkpointing(model, mode)
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recompute the whole block
            lm_loss(model(idx[:, :-1].contiguous()), idx[:, 1:].contiguous()).backward()
        layers = moe_layers(model)
        assert [n for n, _ in layers] == ["blocks.0", "blocks.1"]
        seen.append([(layer.stats.calls, layer.stats.take(), layer.experts.w_up.grad.clone(),
                      layer.router.weight.grad.clone()) for _, layer in layers])
    for (c0, s0, w0, r0), (c1, s1, w1, r1) in zip(*seen):
        assert c0 == c1 == 1
        assert s0["load"] == s1["load"] and s0["dropped"] == s1["dropped"]
        assert s0["aux_loss"] == pytest.approx(s1["aux_loss"], rel=1e-6)
        assert s0["z_loss"] == pytest.approx(s1["z_loss"], rel=1e-6)
        torch.testing.assert_close(w1, w0, atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(r1, r0, atol=1e-7, rtol=1e-5)


# --- the whole model ----------------------------------------------------------------------------


def test_moe_tiny_trains():
    cfg = load_config(None, ["--model.preset=moe-tiny", "--model.vocab_size=64", "--model.moe_z_loss=0.001",
                             "--model.moe_bias_rate=0.001"]).model
    model = build_model(cfg, seed=0)
    assert moe_layer_count(cfg) == 2 and all(isinstance(b.mlp, MoE) for b in model.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 64, (4, 33), generator=gen)
    inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    set_aux_grad_scale(model, 1.0)
    losses = []
    for _ in range(25):
        loss = lm_loss(model(inputs), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        end_moe_step(model)
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 1.0, losses
    for _, layer in moe_layers(model):
        stats = layer.stats.take()
        assert sum(stats["load"]) == pytest.approx(1.0, abs=1e-5)
        assert stats["aux_loss"] > 0 and stats["z_loss"] > 0
        assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


def test_moe_every_and_first_dense_choose_blocks():
    cfg = load_config(None, ["--model.preset=moe-tiny", "--model.vocab_size=64", "--model.n_layer=6",
                             "--model.moe_every=2", "--model.moe_first_dense=1"]).model
    assert [i for i in range(6) if is_moe_layer(cfg, i)] == [1, 3, 5]
    assert moe_layer_count(cfg) == 3
    model = build_model(cfg, seed=0)
    kinds = [type(b.mlp) for b in model.blocks]
    assert kinds == [MLP, MoE, MLP, MoE, MLP, MoE]
    assert [n for n, _ in moe_layers(model)] == ["blocks.1", "blocks.3", "blocks.5"]
    cfg5 = dataclasses.replace(cfg, n_layer=5, moe_first_dense=2, moe_every=2)
    assert [i for i in range(5) if is_moe_layer(cfg5, i)] == [2, 4]
    dense = dataclasses.replace(cfg, moe_experts=0)
    assert not any(is_moe_layer(dense, i) for i in range(6))
    # the model runs, and eval output does not depend on the (unused) stats
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model.eval()
    assert torch.isfinite(model(idx)[..., :64]).all()


def test_model_init_is_deterministic_and_resets_state():
    cfg = load_config(None, ["--model.preset=moe-tiny", "--model.vocab_size=64"]).model
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n
    for _, layer in moe_layers(a):
        assert torch.equal(layer.expert_bias, torch.zeros(cfg.moe_experts))
        assert "expert_bias" in dict(layer.named_buffers())
        assert layer.stats.take() is None


# --- bad configurations -------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, field", [
    (["--model.moe_top_k=5"], "moe_top_k"),
    (["--model.moe_capacity_factor=0"], "moe_capacity_factor"),
    (["--model.moe_capacity_factor=-1.5"], "moe_capacity_factor"),
    (["--model.moe_first_dense=2"], "moe_first_dense"),
    (["--parallel.ep=3"], "parallel.ep"),
    (["--model.preset=tiny", "--train.seq_len=64", "--parallel.ep=2"], "parallel.ep"),
])
def test_bad_config_raises_user_error(overrides, field):
    with pytest.raises(UserError, match=field.replace(".", r"\.")) as info:
        load_config(None, ["--model.preset=moe-tiny", "--model.vocab_size=64", *overrides])
    if field == "parallel.ep" and "tiny" not in overrides[0]:
        assert "moe_experts" in str(info.value)


def test_good_configs_load():
    load_config(None, ["--model.preset=moe-tiny", "--model.vocab_size=64", "--parallel.ep=2"])
    load_config(None, ["--model.preset=moe-tiny", "--model.vocab_size=64", "--model.moe_top_k=4",
                       "--model.moe_first_dense=1", "--model.moe_capacity_factor=0.01"])
    load_config(None, ["--model.preset=tiny", "--model.vocab_size=64", "--train.seq_len=64",
                       "--model.moe_top_k=9"])  # dense: ignored
