"""Worker for tests/distributed/test_tensor_parallel.py: tensor-parallel Trainer runs in one launch.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/distributed/tp_worker.py OUT_DIR [NAME ...]

Per scenario of SCENARIOS[N] (or the named ones), in the same process group:
  1. one optimizer step by hand: the micro-batch loss, every gradient and every parameter after
     the AdamW step, gathered to full tensors (`full_tensor()`), into OUT_DIR/<name>/step.pt;
  2. a fresh Trainer's fit() of STEPS steps: rank 0 writes metrics.jsonl into OUT_DIR/<name>/run,
     and the final full parameters go to OUT_DIR/<name>/final.pt;
  3. what the layout really did to the model, into OUT_DIR/<name>/layout.json (placements and
     local shapes of a few parameters), so a test fails when tp is silently ignored.
The pytest side builds the single-process references with the same builders (`reference`).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

VOCAB = 60        # padded to 64: the last tensor-parallel shard holds padded head rows
SEQ_LEN = 16
N_SAMPLES = 32
MICRO = 2         # per data-parallel rank
STEPS = 4
MODEL_SEED = 7

COMMON = [
    f"--model.vocab_size={VOCAB}", "--model.vocab_multiple=64", f"--train.seq_len={SEQ_LEN}",
    f"--train.max_steps={STEPS}", "--train.deterministic=true", "--train.eval_steps=0",
    "--optim.warmup_steps=1", "--optim.lr=0.01", "--optim.eps=1e-6", "--logging.progress=false",
    "--logging.tensorboard=false", "--logging.log_interval=1", "--metrics.memory_breakdown=false",
    "--checkpoint.interval=0", "--checkpoint.save_final=false",
    "--parallel.timeout_s=60", "--parallel.init_timeout_s=60",
]
GPT2 = ("--model.preset=tiny",)  # learned positions, LayerNorm, GELU, biases, tied embeddings
LLAMA = ("--model.preset=tiny", "--model.position=rope", "--model.norm=rmsnorm", "--model.mlp=swiglu",
         "--model.n_head=4", "--model.n_kv_head=2", "--model.bias=false", "--model.tie_embeddings=false")
ARCH = ("--model.preset=tiny", "--model.n_head=4", "--model.position=alibi", "--model.embedding_norm=true",
        "--model.parallel_block=true", "--model.mlp=relu")
NO_SP = ("--parallel.sequence_parallel=false", "--parallel.loss_parallel=false")
SP = ("--parallel.sequence_parallel=true", "--parallel.loss_parallel=false")
SP_LOSS = ("--parallel.sequence_parallel=true", "--parallel.loss_parallel=true")
FP8 = "--precision.fp8=true"


def scenario(name: str, model: tuple[str, ...], tp: int, strategy: str = "none", extra: tuple[str, ...] = (),
             kind: str = "equal", cp: int = 1):
    """kind: equal (the two phases of `run`), save (a 6-step fit with a checkpoint at step 3) or
    resume (from the world-2 launch's save checkpoint at this layout, to step 6)."""
    return dict(name=name, model=list(model), tp=tp, strategy=strategy, extra=list(extra), kind=kind, cp=cp)


# Resharding: saved at tp2 (world 2), resumed at fsdp2 x tp2 (world 4, half the micro-batch: the
# same global batch) and, on the pytest side, at tp1 in one process.
SAVE = ("--train.max_steps=6", "--checkpoint.interval=3", *SP_LOSS)
SAVED_CHECKPOINT = Path("2") / "llama_tp2_save" / "run" / "checkpoints" / "step_00000003"  # under OUT_DIR/..


SCENARIOS: dict[int, list[dict[str, Any]]] = {
    2: [
        scenario("gpt2_tp2", GPT2, 2, extra=NO_SP),
        scenario("gpt2_tp2_sp", GPT2, 2, extra=SP),
        scenario("gpt2_tp2_sp_loss", GPT2, 2, extra=SP_LOSS),
        scenario("llama_tp2", LLAMA, 2, extra=NO_SP),
        scenario("llama_tp2_sp_loss", LLAMA, 2, extra=SP_LOSS),
        scenario("llama_tp2_save", LLAMA, 2, extra=SAVE, kind="save"),
        scenario("gpt2_tp2_sp_bad_batch", GPT2, 2, extra=SP, kind="bad_batch"),
        scenario("llama_tp2_selective_ac", LLAMA, 2, extra=(*SP_LOSS, "--activations.checkpointing=selective")),
        # Compiled blocks over DTensor (the RoPE model's block takes the embedding's output directly).
        scenario("llama_tp2_compile", LLAMA, 2, extra=(*SP_LOSS, "--compile.scope=blocks")),
        # fp8 linears (torchao) under tp, with torchao's float8 styles. Run here on CPU with the
        # device guard lifted (FP8_ON_CPU): torch 2.13 has CPU fp8 matmuls, gloo cannot all-gather
        # fp8 tensors, so no sequence parallel (its gathers are fp8); on CUDA both run.
        scenario("llama_tp2_fp8", LLAMA, 2, extra=(*NO_SP, FP8)),
        # BLOOM / GPT-J-style switches (issue 19): each rank's ALiBi slopes are its own heads', the embedding
        # norm is a sequence-parallel norm, the parallel block and the ReLU MLP split like the others.
        scenario("arch_tp2_sp_loss", ARCH, 2, extra=SP_LOSS),
        # Context parallel: the cp ranks average gradients through FSDP over the folded (dp_shard, cp) mesh.
        scenario("gpt2_cp2", GPT2, 1, "fsdp", cp=2),
        scenario("llama_cp2_no_balance", LLAMA, 1, "fsdp", ("--parallel.cp_load_balance=false",), cp=2),
        scenario("llama_cp2_ddp_ac", LLAMA, 1, "ddp", ("--activations.checkpointing=full",), cp=2),
        # The context-parallel attention inside compiled blocks, with full checkpointing (which tp refuses).
        scenario("gpt2_cp2_ac_compile", GPT2, 1, "fsdp", ("--compile.scope=blocks", "--activations.checkpointing=full"),
                 cp=2),
    ],
    4: [
        scenario("gpt2_fsdp2_tp2", GPT2, 2, "fsdp", SP_LOSS),
        scenario("llama_fsdp2_tp2_sac_compile", LLAMA, 2, "fsdp",
                 (*SP_LOSS, "--activations.checkpointing=selective", "--compile.scope=blocks")),
        scenario("llama_hsdp_tp2", LLAMA, 2, "hsdp", (*SP_LOSS, "--parallel.dp_replicate=2")),
        scenario("llama_fsdp2_tp2_fp8", LLAMA, 2, "fsdp", (*NO_SP, FP8)),
        scenario("llama_tp4", LLAMA, 4, extra=(*SP_LOSS, "--model.n_head=4", "--model.n_kv_head=4")),
        scenario("llama_resume_fsdp2_tp2", LLAMA, 2, "fsdp", SAVE, kind="resume"),
        scenario("llama_cp4", LLAMA, 1, "fsdp", cp=4),  # a ring of 4 exposes chunk-order bugs
        scenario("gpt2_cp2_tp2", GPT2, 2, "fsdp", SP_LOSS, cp=2),
        scenario("llama_fsdp2_cp2", LLAMA, 1, "fsdp", cp=2),
    ],
}


def allow_fp8_on_cpu() -> None:
    """Lift slipstream's CUDA-only guard on precision.fp8 for this process: the fp8 scenarios
    check tp's float8 styles for numbers on CPU (what the guard protects users from is speed)."""
    import slipstream.optimize.precision as precision

    precision.fp8_support = lambda device: None


def overrides(sc: dict[str, Any], run_dir: Path | str, tp: int, strategy: str, micro: int, cp: int = 1) -> list[str]:
    return [*COMMON, *sc["model"], f"--run.dir={run_dir}", f"--parallel.tp={tp}", f"--parallel.cp={cp}",
            f"--parallel.dp_strategy={strategy}", f"--train.micro_batch_size={micro}", *sc["extra"]]


def make_dataset() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (N_SAMPLES, SEQ_LEN + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def lm_batch_loss(model, batch):
    from slipstream.models.transformer import lm_loss

    return lm_loss(model(batch[0]), batch[1])


def full_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from slipstream.distributed.data_parallel import full_value

    return {name: full_value(t.detach()).float().clone() for name, t in tensors.items()}


def run(cfg) -> dict[str, Any]:
    """Both phases for one config (distributed or reference); returns the step-1 tensors, the
    fit()'s final parameters and the trainer of the fit (for the layout)."""
    from slipstream import Trainer
    from slipstream.models.transformer import build_model

    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]  # compile.scope really compiled (layout.json)
    trainer = Trainer(build_model(cfg.model, "cpu", seed=MODEL_SEED), make_dataset(), lm_batch_loss, config=cfg)
    loss, _, _ = trainer.accumulate_gradients(iter(trainer.train_loader))
    from slipstream.distributed.data_parallel import unwrap

    named = dict(unwrap(trainer.model).named_parameters())  # DDP's wrapper adds "module."
    grads = full_state({n: p.grad for n, p in named.items()})
    grad_norm = trainer.optimizer_step(loss)
    step = {"loss": float(loss), "grad_norm": float(grad_norm), "grads": grads, "params": full_state(named)}

    trainer = Trainer(build_model(cfg.model, "cpu", seed=MODEL_SEED), make_dataset(), lm_batch_loss, config=cfg)
    seen = []  # the sequence length the model's embedding really gets (context parallel: T / cp)
    model = unwrap(trainer.model)
    model.tok_emb.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    # What sequence parallel and loss parallel really did: the tokens the final norm holds on this
    # rank (T / cp / tp with SP), and the head's output (vocabulary-sharded DTensor with loss parallel).
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    norm_tokens, head_out = [], []
    model.final_norm.register_forward_pre_hook(lambda m, args: norm_tokens.append(local(args[0]).shape[1]))
    model.lm_head.register_forward_hook(lambda m, args, out: head_out.append(
        [str(p) for p in out.placements] + [local(out).shape[-1]] if hasattr(out, "placements") else [out.shape[-1]]))
    trainer.fit()
    trainer.seen_seq_len = sorted(set(seen))
    trainer.norm_tokens = sorted(set(norm_tokens))
    trainer.head_out = head_out[-1]
    trainer.compiled_graphs = counters["stats"]["unique_graphs"] - graphs_before
    return {"step": step, "final": full_state(dict(unwrap(trainer.model).named_parameters())), "trainer": trainer}


def fit(cfg):
    from slipstream import Trainer
    from slipstream.models.transformer import build_model

    trainer = Trainer(build_model(cfg.model, "cpu", seed=MODEL_SEED), make_dataset(), lm_batch_loss, config=cfg)
    trainer.fit()
    return trainer


def layout(trainer) -> dict[str, Any]:
    from slipstream.distributed.data_parallel import unwrap

    out = {}
    for name, p in unwrap(trainer.model).named_parameters():
        if hasattr(p, "placements"):
            out[name] = {"placements": [str(pl) for pl in p.placements], "local_shape": list(p.to_local().shape),
                         "mesh": list(p.device_mesh.mesh_dim_names or ())}
        else:
            out[name] = {"placements": None, "local_shape": list(p.shape), "mesh": []}
    model = unwrap(trainer.model)
    out["_tied"] = model.lm_head.weight is model.tok_emb.weight
    out["_seen_seq_len"] = trainer.seen_seq_len
    out["_norm_tokens"] = trainer.norm_tokens
    out["_head_out"] = trainer.head_out
    out["_compiled_graphs"] = trainer.compiled_graphs
    out["_float8_linears"] = sorted(n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")
    return out


def main(argv: list[str]) -> int:
    out_dir, names = Path(argv[0]), set(argv[1:])
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    from slipstream.config import load_config
    from slipstream.distributed.mesh import shutdown

    failed = False
    if any(FP8 in sc["extra"] for sc in SCENARIOS[world]):
        allow_fp8_on_cpu()
    for sc in SCENARIOS[world]:
        if names and sc["name"] not in names:
            continue
        where = out_dir / sc["name"]
        try:
            dp = world // (sc["tp"] * sc["cp"])
            if sc["kind"] == "bad_batch":  # a sequence length sequence parallel cannot split: a clear error
                from slipstream import Trainer
                from slipstream.errors import UserError
                from slipstream.models.transformer import build_model

                cfg = load_config(None, overrides(sc, where / "run", sc["tp"], sc["strategy"], MICRO))
                trainer = Trainer(build_model(cfg.model, "cpu", seed=MODEL_SEED), make_dataset(), lm_batch_loss,
                                  config=cfg)
                try:
                    trainer.model(torch.zeros(1, SEQ_LEN + 1, dtype=torch.long))
                    message = None
                except UserError as e:
                    message = str(e)
                if rank == 0:
                    where.mkdir(parents=True, exist_ok=True)
                    (where / "bad_batch.json").write_text(json.dumps({"error": message}))
                continue
            if sc["kind"] != "equal":
                # The global batch of the save run (tp2, one data-parallel rank, MICRO) at every layout.
                resume = [f"--checkpoint.resume={out_dir.parent / SAVED_CHECKPOINT}"] if sc["kind"] == "resume" else []
                cfg = load_config(None, overrides(sc, where / "run", sc["tp"], sc["strategy"], MICRO // dp) + resume)
                fit(cfg)
                continue
            cfg = load_config(None, overrides(sc, where / "run", sc["tp"], sc["strategy"], MICRO, sc["cp"]))
            result = run(cfg)
            if rank == 0:
                torch.save(result["step"], where / "step.pt")
                torch.save(result["final"], where / "final.pt")
                (where / "layout.json").write_text(json.dumps({"dp": dp, **layout(result["trainer"])}, indent=1))
        except Exception:
            failed = True
            where.mkdir(parents=True, exist_ok=True)
            (where / f"error_rank{rank}.txt").write_text(traceback.format_exc())
            traceback.print_exc()
    shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
