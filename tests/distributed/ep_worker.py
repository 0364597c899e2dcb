"""Worker for tests/distributed/test_expert_parallel.py: MoE Trainer runs in one launch.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/distributed/ep_worker.py OUT_DIR [NAME ...]

Per scenario of SCENARIOS[N]: one optimizer step by hand (loss, every gradient and every
parameter after AdamW, as full tensors) into OUT_DIR/<name>/step_rank<R>.pt, then a fresh
Trainer's fit() (rank 0's metrics.jsonl, the final full parameters and balancing biases into
final_rank<R>.pt: a pipeline rank holds its stages' only; and the same after a DCP checkpoint of
the fit was resumed by another fresh Trainer at the same layout), and every rank's layout of the experts
(placements, local shapes, rows the dispatch moved) into layout.json. The pytest side runs the single-process references with the same builders.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from slipstream.train.lm_loss import lm_loss_fn as lm_batch_loss  # noqa: E402  (a pipeline needs this very function)
from tests.distributed.tp_worker import COMMON, full_state, make_dataset  # noqa: E402

MICRO = 2  # per data-parallel rank
MODEL_SEED = 7
MOE = ("--model.preset=moe-tiny", "--model.moe_experts=4", "--model.moe_aux_loss=0.01")
# Softmax top-1 with z-loss; sigmoid top-2 with shared experts, a dense first block and the balancing bias.
TOP1_Z = (*MOE, "--model.moe_top_k=1", "--model.moe_z_loss=0.001")
SIGMOID = (*MOE, "--model.n_layer=3", "--model.moe_first_dense=1", "--model.moe_router=sigmoid",
           "--model.moe_shared_experts=1", "--model.moe_expert_hidden=32", "--model.moe_bias_rate=0.01",
           "--model.moe_route_scale=2.0")
# Skewed routing: a bias that sends every token to experts 0 and 1 (rank 0's under ep2): experts 2
# and 3 get no tokens, rank 1 computes nothing for anyone.
SKEW_BIAS = [0.0, 0.0, -50.0, -50.0]


def scenario(name: str, model: tuple[str, ...], ep: int, strategy: str, extra: tuple[str, ...] = (),
             tp: int = 1, skew: bool = False, pp: int = 1, reference: tuple[str, ...] = ()):
    """reference: the one-process run's own overrides (a pipeline's micro-batches: see PP_AUX)."""
    return dict(name=name, model=list(model), ep=ep, strategy=strategy, extra=list(extra), tp=tp, skew=skew, pp=pp,
                reference=list(reference))


# A pipeline (pp2 at world 2) runs each rank's 2 sequences as 2 micro-batches of one: the
# balancing losses are each micro-batch's, as in one process accumulating 2 micro-batches of one
# sequence (the same sequences, in the same order). 1F1B and a zero-bubble V schedule.
PP_AUX = ("--train.micro_batch_size=1", "--train.grad_accum_steps=2")
# pp2 x ep2 at world 4: the counts of a micro-batch are summed over the 2 data-parallel ranks, so
# the balancing losses see 2 sequences per micro-batch, which one process cannot group alike:
# compared without them (routing, dispatch, loads and biases are still exact).
NO_AUX = ("--model.moe_aux_loss=0", "--model.moe_bias_rate=0.01")


SCENARIOS: dict[int, list[dict[str, Any]]] = {
    2: [
        scenario("ep2", MOE, 2, "ddp"),
        scenario("dp2_ep1", MOE, 1, "ddp"),  # no expert parallelism: the counts are still the whole batch's
        scenario("ep2_top1_z", TOP1_Z, 2, "ddp"),
        scenario("ep2_sigmoid_shared_bias", SIGMOID, 2, "fsdp"),
        scenario("ep2_skewed", MOE, 2, "ddp", skew=True),
        scenario("ep2_ac_compile", MOE, 2, "ddp", ("--activations.checkpointing=full", "--compile.scope=blocks")),
        # Compiled MoE blocks without checkpointing (which would run them eagerly): fp32 loops over
        # the experts outside the graph (Inductor's grouped GEMM takes bf16 only).
        scenario("ep2_compile", MOE, 2, "ddp", ("--compile.scope=blocks",)),
        # Tensor parallel at one data-parallel rank: the MoE layers' plain weights next to DTensors.
        scenario("tp2_moe", (*MOE, "--parallel.sequence_parallel=true", "--parallel.loss_parallel=true"), 1, "none",
                 tp=2),
        scenario("pp2_1f1b_aux", (*TOP1_Z, "--parallel.pp_schedule=1f1b"), 1, "none", pp=2, reference=PP_AUX),
        scenario("pp2_zbv_aux", (*MOE, "--model.n_layer=4", "--parallel.pp_schedule=zbv"), 1, "none", pp=2,
                 reference=PP_AUX),
    ],
    4: [
        scenario("ep2_fsdp2", MOE, 2, "fsdp"),
        scenario("ep4", MOE, 4, "ddp"),
        scenario("ep2_tp2", (*MOE, "--parallel.sequence_parallel=true", "--parallel.loss_parallel=true"), 2, "fsdp",
                 tp=2),
        scenario("pp2_ep2_ddp", (*MOE, *NO_AUX, "--parallel.pp_schedule=1f1b"), 2, "ddp", pp=2),
        scenario("pp2_ep2_fsdp_interleaved", (*MOE, *NO_AUX, "--model.n_layer=4",
                                               "--parallel.pp_schedule=interleaved-1f1b"), 2, "fsdp", pp=2),
    ],
}


def overrides(sc: dict[str, Any], run_dir: Path | str, ep: int, strategy: str, micro: int, tp: int = 1,
              pp: int = 1) -> list[str]:
    return [*COMMON, *sc["model"], f"--run.dir={run_dir}", f"--parallel.ep={ep}", f"--parallel.tp={tp}",
            f"--parallel.pp={pp}", f"--parallel.dp_strategy={strategy}", f"--train.micro_batch_size={micro}",
            *sc["extra"]]


def reference_overrides(sc: dict[str, Any], run_dir: Path | str, world: int) -> list[str]:
    """One process at the scenario's global batch."""
    dp = world // (sc["tp"] * sc["pp"])
    keep = lambda args: [a for a in args if not a.startswith("--parallel.")]  # noqa: E731
    return overrides({**sc, "model": keep(sc["model"]), "extra": keep(sc["extra"])}, run_dir, 1, "none",
                     MICRO * dp) + sc["reference"]


def build(cfg, skew: bool):
    from slipstream.models.moe import moe_layers
    from slipstream.models.transformer import build_model

    model = build_model(cfg.model, "cpu", seed=MODEL_SEED)
    if skew:
        for _, layer in moe_layers(model):
            layer.expert_bias.copy_(torch.tensor(SKEW_BIAS))
    return model


def biases(model) -> dict[str, torch.Tensor]:
    from slipstream.models.moe import moe_layers

    return {name: layer.expert_bias.detach().clone() for name, layer in moe_layers(model)}


def run(cfg, skew: bool = False) -> dict[str, Any]:
    """One step by hand, then a fit (distributed or reference)."""
    from slipstream import Trainer
    from slipstream.distributed.data_parallel import unwrap

    trainer = Trainer(build(cfg, skew), make_dataset(), lm_batch_loss, config=cfg)
    loss, _, _ = trainer.accumulate_gradients(iter(trainer.train_loader))
    named = dict(unwrap(trainer.model).named_parameters())
    grads = full_state({n: p.grad for n, p in named.items()})
    grad_norm = trainer.optimizer_step(loss)
    step = {"loss": float(loss), "grad_norm": float(grad_norm), "grads": grads, "params": full_state(named)}

    trainer = Trainer(build(cfg, skew), make_dataset(), lm_batch_loss, config=cfg)
    trainer.fit()
    model = unwrap(trainer.model)
    final = {"params": full_state(dict(model.named_parameters())), "biases": biases(model)}
    # A DCP round trip at this layout: a fresh Trainer resumed from the fit's last step holds exactly
    # its parameters and balancing biases (sharded experts included).
    trainer.save_checkpoint()
    trainer.writer.wait()
    longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=cfg.train.max_steps + 1))
    again = Trainer(build(cfg, skew), make_dataset(), lm_batch_loss, config=longer)  # (resumable: below max_steps)
    again.resume(trainer.run_dir / "checkpoints" / f"step_{trainer.step:08d}")
    restored = unwrap(again.model)
    final["restored_params"] = full_state(dict(restored.named_parameters()))
    final["restored_biases"] = biases(restored)
    return {"step": step, "final": final, "trainer": trainer}


def layout(trainer) -> dict[str, Any]:
    from slipstream.distributed.data_parallel import unwrap
    from slipstream.models.moe import moe_layers

    model = unwrap(trainer.model)
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        if ".experts." in name or name.endswith("router.weight"):
            out[name] = {"placements": [str(pl) for pl in p.placements] if hasattr(p, "placements") else None,
                         "local_shape": list(p.to_local().shape if hasattr(p, "to_local") else p.shape),
                         "mesh": list(p.device_mesh.mesh_dim_names or ()) if hasattr(p, "device_mesh") else []}
    out["_received_rows"] = {name: getattr(layer.experts.compute, "received_rows", None)
                             for name, layer in moe_layers(model)}
    from torch._dynamo.utils import counters

    out["_compiled_graphs"] = counters["stats"]["unique_graphs"]  # compile.scope really compiled
    return out


def run_scenarios(out_dir: Path, names: set[str] = frozenset()) -> int:
    """Every scenario of SCENARIOS[world] (or only the named ones), leaving the process group up
    (tests/distributed/shared_worker.py runs other workers' scenarios after these). 1 if any failed."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    from slipstream.config import load_config

    failed = False
    for sc in SCENARIOS[world]:
        if names and sc["name"] not in names:
            continue
        where = out_dir / sc["name"]
        try:
            cfg = load_config(None, overrides(sc, where / "run", sc["ep"], sc["strategy"], MICRO, sc["tp"], sc["pp"]))
            result = run(cfg, sc["skew"])
            info = layout(result["trainer"])
            every_rank = result["trainer"].parallel.gather(info)
            # Every rank writes its own tensors: a pipeline stage holds only its own parameters.
            torch.save(result["step"], where / f"step_rank{rank}.pt")
            torch.save(result["final"], where / f"final_rank{rank}.pt")
            if rank == 0:
                (where / "layout.json").write_text(json.dumps(every_rank, indent=1))
        except Exception:
            failed = True
            where.mkdir(parents=True, exist_ok=True)
            (where / f"error_rank{rank}.txt").write_text(traceback.format_exc())
            traceback.print_exc()
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    from slipstream.distributed.mesh import shutdown

    failed = run_scenarios(Path(argv[0]), set(argv[1:]))
    shutdown()
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
