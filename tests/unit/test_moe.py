"""The mixture-of-experts layer (models/moe.py) against an independent reference.

The reference below is a plain Python loop over tokens and experts, written from the
ModelConfig doc strings (the spec), not from the layer's code: router scores per token,
top-k on the scores plus the balancing bias (selection only), the weights from the unbiased
scores (softmax: renormalized when moe_norm_topk; sigmoid: always normalized over the chosen;
times moe_route_scale), each chosen expert's MLP with per-expert F.linear, shared experts on
every token, capacity dropping (capacity = ceil(factor x tokens x top_k / experts); first
choices before second choices, earlier tokens first), aux loss = n_experts x sum_i f_i P_i
(f = share of routed assignments, P = mean router probability; sigmoid scores normalized per
token) and z-loss = mean(logsumexp(logits)^2).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from slipstream.config.load import load_config
from slipstream.config.schema import ModelConfig
from slipstream.errors import UserError
from slipstream.models.moe import MoE, is_moe_layer, moe_layer_count, moe_layers
from slipstream.models.transformer import MLP, Block, build_model, lm_loss

# --- helpers ------------------------------------------------------------------------------------


def make_cfg(**overrides) -> ModelConfig:
    """A small MoE config: d_model 16, 4 experts of width 8, top-2, SwiGLU, no balancing losses
    (hidden and d_model are multiples of 4 so the grouped GEMM's 16-byte stride rule holds)."""
    base = dict(preset="moe-tiny", vocab_size=64, n_layer=2, n_head=2, n_kv_head=0, d_model=16, d_ff=0,
                mlp="swiglu", bias=False, moe_experts=4, moe_top_k=2, moe_expert_hidden=8,
                moe_aux_loss=0.0, moe_z_loss=0.0, moe_bias_rate=0.0, moe_gemm="auto")
    base.update(overrides)
    return dataclasses.replace(ModelConfig(), **base)


def make_layer(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, router_std: float = 1.0) -> MoE:
    with torch.device("meta"):
        layer = MoE(cfg)
    layer.to_empty(device="cpu")
    layer.reset_state()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            std = router_std if name.startswith("router") else 0.4
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    layer.to(dtype)
    layer.train()
    return layer


def set_aux_grad_scale(model: torch.nn.Module, scale: float) -> None:
    """What the training loop does per micro-batch (train/moe_monitor.py)."""
    for _, layer in moe_layers(model):
        layer.aux_grad_scale = scale


def end_moe_step(model: torch.nn.Module) -> None:
    """What the training loop does after each optimizer step."""
    for _, layer in moe_layers(model):
        layer.end_step()


def randn(*shape, seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def ref_params(layer: MoE) -> dict[str, torch.Tensor]:
    """Leaf copies of the layer's parameters for the reference's own autograd."""
    return {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()}


def tol(dtype, name: str = ""):
    """fp32: rounding of the loop vs the batched layer. float64: the layer computes the router logits,
    scores and weights in fp32 (`logits = self.router(tokens).float()`, meant as an upcast under
    autocast), so everything that depends on the routing weights carries fp32 rounding (~1e-7
    relative): 1e-5 there, 1e-6 for the output itself."""
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-4)
    return dict(atol=1e-6, rtol=1e-6) if name == "out" else dict(atol=1e-5, rtol=1e-5)


# --- the reference ------------------------------------------------------------------------------


@dataclass
class Ref:
    out: torch.Tensor            # (N, d)
    aux: torch.Tensor            # raw aux loss (no coefficient)
    z: torch.Tensor              # raw z-loss
    counts: list[int]            # routed assignments per expert (before capacity)
    chosen: list[list[int]]      # per token, experts in choice order
    dropped: set                 # {(token, slot)}


def _expert(cfg: ModelConfig, P, e: int, v: torch.Tensor) -> torch.Tensor:
    if cfg.mlp == "swiglu":
        h = F.silu(F.linear(v, P["experts.w_gate"][e])) * F.linear(v, P["experts.w_up"][e])
    else:
        h = F.gelu(F.linear(v, P["experts.w_up"][e]), approximate="tanh")
    return F.linear(h, P["experts.w_down"][e])


def _shared(cfg: ModelConfig, P, v: torch.Tensor) -> torch.Tensor:
    def lin(name, u):
        return F.linear(u, P[f"shared.{name}.weight"], P.get(f"shared.{name}.bias"))
    if cfg.mlp == "swiglu":
        h = F.silu(lin("gate_proj", v)) * lin("up_proj", v)
    else:
        h = F.gelu(lin("up_proj", v), approximate="tanh")
    return lin("down_proj", h)


def reference(cfg: ModelConfig, P, x: torch.Tensor, bias=None) -> Ref:
    E, k = cfg.moe_experts, cfg.moe_top_k
    N = x.shape[0]
    bias = [0.0] * E if bias is None else [float(b) for b in bias]
    routes, prob_rows, lse = [], [], []
    for t in range(N):
        logit = F.linear(x[t], P["router.weight"])
        lse.append(torch.logsumexp(logit, 0))
        if cfg.moe_router == "softmax":
            s = torch.softmax(logit, 0)
            prob_rows.append(s)
        else:
            s = torch.sigmoid(logit)
            prob_rows.append(s / s.sum())
        key = [v + b for v, b in zip(s.detach().tolist(), bias)]
        chosen = sorted(range(E), key=lambda e: -key[e])[:k]
        w = torch.stack([s[e] for e in chosen])
        if cfg.moe_router == "sigmoid" or cfg.moe_norm_topk:
            w = w / w.sum()
        w = w * cfg.moe_route_scale
        routes.append(list(zip(chosen, w)))

    kept = {(t, j) for t in range(N) for j in range(k)}
    if not cfg.moe_dropless:
        capacity = math.ceil(cfg.moe_capacity_factor * N * k / E)
        used, kept = [0] * E, set()
        for j in range(k):            # first choices before second choices
            for t in range(N):        # earlier tokens first
                e = routes[t][j][0]
                if used[e] < capacity:
                    used[e] += 1
                    kept.add((t, j))

    outs = []
    for t in range(N):
        y = torch.zeros_like(x[t])
        for j, (e, w) in enumerate(routes[t]):
            if (t, j) in kept:
                y = y + w * _expert(cfg, P, e, x[t])
        if cfg.moe_shared_experts:
            y = y + _shared(cfg, P, x[t])
        outs.append(y)

    counts = [sum(1 for r in routes for e, _ in r if e == i) for i in range(E)]
    f = torch.tensor(counts, dtype=x.dtype) / (N * k)
    aux = E * (f * torch.stack(prob_rows).mean(0)).sum()
    z = torch.stack(lse).square().mean()
    dropped = {(t, j) for t in range(N) for j in range(k)} - kept
    return Ref(torch.stack(outs), aux, z, counts, [[e for e, _ in r] for r in routes], dropped)


def run_layer(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    return layer(x).reshape(-1, x.shape[-1])


# --- forward vs the reference -------------------------------------------------------------------

FORWARD_CASES = {
    "softmax-top1-norm": dict(moe_top_k=1, moe_norm_topk=True),
    "softmax-top1-raw": dict(moe_top_k=1, moe_norm_topk=False),
    "softmax-top2-norm": dict(moe_top_k=2, moe_norm_topk=True),
    "softmax-top2-raw": dict(moe_top_k=2, moe_norm_topk=False),
    "softmax-top3-of-6": dict(moe_experts=6, moe_top_k=3, moe_norm_topk=False),
    "sigmoid-scale": dict(moe_router="sigmoid", moe_route_scale=2.5),
    "sigmoid-top1": dict(moe_router="sigmoid", moe_top_k=1, moe_norm_topk=False),
    "softmax-scale-raw": dict(moe_norm_topk=False, moe_route_scale=1.7),
    "shared-swiglu": dict(moe_shared_experts=2),
    "shared-gelu-bias": dict(mlp="gelu", bias=True, moe_shared_experts=1),
    "gelu": dict(mlp="gelu"),
    "gelu-sigmoid": dict(mlp="gelu", moe_router="sigmoid", moe_route_scale=0.5),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_matches_reference(case, dtype):
    cfg = make_cfg(**FORWARD_CASES[case])
    layer = make_layer(cfg, dtype=dtype)
    x = randn(2, 6, cfg.d_model, dtype=dtype)
    y = run_layer(layer, x)
    ref = reference(cfg, ref_params(layer), x.reshape(-1, cfg.d_model))
    assert y.dtype == dtype
    torch.testing.assert_close(y, ref.out.detach(), **tol(dtype, "out"))
    # eval mode (no stats, no aux injection) gives the same output
    layer.eval()
    torch.testing.assert_close(run_layer(layer, x), y.detach(), atol=0, rtol=0)


def test_weights_use_route_scale_and_raw_probabilities():
    """Hand check of one token: softmax top-2 with norm_topk false and route_scale 3 gives
    3 x p_e (the raw probabilities) per chosen expert."""
    cfg = make_cfg(moe_norm_topk=False, moe_route_scale=3.0, moe_top_k=2)
    layer = make_layer(cfg)
    x = randn(1, 1, cfg.d_model)
    with torch.no_grad():
        p = torch.softmax(F.linear(x[0, 0], layer.router.weight), 0)
        top = torch.topk(p, 2).indices.tolist()
        P = dict(layer.named_parameters())
        want = sum(3.0 * p[e] * _expert(cfg, P, e, x[0, 0]) for e in top)
        torch.testing.assert_close(run_layer(layer, x)[0], want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("gemm", ["grouped", "loop"])
def test_expert_with_no_tokens(gemm):
    """Expert 3's bias pushes it out of every top-2: the layer still matches, expert 3 gets a zero
    gradient (not an error in the grouped GEMM's empty group)."""
    cfg = make_cfg(moe_gemm=gemm)
    layer = make_layer(cfg)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, -10.0]))
    x = randn(2, 5, cfg.d_model)
    y = run_layer(layer, x)
    ref = reference(cfg, ref_params(layer), x.reshape(-1, cfg.d_model), bias=layer.expert_bias)
    assert ref.counts[3] == 0 and all(c > 0 for c in ref.counts[:3])
    torch.testing.assert_close(y, ref.out.detach(), atol=1e-5, rtol=1e-4)
    y.sum().backward()
    for w in (layer.experts.w_up, layer.experts.w_gate, layer.experts.w_down):
        assert w.grad is not None and torch.all(w.grad[3] == 0) and w.grad[:3].abs().sum() > 0
    assert layer.stats.take()["load"][3] == 0.0


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("gemm", ["grouped", "loop"])
def test_all_tokens_to_one_expert(top_k, gemm):
    """A hand-set router (logits = [-1, -2, 5, -3] x a positive feature) sends every token first
    to expert 2 (and second to expert 0)."""
    cfg = make_cfg(moe_top_k=top_k, moe_gemm=gemm, moe_norm_topk=False)
    layer = make_layer(cfg)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, 0] = torch.tensor([-1.0, -2.0, 5.0, -3.0])
    x = randn(2, 6, cfg.d_model)
    x[..., 0] = x[..., 0].abs() + 0.5
    y = run_layer(layer, x)
    ref = reference(cfg, ref_params(layer), x.reshape(-1, cfg.d_model))
    assert all(c[0] == 2 for c in ref.chosen) and ref.counts[2] == 12
    if top_k == 2:
        assert all(c[1] == 0 for c in ref.chosen)
    torch.testing.assert_close(y, ref.out.detach(), atol=1e-5, rtol=1e-4)
    y.sum().backward()
    stats = layer.stats.take()
    want_load = [0.0, 0.0, 1.0, 0.0] if top_k == 1 else [0.5, 0.0, 0.5, 0.0]
    assert stats["load"] == want_load
    assert stats["imbalance"] == pytest.approx(4.0 if top_k == 1 else 2.0)
    assert torch.all(layer.experts.w_up.grad[1] == 0) and torch.all(layer.experts.w_up.grad[3] == 0)


# --- gradients ----------------------------------------------------------------------------------

GRAD_CASES = {
    "softmax-top2-norm": dict(),
    "softmax-top2-raw": dict(moe_norm_topk=False),
    "softmax-top1-norm": dict(moe_top_k=1),
    "softmax-top1-raw": dict(moe_top_k=1, moe_norm_topk=False),
    "sigmoid-scale-shared": dict(moe_router="sigmoid", moe_route_scale=2.5, moe_shared_experts=1),
    "gelu-shared-bias": dict(mlp="gelu", bias=True, moe_shared_experts=2, moe_norm_topk=False),
}


def _grads(named_params) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in named_params if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradients_match_reference(case, dtype):
    cfg = make_cfg(**GRAD_CASES[case])
    layer = make_layer(cfg, dtype=dtype)
    x = randn(2, 6, cfg.d_model, dtype=dtype).requires_grad_()
    run_layer(layer, x).sum().backward()
    P = ref_params(layer)
    xr = x.detach().clone().requires_grad_()
    reference(cfg, P, xr.reshape(-1, cfg.d_model)).out.sum().backward()
    got = _grads(layer.named_parameters())
    assert set(got) == set(P)
    for name, p in P.items():
        torch.testing.assert_close(got[name], p.grad, **tol(dtype, name), msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(x.grad, xr.grad, **tol(dtype, "x"))
    if case == "softmax-top1-norm":  # one weight normalized to 1 (p / p): the output gives the router ~nothing
        assert got["router.weight"].abs().max() < 1e-5


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("which", ["aux", "z", "both"])
def test_balancing_losses_add_their_gradient_in_backward(router, which):
    """output.sum().backward() with the balancing losses on = the reference's gradient of
    output.sum() + scale x (aux_coef x aux + z_coef x z): the router (and the input) get exactly
    coef x d(loss)/d(.) x aux_grad_scale more; the experts get nothing from them."""
    aux_coef = 3.0 if which in ("aux", "both") else 0.0
    z_coef = 0.5 if which in ("z", "both") else 0.0
    scale = 0.25
    cfg = make_cfg(moe_router=router, moe_aux_loss=aux_coef, moe_z_loss=z_coef)
    dtype = torch.float64
    x = randn(2, 6, cfg.d_model, dtype=dtype)

    plain = make_layer(make_cfg(moe_router=router), dtype=dtype)
    xp = x.clone().requires_grad_()
    run_layer(plain, xp).sum().backward()
    g_plain = _grads(plain.named_parameters())

    layer = make_layer(cfg, dtype=dtype)
    layer.aux_grad_scale = scale
    xl = x.clone().requires_grad_()
    run_layer(layer, xl).sum().backward()
    g_layer = _grads(layer.named_parameters())

    P = ref_params(layer)
    xr = x.clone().requires_grad_()
    ref = reference(cfg, P, xr.reshape(-1, cfg.d_model))
    balancing = scale * (aux_coef * ref.aux + z_coef * ref.z)
    d_router, d_x = torch.autograd.grad(balancing, [P["router.weight"], xr], retain_graph=True)
    assert d_router.abs().max() > 2e-3  # the check below is not vacuous
    (ref.out.sum() + balancing).backward()

    for name, p in P.items():
        torch.testing.assert_close(g_layer[name], p.grad, **tol(dtype, name), msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(xl.grad, xr.grad, **tol(dtype, "x"))
    # exactly the balancing term on top of the output's gradient (to the fp32 routing's rounding)
    torch.testing.assert_close(g_layer["router.weight"] - g_plain["router.weight"], d_router, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xl.grad - xp.grad, d_x, atol=1e-5, rtol=1e-5)
    for name in ("experts.w_up", "experts.w_gate", "experts.w_down"):
        torch.testing.assert_close(g_layer[name], g_plain[name], atol=1e-12, rtol=0)
    # the statistics hold the raw (coefficient-free) values
    stats = layer.stats.take()
    assert stats["aux_loss"] == (pytest.approx(ref.aux.item(), rel=1e-5) if aux_coef else 0.0)
    assert stats["z_loss"] == (pytest.approx(ref.z.item(), rel=1e-5) if z_coef else 0.0)


def test_aux_grad_scale_scales_linearly():
    cfg = make_cfg(moe_aux_loss=5.0)
    x = randn(2, 6, cfg.d_model, dtype=torch.float64)
    diffs = []
    for scale in (0.0, 1.0, 0.5):
        layer = make_layer(cfg, dtype=torch.float64)
        set_aux_grad_scale(layer, scale)
        assert layer.aux_grad_scale == scale
        run_layer(layer, x).sum().backward()
        diffs.append(layer.router.weight.grad.clone())
    base, full, half = diffs
    torch.testing.assert_close(half - base, 0.5 * (full - base), atol=1e-5, rtol=1e-5)
    assert (full - base).abs().max() > 0.05


# --- capacity -----------------------------------------------------------------------------------


def _logit_layer(cfg: ModelConfig, logits: torch.Tensor) -> tuple[MoE, torch.Tensor]:
    """d_model = experts, router weight = identity: the input rows are the router logits."""
    layer = make_layer(cfg)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(cfg.moe_experts))
    return layer, logits.reshape(1, -1, cfg.moe_experts).clone()


def test_capacity_priority_hand_case():
    """4 tokens, top-2 of 4 experts, factor 1 -> capacity ceil(1 x 4 x 2 / 4) = 2.
    expert 1 is asked by token 0 (second choice) and tokens 1, 2 (first choices): token 0's second
    choice is dropped; expert 2 by tokens 1, 2 (second) and 3 (first): token 3 and then token 1
    (earlier) are kept, token 2's second choice is dropped."""
    cfg = make_cfg(d_model=4, moe_dropless=False, moe_capacity_factor=1.0, moe_norm_topk=False)
    logits = torch.tensor([[2.0, 1.0, -5.0, -5.0],
                           [-5.0, 2.0, 1.0, -5.0],
                           [-5.0, 2.0, 1.0, -5.0],
                           [-5.0, -5.0, 2.0, 1.0]])
    for gemm in ("grouped", "loop"):
        layer, x = _logit_layer(dataclasses.replace(cfg, moe_gemm=gemm), logits)
        y = run_layer(layer, x)
        P = dict(layer.named_parameters())
        ref = reference(cfg, P, x[0])
        assert ref.dropped == {(0, 1), (2, 1)}
        with torch.no_grad():
            p = torch.softmax(logits, -1)
            want = torch.stack([p[0, 0] * _expert(cfg, P, 0, x[0, 0]),
                                p[1, 1] * _expert(cfg, P, 1, x[0, 1]) + p[1, 2] * _expert(cfg, P, 2, x[0, 1]),
                                p[2, 1] * _expert(cfg, P, 1, x[0, 2]),
                                p[3, 2] * _expert(cfg, P, 2, x[0, 3]) + p[3, 3] * _expert(cfg, P, 3, x[0, 3])])
        torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(y, ref.out.detach(), atol=1e-6, rtol=1e-5)
        y.sum().backward()
        stats = layer.stats.take()
        assert stats["dropped"] == pytest.approx(0.25)
        assert stats["load"] == [0.125, 0.375, 0.375, 0.125]  # routed (before capacity) shares


def test_capacity_all_first_choices_to_one_expert():
    """Every token's first choice is expert 0, second expert 1 (bias); capacity ceil(1 x 6 x 2 / 4) = 3:
    tokens 0-2 keep both choices, tokens 3-5 keep nothing routed (only the shared expert)."""
    cfg = make_cfg(moe_dropless=False, moe_capacity_factor=1.0, moe_shared_experts=1)
    layer = make_layer(cfg)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([10.0, 5.0, 0.0, 0.0]))
    x = randn(1, 6, cfg.d_model)
    y = run_layer(layer, x)
    P = dict(layer.named_parameters())
    ref = reference(cfg, P, x[0], bias=layer.expert_bias)
    assert ref.dropped == {(t, j) for t in range(3, 6) for j in range(2)}
    torch.testing.assert_close(y, ref.out.detach(), atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(y[3:], torch.stack([_shared(cfg, P, x[0, t]) for t in range(3, 6)]),
                                   atol=1e-6, rtol=1e-5)
    assert layer.stats.take()["dropped"] == pytest.approx(0.5)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("factor", [0.5, 0.75, 1.0])
@pytest.mark.parametrize("gemm", ["grouped", "loop"])
def test_capacity_random_matches_reference(router, factor, gemm):
    cfg = make_cfg(moe_router=router, moe_dropless=False, moe_capacity_factor=factor, moe_gemm=gemm,
                   moe_aux_loss=0.1)
    layer = make_layer(cfg, seed=3)
    x = randn(3, 4, cfg.d_model, seed=4).requires_grad_()
    y = run_layer(layer, x)
    P = ref_params(layer)
    xr = x.detach().clone().requires_grad_()
    ref = reference(cfg, P, xr.reshape(-1, cfg.d_model))
    assert ref.dropped, "the case must drop something"
    torch.testing.assert_close(y, ref.out.detach(), atol=1e-5, rtol=1e-4)
    y.sum().backward()
    (ref.out.sum() + 0.1 * ref.aux).backward()  # f counts the routed assignments, dropped ones included
    for name, p in P.items():
        torch.testing.assert_close(dict(layer.named_parameters())[name].grad, p.grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-4)
    stats = layer.stats.take()
    assert stats["dropped"] == pytest.approx(len(ref.dropped) / (12 * cfg.moe_top_k))


def test_dropless_drops_nothing():
    cfg = make_cfg(moe_dropless=True, moe_capacity_factor=0.1)  # the factor is ignored when dropless
    layer = make_layer(cfg)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([10.0, 5.0, 0.0, 0.0]))  # everything to experts 0 and 1
    x = randn(2, 6, cfg.d_model)
    y = run_layer(layer, x)
    ref = reference(cfg, ref_params(layer), x.reshape(-1, cfg.d_model), bias=layer.expert_bias)
    assert not ref.dropped and ref.counts == [12, 12, 0, 0]
    torch.testing.assert_close(y, ref.out.detach(), atol=1e-5, rtol=1e-4)
    assert layer.stats.take()["dropped"] == 0.0


# --- grouped GEMM vs a matmul per expert ---------------------------------------------------------

GEMM_CASES = {
    "swiglu": dict(),
    "gelu-shared": dict(mlp="gelu", bias=True, moe_shared_experts=1),
    "sigmoid-8-experts-top3": dict(moe_router="sigmoid", moe_experts=8, moe_top_k=3, moe_route_scale=2.0),
    "capacity": dict(moe_dropless=False, moe_capacity_factor=0.75, moe_aux_loss=0.1, moe_z_loss=0.01),
}


@pytest.mark.parametrize("case", list(GEMM_CASES))
def test_grouped_and_loop_agree(case):
    outs, grads = {}, {}
    for gemm in ("grouped", "loop", "auto"):
        cfg = make_cfg(moe_gemm=gemm, **GEMM_CASES[case])
        layer = make_layer(cfg, seed=5)
        x = randn(4, 8, cfg.d_model, seed=6).requires_grad_()
        y = layer(x)
        y.backward(randn(*y.shape, seed=7))
        outs[gemm] = y.detach()
        grads[gemm] = {**_grads(layer.named_parameters()), "x": x.grad}
    for other in ("loop", "auto"):
        torch.testing.assert_close(outs[other], outs["grouped"], atol=1e-6, rtol=1e-6)
        for name, g in grads["grouped"].items():
            torch.testing.assert_close(grads[other][name], g, atol=1e-6, rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_auto_gemm_with_unaligned_widths():
    """moe_gemm=auto must work for any valid width: "grouped where torch supports it for the device
    and dtype", "same results either way". d_model = 6 and an expert width of 6 are valid configs."""
    for d, h in ((6, 8), (8, 6)):
        cfg = make_cfg(d_model=d, moe_expert_hidden=h, moe_gemm="auto")
        loop = make_layer(dataclasses.replace(cfg, moe_gemm="loop"))
        auto = make_layer(cfg)
        x = randn(2, 3, d)
        want = loop(x)
        try:
            got = auto(x)
        except RuntimeError as e:
            pytest.fail(f"BUG moe.py: moe_gemm=auto picks torch._grouped_mm on CPU fp32 for d_model={d}, "
                        f"expert hidden={h}, which it cannot run ({e}); grouped_mm_supported() only probes "
                        "the device and dtype (with an aligned 16x16 case), not the 16-byte stride rule of "
                        "the actual widths, so auto should fall back to the loop there")
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


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
