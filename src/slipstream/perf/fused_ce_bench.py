"""Measure the fused linear + cross-entropy against the unfused reference: time and peak memory.

    python -m slipstream bench fused-ce --rows 4096 --d 256 --vocab 32768   (or `slipstream bench fused-ce`)

How peak memory is measured (both paths measured the same way, nothing assumed):
- CUDA: torch.cuda.max_memory_allocated() during forward + backward, minus what was allocated
  before (inputs and weights are not counted).
- CPU: the profiler's allocator-level memory events (profile_memory=True). Every allocation and
  free made by the CPU allocator while the function runs is recorded with its size; replaying
  them in time order gives the exact peak of bytes allocated above the starting point,
  including temporaries that live and die inside a custom op. (MemTracker, a dispatch mode,
  only sees the outputs of the ops it intercepts, so it misses the chunk logits allocated inside
  our custom op and would flatter the fused path.)
"""

from pathlib import Path
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from slipstream.ops.fused_ce import fused_linear_cross_entropy, linear_cross_entropy_reference


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(fn: Callable[[], object], device: torch.device | str) -> int:
    """Peak bytes allocated on `device` above the level at the start, while fn() runs."""
    device = torch.device(device)
    if device.type == "cuda":
        _sync(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - start
    if device.type != "cpu":
        raise ValueError(f"peak memory measurement supports cpu and cuda, not {device.type}")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # Each "[memory]" event is one allocation (+bytes) or free (-bytes). A free of a tensor that
    # existed before fn() started lowers the running level (that memory is reusable), so measure
    # self-contained functions: ones that do not free what an earlier call left behind.
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events = [e for e in events if e.device_type() == torch.autograd.DeviceType.CPU]
    current = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median of `repeats` timed calls after `warmup` untimed ones (the shared perf.timer)."""
    from slipstream.perf.timer import time_callable

    return time_callable(fn, warmup=warmup, repeats=repeats, device=device, max_rel_iqr=0.25).median


def benchmark_fused_ce(
    n_rows: int,
    d: int,
    vocab: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    repeats: int = 5,
    chunk_size: int = 1024,
    backend: str = "auto",
) -> dict:
    """Median forward+backward time and peak memory of the fused op vs the reference."""
    device = torch.device(device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(n_rows, d, generator=generator) / d**0.5).to(device=device, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, d, generator=generator).to(device=device, dtype=dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n_rows,), generator=generator).to(device)

    def run(loss_fn) -> torch.Tensor:
        # autograd.grad, not .backward(): the grads are allocated (and counted) by every call and
        # freed when it returns, so no call frees memory that an earlier one left in .grad.
        loss = loss_fn()
        torch.autograd.grad(loss, (h, weight))
        return loss.detach()

    def fused() -> torch.Tensor:
        return run(lambda: fused_linear_cross_entropy(h, weight, targets, chunk_size=chunk_size, backend=backend))

    def reference() -> torch.Tensor:
        return run(lambda: linear_cross_entropy_reference(h, weight, targets))

    def unfused() -> torch.Tensor:
        # What a model does without the fused op: the head matmul in the input dtype, then the
        # loss on fp32 logits (as slipstream's lm_loss). The fair speed/memory baseline.
        return run(lambda: torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(h, weight).float(), targets))

    exact = reference()  # fp32 ground truth
    loss_diff = (fused() - exact).abs().item()
    unfused_diff = (unfused() - exact).abs().item()
    result = {
        "n_rows": n_rows,
        "d": d,
        "vocab": vocab,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "chunk_size": chunk_size,
        "logits_fp32_bytes": n_rows * vocab * 4,  # what the unfused path materializes (at least once)
        "loss_abs_diff": loss_diff,                    # fused vs the fp32 reference
        "unfused_loss_abs_diff": unfused_diff,         # unfused (same dtype) vs the fp32 reference
        "fused_ms": 1e3 * _median_seconds(fused, device, repeats),
        "unfused_ms": 1e3 * _median_seconds(unfused, device, repeats),
        "reference_ms": 1e3 * _median_seconds(reference, device, repeats),
        "fused_peak_bytes": peak_memory_bytes(fused, device),
        "unfused_peak_bytes": peak_memory_bytes(unfused, device),
        "reference_peak_bytes": peak_memory_bytes(reference, device),
    }
    return result


def run_fused_ce_bench(rows: int = 4096, d: int = 256, vocab: int = 32768, dtypes: tuple[str, ...] = ("float32",),
                       device: str = "cpu", repeats: int = 5, chunk_sizes: tuple[int, ...] = (1024,),
                       backend: str = "auto", out: str = "") -> dict:
    """`slipstream bench fused-ce`: every (dtype, chunk) case, printed and written as JSON."""
    from slipstream.observe.env import collect_env, write_json_atomic

    cases = []
    mib = 2**20
    for dtype_name in dtypes:
        for chunk_size in chunk_sizes:
            r = benchmark_fused_ce(rows, d, vocab, getattr(torch, dtype_name), device, repeats, chunk_size, backend)
            cases.append(r)
            print(f"N={rows} d={d} V={vocab} {r['dtype']} {r['device']} chunk={chunk_size}: "
                  f"fused {r['fused_ms']:.1f} ms / {r['fused_peak_bytes'] / mib:.1f} MiB peak, "
                  f"unfused {r['unfused_ms']:.1f} ms / {r['unfused_peak_bytes'] / mib:.1f} MiB, "
                  f"fp32 reference {r['reference_ms']:.1f} ms / {r['reference_peak_bytes'] / mib:.1f} MiB "
                  f"(|loss - fp32 reference|: fused {r['loss_abs_diff']:.2e}, unfused {r['unfused_loss_abs_diff']:.2e})")
    result = {"bench": "fused-ce", "backend": backend, "repeats": repeats, "cases": cases, "env": collect_env()}
    out = out or f"benchmarks/fused-ce-{torch.device(device).type}.json"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, result)
    print(f"wrote {out}")
    return result
