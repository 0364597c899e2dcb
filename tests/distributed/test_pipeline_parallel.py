"""Pipeline parallelism (distributed/pipeline_parallel.py) against one process.

Unit tests (no launch): the layer split (every layer exactly once, balanced by cost, the user's
split and its errors), the stage placement, and that the stage modules carry the unsplit
model's names and exactly its weights (and together compute its logits).

One torchrun launch per world size (tests/distributed/pp_worker.py, gloo, fp32, a 5-layer model:
an uneven split): every schedule torch provides at world 2 with 2 and 4 micro-batches, GPT-2
style (tied embeddings across the first and last stage) and Llama style (RoPE, GQA, SwiGLU,
untied); 1f1b, interleaved-1f1b and dualpipev at world 4. Each is compared with one process at
the same global batch: the loss, every gradient, every parameter after one AdamW step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slipstream.distributed.pipeline_stages import (StageCosts, build_stage_modules, check_schedule,
                                                   split_layers, stage_costs, stage_indices, stage_rank)
from slipstream.errors import UserError
from slipstream.models.transformer import build_model, lm_loss
from tests.distributed import pp_worker as w

LOSS_RTOL = 1e-6    # relative; measured <= 1.2e-7 (every schedule, world 2 and 4)
GRAD_RTOL = 1e-5    # of the largest reference gradient; measured <= 4.5e-7
PARAM_ATOL = 1e-5   # after one AdamW step at lr 1e-2 (the bound); measured <= 6.2e-6

# Scenarios a schedule cannot run: a UserError on every rank, before any communication.
EXPECTED_ERRORS = {
    "gpt2_dualpipev_m2": "DualPipeV requires at least as many microbatches as stages",
    "llama_dualpipev_m2": "DualPipeV requires at least as many microbatches as stages",
    "gpt2_1f1b_m4_b6": "6 sequences) must be divisible by parallel.pp_microbatches = 4",
}


# --- the split -----------------------------------------------------------------------------------

def assert_covers(ranges: list[range], n_layer: int) -> None:
    """Every layer exactly once, in order, every stage at least one."""
    assert [i for r in ranges for i in r] == list(range(n_layer))
    assert all(len(r) >= 1 for r in ranges)


@pytest.mark.parametrize("n_layer", [1, 3, 5, 7, 9, 13])
def test_every_layer_exactly_once(n_layer):
    weights = [None, StageCosts(block=1.0, embedding=0.7, head=2.5), StageCosts(block=3.0, head=100.0)]
    for n_stages in range(1, n_layer + 1):
        for w_ in weights:
            ranges = split_layers(n_layer, n_stages, weights=w_)
            assert len(ranges) == n_stages
            assert_covers(ranges, n_layer)


def test_default_split_balances_embedding_and_head():
    assert [len(r) for r in split_layers(5, 2)] == [3, 2]  # equal blocks: max 3
    # The head costs 2.5 blocks: the last stage takes fewer (4 | 2 + 2.5 beats 3 | 3 + 2.5).
    assert [len(r) for r in split_layers(6, 2, weights=StageCosts(block=1.0, head=2.5))] == [4, 2]
    # An embedding of 2 blocks' cost: the first stage takes fewer.
    assert [len(r) for r in split_layers(6, 2, weights=StageCosts(block=1.0, embedding=2.0))] == [2, 4]


def test_stage_costs_weight_the_head_by_its_matmul():
    """A GPT-2 124M shape: the 50k-row head costs several blocks, so the last of 4 stages holds fewer."""
    cfg = dataclasses.replace(w.make_config("gpt2").model, n_layer=12, d_model=768, n_head=12, vocab_size=50257,
                              vocab_multiple=64, max_seq_len=1024)
    costs = stage_costs(cfg, 1024)
    assert 3.0 < costs.head / costs.block < 6.0
    sizes = [len(r) for r in split_layers(12, 4, weights=costs)]
    assert sum(sizes) == 12 and sizes[-1] < sizes[0], sizes


def test_user_split():
    assert split_layers(5, 3, layers=[2, 1, 2]) == [range(0, 2), range(2, 3), range(3, 5)]


@pytest.mark.parametrize("n_layer, n_stages, layers, message", [
    (5, 3, [2, 2], "gives 2 stages, the pipeline has 3"),
    (5, 3, [2, 0, 3], "every stage needs at least one layer"),
    (5, 3, [2, 2, 2], "sums to 6 layers, the model has 5"),
    (5, 3, [1, 1, 1], "sums to 3 layers, the model has 5"),
    (3, 4, None, "4 pipeline stages (parallel.pp x pp_virtual_stages) for a model of 3 layers"),
], ids=["too-few-stages", "empty-stage", "duplicated", "lost", "more-stages-than-layers"])
def test_bad_split_is_a_clear_error(n_layer, n_stages, layers, message):
    with pytest.raises(UserError, match=None) as e:
        split_layers(n_layer, n_stages, layers=layers)
    assert message in str(e.value)


# --- schedules and placement -------------------------------------------------------------------------

@pytest.mark.parametrize("schedule, virtual, message", [
    ("pipedream", 1, "not a pipeline schedule; valid: gpipe, 1f1b"),
    ("gpipe", 2, "runs exactly 1 stage per rank"),
    ("1f1b", 2, "runs exactly 1 stage per rank"),
    ("zbv", 1, "runs exactly 2 stages per rank"),
    ("dualpipev", 3, "runs exactly 2 stages per rank"),
    ("interleaved-1f1b", 0, "need at least 1"),
])
def test_schedule_stage_count_mismatch_is_a_clear_error(schedule, virtual, message):
    with pytest.raises(UserError) as e:
        check_schedule(schedule, virtual)
    assert message in str(e.value)


def test_stage_placement():
    assert [stage_indices("1f1b", r, 4, 1) for r in range(4)] == [[0], [1], [2], [3]]
    assert [stage_indices("interleaved-1f1b", r, 2, 3) for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    assert [stage_indices("zbv", r, 4, 2) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    for schedule, virtual in (("looped-bfs", 2), ("dualpipev", 2)):
        for rank in range(4):
            assert all(stage_rank(schedule, s, 4) == rank for s in stage_indices(schedule, rank, 4, virtual))


# --- config and layout: refused before any work, with the fix named ----------------------------------

PP = ["--model.preset=tiny", "--model.n_layer=4", "--train.seq_len=32", "--parallel.pp=2"]


@pytest.mark.parametrize("extra, message", [
    (["--parallel.pp_schedule=1f1b", "--parallel.pp_virtual_stages=2"], "runs exactly 1 stage per rank"),
    (["--parallel.pp_schedule=zbv", "--parallel.pp_virtual_stages=3"], "runs exactly 2 stages per rank (a V)"),
    (["--parallel.pp_schedule=interleaved-1f1b", "--parallel.pp_virtual_stages=3"], "6 pipeline stages"),
    (["--parallel.pp_layers=2,1"], "must give 2 stages (pp x virtual stages) of at least one block each, adding up to "
                                   "model.n_layer = 4"),
    (["--parallel.pp_layers=2,x"], "comma-separated integers"),
    (["--train.micro_batch_size=6", "--parallel.pp_microbatches=4"], "must divide the sequences one data-parallel"),
    (["--train.micro_batch_size=1"], "1f1b needs at least 2 micro-batches"),
    (["--parallel.pp_schedule=dualpipev", "--train.micro_batch_size=2"], "dualpipev needs at least 4 micro-batches"),
    (["--train.fused_loss=true"], "set --train.fused_loss=false"),
    (["--optim.in_backward=true", "--optim.grad_clip=0"], "set --optim.in_backward=false"),
    (["--precision.autocast=fp16"], "use --precision.autocast=bf16"),
    (["--compile.scope=model"], "use --compile.scope=blocks"),
    (["--activations.checkpointing=offload"], "use full or selective"),
    (["--parallel.pp_schedule=zbv", "--activations.checkpointing=selective"], "use --activations.checkpointing=full"),
])
def test_bad_pipeline_config_is_refused_when_loaded(extra, message):
    from slipstream.config import load_config

    with pytest.raises(UserError) as e:
        load_config(None, [*PP, "--train.micro_batch_size=4", *extra])
    assert message in str(e.value)


@pytest.mark.parametrize("extra, world, message", [
    (["--parallel.dp_strategy=zero1"], 4, "runs with dp_strategy none, ddp, fsdp or hsdp"),
    (["--parallel.dp_strategy=zero2"], 4, "runs with dp_strategy none, ddp, fsdp or hsdp"),
    (["--parallel.cp=2", "--parallel.dp_strategy=fsdp"], 4, "does not compose with parallel.cp yet"),
    (["--parallel.dp_strategy=ddp", "--parallel.local_sgd_period=2"], 4, "are DDP settings, which parallel.pp > 1"),
    (["--parallel.dp_strategy=ddp", "--parallel.comm_hook=bf16"], 4, "are DDP settings, which parallel.pp > 1"),
    ([], 3, "does not divide the world size 3"),
])
def test_layouts_a_pipeline_cannot_run_are_refused_before_joining(extra, world, message):
    from slipstream.config import load_config
    from slipstream.config.dims import check_compatibility, resolve_parallel_dims

    cfg = load_config(None, [*PP, "--train.micro_batch_size=4", *extra])
    with pytest.raises(UserError) as e:
        check_compatibility(cfg, resolve_parallel_dims(cfg.parallel, world, world))
    assert message in str(e.value)


def test_the_trainer_refuses_a_custom_loss_under_a_pipeline():
    """The Python API: the last stage computes the LM loss; a custom loss_fn would be ignored."""
    from slipstream.config import load_config
    from slipstream.train.trainer import Trainer

    cfg = load_config(None, [*PP, "--train.micro_batch_size=4", "--model.vocab_size=64"])
    with pytest.raises(UserError, match="a custom loss_fn cannot run inside the schedule"):
        Trainer(build_model(cfg.model), None, lambda model, batch: model(batch[0]).mean(), config=cfg)


def test_mesh_puts_the_pipeline_outermost():
    """[pp, dp, ...]: the stages of one pipeline read the same batch; dp ranks differ inside a stage."""
    from slipstream.config import load_config
    from slipstream.config.dims import resolve_parallel_dims

    dims = resolve_parallel_dims(load_config(None, [*PP, "--train.micro_batch_size=4"]).parallel, 4, 4)
    assert dims.strategy == "ddp" and dims.mesh_dims == (("pp", 2), ("dp_replicate", 2))
    assert [dims.dp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [dims.pp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert dims.same_batch == 2


# --- stage modules: unsplit names, the single process's weights ----------------------------------------

@pytest.mark.parametrize("model", list(w.MODELS))
def test_stages_hold_the_unsplit_names_and_weights(model):
    cfg = w.make_config(model).model
    reference = build_model(cfg, seed=w.MODEL_SEED)
    want = dict(reference.named_parameters())
    splits = split_layers(cfg.n_layer, 3, layers=[2, 1, 2])
    stages = [build_stage_modules(cfg, [s], splits, seed=w.MODEL_SEED)[0] for s in range(3)]  # one per "rank"
    got: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            assert name not in got, f"{name} on two stages"
            got[name] = param
    tied_copy = {"lm_head.weight"} if cfg.tie_embeddings else set()  # the last stage's copy of tok_emb
    assert set(got) == set(want) | tied_copy
    assert set(got) <= set(reference.state_dict())  # checkpoint keys of the unsplit model
    assert "blocks.3.attn.q_proj.weight" in dict(stages[2].named_parameters())
    for name, param in got.items():
        source = "tok_emb.weight" if name in tied_copy else name
        assert torch.equal(param, want[source]), name
    # Chained, the stages compute the model's logits (padded vocabulary columns -inf).
    x, y = w.batch(2)
    h = x
    for stage in stages:
        h = stage(h)
    ref_logits = reference(x)
    assert torch.equal(h[..., : cfg.vocab_size], ref_logits[..., : cfg.vocab_size])
    assert torch.isneginf(h[..., cfg.vocab_size:]).all()
    assert torch.equal(lm_loss(h, y.contiguous()), lm_loss(ref_logits, y.contiguous()))


def test_v_rank_holds_its_own_copy_of_the_tied_embedding():
    """Under a V schedule rank 0 holds the first and the last stage: the head gets the table's
    values in a parameter of its own (FSDP cannot shard one parameter in two stages' units);
    the step sums both gradients into both (checked against one process at world 2 and 4)."""
    cfg = w.make_config("gpt2").model
    first, last = build_stage_modules(cfg, [0, 3], split_layers(cfg.n_layer, 4), seed=w.MODEL_SEED)
    assert last.lm_head.weight is not first.tok_emb.weight
    assert torch.equal(last.lm_head.weight, first.tok_emb.weight)


# --- against one process, one launch per world size ------------------------------------------------

class Launch:
    """pp_worker.py's scenarios at one world size, a part of the launch this session's distributed
    modules share (tests/distributed/conftest.py)."""

    def __init__(self, part):
        self.part, self.world, self.out = part, part.world, part.out
        self.proc, self.seconds = part.launch.proc, part.launch.seconds

    def results(self, name: str) -> list[dict]:
        out = []
        for rank in range(self.world):
            path = self.out / name / f"rank{rank}.pt"
            if not path.is_file():
                pytest.fail(f"world {self.world}: no result for {name!r} rank {rank}; exit {self.proc.returncode}\n"
                            f"{self.proc.stderr[-6000:]}")
            result = torch.load(path, weights_only=True)  # our own worker's output: tensors, numbers, lists
            if "error" in result:
                pytest.fail(f"world {self.world}: {name!r} failed on rank {rank}:\n{result['error']}")
            out.append(result)
        return out


@pytest.fixture(scope="module")
def launches(shared_launches) -> dict[int, Launch]:
    return {world: Launch(shared_launches.part(world, "pp")) for world in (2, 4)}


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, int], dict]:
    """One process, the whole global batch in one forward/backward, one AdamW step."""
    out = {}
    for model in w.MODELS:
        for n_layer in sorted({sc["n_layer"] for scs in w.SCENARIOS.values() for sc in scs}):
            cfg = w.make_config(model, n_layer)
            net = build_model(cfg.model, seed=w.MODEL_SEED)
            x, y = w.batch()
            loss = lm_loss(net(x), y.contiguous())
            loss.backward()
            named = dict(net.named_parameters())
            grads = {n: p.grad.clone() for n, p in named.items()}
            w.optimizer(named).step()
            out[(model, n_layer)] = {"loss": loss.item(), "grads": grads,
                                     "params": {n: p.detach().clone() for n, p in named.items()}}
    return out


def test_launches_exit_cleanly(launches):
    for launch in launches.values():
        print(f"measured world {launch.world}: pp scenarios {launch.part.seconds()} s, "
              f"shared launch {launch.seconds:.1f} s")
        assert launch.part.exit_codes() == [0] * launch.world, launch.part.launch.tail()
        assert launch.part.exited_cleanly(), launch.part.launch.tail()


ALL = [(world, sc) for world, scs in w.SCENARIOS.items() for sc in scs]


@pytest.mark.parametrize("world, sc", ALL, ids=[f"world{world}-{sc['name']}" for world, sc in ALL])
def test_pipeline_matches_single_process(world, sc, launches, references):
    results = launches[world].results(sc["name"])
    if sc["name"] in EXPECTED_ERRORS:
        for result in results:
            assert EXPECTED_ERRORS[sc["name"]] in result.get("user_error", ""), result
        return
    assert all("user_error" not in r for r in results), results[0].get("user_error")
    ref = references[(sc["model"], sc["n_layer"])]
    # The stages of all ranks hold every layer exactly once, unevenly split.
    layers = sorted(i for r in results for stage_layers in r["stages"] for i in stage_layers)
    assert layers == list(range(sc["n_layer"]))
    # The loss: the mean over the micro-batches, sent from the last stage to every pp rank.
    losses = [r["loss"] for r in results]
    assert len(set(losses)) == 1 and losses[0] is not None
    assert abs(losses[0] - ref["loss"]) <= LOSS_RTOL * abs(ref["loss"])
    # Every gradient and parameter, by unsplit name (a tied head's copy compares with tok_emb).
    largest = max(g.abs().max().item() for g in ref["grads"].values())
    seen = set()
    for result in results:
        for name, grad in result["grads"].items():
            source = "tok_emb.weight" if name == "lm_head.weight" and name not in ref["grads"] else name
            seen.add(source)
            grad_diff = (grad - ref["grads"][source]).abs().max().item()
            assert grad_diff <= GRAD_RTOL * largest, f"{name}: gradient off by {grad_diff:.2e} (largest {largest:.2e})"
            param_diff = (result["params"][name] - ref["params"][source]).abs().max().item()
            assert param_diff <= PARAM_ATOL, f"{name}: parameter off by {param_diff:.2e} after the AdamW step"
    assert seen == set(ref["grads"])
