"""`slipstream bench packing`: what a document mask costs, in training tokens/s.

One small model trains on packed rows of synthetic documents (lengths drawn from a geometric
distribution, each closed by the end-of-text token, as `data prepare` writes them) with

    eos     data.packing = eos: one causal mask, attention crosses documents (SDPA is_causal)
    dense   data.packing = document, SDPA with a dense (B, 1, T, T) document-causal mask
    flex    data.packing = document, FlexAttention with a block mask (CUDA; torch has no
            FlexAttention backward on CPU, so there it is timed in evaluation only)

A training step is forward + backward + AdamW step of the loss fn `slipstream train` uses
(train/lm_loss.py, eot_id set for document packing). The variants are interleaved round by
round, so a machine shared with other work slows them alike; each variant's number is the
median step time over all its rounds (also recorded: the best round, and the median of the
per-round ratios to eos). An evaluation pass (forward, no grad) of every runnable kernel is
timed the same way (on CPU flex both compiled and eager, the default there). The JSON records
the machine, versions and git sha.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from slipstream.errors import UserError

SIZES = {
    # GPT-2 shape at CPU scale, narrow so that attention (T = 512) is a sizeable part of the step.
    "default": dict(n_layer=4, n_head=4, d_model=128, vocab=4096, seq_len=512, batch=4, mean_doc=128),
    "ci": dict(n_layer=2, n_head=2, d_model=64, vocab=512, seq_len=64, batch=2, mean_doc=16),
}


def packed_rows(batch: int, seq_len: int, vocab: int, eot: int, mean_doc: int, seed: int = 0) -> torch.Tensor:
    """(batch, seq_len + 1) token rows of back-to-back documents of geometric lengths (mean `mean_doc`)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, eot, (batch, seq_len + 1), generator=g)
    ends = torch.rand(rows.shape, generator=g) < 1.0 / mean_doc
    return torch.where(ends, eot, rows)


def _variants(device: torch.device) -> tuple[dict[str, str | None], dict[str, str]]:
    """({variant: kernel} for training, {variant: why not} for those that cannot train here)."""
    from slipstream.models.doc_mask import flex_runnable

    train: dict[str, str | None] = {"eos": None, "dense": "dense"}
    skipped = {}
    reason = flex_runnable(device, needs_grad=True)
    if reason is None:
        train["flex"] = "flex"
    else:
        skipped["flex"] = reason
    return train, skipped


def run_packing_bench(size: str = "default", rounds: int = 5, steps: int = 3, device: str = "cpu",
                      out: str = "", threads: int = 0) -> dict[str, Any]:
    from slipstream.config.schema import ModelConfig
    from slipstream.models.doc_mask import DocumentMask, doc_ids_after, flex_runnable
    from slipstream.models.flops import flops_per_token
    from slipstream.models.transformer import build_model
    from slipstream.observe.env import collect_env, write_json_atomic
    from slipstream.train.lm_loss import lm_loss_fn

    if size not in SIZES:
        raise UserError(f"--size {size!r} is unknown; use one of {', '.join(SIZES)}")
    if rounds < 1 or steps < 1:
        raise UserError(f"--rounds and --steps must be >= 1 (got {rounds} and {steps})")
    if threads < 0:
        raise UserError(f"--threads must be >= 0 (0 = torch's default), got {threads}")
    if threads:  # fewer threads than cores: steadier timings on a machine shared with other work
        torch.set_num_threads(threads)
    s = SIZES[size]
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA GPU here; use --device cpu")
    eot = s["vocab"] - 1
    cfg = ModelConfig(vocab_size=s["vocab"], n_layer=s["n_layer"], n_head=s["n_head"], d_model=s["d_model"],
                      max_seq_len=s["seq_len"], position="learned")
    rows = packed_rows(s["batch"], s["seq_len"], s["vocab"], eot, s["mean_doc"]).to(dev)
    x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    docs_per_row = float((doc_ids_after(x, eot).amax(dim=1) + 1).float().mean())
    train, skipped = _variants(dev)
    models = {name: build_model(cfg, dev, seed=0) for name in train}
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def train_step(name: str) -> None:
        model, optim = models[name], optims[name]
        kernel = train[name]
        loss = lm_loss_fn(model, (x, y), eot_id=None if kernel is None else eot, kernel=kernel or "auto")
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    eval_kernels: dict[str, tuple[str, bool] | None] = {"eos": None, "dense": ("dense", False)}
    if flex_runnable(dev, needs_grad=False) is None:
        eval_kernels["flex"] = ("flex", True)
        if dev.type == "cpu":  # the default on CPU (eager); compiled unless a smoke run (seconds to compile)
            eval_kernels["flex-eager"] = ("flex", False)
            if size == "ci":
                del eval_kernels["flex"]
    evaluator = build_model(cfg, dev, seed=0).eval()

    @torch.no_grad()
    def eval_step(name: str) -> None:
        choice = eval_kernels[name]
        if choice is None:
            evaluator(x)
        else:
            kernel, compiled = choice
            evaluator(x, doc_ids=DocumentMask(doc_ids_after(x, eot), kernel=kernel, needs_grad=False,
                                              compiled=compiled))

    def timed(fn, name: str) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            fn(name)
        sync()
        return (time.perf_counter() - start) / steps

    for name in train:  # warm-up: first-call allocations, thread pools (and compilation on CUDA)
        train_step(name)
    for name in eval_kernels:
        eval_step(name)
    train_s: dict[str, list[float]] = {name: [] for name in train}
    eval_s: dict[str, list[float]] = {name: [] for name in eval_kernels}
    for r in range(rounds):
        for name in train:
            train_s[name].append(timed(train_step, name))
        for name in eval_kernels:
            eval_s[name].append(timed(eval_step, name))
        print(f"round {r + 1}/{rounds}: train " + ", ".join(f"{n} {train_s[n][-1] * 1e3:.0f} ms" for n in train)
              + "; eval " + ", ".join(f"{n} {eval_s[n][-1] * 1e3:.0f} ms" for n in eval_kernels))
    tokens = s["batch"] * s["seq_len"]

    def summary(samples: dict[str, list[float]]) -> dict[str, Any]:
        # The best round too: on a machine shared with other work it is the least disturbed one.
        return {name: {"step_s_median": statistics.median(v), "tokens_per_s": tokens / statistics.median(v),
                       "step_s_min": min(v), "tokens_per_s_best": tokens / min(v), "step_s_all": v}
                for name, v in samples.items()}

    training, evaluation = summary(train_s), summary(eval_s)
    for rows_, samples in ((training, train_s), (evaluation, eval_s)):
        for name, row in rows_.items():
            row["vs_eos"] = row["tokens_per_s"] / rows_["eos"]["tokens_per_s"]
            # Speed relative to eos within each round, then the median: robust to load that
            # changes between rounds on a shared machine.
            row["vs_eos_paired"] = statistics.median(e / v for e, v in zip(samples["eos"], samples[name]))
    result = {
        "bench": "packing", "size": size, "device": str(dev), "rounds": rounds, "steps_per_round": steps,
        "model": {k: s[k] for k in ("n_layer", "n_head", "d_model", "vocab", "seq_len")},
        "mflops_per_token": flops_per_token(cfg, s["seq_len"]) / 1e6,
        "batch": s["batch"], "tokens_per_step": tokens, "mean_doc_tokens": s["mean_doc"],
        "documents_per_row": docs_per_row,
        "training": training, "evaluation": evaluation, "not_run": skipped,
        "env": collect_env(),
    }
    for what, rows_ in (("train", training), ("eval", evaluation)):
        for name, row in rows_.items():
            print(f"{what} {name:<10} {row['tokens_per_s']:>10,.0f} tokens/s (best round "
                  f"{row['tokens_per_s_best']:,.0f}; {row['vs_eos']:.2f}x eos, {row['vs_eos_paired']:.2f}x paired by round)")
    for name, why in skipped.items():
        print(f"train {name}: not run ({why})")
    path = out or f"benchmarks/packing-{dev.type}.json"
    write_json_atomic(path, result)
    print(f"wrote {path}")
    return result
