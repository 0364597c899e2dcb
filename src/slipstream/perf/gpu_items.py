"""The items of `slipstream bench gpu` (perf/gpu_suite.py runs them): every check and benchmark
that exists only as a CUDA code path, each with its time budget and the files it writes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../src/slipstream
SRC_DIR = PACKAGE_DIR.parent
REPO_DIR = SRC_DIR.parent  # a source checkout: configs/ and tests/ live here


@dataclass(frozen=True)
class Item:
    """One check or benchmark of the suite.

    kind: "slipstream" (args after `python -m slipstream`), "module" (`python -m <module>
    args`; the module has a build_parser()), "pytest" (args after `python -m pytest`) or
    "python" (args after the interpreter, e.g. -c CODE).
    args may hold {out} (the output folder), {work} (a scratch folder of this item) and
    {repo} (the source checkout). outputs: files the item writes under {out}, same
    placeholders. collect: how the suite itself turns the item's scratch results into
    gpu-<name>.json: "pytest" (the junit XML) or "train" (the run's summary.json and
    metrics.jsonl); None when the command writes its own JSON.
    """

    name: str
    budget_s: int
    kind: str
    args: tuple[str, ...]
    what: str
    outputs: tuple[str, ...] = ()
    module: str = ""
    collect: str | None = None
    config_overrides: bool = False  # a slipstream command taking --config plus --section.key=value

    def expanded(self, out: Path, work: Path) -> list[str]:
        return [_expand(a, out, work) for a in self.args]

    def output_paths(self, out: Path, work: Path) -> list[Path]:
        own = [Path(_expand(o, out, work)) for o in self.outputs]
        return own + ([out / f"gpu-{self.name}.json"] if self.collect else [])


def _expand(text: str, out: Path, work: Path) -> str:
    return text.replace("{out}", str(out)).replace("{work}", str(work)).replace("{repo}", str(REPO_DIR))


# Shared by the two short training runs: nothing but the steps (no eval, checkpoint or TensorBoard).
_QUIET_RUN = ("--run.dir={work}/run", "--train.device=cuda", "--train.grad_accum_steps=1", "--train.eval_tokens=0",
              "--checkpoint.save_final=false", "--checkpoint.interval=0", "--logging.progress=false",
              "--logging.tensorboard=false", "--optim.warmup_steps=2")

# Budgets: the wall times of the first run on one H200 (benchmarks/gpu-suite.json) plus a margin.
# planner (106 s) and ladder-memory (4 of 5 rungs in about 200 s) ran then with the stock
# MemTracker, whose cost grows with depth squared (slipstream/memtrack.py): their budgets count
# on the fix and are the ones to check on the next run.
ITEMS: tuple[Item, ...] = (
    Item("cuda-tests", 40, "pytest", ("{repo}/tests/gpu/test_gpu_cuda_paths.py",
                                      "{repo}/tests/gpu/test_gpu_sparse_kernel.py",
                                      "{repo}/tests/gpu/test_gpu_ring_attention.py"),
         "CUDA equivalence tests: TF32 and fp8 training vs fp32/bf16, pinned-memory prefetch batches and resume, "
         "allocator-stat memory phases, the allocator snapshot file, the 2:4 sparse matmul vs dense, torch's ring "
         "attention (parallel.cp_attention=ring) on a cp mesh of 1 vs plain SDPA",
         collect="pytest"),
    Item("fused-ce-tests", 45, "pytest", ("{repo}/tests/gpu/test_gpu_fused_ce.py",),
         "the Triton fused linear + cross-entropy kernels on CUDA tensors vs the fp32 reference (fp32, bf16, "
         "fp16; ragged shapes, ignored rows, torch.compile); the CPU unit tests of the op run in CI",
         collect="pytest"),
    Item("probe", 15, "slipstream",
         ("probe", "--sections", "compute", "memory", "--device", "cuda", "--sizes", "4096", "8192",
          "--out", "{out}/gpu-probe.json", "--force"),
         "matmul TFLOP/s for fp32, tf32, bf16, fp16, fp8 vs the datasheet; device copy and host<->device "
         "bandwidth, pinned vs pageable", outputs=("{out}/gpu-probe.json",)),
    Item("fused-ce-bench", 25, "slipstream",
         ("bench", "fused-ce", "--device", "cuda", "--backend", "triton", "--rows", "16384", "--d", "768",
          "--vocab", "50304", "--dtype", "bfloat16", "float32", "--chunk-size", "4096", "--repeats", "5",
          "--out", "{out}/gpu-fused-ce.json", "--force"),
         "Triton fused linear + cross-entropy vs the unfused head + loss at GPT-2's head shape: time and allocator "
         "peak", outputs=("{out}/gpu-fused-ce.json",)),
    Item("precision", 35, "module", ("--device", "cuda", "--steps", "8", "--out", "{out}/gpu-precision.json"),
         "the precision switches on GPT-2 124M: fp32, tf32, bf16, bf16 + fp8 (torchao): loss per step vs fp32 "
         "(equivalence) and tokens/s (speed)", outputs=("{out}/gpu-precision.json",),
         module="slipstream.perf.precision_bench"),
    Item("memory", 30, "slipstream",
         ("train", "--config", "{repo}/configs/gpt2-124m.toml", *_QUIET_RUN, "--train.max_steps=3",
          "--train.micro_batch_size=8", "--train.fused_loss=true", "--metrics.memory_breakdown=true",
          "--metrics.memory_snapshot=true", "--logging.log_interval=1"),
         "GPT-2 124M, 3 steps: the step's memory by phase and category from the CUDA allocator's statistics, the "
         "planner's error against it, and the allocator snapshot of steps 2-3", collect="train",
         config_overrides=True),
    Item("gpt2-step", 50, "slipstream",
         ("train", "--config", "{repo}/configs/gpt2-124m.toml", *_QUIET_RUN, "--train.max_steps=30",
          "--train.micro_batch_size=32", "--precision.autocast=bf16", "--precision.tf32=true",
          "--compile.scope=blocks", "--train.fused_loss=true", "--optim.implementation=fused",
          "--data.pin_memory=true", "--data.prefetch=2", "--metrics.memory_breakdown=false",
          "--logging.log_interval=10"),
         "GPT-2 124M training step at the best single-GPU switches (bf16, TF32, regional compile, fused loss, "
         "fused AdamW, pinned prefetch; 32 x 1024 tokens): tokens/s and MFU after warm-up", collect="train",
         config_overrides=True),
    Item("planner", 75, "slipstream", ("bench", "planner", "--device", "cuda", "--out", "{out}/gpu-planner.json", "--force"),
         "the planner's predicted peak memory and step time vs the CUDA allocator and the clock on GPT-2 and "
         "GPT-2 medium steps (17 cases)", outputs=("{out}/gpu-planner.json",)),
    Item("ladder-memory", 120, "slipstream",
         ("bench", "ladder", "memory", "--size", "book", "--device", "cuda", "--repeats", "1", "--steps", "3",
          "--batch", "8", "--out-dir", "{out}", "--force"),
         "the memory ladder at the book's size (gpt2-large, seq 1024; global batch 8 to fit the budget): "
         "allocator peak per rung", outputs=("{out}/ladder-memory-cuda-book.json", "{out}/ladder-memory-cuda-book.png")),
    Item("ladder-speed", 40, "slipstream",
         ("bench", "ladder", "speed", "--size", "book", "--device", "cuda", "--repeats", "1", "--steps", "6",
          "--batch", "32", "--out-dir", "{out}", "--force"),
         "the speed ladder at the book's size (gpt-mini, seq 512, batch 32): tokens/s per rung, pinned + "
         "non-blocking and TF32 included", outputs=("{out}/ladder-speed-cuda-book.json", "{out}/ladder-speed-cuda-book.png")),
    # Not run on a GPU yet: 100 s is an estimate. Its 12 rows each cost a trainer build, 6 small steps,
    # an eval, a checkpoint of GPT-2 124M with its Adam state (~1.5 GB) and a model.pt export: about
    # 5-8 s per trained row on one GPU, plus the export, one-shot and generate timings. Check its
    # wall time on the first run.
    Item("ladder-compression", 100, "slipstream",
         ("bench", "ladder", "compression", "--size", "gpu", "--device", "cuda", "--out-dir", "{out}", "--force"),
         "the compression ladder on CUDA at GPT-2 124M shapes (batch 8 x 128, 6 steps per row): allocator peak, "
         "ms/step, val loss, sizes and generate tok/s per technique vs dense fp32, the 2:4 row through the "
         "sparse kernel", outputs=("{out}/ladder-compression-cuda-gpu.json",)),
)
