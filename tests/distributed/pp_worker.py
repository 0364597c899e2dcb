"""Worker for tests/distributed/test_pipeline_parallel.py: every pipeline scenario in one launch.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/distributed/pp_worker.py OUT_DIR

Per scenario of SCENARIOS[N], in the same (gloo) process group, each rank builds its stages,
runs one pipeline_step over the global batch and one AdamW step, and writes
OUT_DIR/<name>/rank<r>.pt: the loss (on the last stage's rank), this rank's gradients and
parameters after the step by their unsplit names, and its stage indices and layer ranges. A
scenario that a schedule cannot run writes the UserError's message instead. The pytest side
builds the single-process reference with the same builders (`make_config`, `batch`, `optimizer`).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

VOCAB = 60        # padded to 64: the head's padded columns are masked on the last stage
SEQ_LEN = 16
GLOBAL_BATCH = 8  # sequences per step, split into the scenario's micro-batches
N_LAYER = 5       # uneven over 2 and 4 stages
MODEL_SEED = 7

GPT2 = ["--model.preset=tiny"]  # learned positions, LayerNorm, GELU, biases, tied embeddings
LLAMA = ["--model.preset=tiny", "--model.position=rope", "--model.norm=rmsnorm", "--model.mlp=swiglu",
         "--model.n_head=4", "--model.n_kv_head=2", "--model.bias=false", "--model.tie_embeddings=false"]
MODELS = {"gpt2": GPT2, "llama": LLAMA}
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "looped-bfs": 2, "interleaved-zero-bubble": 2,
           "zbv": 2, "dualpipev": 2}


def scenario(model: str, schedule: str, micro: int, batch: int = GLOBAL_BATCH, n_layer: int = N_LAYER) -> dict[str, Any]:
    name = f"{model}_{schedule}_m{micro}" + ("" if batch == GLOBAL_BATCH else f"_b{batch}") + (
        "" if n_layer == N_LAYER else f"_l{n_layer}")
    return dict(name=name, model=model, schedule=schedule, micro=micro, batch=batch, n_layer=n_layer)


SCENARIOS: dict[int, list[dict[str, Any]]] = {
    2: [scenario(model, schedule, micro) for model in MODELS for schedule in VIRTUAL for micro in (2, 4)]
    + [scenario("gpt2", "1f1b", 4, batch=6)],  # a global batch the micro-batches do not divide
    # pp 4: 8 stages need more than 5 layers (9: still uneven). The tied table's copies sit on ranks
    # 0 and 3 (a 2-rank subgroup of the pp group) for 1f1b and interleaved, on rank 0 alone for the V.
    4: [scenario(model, "1f1b", 4) for model in MODELS]
    + [scenario(model, schedule, 8, n_layer=9) for model in MODELS for schedule in ("interleaved-1f1b", "dualpipev")],
}


def make_config(model: str, n_layer: int = N_LAYER):
    from slipstream.config import load_config

    return load_config(None, [*MODELS[model], f"--model.vocab_size={VOCAB}", "--model.vocab_multiple=64",
                              f"--model.n_layer={n_layer}", f"--train.seq_len={SEQ_LEN}"])


def batch(size: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (size, SEQ_LEN + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]  # the targets are a non-contiguous view, as a loader's window gives


def optimizer(params: dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    """slipstream's AdamW groups (matrices decay, biases and gains don't), by unsplit name."""
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}] + ([{"params": no_decay, "weight_decay": 0.0}] if no_decay else [])
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-6, foreach=False)


def run(sc: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from slipstream.distributed.pipeline_parallel import build_pipeline, pipeline_step
    from slipstream.errors import UserError
    from slipstream.models.transformer import lm_loss

    cfg = make_config(sc["model"], sc["n_layer"])
    try:
        pipe = build_pipeline(cfg.model, sc["schedule"], dist.group.WORLD, sc["micro"], lm_loss,
                              virtual_stages=VIRTUAL[sc["schedule"]], seq_len=SEQ_LEN, seed=MODEL_SEED)
        params = pipe.named_parameters()
        opt = optimizer(params)
        inputs, targets = batch(sc["batch"])
        loss = pipeline_step(pipe, inputs, targets)
    except UserError as e:  # raised on every rank alike, before any communication
        return {"user_error": str(e)}
    grads = {name: p.grad.clone() for name, p in params.items()}
    opt.step()
    return {"loss": None if loss is None else float(loss), "grads": grads,
            "params": {name: p.detach().clone() for name, p in params.items()},
            "stages": [list(m.layers) for m in pipe.modules], "indices": [s.stage_index for s in pipe.stages]}


def run_scenarios(out_dir: Path) -> int:
    """Every scenario of SCENARIOS[world], in the launch's process group (joined here unless another
    worker's scenarios already did: tests/distributed/shared_worker.py). 1 if one failed."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # communicates: rendezvous of the launch
    failed = False
    for sc in SCENARIOS[world]:
        where = out_dir / sc["name"]
        where.mkdir(parents=True, exist_ok=True)
        try:
            result = run(sc, rank)
        except Exception:
            failed = True
            result = {"error": traceback.format_exc()}
            traceback.print_exc()
        torch.save(result, where / f"rank{rank}.pt")
        if failed:
            break  # the other rank may be stuck in the failed scenario's communication
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    failed = run_scenarios(Path(argv[0]))
    dist.destroy_process_group()
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
