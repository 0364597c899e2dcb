"""Image classification on WebDataset tar shards with the slipstream Trainer: the data-loading
chapter end to end (worker processes, pinned memory on CUDA, prefetch) and the data wait they
remove, measured.

    python examples/image_classification.py                       # 2 workers, 150 steps
    python examples/image_classification.py --workers 0 2 --json benchmarks/image-data-wait-cpu.json

1. Data: 10 classes of synthetic 64x64 RGB images (a square or a disc in one of five colours,
   at a random place and size, on a noisy background; class = shape x colour), written once as
   tar shards of PNG + class members into OUT/shards (train-000..N.tar and a held-out val.tar),
   the layout `webdataset.TarWriter` writes.
2. A CPU augmentation pipeline in the DataLoader workers (TarShards' transform): random resized
   crop to 32x32, horizontal flip, colour jitter (brightness, contrast, saturation), a blur and
   normalization, on PIL images: about as costly per sample as a real photo pipeline, so with
   workers=0 the step waits for it. Its randomness is seeded per sample by TarShards, so the
   batches are the same with any number of workers and after a resume.
3. A small CNN trained by slipstream.Trainer with data.num_workers / data.prefetch /
   data.pin_memory; the data wait per step comes from the trainer's metrics.jsonl (data_wait_s
   next to step_time_s, per logging interval); accuracy on the held-out shard at the end.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageEnhance, ImageFilter

from slipstream import Trainer, load_config
from slipstream.data.tar_shards import TarShards
from slipstream.train.rundir import MARKER as RUN_MARKER

CLASSES = 10
SIZE = 64  # stored images; the network sees 32x32 crops
CROP = 32
COLOURS = [(220, 40, 40), (40, 180, 60), (50, 80, 230), (230, 200, 40), (170, 60, 200)]
MEAN, STD = (0.45, 0.45, 0.45), (0.25, 0.25, 0.25)


# --- 1. the data ----------------------------------------------------------------------------------------------------

def draw(label: int, rng: np.random.Generator) -> Image.Image:
    noise = rng.normal(110, 35, (SIZE, SIZE, 3)).clip(0, 255).astype(np.uint8)
    img = Image.fromarray(noise)
    colour = tuple(int(np.clip(c + rng.normal(0, 15), 0, 255)) for c in COLOURS[label % 5])
    r = int(rng.integers(12, 22))
    cx, cy = (int(v) for v in rng.integers(r, SIZE - r, 2))
    shape = ImageDraw.Draw(img)
    box = (cx - r, cy - r, cx + r, cy + r)
    (shape.rectangle if label < 5 else shape.ellipse)(box, fill=colour)
    return img


def write_shard(path: Path, samples) -> None:
    """Members KEY.png and KEY.cls per sample (what webdataset.TarWriter writes), atomically."""
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        for key, img, label in samples:
            png = io.BytesIO()
            img.save(png, format="PNG")
            for name, data in ((f"{key}.png", png.getvalue()), (f"{key}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), 0
                tar.addfile(info, io.BytesIO(data))
    tmp.replace(path)


def make_shards(folder: Path, train_shards: int = 8, per_shard: int = 250, val: int = 500, seed: int = 0) -> Path:
    """Write the shards once; an existing complete folder is used as it is."""
    shards = folder / "shards"
    if (shards / "val.tar").exists():
        return shards
    shards.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = [f"train-{i:03d}" for i in range(train_shards)] + ["val"]
    counts = [per_shard] * train_shards + [val]
    key = 0
    for name, count in zip(names, counts):
        samples = []
        for _ in range(count):
            label = int(rng.integers(CLASSES))
            samples.append((f"{key:06d}", draw(label, rng), label))
            key += 1
        write_shard(shards / f"{name}.tar", samples)
    return shards


# --- 2. augmentation (runs in the workers) --------------------------------------------------------------------------

def to_tensor(img: Image.Image) -> torch.Tensor:
    x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (x - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)


def rand(lo: float, hi: float) -> float:
    return lo + (hi - lo) * torch.rand(()).item()  # torch's generator: TarShards seeds it per sample


def augment(sample: dict) -> tuple[torch.Tensor, int]:
    img = sample["png"]  # a PIL image (decode="pil")
    scale, ratio = rand(0.5, 1.0), math.exp(rand(math.log(3 / 4), math.log(4 / 3)))
    w = min(SIZE, int(round(SIZE * math.sqrt(scale * ratio))))
    h = min(SIZE, int(round(SIZE * math.sqrt(scale / ratio))))
    x0, y0 = int(rand(0, SIZE - w + 1)), int(rand(0, SIZE - h + 1))
    img = img.resize((CROP, CROP), Image.BILINEAR, box=(x0, y0, x0 + w, y0 + h))
    if rand(0, 1) < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        img = enhance(img).enhance(rand(0.7, 1.3))
    img = img.filter(ImageFilter.GaussianBlur(rand(0.1, 1.0)))
    return to_tensor(img), sample["cls"]


def evaluate_transform(sample: dict) -> tuple[torch.Tensor, int]:
    img = sample["png"].resize((CROP, CROP), Image.BILINEAR)
    return to_tensor(img), sample["cls"]


# --- 3. model, training, measurement --------------------------------------------------------------------------------

def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, CLASSES))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


@torch.no_grad()
def accuracy(model: nn.Module, shard: Path, device: torch.device) -> float:
    model.eval()
    data = TarShards(shard, decode="pil", transform=evaluate_transform)
    right = total = 0
    for images, labels in torch.utils.data.DataLoader(data, batch_size=250):
        right += (model(images.to(device)).argmax(1) == labels.to(device)).sum().item()
        total += len(labels)
    model.train()
    return right / total


def data_wait(run_dir: Path) -> dict:
    """The trainer's per-interval means from metrics.jsonl, the first interval (worker start-up,
    warm-up) left out when there are more."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "data_wait_s" in r and "step_time_s" in r]
    rows = rows[1:] if len(rows) > 1 else rows
    wait = sum(r["data_wait_s"] for r in rows) / max(1, len(rows))
    step = sum(r["step_time_s"] for r in rows) / max(1, len(rows))
    return {"data_wait_s": wait, "step_time_s": step, "data_wait_fraction": wait / step if step else None,
            "intervals": len(rows)}


def train(shards: Path, run_dir: Path, workers: int, steps: int, batch: int = 64, prefetch: int = 2,
          resume: str = "none", overrides: tuple[str, ...] = ()) -> dict:
    cfg = load_config(None, [
        f"--run.dir={run_dir}", f"--train.max_steps={steps}", f"--train.micro_batch_size={batch}",
        "--optim.lr=3e-3", f"--optim.warmup_steps={min(20, steps // 5)}", "--optim.weight_decay=0.0",
        f"--data.num_workers={workers}", f"--data.prefetch={prefetch}", "--logging.log_interval=10",
        "--train.eval_interval=0", "--train.eval_steps=2", "--logging.progress=false",
        f"--checkpoint.resume={resume}", *overrides])
    if resume == "none" and (run_dir / RUN_MARKER).is_file():
        shutil.rmtree(run_dir)  # a run folder slipstream wrote (its marker says so): a fresh run starts clean
    torch.manual_seed(cfg.train.seed)
    model = make_model()
    train_data = TarShards(sorted(shards.glob("train-*.tar")), decode="pil", transform=augment)
    val_data = TarShards(shards / "val.tar", decode="pil", transform=evaluate_transform)
    trainer = Trainer(model, train_data=train_data, val_data=val_data, loss_fn=loss_fn, config=cfg)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    summary = trainer.fit()
    result = {"workers": workers, "prefetch": prefetch, "batch": batch, "steps": steps,
              "load_average_1m_before": load_before, "load_average_1m_after": os.getloadavg()[0],
              "steps_this_run": summary["steps_this_run"],
              "wall_s": time.perf_counter() - start, "final_loss": summary["final_loss"],
              "val_loss": summary["val_loss"], "samples_per_s": summary["tokens_per_s"],
              "accuracy": accuracy(model, shards / "val.tar", trainer.device), **data_wait(Path(summary["run_dir"]))}
    result["model"] = model
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2],
                        help="data.num_workers; several (e.g. 0 2 0 2): one run each, in that order")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/image-classification"),
                        help="the shards (written once) and the run folders (a fresh run replaces its folder)")
    parser.add_argument("--resume", default="none", help="checkpoint.resume: none, auto or a checkpoint folder")
    parser.add_argument("--json", type=Path, help="write the measurements (with the machine) to this file")
    args = parser.parse_args(argv)
    shards = make_shards(args.out)
    results = []
    for i, workers in enumerate(args.workers):
        run_dir = args.out / (f"run-workers{workers}" if len(args.workers) == 1 else f"run-{i}-workers{workers}")
        result = train(shards, run_dir, workers, args.steps, args.batch, args.prefetch,
                       args.resume)
        result.pop("model")
        results.append(result)
        share = result["data_wait_fraction"]
        print(f"workers={workers}: step {result['step_time_s'] * 1e3:.1f} ms, data wait "
              f"{result['data_wait_s'] * 1e3:.1f} ms ({'n/a' if share is None else f'{100 * share:.0f} %'} of the "
              f"step), {result['samples_per_s']:.0f} samples/s, held-out accuracy {100 * result['accuracy']:.1f} %")
    if args.json:
        from slipstream.observe.env import collect_env, write_json_atomic

        write_json_atomic(args.json, {"bench": "image-data-wait", "command": " ".join(["python", *sys.argv]),
                                      "env": collect_env(), "summary": summarize(results), "results": results})
    return results


def summarize(results: list[dict]) -> dict:
    """Per worker count, the mean over its runs (interleaved runs share the machine's load)."""
    out = {}
    for workers in sorted({r["workers"] for r in results}):
        runs = [r for r in results if r["workers"] == workers]
        mean = {k: sum(r[k] for r in runs) / len(runs)
                for k in ("step_time_s", "data_wait_s", "data_wait_fraction", "samples_per_s", "accuracy")}
        out[f"workers={workers}"] = {"runs": len(runs), **mean}
    return out


if __name__ == "__main__":
    main()
