"""Dropout under tensor and context parallelism (issue 13): the same mask where an activation is
replicated, a mask of its own on every rank where it is sharded (distributed.sharded_dropout).

One torchrun launch per world size (tests/distributed/dropout_worker.py's scenarios, in the launch
this session's distributed modules share: tests/distributed/conftest.py) writes every rank's
dropout masks, per site, of two training forwards, and the loss and gradients of one step with
and without activation checkpointing. Here each scenario's masks are compared rank against rank
with the stream every rank must draw from (`_stream`): equal streams, equal masks; different
streams, different masks. A switch that is silently ignored fails either way: without the
per-rank streams the sharded masks repeat on every rank (the ranks draw from equal generators),
without the shared generator state the replicated masks differ (the worker seeds every rank
differently in the "rank" scenarios). The one-process tests check the hooks' bookkeeping and the
worker's attention-mask probe.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from slipstream.config import load_config
from slipstream.errors import UserError
from tests.distributed import dropout_worker as w

N_LAYER = 2  # the tiny preset's blocks: attention runs once per block, twice with AC's recompute
# Share of kept elements per site and rank (both forwards, >= 512 elements): 1 - p within 0.12,
# about 7 standard deviations; a dropout that never ran keeps everything.
KEEP_ATOL = 0.12


@pytest.fixture(scope="module")
def launches(shared_launches) -> dict[int, Path]:
    """world -> the folder of dropout_worker.py's scenarios in the shared launch of that world size."""
    parts = {world: shared_launches.part(world, "dropout") for world in (2, 4)}
    for part in parts.values():
        part.check()
    return {world: part.out for world, part in parts.items()}


CASES = [(world, sc["name"]) for world in (2, 4) for sc in w.SCENARIOS[world]]


def _scenario(world: int, name: str) -> dict:
    return {s["name"]: s for s in w.SCENARIOS[world]}[name]


def _ranks(launches: dict[int, Path], world: int, name: str) -> list[dict]:
    # The worker's own tensors (weights_only: no code runs).
    return [torch.load(launches[world] / name / f"rank{r}.pt", weights_only=True) for r in range(world)]


def _stream(sc: dict, rank: int, site: str) -> tuple:
    """What a rank's mask at `site` is drawn from: ranks with equal keys must drop the same elements.

    The mesh puts tp innermost, then cp, then the data-parallel dims. Attention is sharded over tp
    (heads); the embedding and residual dropouts only with sequence parallel; everything over cp.
    A rank's generators: seeded alike ("same"), or per rank ("rank") and then made equal inside a
    tp group whose stream is replicated (shard_dropout_rng's share_generator_state)."""
    tp, cp = sc["tp"], sc["cp"]
    tp_rank, cp_rank = rank % tp, rank // tp % cp
    key = []
    if tp > 1 and (site.startswith("attn") or sc["sp"]):
        key.append(("tp", tp_rank))
    if cp > 1:
        key.append(("cp", cp_rank))
    if sc["seeds"] == "rank":
        shared = tp > 1 and not sc["sp"]
        key.append(("generators", rank // tp if shared else rank))
    return tuple(key)


@pytest.mark.parametrize("world, name", CASES)
def test_masks_agree_where_replicated_and_differ_where_sharded(launches, world, name):
    sc = _scenario(world, name)
    ranks = _ranks(launches, world, name)
    sites = list(ranks[0]["masks"])
    want = {"emb", *(f"block{i}.{where}" for i in range(N_LAYER) for where in ("attn", "mlp")),
            *(f"attn{i}" for i in range(N_LAYER))}
    assert set(sites) == want  # every dropout site ran (and attention really dropped: dropout_p > 0)
    for site in sites:
        for a, b in itertools.combinations(range(world), 2):
            same = all(torch.equal(ma, mb) for ma, mb in zip(ranks[a]["masks"][site], ranks[b]["masks"][site]))
            expected = _stream(sc, a, site) == _stream(sc, b, site)
            assert same == expected, (site, a, b, "must be equal" if expected else "must differ")
    for rank, result in enumerate(ranks):
        masks = result["masks"]
        for site in sites:
            assert len(masks[site]) == 2  # two forwards
            keep = torch.cat([m.flatten() for m in masks[site]]).float().mean().item()
            assert abs(keep - (1 - w.DROPOUT)) <= KEEP_ATOL, (site, rank, keep)
        # New masks at every call: from step to step, from layer to layer, after attention and after the MLP.
        every = [(site, i, m) for site in sites for i, m in enumerate(masks[site])]
        for (s1, i1, m1), (s2, i2, m2) in itertools.combinations(every, 2):
            if m1.shape == m2.shape:
                assert not torch.equal(m1, m2), (rank, (s1, i1), (s2, i2))


def test_the_expected_streams_are_the_documented_ones():
    """_stream spelled out for two layouts, so the rule the launch is checked against is readable."""
    tp2 = _scenario(2, "tp2")
    assert _stream(tp2, 0, "emb") == _stream(tp2, 1, "emb")  # replicated stream: one mask
    assert _stream(tp2, 0, "attn0") != _stream(tp2, 1, "attn0")  # heads: a mask per rank
    cp2_tp2 = _scenario(4, "cp2_tp2")
    assert [_stream(cp2_tp2, r, "block0.mlp") for r in range(4)].count(_stream(cp2_tp2, 0, "block0.mlp")) == 2
    assert len({_stream(cp2_tp2, r, "attn1") for r in range(4)}) == 4


@pytest.mark.parametrize("world, name", CASES)
def test_activation_checkpointing_replays_the_masks(launches, world, name):
    """From the same generator state, full and selective AC give bitwise the loss and gradients of no
    AC: the recompute in backward draws the masks of the forward again (and it did recompute)."""
    for rank, result in enumerate(_ranks(launches, world, name)):
        ac = result["ac"]
        assert ac["none"]["attn_calls"] == N_LAYER
        for mode in ("full", "selective"):
            assert ac[mode]["attn_calls"] == 2 * N_LAYER, (rank, mode)
            assert ac[mode]["loss"] == ac["none"]["loss"], (rank, mode)
            assert ac[mode]["grads"].keys() == ac["none"]["grads"].keys()
            for n, want in ac["none"]["grads"].items():
                assert torch.equal(ac[mode]["grads"][n], want), (rank, mode, n)


def test_a_tp2_fit_with_dropout_trains(launches):
    """A short fit at tp2 with dropout on data it can learn: every loss finite, and it falls."""
    run = launches[2] / "tp2" / "run"
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == w.FIT_STEPS
    assert all(math.isfinite(x) for x in losses), losses
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.6 * first, losses  # measured: 3.87 -> 1.39


# --- one process -------------------------------------------------------------------------------

class _FakeMesh:
    """The two things shard_dropout_rng asks of a mesh whose activations are sharded."""

    def __init__(self, rank: int, size: int):
        self.rank, self.n = rank, size

    def get_local_rank(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.n


def _model(dropout: float):
    from slipstream.models.transformer import build_model

    cfg = load_config(None, ["--model.preset=tiny", "--model.vocab_size=64", "--train.seq_len=16",
                             f"--model.dropout={dropout}"]).model
    return build_model(cfg, "cpu", seed=0)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def test_nothing_is_installed_at_dropout_zero():
    from slipstream.distributed.sharded_dropout import shard_dropout_rng

    model = _model(0.0)
    before = model(_tokens())
    for sharded in (True, False):  # (replicated would broadcast generator states: not at dropout 0)
        assert shard_dropout_rng(model, _FakeMesh(1, 2), stream_sharded=sharded) is model
    for module in model.modules():
        assert not hasattr(module, "_rank_streams")
        assert not module._forward_pre_hooks and not module._forward_hooks
    assert torch.equal(model(_tokens()), before)


def test_rank_streams_differ_restore_the_generator_and_draw_nothing_in_eval():
    """Two ranks' copies of one model from the same generator state: their masks differ, yet both
    leave the default generator in the same state (a rank's stream never leaks into the shared
    one); in eval mode nothing is drawn at all."""
    from slipstream.distributed.sharded_dropout import shard_dropout_rng

    x = _tokens()
    runs = []
    for rank in (0, 1):
        model = shard_dropout_rng(_model(0.2), _FakeMesh(rank, 2), stream_sharded=True)
        assert all(len(m._rank_streams.shards) == 1 for m in (model.emb_dropout, model.blocks[0].attn,
                                                               model.blocks[1].dropout))
        masks = []
        model.emb_dropout.register_forward_hook(lambda m, args, out: masks.append(out != 0))
        torch.manual_seed(5)
        probe = w.AttentionMasks()
        with torch.no_grad(), probe:
            model(x)
        runs.append({"emb": masks[0], "attn": probe.masks, "state": torch.get_rng_state()})
        model.eval()
        state = torch.get_rng_state()
        eval_out = model(x)
        assert torch.equal(torch.get_rng_state(), state)  # eval: no draw
        assert all(not m._rank_streams._forks for m in model.modules() if hasattr(m, "_rank_streams"))  # all restored
        runs[-1]["eval"] = eval_out
    assert not torch.equal(runs[0]["emb"], runs[1]["emb"])
    assert len(runs[0]["attn"]) == N_LAYER and not torch.equal(runs[0]["attn"][0], runs[1]["attn"][0])
    assert torch.equal(runs[0]["state"], runs[1]["state"])
    assert torch.equal(runs[0]["eval"], runs[1]["eval"])  # eval: no dropout, the same model


@pytest.mark.parametrize("tq, causal", [(8, True), (4, False)])
def test_the_probe_reads_the_real_attention_mask(tq, causal):
    """dropout_worker.AttentionMasks draws scaled_dot_product_attention's mask again from the same
    generator state; the real call's output is softmax(scores) * mask / (1 - p) @ v with that mask,
    both causal (tp) and with cp's boolean mask over gathered keys (fewer queries than keys)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, t, 4, generator=g) for t in (tq, 8, 8))
    allowed = torch.arange(4, 8)[:, None] >= torch.arange(8)[None, :]  # the last 4 of 8 positions
    kwargs = dict(is_causal=True) if causal else dict(attn_mask=allowed)
    p = 0.3
    probe = w.AttentionMasks()
    torch.manual_seed(11)
    with probe:
        got = F.scaled_dot_product_attention(q, k, v, dropout_p=p, **kwargs)
    (keep,) = probe.masks
    assert keep.shape == (2, 2, tq, 8) and 0 < keep.float().mean() < 1
    scores = q @ k.transpose(-1, -2) / math.sqrt(4)
    mask = torch.ones(tq, 8, dtype=torch.bool).tril() if causal else allowed
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    want = (weights * keep / (1 - p)) @ v
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _cfg(*extra: str):
    return load_config(None, ["--model.preset=tiny", "--model.vocab_size=64", "--train.seq_len=16", *extra])


def test_dropout_is_accepted_under_tp_and_cp():
    from slipstream.distributed.context_parallel import check_context_parallel
    from slipstream.distributed.tensor_parallel import check_tensor_parallel

    check_tensor_parallel(_cfg("--model.dropout=0.1"), 2)
    check_context_parallel(_cfg("--model.dropout=0.1"), 2, 2)


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_dropout_with_compile_is_refused_under_tp_and_cp(scope):
    """The hooks break dynamo's graphs; a checkpointed block then runs in eager (compile silently lost)."""
    from slipstream.distributed.context_parallel import check_context_parallel
    from slipstream.distributed.tensor_parallel import check_tensor_parallel

    cfg = _cfg("--model.dropout=0.1", f"--compile.scope={scope}")
    with pytest.raises(UserError, match="parallel.tp > 1") as info:
        check_tensor_parallel(cfg, 2)
    assert "set --compile.scope=off or --model.dropout=0" in str(info.value)
    with pytest.raises(UserError, match="parallel.cp > 1") as info:
        check_context_parallel(cfg, 2, 1)
    assert "set --compile.scope=off or --model.dropout=0" in str(info.value)
    check_tensor_parallel(_cfg(f"--compile.scope={scope}"), 2)  # without dropout: compiled as before
