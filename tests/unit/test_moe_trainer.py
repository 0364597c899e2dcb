"""What the Trainer does for MoE layers outside the layer itself (issue 15): the balancing bias
moves once per optimizer step through every step entry point, a pipeline stage cut from a model
with real weights keeps its bias, and a checkpoint resumes across optimizers with another number
of param groups (they follow the layout's meshes)."""

from __future__ import annotations

import torch

from slipstream import Trainer
from slipstream.config import load_config
from slipstream.models.moe import moe_layers
from slipstream.models.transformer import build_model
from slipstream.train.lm_loss import lm_loss_fn

ARGS = ["--model.preset=moe-tiny", "--model.vocab_size=64", "--train.seq_len=16", "--train.micro_batch_size=2",
        "--model.moe_bias_rate=0.01", "--logging.progress=false", "--logging.tensorboard=false",
        "--metrics.memory_breakdown=false", "--checkpoint.save_final=false", "--train.eval_steps=0"]


def _data():
    tokens = torch.randint(0, 64, (16, 17), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def test_train_step_moves_the_bias_once_per_step(tmp_path):
    cfg = load_config(None, [*ARGS, f"--run.dir={tmp_path / 'run'}"])
    trainer = Trainer(build_model(cfg.model, seed=0), _data(), lm_loss_fn, config=cfg)
    it = iter(trainer.train_loader)
    layer = moe_layers(trainer.model)[0][1]
    for step in range(1, 4):
        trainer.train_step(it)
        assert layer.stats.step_counts is None  # this step's counts were used up by the update
        # Each step moves every expert's bias by exactly the rate (sign toward balance), once.
        steps_moved = (layer.expert_bias.abs() / 0.01).round()
        assert steps_moved.max().item() <= step and steps_moved.max().item() >= 1


def test_pipeline_stage_of_a_model_with_weights_keeps_its_bias():
    from slipstream.distributed.pipeline_stages import split_stages

    cfg = load_config(None, ARGS)
    model = build_model(cfg.model, seed=0)
    bias = torch.tensor([0.0, 0.0, -50.0, -50.0])
    for _, layer in moe_layers(model):
        layer.expert_bias.copy_(bias)
    stages = split_stages(model, [0, 1], [range(0, 1), range(1, 2)])
    for stage in stages:
        for _, layer in moe_layers(stage):
            assert torch.equal(layer.expert_bias, bias)


def test_scheduler_state_resumes_across_a_different_number_of_param_groups():
    from slipstream.train.schedule import build_scheduler, load_scheduler_state, scheduler_state

    cfg = load_config(None, ARGS)
    params = [torch.nn.Parameter(torch.zeros(2, 2)) for _ in range(3)]
    three = torch.optim.AdamW([{"params": [p]} for p in params], lr=cfg.optim.lr)
    two = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=cfg.optim.lr)
    saved_scheduler = build_scheduler(three, cfg.optim, 10)
    for _ in range(4):
        three.step()
        saved_scheduler.step()
    resumed = build_scheduler(two, cfg.optim, 10)
    load_scheduler_state(resumed, scheduler_state(saved_scheduler))
    three.step(), two.step()
    saved_scheduler.step(), resumed.step()
    assert [g["lr"] for g in two.param_groups] == [three.param_groups[0]["lr"]] * 2
