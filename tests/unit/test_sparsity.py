"""[sparsity]: masks on the blocks' linears (optimize/sparsity.py), the cubic schedule, the
config rules, the trainer's hook (train, checkpoint, resume bit for bit) and export."""

import json
import shutil

import pytest
import torch
import torch.nn as nn

from slipstream.config import load_config
from slipstream.config.schema import SparsityConfig
from slipstream.errors import UserError
from slipstream.optimize import sparsity as sp


def tiny_model(*overrides, preset="tiny"):
    from slipstream.models.transformer import build_model

    cfg = load_config(None, [f"--model.preset={preset}", "--model.vocab_size=256", "--train.seq_len=32", *overrides])
    return build_model(cfg.model, seed=0)


def tokens(n=2, t=32, seed=1):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def loss_of(model, x):
    from slipstream.models.transformer import lm_loss

    return lm_loss(model(x[:, :-1]), x[:, 1:].contiguous())


def pruned(model, method, target=0.5, scope="layer"):
    cfg = SparsityConfig(method=method, target=target, scope=scope)
    sp.apply_sparsity(model, cfg)
    sp.compute_masks(model, cfg, target)
    return model


def test_cubic_schedule_matches_the_hand_computed_values():
    cfg = SparsityConfig(method="magnitude", target=0.8, start_step=10, end_step=50, every=10)
    # s_t = 0.8 (1 - (1 - (t - 10) / 40)^3), held between the pruning steps 10, 20, ..., 50
    hand = {0: 0.0, 9: 0.0, 10: 0.0, 19: 0.0, 20: 0.8 * (1 - 0.75 ** 3), 29: 0.4625, 30: 0.8 * 0.875,
            40: 0.8 * (1 - 0.25 ** 3), 49: 0.7875, 50: 0.8, 99: 0.8}
    assert hand[20] == pytest.approx(0.4625) and hand[40] == pytest.approx(0.7875)
    for step, value in hand.items():
        assert sp.sparsity_at(step, cfg) == pytest.approx(value, abs=1e-12), step
    assert [t for t in range(100) if sp.pruning_step(t, cfg)] == [10, 20, 30, 40, 50]
    odd = SparsityConfig(method="magnitude", target=0.8, start_step=10, end_step=45, every=10)
    assert [t for t in range(100) if sp.pruning_step(t, odd)] == [10, 20, 30, 40, 45]  # the target at end_step
    at_once = SparsityConfig(method="magnitude", target=0.8, start_step=7)
    assert [t for t in range(100) if sp.pruning_step(t, at_once)] == [7] and sp.sparsity_at(7, at_once) == 0.8
    # torchao's implementation of the same formula agrees (s_0 = 0, n x dt = end - start)
    from torchao.prototype.sparsity.scheduler.cubic_scheduler import CubicSL

    for t in (10, 20, 30, 40, 50):
        assert sp.sparsity_at(t, cfg) == pytest.approx(CubicSL.sparsity_compute_fn(0.0, 0.8, t, 10, 1, 40))


def test_magnitude_per_layer_reaches_the_target_in_every_layer():
    model = pruned(tiny_model(), "magnitude", 0.75)
    per_layer, overall = sp.measured_sparsity(model)
    assert len(per_layer) == 2 * 6 and all(name.startswith("blocks.") for name in per_layer)  # q k v o up down
    assert all(s == 0.75 for s in per_layer.values()), per_layer  # widths divisible by 4: exactly
    assert overall == 0.75
    w, mask = model.blocks[0].mlp.up_proj.weight, model.blocks[0].mlp.up_proj.weight_mask
    assert torch.equal(w == 0, ~mask)
    assert w.abs()[mask].min() >= model_before().blocks[0].mlp.up_proj.weight.abs()[~mask].max()  # smallest |w| went
    assert sp.measured_sparsity(model_before())[1] == 0  # (nothing without masks)


def model_before():
    return tiny_model()


def test_magnitude_global_one_threshold_over_all_layers():
    dense = tiny_model()
    model = pruned(tiny_model(), "magnitude", 0.5, scope="global")
    per_layer, overall = sp.measured_sparsity(model)
    assert overall == 0.5
    assert len({round(s, 3) for s in per_layer.values()}) > 2  # layers differ (the residual projections are smaller)
    kept, gone = [], []
    for (name, m), (_, d) in zip(model.named_modules(), dense.named_modules()):
        if hasattr(m, "weight_mask"):
            kept.append(d.weight.abs()[m.weight_mask])
            gone.append(d.weight.abs()[~m.weight_mask])
    assert torch.cat(kept).min() >= torch.cat(gone).max()  # one threshold


def test_2_4_two_zeros_in_every_block_of_four_along_the_input_dim(capsys, monkeypatch):
    monkeypatch.setattr(sp, "_said_dense_math", False)
    dense = tiny_model()
    model = pruned(tiny_model(), "2:4")
    pruned(tiny_model(), "2:4")
    assert capsys.readouterr().out.count("run as dense matmuls on CPU (the 2:4 sparse matmul needs CUDA") == 1
    checked = 0
    for (name, m), (_, d) in zip(model.named_modules(), dense.named_modules()):
        if not hasattr(m, "weight_mask"):
            continue
        blocks = m.weight.view(m.out_features, m.in_features // 4, 4)
        assert ((blocks == 0).sum(-1) == 2).all(), name
        # the two kept of each block are its two largest |w| (values unchanged)
        ref = d.weight.view_as(blocks)
        top2 = ref.abs().topk(2, dim=-1).indices
        assert torch.equal(torch.zeros_like(blocks).scatter(-1, top2, ref.gather(-1, top2)), blocks), name
        checked += 1
    assert checked == 12
    assert sp.measured_sparsity(model)[1] == 0.5


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_heads_zero_whole_heads_by_weight_norm(preset):
    dense = tiny_model("--model.n_head=4", preset=preset)
    model = pruned(tiny_model("--model.n_head=4", preset=preset), "heads", 0.5)
    for b, d in zip(model.blocks, dense.blocks):
        a, hd, H = b.attn, b.attn.head_dim, 4
        q, o = a.q_proj.weight.view(H, hd, -1), a.o_proj.weight.view(-1, H, hd)
        q_zero = (q == 0).flatten(1).all(1)
        assert q_zero.sum() == 2 and ((q == 0).flatten(1).any(1) == q_zero).all()  # whole heads or nothing
        assert torch.equal((o == 0).transpose(0, 1).flatten(1).all(1), q_zero)  # o_proj's columns of the same heads
        if a.q_proj.bias is not None:
            assert torch.equal((~a.q_proj.bias_mask.view(H, hd)).all(1), q_zero)  # (biases start at zero)
        mha = a.n_kv_head == H
        assert torch.equal((a.k_proj.weight.view(-1, hd, a.k_proj.in_features) == 0).flatten(1).all(1),
                           q_zero if mha else torch.zeros(a.n_kv_head, dtype=torch.bool))  # GQA: k/v kept
        # the pruned heads are the two of smallest L2 norm over their q (k, v) rows and o columns
        dq, do = d.attn.q_proj.weight.view(H, hd, -1), d.attn.o_proj.weight.view(-1, H, hd)
        norm2 = dq.pow(2).sum((1, 2)) + do.pow(2).sum((0, 2))
        if mha:
            norm2 = norm2 + sum(w.weight.view(H, hd, -1).pow(2).sum((1, 2)) for w in (d.attn.k_proj, d.attn.v_proj))
        assert set(norm2.topk(2, largest=False).indices.tolist()) == set(q_zero.nonzero().flatten().tolist())


def test_channels_zero_whole_mlp_channels():
    model = pruned(tiny_model(preset="llama-tiny"), "channels", 0.25)
    for b in model.blocks:
        m = b.mlp
        hidden = m.down_proj.in_features
        gone = (m.up_proj.weight == 0).all(1)
        assert gone.sum() == hidden // 4 and ((m.up_proj.weight == 0).any(1) == gone).all()
        assert torch.equal((m.gate_proj.weight == 0).all(1), gone)
        assert torch.equal((m.down_proj.weight == 0).all(0), gone)
        assert not (m.down_proj.weight[:, ~gone] == 0).any()


def test_masked_model_equals_dense_model_with_the_masked_weights_and_stays_masked_after_steps():
    cfg = SparsityConfig(method="magnitude", target=0.6, start_step=1)
    model = sp.apply_sparsity(tiny_model(), cfg)
    schedule = sp.SparsitySchedule(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = tokens()
    moved = []
    for step in range(3):
        schedule.update(step)  # dense at step 0 (AdamW's moments fill up), pruned from step 1 on
        loss_of(model, x).backward()
        q, up = model.blocks[0].attn.q_proj, model.blocks[0].mlp.up_proj
        assert (q.weight.grad[~q.weight_mask] == 0).all() and q.weight.grad.abs().sum() > 0  # masked gradient
        opt.step()
        opt.zero_grad()
        moved.append(bool((up.weight[~up.weight_mask] != 0).any()))
        schedule.apply()
    assert moved == [False, True, True]  # momentum moves pruned weights: apply() is what keeps them zero
    assert sp.measured_sparsity(model)[1] == pytest.approx(0.6, abs=1e-3)
    dense = tiny_model()
    dense.load_state_dict({k: v for k, v in model.state_dict().items() if not k.endswith("_mask")})
    with torch.no_grad():
        assert torch.equal(loss_of(model, x), loss_of(dense, x))
        assert loss_of(model, x) != loss_of(tiny_model(), x)
    folded = sp.fold_masks(model)
    assert not any(k.endswith("_mask") for k in folded.state_dict())


def test_refusals():
    from slipstream.config.sparsity_rules import check_sparsity_rules

    def refused(match, *overrides):
        with pytest.raises(UserError, match=match):
            check_sparsity_rules(load_config(None, ["--train.max_steps=100", *overrides]))

    check_sparsity_rules(load_config(None, ["--sparsity.method=magnitude", "--sparsity.end_step=50"]))
    refused("parallel.tp=1", "--sparsity.method=magnitude", "--parallel.tp=2")
    refused("parallel.pp=1", "--sparsity.method=heads", "--parallel.pp=2")
    refused("dp_strategy=ddp", "--sparsity.method=magnitude", "--parallel.dp_strategy=fsdp")
    refused("not implemented yet", "--sparsity.method=2:4", "--sparsity.end_step=50")
    refused("target=0.5", "--sparsity.method=2:4", "--sparsity.target=0.7")
    refused("scope=layer", "--sparsity.method=heads", "--sparsity.scope=global")
    refused("never be reached", "--sparsity.method=magnitude", "--sparsity.end_step=200")
    # steps run 0 .. max_steps - 1: end_step = max_steps would stop short of the target
    refused("end_step <= train.max_steps - 1 = 99", "--sparsity.method=magnitude", "--sparsity.end_step=100")
    check_sparsity_rules(load_config(None, ["--train.max_steps=100", "--sparsity.method=magnitude",
                                            "--sparsity.end_step=99"]))
    refused("nothing would be pruned", "--sparsity.method=magnitude", "--sparsity.start_step=100")
    refused("mixture-of-experts", "--sparsity.method=magnitude", "--model.moe_experts=4")
    with pytest.raises(UserError, match="prunes no head"):
        sp.apply_sparsity(tiny_model(), SparsityConfig(method="heads", target=0.2))  # 0.2 x 2 heads
    with pytest.raises(UserError, match="slipstream transformers"):
        sp.apply_sparsity(nn.Sequential(nn.Linear(8, 8)), SparsityConfig(method="magnitude"))


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.fixture(scope="module")
def sparse_runs(tmp_path_factory, data_dir):
    """The default job (tiny) pruned on the cubic schedule from step 1 to 3 (global magnitude,
    target 0.6, from 0 at step 0 to 0.6 at step 3): 4 steps straight, and the same resumed from
    its step-2 checkpoint."""
    from slipstream.train.lm import train_lm

    tmp = tmp_path_factory.mktemp("sparsity")
    base = ["--model.preset=tiny", f"--data.dir={data_dir}", "--train.max_steps=4", "--train.micro_batch_size=2",
            "--train.seq_len=32", "--train.eval_steps=0", "--optim.warmup_steps=1", "--logging.log_interval=1",
            "--logging.progress=false", "--train.deterministic=true", "--logging.tensorboard=false",
            "--checkpoint.interval=2", "--sparsity.method=magnitude", "--sparsity.scope=global",
            "--sparsity.target=0.6", "--sparsity.start_step=0", "--sparsity.end_step=3", "--sparsity.every=1"]
    straight, resumed = tmp / "straight", tmp / "resumed"
    train_lm(load_config(None, base + [f"--run.dir={straight}"]))
    shutil.copytree(straight, resumed, symlinks=True)
    _step_2, *later = sorted((resumed / "checkpoints").glob("step_*"))
    for checkpoint in later:
        shutil.rmtree(checkpoint)  # as if the run had died after the step-2 checkpoint
    (resumed / "metrics.jsonl").unlink()
    train_lm(load_config(None, base + [f"--run.dir={resumed}", "--checkpoint.resume=auto"]))
    return straight, resumed


def checkpoint_model(run_dir, step):
    from slipstream.checkpoint import manager as ckpt
    from slipstream.config.load import config_from_toml_text
    from slipstream.models.transformer import build_model

    folder = run_dir / "checkpoints" / f"step_{step:08d}"
    cfg = config_from_toml_text((folder / "config.toml").read_text())
    model = build_model(cfg.model)
    sp.register_masks(model, cfg.sparsity)
    ckpt.load_checkpoint(folder, model)
    return model


def test_default_job_prunes_on_schedule_and_resumes_exactly(sparse_runs):
    straight, resumed = sparse_runs
    assert losses(resumed) == {s: loss for s, loss in losses(straight).items() if s > 2}  # bitwise
    # 2 steps done: the masks computed before the second step, 0.6 (1 - (1 - 1/3)^3) = 0.6 x 19/27;
    # 4 steps done: those of step 3 (end_step), the target
    at_2, at_4 = checkpoint_model(straight, 2), checkpoint_model(straight, 4)
    assert sp.measured_sparsity(at_2)[1] == pytest.approx(0.6 * 19 / 27, abs=1e-4)
    assert sp.measured_sparsity(at_4)[1] == pytest.approx(0.6, abs=1e-4)
    for model in (at_2, at_4):  # the saved masks are the saved zeros
        for m, name in sp.masked_tensors(model):
            assert torch.equal(getattr(m, name) == 0, ~getattr(m, name + "_mask"))
    again = checkpoint_model(resumed, 4)
    assert all(torch.equal(a, b) for a, b in zip(at_4.state_dict().values(), again.state_dict().values()))


def test_export_writes_the_masked_weights_under_their_own_names(sparse_runs, tmp_path):
    from slipstream.cli import main

    straight, _ = sparse_runs
    assert main(["checkpoint", "export", str(straight), "--format", "torch", "--out", str(tmp_path / "t")]) == 0
    sd = torch.load(tmp_path / "t" / "model.pt", weights_only=True)
    assert not any(k.endswith("_mask") for k in sd)
    saved = checkpoint_model(straight, 4)
    zeros = total = 0
    names = {id(p): k for k, p in saved.named_parameters()}
    for m, name in sp.masked_tensors(saved):
        key = names[id(getattr(m, name))]
        assert torch.equal(sd[key], getattr(m, name) * getattr(m, name + "_mask"))
        zeros, total = zeros + int((sd[key] == 0).sum()), total + sd[key].numel()
    assert zeros / total == pytest.approx(0.6, abs=1e-4)


# --- Wanda and pruning a dense checkpoint --------------------------------------------------

def test_wanda_ranks_by_weight_times_input_norm_within_each_output_row():
    """A hand computation on one linear: the score abs(w_ij) x ||X_j||, the lowest half of each
    row zeroed; and the input norms are those of the real inputs of every pruned linear."""
    model = tiny_model()
    cfg = SparsityConfig(method="magnitude", target=0.5, criterion="wanda")
    sp.apply_sparsity(model, cfg)
    inputs = [tokens(2, 32, seed=s) for s in (3, 4)]
    norms = sp.input_norms(model, inputs)
    up = model.blocks[0].mlp.up_proj
    seen = []
    handle = up.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        for x in inputs:
            model(x)
    handle.remove()
    assert torch.allclose(norms[up], torch.cat(seen).norm(dim=0), rtol=1e-5)
    assert len(norms) == 2 * 6 and model.training  # every pruned linear; the mode restored

    before = up.weight.detach().clone()
    sp.compute_masks(model, cfg, 0.5, norms)
    score = before.abs() * norms[up][None, :]
    k = up.in_features // 2
    hand = torch.ones_like(before, dtype=torch.bool).scatter_(1, score.argsort(dim=1)[:, :k], False)
    assert torch.equal(up.weight_mask, hand) and torch.equal(up.weight == 0, ~hand)
    assert all(s == 0.5 for s in sp.measured_sparsity(model)[0].values())
    # the activations change the choice: not the magnitude masks
    assert not torch.equal(up.weight_mask, pruned(tiny_model(), "magnitude", 0.5).blocks[0].mlp.up_proj.weight_mask)


def test_wanda_norms_of_a_compiled_model_that_already_ran_are_the_eager_ones():
    """Hooks added after compilation never run inside an existing graph: input_norms runs the
    calibration eagerly (without it every norm here was 0 and the masks fell in tie order)."""
    model = tiny_model()
    sp.apply_sparsity(model, SparsityConfig(method="magnitude", criterion="wanda"))
    eager = sp.input_norms(model, [tokens()])
    for block in model.blocks:
        block.compile(backend="eager")
    model.eval()
    with torch.no_grad():
        model(tokens(), return_hidden=True)  # an eval-mode graph exists before the hooks
    model.train()
    compiled = sp.input_norms(model, [tokens()])
    assert all(torch.allclose(compiled[m], eager[m], rtol=1e-5) and eager[m].sum() > 0 for m in eager)


def test_wanda_2_4_keeps_the_two_best_scores_of_every_four():
    model = tiny_model()
    cfg = SparsityConfig(method="2:4", target=0.5, criterion="wanda")
    sp.apply_sparsity(model, cfg)
    norms = sp.input_norms(model, [tokens()])
    v = model.blocks[1].attn.v_proj
    score = (v.weight.detach().abs() * norms[v][None, :]).reshape(-1, 4)
    sp.compute_masks(model, cfg, 0.5, norms)
    kept = v.weight_mask.reshape(-1, 4)
    assert (kept.sum(1) == 2).all()
    assert (score[kept].reshape(-1, 2).min(1).values >= score[~kept].reshape(-1, 2).max(1).values).all()


def test_wanda_refusals():
    def refused(match, *overrides):
        with pytest.raises(UserError, match=match):
            load_config(None, ["--sparsity.criterion=wanda", *overrides])

    refused("scope=layer", "--sparsity.method=magnitude", "--sparsity.scope=global")
    refused("method=magnitude or 2:4", "--sparsity.method=heads")
    with pytest.raises(UserError, match="calibration inputs"):
        sp.SparsitySchedule.attach(tiny_model(), SparsityConfig(method="magnitude", criterion="wanda"))


@pytest.fixture(scope="module")
def dense_then_pruned(tmp_path_factory, data_dir):
    """The default job (tiny) trained dense for 3 steps; then resumed from its step-3 checkpoint
    with [sparsity] Wanda 50 % (one shot at the resumed step) to step 5, twice: straight, and
    again from the pruned run's step-4 checkpoint (which holds masks)."""
    from slipstream.train.lm import train_lm

    tmp = tmp_path_factory.mktemp("dense")
    base = ["--model.preset=tiny", f"--data.dir={data_dir}", "--train.micro_batch_size=2", "--train.seq_len=32",
            "--train.eval_steps=0", "--optim.warmup_steps=1", "--logging.log_interval=1", "--logging.progress=false",
            "--train.deterministic=true", "--logging.tensorboard=false", "--checkpoint.interval=1"]
    sparse = ["--sparsity.method=magnitude", "--sparsity.criterion=wanda", "--sparsity.target=0.5",
              "--sparsity.calibration_tokens=256"]
    dense, pruned_run, again = tmp / "dense", tmp / "pruned", tmp / "again"
    train_lm(load_config(None, base + ["--train.max_steps=3", f"--run.dir={dense}"]))
    start = dense / "checkpoints" / "step_00000003"
    train_lm(load_config(None, base + sparse + ["--train.max_steps=5", f"--run.dir={pruned_run}",
                                                f"--checkpoint.resume={start}"]))
    shutil.copytree(pruned_run, again, symlinks=True)
    shutil.rmtree(again / "checkpoints" / "step_00000005")
    (again / "metrics.jsonl").unlink()
    train_lm(load_config(None, base + sparse + ["--train.max_steps=5", f"--run.dir={again}",
                                                "--checkpoint.resume=auto"]))
    return dense, pruned_run, again


def test_resuming_a_dense_checkpoint_prunes_it_in_one_shot_with_wanda(dense_then_pruned, data_dir):
    dense, pruned_run, again = dense_then_pruned
    model = checkpoint_model(pruned_run, 4)
    per_layer, overall = sp.measured_sparsity(model)
    assert len(per_layer) == 12 and all(s == 0.5 for s in per_layer.values()), per_layer
    # The masks are Wanda's for the dense step-3 weights and the calibration windows: recompute them.
    from slipstream.data.eval_windows import EvalWindows

    reference = checkpoint_model(dense, 3)
    cfg = SparsityConfig(method="magnitude", target=0.5, criterion="wanda")
    sp.apply_sparsity(reference, cfg)
    windows = EvalWindows(str(data_dir), "train", 2, 32, 256)
    sp.compute_masks(reference, cfg, 0.5, sp.input_norms(reference, [x for (x, _), _ in windows]))
    assert all(torch.equal(getattr(a, n + "_mask"), getattr(b, n + "_mask"))
               for (a, n), (b, _) in zip(sp.masked_tensors(model), sp.masked_tensors(reference)))
    # ...and the masked run resumed from its own (masked) checkpoint continues bit for bit.
    assert losses(again) == {s: loss for s, loss in losses(pruned_run).items() if s > 4}
    assert sorted(losses(pruned_run)) == [4, 5]


def test_checkpoint_prune_one_shot_wanda_writes_a_checkpoint_the_tools_read(dense_then_pruned, tmp_path, capsys):
    from slipstream.cli import main

    dense, pruned_run, _ = dense_then_pruned
    out = tmp_path / "wanda"
    assert main(["checkpoint", "prune", str(dense), "--out", str(out), "--method", "magnitude", "--criterion",
                 "wanda", "--target", "0.5", "--calibration-tokens", "256", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["measured_sparsity"] == 0.5 and result["step"] == 3
    assert result["val_loss_after"] != result["val_loss_before"]
    assert json.loads((out / "prune.json").read_text()) == result
    # The same masks as the training run that resumed the dense checkpoint with Wanda (it prunes
    # at step 3 and never recomputes them).
    one_shot, trained = checkpoint_model(out, 3), checkpoint_model(pruned_run, 4)
    assert all(torch.equal(getattr(a, n + "_mask"), getattr(b, n + "_mask"))
               for (a, n), (b, _) in zip(sp.masked_tensors(one_shot), sp.masked_tensors(trained)))
    # eval reads it (masked weights, no mask buffers needed) and agrees with what prune measured.
    assert main(["eval", "--checkpoint", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(result["val_loss_after"], rel=1e-6)
    # training cannot resume a weights-only checkpoint: a clear error
    folder = out / "checkpoints" / "step_00000003"
    assert main(["train", "--config", str(folder / "config.toml"), f"--checkpoint.resume={folder}",
                 f"--run.dir={tmp_path / 'ft'}", "--train.max_steps=5"]) != 0
    assert "holds no optimizer state" in capsys.readouterr().err


def test_checkpoint_prune_refusals(dense_then_pruned, tmp_path, capsys):
    from slipstream.cli import main

    dense, pruned_run, _ = dense_then_pruned

    def refused(match, source, out, *args):
        assert main(["checkpoint", "prune", str(source), "--out", str(tmp_path / out), *args]) != 0
        assert match in capsys.readouterr().err

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    refused("not an empty folder", dense, "taken", "--method", "magnitude")
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    refused("already holds masks", pruned_run, "a", "--method", "magnitude")
    refused("use --target 0.5", dense, "b", "--method", "2:4", "--target", "0.6")
    refused("use --scope layer", dense, "c", "--method", "magnitude", "--criterion", "wanda", "--scope", "global")
    refused("not a fraction", dense, "d", "--method", "magnitude", "--target", "1.5")
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_export_quantize_int8_is_the_weight_only_model_generate_runs(dense_then_pruned, tmp_path):
    from slipstream.cli import main
    from slipstream.optimize.weight_quant import quantize_weights

    dense, _, _ = dense_then_pruned
    assert main(["checkpoint", "export", str(dense), "--format", "torch", "--out", str(tmp_path / "q"),
                 "--quantize", "int8"]) == 0
    assert main(["checkpoint", "export", str(dense), "--format", "torch", "--out", str(tmp_path / "f")]) == 0
    saved = torch.load(tmp_path / "q" / "model.pt", weights_only=True)
    expected = quantize_weights(checkpoint_model(dense, 3), "int8").state_dict()
    assert saved.keys() == expected.keys()
    key = "blocks.0.mlp.up_proj.weight"
    assert type(saved[key]).__name__ == type(expected[key]).__name__ != "Tensor"
    assert torch.equal(saved[key].dequantize(), expected[key].dequantize())
    assert (tmp_path / "q" / "model.pt").stat().st_size < (tmp_path / "f" / "model.pt").stat().st_size


def test_sparse_kernel_refuses_weights_that_are_not_2_4_and_a_device_without_it(dense_then_pruned, tmp_path,
                                                                                  capsys):
    from slipstream.cli import main

    dense, _, _ = dense_then_pruned
    args = ["generate", "--prompt", "a", "--max-new-tokens", "2", "--device", "cpu", "--sparse-kernel"]
    assert main([*args, "--checkpoint", str(dense)]) != 0
    assert "needs 2:4 weights" in capsys.readouterr().err
    assert main(["checkpoint", "prune", str(dense), "--out", str(tmp_path / "24"), "--method", "2:4",
                 "--no-eval"]) == 0
    assert main([*args, "--checkpoint", str(tmp_path / "24")]) != 0
    err = capsys.readouterr().err
    assert "compute capability 8.0" in err and "this is cpu" in err
    assert main([*args, "--checkpoint", str(tmp_path / "24"), "--quantize", "int8"]) != 0
    assert "cannot be combined" in capsys.readouterr().err
