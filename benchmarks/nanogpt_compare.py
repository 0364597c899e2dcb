"""slipstream vs nanoGPT at equal steps, evaluated on identical windows.

    python benchmarks/nanogpt_compare.py --nanogpt PATH/TO/nanoGPT [--seeds 1337 7 42] [--steps 500]

Both train the default job's shape (6 layers, 6 heads, width 192, byte vocabulary 257,
16 x 256 tokens, AdamW lr 1e-3, 50 warmup steps, cosine to 1e-4, weight decay 0.1, betas
0.9/0.95, clip 1.0, fp32, biases, no dropout) on the same prepared token shards: slipstream's
`train_*.bin` / `val_*.bin` are concatenated into nanoGPT's `train.bin` / `val.bin`. nanoGPT
runs unmodified from the given checkout: its seed (hard-coded 1337) is offset through
torch.manual_seed and each evaluation's checkpoint is kept (torch.save renamed per step),
both from a small wrapper. Each system's checkpoints at the evaluation steps are then
scored by the same function on every seq_len window of the val split (slipstream's
EvalWindows), so the losses are over identical tokens. The result goes to
benchmarks/nanogpt-compare-cpu.json with machine, versions and git sha.

`--slipstream-set key=value` passes overrides to slipstream only (e.g. to measure the
effect of one difference); the committed file uses the defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(n_layer=6, n_head=6, n_embd=192, block_size=256, batch_size=16, bias=True, dropout=0.0)
OPTIM = dict(learning_rate=1e-3, min_lr=1e-4, warmup_iters=50, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0)

# Runs nanoGPT's train.py as it is; only the seed and the checkpoint file name are changed from outside.
NANOGPT_WRAPPER = """
import os, runpy, sys, torch
seed = int(os.environ["COMPARE_SEED"])
real_seed, real_save = torch.manual_seed, torch.save
torch.manual_seed = lambda s: real_seed(s - 1337 + seed)  # train.py seeds 1337 + rank offset
def save_each(obj, path, *args, **kwargs):  # keep every evaluation's checkpoint, not only the last
    return real_save(obj, str(path).replace("ckpt.pt", f"ckpt_{obj['iter_num']}.pt"), *args, **kwargs)
torch.save = save_each
sys.path.insert(0, os.environ["NANOGPT_DIR"])
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path(os.path.join(os.environ["NANOGPT_DIR"], "train.py"), run_name="__main__")
"""


def concat_split(data_dir: Path, split: str, out: Path) -> None:
    manifest = json.loads((data_dir / "manifest.json").read_text())
    with open(out, "wb") as f:
        for shard in manifest["splits"][split]["shards"]:
            f.write((data_dir / shard["file"]).read_bytes())


def run_nanogpt(nanogpt: Path, data_dir: Path, work: Path, seed: int, steps: int, eval_every: int) -> Path:
    out = work / f"nanogpt-{seed}"
    if (out / f"ckpt_{steps}.pt").exists():
        return out
    dataset = work / "nanogpt-data" / "data" / "slipstream"
    if not (dataset / "val.bin").exists():
        dataset.mkdir(parents=True, exist_ok=True)
        concat_split(data_dir, "train", dataset / "train.bin")
        concat_split(data_dir, "val", dataset / "val.bin")
        vocab = json.loads((data_dir / "manifest.json").read_text())["vocab_size"]
        with open(dataset / "meta.pkl", "wb") as f:
            pickle.dump({"vocab_size": vocab}, f)  # train.py reads the vocabulary from here
        (work / "nanogpt-data" / "configurator.py").symlink_to(nanogpt / "configurator.py")
    (work / "wrapper.py").write_text(NANOGPT_WRAPPER)
    args = {**SHAPE, **OPTIM, "out_dir": str(out), "dataset": "slipstream", "device": "cpu", "compile": False,
            "dtype": "float32", "max_iters": steps, "lr_decay_iters": steps, "eval_interval": eval_every,
            "eval_iters": 20, "log_interval": 50, "gradient_accumulation_steps": 1, "always_save_checkpoint": True}
    argv = [f"--{k}={v}" for k, v in args.items()]
    env = dict(os.environ, COMPARE_SEED=str(seed), NANOGPT_DIR=str(nanogpt))
    with open(work / f"nanogpt-{seed}.log", "w") as log:  # cwd: train.py reads data/ and configurator.py from it
        subprocess.run([sys.executable, str(work / "wrapper.py"), *argv], cwd=work / "nanogpt-data", env=env,
                       stdout=log, stderr=subprocess.STDOUT, check=True)
    return out


def run_slipstream(data_dir: Path, work: Path, seed: int, steps: int, eval_every: int, extra: list[str],
                   tag: str = "") -> Path:
    tag = tag or "-".join(e.replace("=", "_").replace(".", "_") for e in extra)
    out = work / f"slipstream-{seed}{'-' + tag if tag else ''}"
    if (out / "summary.json").exists():
        return out
    argv = ["--config", str(ROOT / "configs" / "quickstart.toml"), f"--data.dir={data_dir}", f"--run.dir={out}",
            f"--train.seed={seed}", f"--train.max_steps={steps}", f"--checkpoint.interval={eval_every}",
            "--checkpoint.async_save=false", "--logging.progress=false",
            f"--train.eval_interval={eval_every}", *[f"--{e}" for e in extra]]
    with open(work / f"{out.name}.log", "w") as log:
        subprocess.run([sys.executable, "-m", "slipstream", "train", *argv], cwd=work, stdout=log,
                       stderr=subprocess.STDOUT, check=True)
    return out


def val_windows(data_dir: Path, seq_len: int):
    from slipstream.data.eval_windows import EvalWindows

    return EvalWindows(str(data_dir), "val", batch_size=16, seq_len=seq_len, max_tokens=2**62)


@torch.no_grad()
def score(logits_fn, windows) -> tuple[float, float]:
    """Mean and standard error of the per-window loss over every window."""
    losses = []
    for (x, y), w in windows:
        logits = logits_fn(x).float()
        per = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        losses += per.view(y.shape).mean(1)[w > 0].tolist()
    return float(np.mean(losses)), float(np.std(losses, ddof=1) / math.sqrt(len(losses)))


def score_nanogpt(nanogpt: Path, ckpt: Path, windows) -> tuple[float, float]:
    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig  # nanoGPT's own model.py, from the checkout

    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**state["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in state["model"].items()})
    model.eval()
    # nanoGPT returns only the last position's logits without targets: pass the targets to get all.
    return score(lambda x: model(x, torch.zeros_like(x))[0], windows)


def score_slipstream(run: Path, step: int, windows) -> tuple[float, float]:
    from slipstream.train.lm import load_lm_from_checkpoint

    model, _, cfg = load_lm_from_checkpoint(run / "checkpoints" / f"step_{step:08d}", device="cpu")
    model.eval()
    return score(lambda x: model(x)[..., :cfg.model.vocab_size], windows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout (train.py, model.py, configurator.py)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1337, 7, 42])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--work", type=Path, default=ROOT / ".cache" / "nanogpt-compare")
    p.add_argument("--data", type=Path, default=None, help="prepared slipstream data (default: the default job's)")
    p.add_argument("--slipstream-set", nargs="*", default=[], help="extra slipstream overrides, section.key=value")
    p.add_argument("--only", choices=("both", "slipstream", "nanogpt"), default="both",
                   help="train and score one system only (runs are cached in --work; a later run with both reuses them)")
    p.add_argument("--tag", default="", help="name slipstream's runs apart (e.g. when PYTHONPATH points at another version)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "nanogpt-compare-cpu.json")
    args = p.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.data or args.work / "data"
    if not (data / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "slipstream", "data", "prepare", "--input", "stdlib", "--tokenizer",
                        "byte", "--out", str(data), "--quiet"], check=True)
    windows = val_windows(data, SHAPE["block_size"])
    steps = list(range(args.eval_every, args.steps + 1, args.eval_every))
    rows = []
    for seed in args.seeds:
        t0 = time.perf_counter()
        row = {"seed": seed}
        if args.only in ("both", "slipstream"):
            run = run_slipstream(data, args.work, seed, args.steps, args.eval_every, args.slipstream_set, args.tag)
            row["slipstream"] = {s: score_slipstream(run, s, windows) for s in steps}
        if args.only in ("both", "nanogpt"):
            out = run_nanogpt(args.nanogpt, data, args.work, seed, args.steps, args.eval_every)
            row["nanogpt"] = {s: score_nanogpt(args.nanogpt, out / f"ckpt_{s}.pt", windows) for s in steps}
        row["seconds"] = time.perf_counter() - t0
        print(json.dumps(row), flush=True)
        rows.append(row)
    summary = {}
    for system in ("slipstream", "nanogpt"):
        for s in steps:
            values = [r[system][s][0] for r in rows if system in r]
            if values:
                summary[f"{system}@{s}"] = {"mean": float(np.mean(values)),
                                            "seed_std": float(np.std(values, ddof=1)) if len(values) > 1 else None}
    from slipstream.observe.env import collect_env, write_json_atomic

    result = {"what": "val loss on every 256-token window of the val split (mean, standard error) per seed and step",
              "shape": SHAPE, "optim": OPTIM, "steps": args.steps, "seeds": args.seeds,
              "windows": windows.n_windows, "tokens": windows.tokens, "slipstream_overrides": args.slipstream_set,
              "rows": rows, "summary": summary, "env": collect_env()}
    if args.slipstream_set or args.tag or args.only != "both":
        print(json.dumps(summary, indent=2))
        return  # an experiment or a part, not the committed comparison
    write_json_atomic(args.out, result)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
