"""optim.optimizer = muon: Muon for the hidden matrices, AdamW for the rest (optimize/muon.py).

Muon's step is checked against a Newton-Schulz iteration written here (float64); torch runs its
iteration in bf16, so the parameters agree to ~2 % of the step, well inside what any wrong
setting (lr scale, momentum, weight decay, iteration count, or AdamW instead) would change."""

import copy
import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from slipstream.config import load_config
from slipstream.config.dims import ParallelDims
from slipstream.errors import UserError
from slipstream.models.transformer import build_model
from slipstream.optimize.muon import MuonWithAdamW, hidden_matrices
from slipstream.plan.memory import estimate_memory
from slipstream.plan.space import PlanModel, Strategy
from slipstream.train.lm import train_lm
from slipstream.train.schedule import build_scheduler, load_scheduler_state, lr_multiplier, scheduler_state
from slipstream.train.setup import build_optimizer

MUON = ["--optim.optimizer=muon"]


def muon_config(*overrides):
    return load_config(None, ["--model.preset=tiny", "--model.vocab_size=256", "--train.seq_len=32", *MUON,
                              *overrides])


def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic iteration (a, b, c) = (3.4445, -4.7750, 2.0315) on G / ||G||_F, on the wide side."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class Net(nn.Module):
    """A user module: an embedding, one hidden matrix, a bias-carrying head."""

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.embed = nn.Embedding(10, cols)
        self.hidden = nn.Linear(cols, rows, bias=False)
        self.head = nn.Linear(rows, 10)


@pytest.mark.parametrize("shape, adjust, momentum, ns_steps", [
    ((8, 16), "match_rms_adamw", 0.5, 5),
    ((16, 8), "original", 0.9, 3),
])
def test_muon_step_matches_an_independent_newton_schulz(shape, adjust, momentum, ns_steps):
    lr, wd = 0.02, 0.1
    cfg = muon_config(f"--optim.muon_lr={lr}", f"--optim.weight_decay={wd}", f"--optim.muon_adjust_lr={adjust}",
                      f"--optim.muon_momentum={momentum}", f"--optim.muon_ns_steps={ns_steps}")
    torch.manual_seed(0)
    net = Net(*shape)
    optimizer = build_optimizer(net, cfg)
    rows, cols = shape
    scale = 0.2 * math.sqrt(max(rows, cols)) if adjust == "match_rms_adamw" else math.sqrt(max(1.0, rows / cols))
    weight = net.hidden.weight.detach().double().clone()
    buffer = torch.zeros_like(weight)
    for _ in range(2):  # the second step shows the momentum
        for p in net.parameters():
            p.grad = torch.randn_like(p)
        grad = net.hidden.weight.grad.double()
        # Nesterov momentum as a sum (torch keeps an average, (1 - momentum) x the sum: the same
        # direction, and Newton-Schulz normalizes the scale away).
        buffer = momentum * buffer + grad
        update = newton_schulz(grad + momentum * buffer, ns_steps)
        expected = weight * (1 - lr * wd) - lr * scale * update    # decoupled weight decay
        before = net.hidden.weight.detach().double().clone()
        optimizer.step()
        got = net.hidden.weight.detach().double()
        assert (got - expected).norm() < 0.05 * (expected - before).norm()
        weight = got.clone()  # continue from torch's weights: its bf16 rounding does not accumulate here


def test_parameter_grouping_on_the_tiny_transformer():
    cfg = muon_config()
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg)
    assert isinstance(optimizer, MuonWithAdamW) and isinstance(optimizer.muon, torch.optim.Muon)
    assert isinstance(optimizer.adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.muon.param_groups for p in g["params"]}
    projections = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj")
    assert muon == {f"blocks.{i}.{m}.weight" for i in range(2) for m in projections}
    adamw = {names[id(p)]: g["weight_decay"] for g in optimizer.adamw.param_groups for p in g["params"]}
    assert set(adamw) | muon == set(names.values()) and not set(adamw) & muon
    assert adamw["tok_emb.weight"] == adamw["pos_emb.weight"] == 0.1   # matrices decay (tied head: the embedding)
    assert adamw["blocks.0.attn.q_proj.bias"] == adamw["final_norm.weight"] == 0.0
    group = optimizer.muon.param_groups[0]
    assert (group["lr"], group["momentum"], group["adjust_lr_fn"], group["ns_steps"], group["weight_decay"]) == \
        (cfg.optim.lr, 0.95, "match_rms_adamw", 5, 0.1)                # muon_lr = 0: optim.lr
    assert len(optimizer.param_groups) == len(optimizer.adamw.param_groups) + 1
    assert optimizer.param_groups[0] is optimizer.adamw.param_groups[0]  # the logged lr is optim.lr's


def test_moe_routers_experts_and_untied_head_stay_on_adamw():
    cfg = load_config(None, ["--model.preset=moe-tiny", "--model.vocab_size=256", "--model.moe_shared_experts=1",
                             *MUON])
    model = build_model(cfg.model)
    muon = {name for name, _ in hidden_matrices(model)}
    assert "blocks.0.attn.q_proj.weight" in muon and "blocks.1.mlp.shared.down_proj.weight" in muon
    assert not any(part in name for name in muon for part in ("router", "experts", "lm_head", "tok_emb"))
    assert isinstance(build_optimizer(model, cfg), MuonWithAdamW)  # the 3-D experts never reach torch's Muon


def test_user_module_rule():
    class User(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(20, 8)            # an embedding by type, whatever its name
            self.word_embeddings = nn.Parameter(torch.zeros(20, 8))
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
            self.gain = nn.Parameter(torch.ones(8))
            self.cls_head = nn.Linear(8, 3)
            self.frozen = nn.Linear(8, 8)
            self.frozen.requires_grad_(False)

    assert [name for name, _ in hidden_matrices(User())] == ["body.0.weight", "body.2.weight"]


def test_a_model_without_hidden_matrices_is_refused_and_one_without_edges_is_noted(capsys):
    """Muon on nothing would silently be AdamW; Muon on every 2-D weight of a user module steps its
    input and output layers too, which the user is told (with the rule that keeps them on AdamW)."""
    class Gains(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(10, 4)
            self.gain = nn.Parameter(torch.ones(4))

    class OptimizedModule(nn.Module):  # torch.compile's wrapper (by name; compiling costs seconds)
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    for model in (Gains(), OptimizedModule(Gains())):  # named by the user's class, not the wrapper's
        with pytest.raises(UserError, match=r"no hidden-layer weight matrix in Gains.*--optim.optimizer=adamw"):
            build_optimizer(model, muon_config())
    mlp = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 1, bias=False))
    optimizer = build_optimizer(mlp, muon_config())
    assert optimizer.adamw is None and len(optimizer.muon.param_groups[0]["params"]) == 2
    assert "input and output layers too" in capsys.readouterr().out
    build_optimizer(Net(8, 16), muon_config())  # an embedding and a head: nothing to say
    build_optimizer(build_model(muon_config().model), muon_config())
    assert capsys.readouterr().out == ""


def test_schedule_moves_both_groups_from_their_own_peak():
    cfg = muon_config("--optim.lr=1e-3", "--optim.muon_lr=0.02", "--optim.min_lr=1e-4", "--optim.warmup_steps=4")
    optimizer = build_optimizer(build_model(cfg.model), cfg)
    scheduler = build_scheduler(optimizer, cfg.optim, 20)
    for step in range(1, 8):
        optimizer.step()  # no gradients: nothing moves
        scheduler.step()
        factor = lr_multiplier(step, cfg.optim, 20)
        assert optimizer.muon.param_groups[0]["lr"] == pytest.approx(0.02 * factor)
        assert all(g["lr"] == pytest.approx(1e-3 * factor) for g in optimizer.adamw.param_groups)


def test_a_stage_with_other_groups_resumes_the_schedule_rank_0_saved():
    """Rank 0 saves the scheduler (trainer_state.json); a pipeline stage holding blocks only has no
    AdamW matrices, so one group fewer, and must still continue each group from its own peak."""
    cfg = muon_config("--optim.lr=1e-3", "--optim.muon_lr=0.02", "--optim.min_lr=1e-4", "--optim.warmup_steps=4")
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg.optim, 20)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    state = json.loads(json.dumps(scheduler_state(scheduler)))  # as trainer_state.json holds it
    stage = nn.Module()
    stage.blocks = nn.ModuleDict({"1": model.blocks[1]})
    stage_optimizer = build_optimizer(stage, cfg)
    assert len(stage_optimizer.param_groups) == 2 < len(optimizer.param_groups)
    stage_scheduler = build_scheduler(stage_optimizer, cfg.optim, 20)
    load_scheduler_state(stage_scheduler, state)
    stage_optimizer.step()
    stage_scheduler.step()
    factor = lr_multiplier(4, cfg.optim, 20)
    assert stage_optimizer.muon.param_groups[0]["lr"] == pytest.approx(0.02 * factor)
    assert stage_optimizer.adamw.param_groups[0]["lr"] == pytest.approx(1e-3 * factor)


@pytest.mark.parametrize("overrides, switch", [
    (["--optim.offload=true"], "optim.offload"),
    (["--optim.in_backward=true", "--optim.grad_clip=0"], "optim.in_backward"),
    (["--optim.state_dtype=bf16"], "optim.state_dtype"),
    (["--parallel.dp_strategy=zero1"], "parallel.dp_strategy = zero1"),
    (["--parallel.dp_strategy=fsdp"], "parallel.dp_strategy = fsdp"),
    (["--parallel.dp_strategy=hsdp"], "parallel.dp_strategy = hsdp"),
    (["--parallel.tp=2"], "parallel.tp"),
    (["--parallel.cp=2"], "parallel.cp"),
    (["--optim.muon_adjust_lr=original"], "optim.muon_lr"),  # Keller's scale wants ~0.02, not AdamW's lr
])
def test_refused_combinations_name_both_switches(overrides, switch):
    with pytest.raises(UserError, match="optim.optimizer = muon") as error:
        muon_config(*overrides)
    assert switch in str(error.value)
    load_config(None, ["--model.preset=tiny", "--train.seq_len=32", *overrides])  # fine with AdamW


def test_whole_matrix_layouts_are_allowed_and_a_resolved_sharded_one_refused():
    for overrides in (["--parallel.dp_strategy=ddp"], ["--parallel.dp_strategy=ddp", "--parallel.cp=2"],
                      ["--parallel.pp=2"]):
        muon_config(*overrides)
    cfg = muon_config()  # dp_strategy auto, resolved to fsdp at launch (e.g. cp > 1 on one data-parallel rank)
    fsdp = SimpleNamespace(dims=ParallelDims("fsdp", 1, 2))
    with pytest.raises(UserError, match="dp_strategy = fsdp"):
        build_optimizer(build_model(cfg.model), cfg, fsdp)


@pytest.mark.parametrize("overrides, strategy", [
    (["--model.preset=tiny"], Strategy(precision="fp32")),
    (["--model.preset=tiny"], Strategy(dp_strategy="ddp", dp=2, pp=2, precision="fp32")),
    (["--model.preset=moe-tiny", "--model.moe_shared_experts=1"], Strategy(precision="fp32")),
])
def test_planner_counts_one_moment_for_the_matrices(overrides, strategy):
    cfg = load_config(None, [*overrides, "--model.vocab_size=256", "--train.seq_len=32"])
    plan = PlanModel(cfg.model.preset, cfg.model)
    adamw = estimate_memory(plan, strategy, 32, device="cpu").breakdown["optimizer_state"]
    muon = estimate_memory(plan, strategy, 32, device="cpu", optimizer="muon").breakdown["optimizer_state"]
    matrices = sum(p.numel() for _, p in hidden_matrices(build_model(cfg.model))) // strategy.pp  # per stage
    assert adamw - muon == 4 * matrices                              # one fp32 buffer instead of two


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def test_training_lowers_the_loss_and_resumes_exactly(tiny_overrides, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    run = tiny_overrides + MUON + ["--optim.lr=3e-3", "--train.eval_steps=0", "--logging.tensorboard=false"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_lm(load_config(None, run + [f"--run.dir={straight}", "--checkpoint.interval=6"]))
    shutil.copytree(straight, resumed, symlinks=True)
    step_6, *later = sorted((resumed / "checkpoints").glob("step_*"))
    keys = FileSystemReader(str(step_6 / "model_optim")).read_metadata().state_dict_metadata
    assert "optim.state.blocks.0.attn.q_proj.weight.momentum_buffer" in keys   # Muon's state, saved
    assert "optim.state.tok_emb.weight.exp_avg" in keys                        # AdamW's
    for checkpoint in later:
        shutil.rmtree(checkpoint)  # as if the run had died after the step-6 checkpoint
    (resumed / "metrics.jsonl").unlink()  # what is logged now comes from the resumed steps only
    train_lm(load_config(None, run + [f"--run.dir={resumed}", "--checkpoint.resume=auto"]))
    straight_losses = losses(straight)
    assert losses(resumed) == {step: loss for step, loss in straight_losses.items() if step > 6}  # bitwise
    # AdamW cannot continue from Muon's state: the layout check names the switch before any load
    adamw_run = [o for o in run if o not in MUON] + [f"--run.dir={resumed}", "--checkpoint.resume=auto",
                                                     "--train.max_steps=14"]
    with pytest.raises(UserError, match=r"optim.optimizer: muon -> adamw"):
        train_lm(load_config(None, adamw_run))
    assert straight_losses[12] < straight_losses[1] - 1.0, straight_losses


def test_state_dict_round_trip_of_the_wrapper_itself():
    """torch's layout from state_dict(), loaded by position (local SGD's DCP path and user code
    use the wrapper's own methods; the trainer's checkpoints go through the two optimizers)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    cfg = muon_config()
    torch.manual_seed(0)
    models = [build_model(cfg.model), build_model(cfg.model)]
    optimizers = [build_optimizer(m, cfg) for m in models]

    def step(model, optimizer, seed):
        torch.manual_seed(seed)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()

    for seed in range(2):
        step(models[0], optimizers[0], seed)
    saved = optimizers[0].state_dict()
    assert len(saved["state"]) == sum(1 for _ in models[0].parameters())
    models[1].load_state_dict(models[0].state_dict())
    optimizers[1].load_state_dict(copy.deepcopy(saved))  # torch's state_dict holds the live tensors
    step(models[0], optimizers[0], 5)
    step(models[1], optimizers[1], 5)
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    # DCP's flat form, by parameter name, on the wrapper as one optimizer
    _, flat = get_state_dict(models[0], optimizers[0])
    set_state_dict(models[1], optimizers[1], model_state_dict=copy.deepcopy(models[0].state_dict()),
                   optim_state_dict=copy.deepcopy(flat))
    for m, o in zip(models, optimizers):
        step(m, o, 6)
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    assert torch.equal(optimizers[1].muon.state[models[1].blocks[0].attn.q_proj.weight]["momentum_buffer"],
                       optimizers[0].muon.state[models[0].blocks[0].attn.q_proj.weight]["momentum_buffer"])
