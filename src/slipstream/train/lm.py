"""The language-model job behind `slipstream train` and `slipstream generate`.

config -> data (prepared once, cached) -> model (meta -> materialize -> init) -> Trainer.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
from pathlib import Path
from typing import Any

import torch

from slipstream.config.schema import Config, ModelConfig
from slipstream.errors import UserError


def default_data_dir(cfg: Config) -> Path:
    """data/<tokenizer>-<inputs>-<hash>: one cached folder per (inputs, tokenizer) pair."""
    key = repr((sorted(cfg.data.inputs), cfg.data.tokenizer, cfg.data.text_field, cfg.data.val_fraction))
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{cfg.data.tokenizer.split('/')[-1]}-{'-'.join(Path(i).name for i in cfg.data.inputs)}")
    return Path("data") / f"{slug.strip('-')[:60]}-{digest}"


def ensure_data(cfg: Config) -> tuple[Path, dict[str, Any]]:
    """The prepared token shards of this run.

    data.dir set: use that prepared folder as it is (from `slipstream data prepare`).
    data.dir empty: prepare data.inputs on first use into a cache folder; later runs reuse it.
    """
    from slipstream.data import load_manifest, prepare_dataset

    if cfg.data.dir:
        return Path(cfg.data.dir), load_manifest(cfg.data.dir)
    data_dir = default_data_dir(cfg)
    manifest = prepare_dataset(cfg.data.inputs, cfg.data.tokenizer, str(data_dir), text_field=cfg.data.text_field,
                               val_fraction=cfg.data.val_fraction, num_workers=cfg.data.prepare_workers or None,
                               progress=cfg.logging.progress)
    return data_dir, manifest


def resolve_vocab(model_cfg: ModelConfig, data_vocab: int) -> ModelConfig:
    if model_cfg.vocab_size == 0:
        return dataclasses.replace(model_cfg, vocab_size=data_vocab)
    if model_cfg.vocab_size < data_vocab:
        raise UserError(f"model.vocab_size = {model_cfg.vocab_size} is smaller than the tokenizer's vocabulary "
                        f"({data_vocab}); set model.vocab_size = 0 to take it from the data")
    return model_cfg


def lm_loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    from slipstream.models.transformer import lm_loss

    x, y = batch
    return lm_loss(model(x), y)


def fused_lm_loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                     chunk_size: int = 4096) -> torch.Tensor:
    """The same loss as lm_loss_fn, with the output head fused into the cross-entropy."""
    from slipstream.distributed.data_parallel import unwrap
    from slipstream.ops.fused_ce import fused_linear_cross_entropy

    x, y = batch
    hidden = model(x, return_hidden=True)
    device_type = hidden.device.type
    # A custom op is outside autocast's reach: cast as autocast would cast a matmul's inputs.
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    # DDP wraps the model (FSDP2 shards it in place): the head lives on the wrapped module.
    head = unwrap(model).lm_head.weight
    return fused_linear_cross_entropy(hidden.to(dtype), head.to(dtype), y, chunk_size=chunk_size)


def describe_model(cfg: Config) -> str:
    from slipstream.observe.flops import flops_per_token, param_count

    m = cfg.model
    n = param_count(m)
    return (f"model {m.preset}: {n.total / 1e6:.2f}M parameters ({n.matmul / 1e6:.2f}M in matmuls), "
            f"{m.n_layer} layers, {m.n_head} heads, width {m.d_model}, vocab {m.vocab_size}; "
            f"{flops_per_token(m, cfg.train.seq_len) / 1e6:.1f} MFLOPs/token")


def build_lm_trainer(cfg: Config):
    """Everything `slipstream train` needs, assembled in the one documented order."""
    from slipstream.data import TokenLoader, get_tokenizer, tokenizer_spec_for
    from slipstream.distributed.data_parallel import materialize_sharded
    from slipstream.distributed.mesh import SHARDED, init_parallel
    from slipstream.models.transformer import Transformer, materialize
    from slipstream.observe.flops import flops_per_token
    from slipstream.perf.repro import seed_all
    from slipstream.train.rundir import check_run_dir, make_run_dir
    from slipstream.train.trainer import Trainer

    par = init_parallel(cfg)  # under torchrun: join the job first; errors in the layout stop every rank
    device = par.device
    # Rank 0 names the run directory (a default name holds a timestamp) and every rank uses it.
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=par.broadcast(str(make_run_dir(cfg)))))
    check_run_dir(make_run_dir(cfg))  # fail before preparing data or building the model
    if par.env.local_rank != 0:
        par.barrier()  # one process per node prepares (or finds) the cached data; the others wait
    data_dir, manifest = ensure_data(cfg)
    if par.env.local_rank == 0:
        par.barrier()
    tokenizer = tokenizer_spec_for(str(data_dir), manifest)
    get_tokenizer(tokenizer)  # a missing tokenizer file fails now, not when the first checkpoint is saved
    train_cfg = cfg.train
    if train_cfg.eval_steps and manifest["splits"].get("val", {}).get("tokens", 0) <= train_cfg.seq_len:
        print(f"note: {data_dir} has no validation split long enough for one sequence; evaluation is off "
              "(prepare with data.val_fraction > 0 to get one)")
        train_cfg = dataclasses.replace(train_cfg, eval_steps=0)
    # The run's config.toml records what was actually used: data folder, its tokenizer and vocabulary.
    cfg = dataclasses.replace(cfg, model=resolve_vocab(cfg.model, manifest["vocab_size"]), train=train_cfg,
                              data=dataclasses.replace(cfg.data, dir=str(data_dir), tokenizer=manifest["tokenizer"]))
    seed_all(cfg.train.seed)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    init_model = None
    if par.dims.strategy in SHARDED:
        # Sharded strategies materialize after fully_shard: a rank never holds the whole model,
        # yet gets exactly the shards of the weights a single process would draw from the seed.
        init_model = functools.partial(materialize_sharded, materialize=materialize, cfg=cfg, device=device,
                                       seed=cfg.train.seed)
    else:
        model = materialize(model, device, cfg.train.seed)

    t = cfg.train
    d = cfg.data
    train_loader = TokenLoader(str(data_dir), "train", t.micro_batch_size, t.seq_len, seed=t.seed,
                               mode=d.sampling, device=device, prefetch=d.prefetch, num_workers=d.num_workers,
                               rank=par.dp_rank, world_size=par.dims.dp,
                               pin_memory=d.pin_memory, augment=d.augment, augment_prob=d.augment_prob,
                               augment_cost_ms=d.augment_cost_ms)
    val_loader = None
    if t.eval_steps:
        val_loader = TokenLoader(str(data_dir), "val", t.micro_batch_size, t.seq_len, seed=t.seed,
                                 mode="sequential", device=device, rank=par.dp_rank, world_size=par.dims.dp)
    meta, files = {"tokenizer": tokenizer}, {}
    if tokenizer.startswith("bpe:"):  # ship the tokenizer with the checkpoint so generate works anywhere
        files["tokenizer.json"] = tokenizer[4:]
        meta["tokenizer"] = "bpe:tokenizer.json"
    loss_fn = functools.partial(fused_lm_loss_fn, chunk_size=t.fused_loss_chunk) if t.fused_loss else lm_loss_fn
    planned = plan_step_memory(cfg, par, device)
    return Trainer(model, train_loader, loss_fn, config=cfg, val_data=val_loader,
                   tokens_per_batch=t.micro_batch_size * t.seq_len,
                   flops_per_token=flops_per_token(cfg.model, t.seq_len), device=device,
                   checkpoint_meta=meta, checkpoint_files=files, model_summary=describe_model(cfg), parallel=par,
                   init_model=init_model, planned_peak_bytes=planned)


def plan_step_memory(cfg: Config, par, device: torch.device) -> int | None:
    """The planner's step peak for this run (compared with the measured one in summary.json).
    On a GPU, a config predicted not to fit gets a warning before any memory is spent."""
    import warnings

    from slipstream.plan.memory import GIB, estimate_memory
    from slipstream.plan.space import PlanModel, strategy_from_config

    dims = par.dims
    try:
        strategy = strategy_from_config(cfg, dims.dp, dims.strategy, dims.dp_shard)
        estimate = estimate_memory(PlanModel(cfg.model.preset, cfg.model), strategy, cfg.train.seq_len,
                                   device=device.type, optimizer_state_bytes=2 if cfg.optim.state_dtype == "bf16" else 4)
    except Exception as e:  # noqa: BLE001 - the prediction is a check; it must never stop a run
        if par.is_main:
            warnings.warn(f"slipstream plan could not predict this run's memory ({type(e).__name__}: {e})",
                          stacklevel=2)
        return None
    if device.type == "cuda" and par.is_main:
        capacity = torch.cuda.get_device_properties(device).total_memory
        if estimate.total_bytes > capacity:
            warnings.warn(f"slipstream plan predicts {estimate.total_bytes / GIB:.1f} GiB per GPU for this config, "
                          f"more than the GPU's {capacity / GIB:.1f} GiB; `slipstream plan --model <this config's "
                          f"TOML> --gpus {par.world_size}x<GPU> --seq {cfg.train.seq_len} --global-batch "
                          f"{cfg.train.micro_batch_size * cfg.train.grad_accum_steps * dims.dp}` lists layouts "
                          "that fit", stacklevel=2)
    return estimate.peak_bytes


def train_lm(cfg: Config) -> dict[str, Any]:
    return build_lm_trainer(cfg).fit()


def load_lm_from_checkpoint(path: str | Path, device: str = "auto"):
    """(model, tokenizer, config) from a checkpoint folder or run directory; weights only."""
    from slipstream.checkpoint import manager as ckpt
    from slipstream.config.load import config_from_toml_text
    from slipstream.data import get_tokenizer
    from slipstream.models.transformer import Transformer, materialize
    from slipstream.train.setup import resolve_device

    ckpt_dir = ckpt.resolve_checkpoint(path)
    meta = ckpt.read_meta(ckpt_dir)
    try:
        cfg = config_from_toml_text((ckpt_dir / "config.toml").read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"checkpoint '{ckpt_dir}' has no readable config.toml ({e.strerror}); it is damaged") from None
    target = resolve_device(device, what="--device")
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model = materialize(model, target, seed=0)
    ckpt.load_checkpoint(ckpt_dir, model)
    spec = meta.get("tokenizer", cfg.data.tokenizer)
    if spec.startswith("bpe:") and not Path(spec[4:]).is_absolute():
        spec = f"bpe:{ckpt_dir / spec[4:]}"
    return model, get_tokenizer(spec), cfg


def generate_text(checkpoint: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: int | None = 50, seed: int = 0, device: str = "auto") -> str:
    from slipstream.models.transformer import generate

    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise UserError(f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k must be >= 1, got {top_k}")
    model, tokenizer, _cfg = load_lm_from_checkpoint(checkpoint, device)
    ids = tokenizer.encode(prompt)
    start = 0
    if not ids:  # an empty prompt starts a new document: after the end-of-text token, which we don't print
        ids, start = [tokenizer.eot_id], 1
    if max(ids) >= model.cfg.vocab_size:
        raise UserError("the prompt encodes to ids outside the model's vocabulary; wrong tokenizer for this checkpoint")
    device_ = next(model.parameters()).device
    idx = torch.tensor([ids], dtype=torch.long, device=device_)
    gen = torch.Generator(device=device_).manual_seed(seed)
    out = generate(model, idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=gen)
    return tokenizer.decode(out[0, start:].tolist())
