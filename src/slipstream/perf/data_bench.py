"""`slipstream bench data`: does every reader stay ahead of the training step?

Three measurements, all on this machine:

- readers: tokens/s each training reader delivers when pulled back to back (GPT-2 124M batches
  of 16 x 1024 tokens): local memory-mapped shards (in process, and with 2 DataLoader workers),
  and streaming (data.streaming) from a local folder, from a plain HTTP server and from an
  S3-compatible (moto) server, both started by the benchmark on 127.0.0.1.
- prepare: tokens/s of `data prepare` (byte tokenizer, 2 workers) from Parquet and from JSONL
  holding the same documents: the raw-input readers.
- consumption: the share of the step spent waiting for data, data wait / (data wait + step).
  The default job trains for real on this CPU (local shards with 0 and 2 workers, and
  streaming over HTTP), its data wait read from metrics.jsonl. GPT-2 124M is planned on one
  H100 in bf16 (the planner's step time); each reader then feeds a loop that stands in for
  that step by sleeping its length, and the time blocked in next() is the data wait.

The issue's bar: data wait < 1 % of the step at 2 workers.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from slipstream.errors import UserError

GPT2_BATCH, GPT2_SEQ = 16, 1024  # sequences x tokens of one GPT-2 124M micro-batch (the shape)
SIZES = {  # batches pulled per reader, emulated GPT-2 steps, default-job training steps (+ its overrides)
    "default": {"batches": 60, "emulated_steps": 40, "train_steps": 30, "job": []},
    "ci": {"batches": 4, "emulated_steps": 3, "train_steps": 3,
           "job": ["--model.n_layer=1", "--model.d_model=64", "--model.n_head=2", "--train.micro_batch_size=4",
                   "--train.seq_len=64"]},
}
WORKERS = 2


def run_data_bench(out: str = "", size: str = "default", data_dir: str = "") -> dict[str, Any]:
    from slipstream.config.load import load_config
    from slipstream.data.ensure import ensure_data
    from slipstream.observe.env import collect_env
    from slipstream.perf.sharding import write_result

    if size not in SIZES:
        raise UserError(f"unknown --size '{size}'; choose {' or '.join(SIZES)}")
    if size != "default" and not out:
        raise UserError(f"--size {size} needs --out: benchmarks/data-cpu.json holds the default size's result")
    n = SIZES[size]
    given = [f"--data.dir={data_dir}"] if data_dir else []
    corpus = str(ensure_data(load_config(None, given))[0])  # the default corpus, prepared once
    step_gpt2 = planned_gpt2_step_s()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="slipstream-data-bench-") as tmp:
        readers = measure_readers(corpus, Path(tmp), n["batches"], n["emulated_steps"], step_gpt2)
        prepare = measure_prepare(corpus, Path(tmp), size)
        default_job = measure_default_job(corpus, Path(tmp), n["train_steps"], n["job"])
    result = {"bench": "data", "size": size, "workers": WORKERS,
              "gpt2_shape": {"micro_batch": GPT2_BATCH, "seq_len": GPT2_SEQ, "planned_step_s_h100_bf16": step_gpt2,
                             "consumed_tokens_per_s": GPT2_BATCH * GPT2_SEQ / step_gpt2},
              "measured": "readers: tokens/s pulling GPT-2 batches back to back after 2 warm-up batches; "
                          "wait_share_gpt2: time the training thread blocks for a batch / (that + the sleeps standing "
                          "in for the planned H100 step), with the handoff thread CUDA runs (TokenLoader's prefetch "
                          "thread, the DataLoader's pin-memory thread) emulated; *_no_handoff_thread: next() on the "
                          "training thread as on a CPU-only machine; default_job: real training on this CPU, data_wait_s / step_time_s from "
                          "metrics.jsonl (steps >= 3); prepare: input tokens / prepare seconds",
              "readers": readers, "prepare": prepare, "default_job": default_job,
              "load_average": {"before": list(load_before), "after": list(os.getloadavg())}, "env": collect_env()}
    return write_result(result, Path(out or "benchmarks/data-cpu.json"), _print_table)


def planned_gpt2_step_s() -> float:
    """The planner's step time of GPT-2 124M, 16 x 1024 tokens, bf16, on one H100."""
    from slipstream.config.load import load_config
    from slipstream.plan.hardware import make_cluster
    from slipstream.plan.model import PlanModel
    from slipstream.plan.space import Workload, strategy_from_config
    from slipstream.plan.timing import estimate_time

    cfg = load_config(None, ["--model.preset=gpt2", "--model.vocab_size=50257", f"--train.seq_len={GPT2_SEQ}",
                             f"--train.micro_batch_size={GPT2_BATCH}", "--precision.autocast=bf16",
                             "--compile.scope=model"])
    strategy = strategy_from_config(cfg, 1)
    work = Workload(GPT2_SEQ, GPT2_BATCH)
    return float(estimate_time(PlanModel(cfg.model.preset, cfg.model), strategy, work, make_cluster("1xH100")).step_s)


# ----------------------------------------------------------------------------------------------- readers

def measure_readers(corpus: str, tmp: Path, batches: int, emulated_steps: int, step_s: float) -> list[dict]:
    from slipstream.data.loader import TokenLoader
    from slipstream.data.streaming import StreamingTokenLoader
    from slipstream.perf.local_servers import HttpFileServer, S3Server

    def local(workers: int):
        return lambda: TokenLoader(corpus, "train", GPT2_BATCH, GPT2_SEQ, mode="sequential", num_workers=workers,
                                   prefetch=2)

    def streaming(url: str, name: str):
        return lambda: StreamingTokenLoader(url, "train", GPT2_BATCH, GPT2_SEQ, cache_dir=str(tmp / f"cache-{name}"),
                                            threads=WORKERS, readahead=4)

    rows = []
    rows.append(_measure("local shards, in process", local(0), batches, emulated_steps, step_s))
    rows.append(_measure(f"local shards, {WORKERS} workers", local(WORKERS), batches, emulated_steps, step_s))
    rows.append(_measure("streaming, local folder", streaming(corpus, "local"), batches, emulated_steps, step_s))
    http = HttpFileServer(corpus)
    try:
        rows.append(_measure("streaming, HTTP server", streaming(http.url, "http"), batches, emulated_steps, step_s))
    finally:
        http.close()
    try:
        s3 = S3Server()
    except UserError as e:
        rows.append({"reader": "streaming, S3 (moto)", "skipped": str(e)})
        return rows
    saved = {k: os.environ.get(k) for k in s3.env}
    os.environ.update(s3.env)  # botocore reads the endpoint and the dummy credentials from here
    try:
        url = s3.upload(corpus, "corpus")
        rows.append(_measure("streaming, S3 (moto)", streaming(url, "s3"), batches, emulated_steps, step_s))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3.close()
    return rows


class _HandoffThread:
    """What CUDA adds between a reader and the step: a thread that takes each batch off the
    reader (TokenLoader's prefetch thread in process; the DataLoader's pin-memory thread with
    workers) and queues it, two deep, so the training thread only dequeues. Used to emulate the
    H100 step on this CPU-only machine, where those threads do not start."""

    def __init__(self, loader, depth: int = 2) -> None:
        import queue
        import threading

        self.loader, self.queue, self.stop = loader, queue.Queue(maxsize=depth), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="bench-handoff")
        self.thread.start()

    def _run(self) -> None:
        import queue

        while not self.stop.is_set():
            item = next(self.loader)
            while not self.stop.is_set():
                try:
                    self.queue.put(item, timeout=0.1)  # blocks while two batches wait: the reader stays ahead
                    break
                except queue.Full:
                    continue

    def __next__(self):
        return self.queue.get()  # the training thread's only wait: the next batch is (almost) always there

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.loader.close()


def _measure(name: str, make, batches: int, emulated_steps: int, step_s: float) -> dict[str, Any]:
    """Back-to-back throughput, then the data wait of a loop whose 'step' sleeps step_s: with the
    handoff thread CUDA has (the emulated H100 step) and, for reference, without it (next() on
    the training thread, as on a CPU-only machine)."""
    loader = make()
    try:
        for _ in range(2):  # warm-up: workers start, the first chunks arrive
            next(loader)
        t0 = time.perf_counter()
        for _ in range(batches):
            next(loader)
        elapsed = time.perf_counter() - t0
    finally:
        loader.close()
    shares = {}
    for key, wrap in (("wait_share_gpt2", _HandoffThread), ("wait_share_gpt2_no_handoff_thread", lambda x: x)):
        loader = wrap(make())
        waited = 0.0
        try:
            for _ in range(2):
                next(loader)
            for _ in range(emulated_steps):
                t0 = time.perf_counter()
                next(loader)
                waited += time.perf_counter() - t0
                time.sleep(step_s)  # stands in for the GPU step: the loader's threads and workers run meanwhile
        finally:
            loader.close()
        shares[key] = waited / (waited + emulated_steps * step_s)
    return {"reader": name, "tokens_per_s": batches * GPT2_BATCH * GPT2_SEQ / elapsed,
            "batch_s": elapsed / batches, **shares}


# ----------------------------------------------------------------------------------------------- prepare

def _documents(corpus_tokens_dir: str, limit_bytes: int) -> list[str]:
    """Documents to re-encode as Parquet / JSONL: the stdlib corpus's sources, up to limit_bytes."""
    from slipstream.data.sources import iter_documents

    docs, size = [], 0
    for text in iter_documents(["stdlib"]):
        docs.append(text)
        size += len(text)
        if size >= limit_bytes:
            break
    return docs


def measure_prepare(corpus: str, tmp: Path, size: str) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from slipstream.data.prepare import prepare_dataset

    docs = _documents(corpus, 64 << 20 if size == "default" else 1 << 20)
    parquet = tmp / "docs.parquet"
    pq.write_table(pa.table({"text": docs}), parquet, row_group_size=max(1, len(docs) // 8))
    jsonl = tmp / "docs.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for text in docs:
            f.write(json.dumps({"text": text}) + "\n")
    rows = []
    for name, path in (("parquet", parquet), ("jsonl", jsonl)):
        t0 = time.perf_counter()
        manifest = prepare_dataset([str(path)], "byte", str(tmp / f"prep-{name}"), num_workers=WORKERS,
                                   progress=False)
        seconds = time.perf_counter() - t0
        tokens = sum(info["tokens"] for info in manifest["splits"].values())
        rows.append({"input": name, "documents": len(docs), "input_bytes": path.stat().st_size, "tokens": tokens,
                     "seconds": seconds, "tokens_per_s": tokens / seconds})
    return rows


# ----------------------------------------------------------------------------------------------- default job

def measure_default_job(corpus: str, tmp: Path, steps: int, overrides: list[str]) -> list[dict]:
    """The default job trained for real: data wait over step time, per reader."""
    from slipstream.perf.local_servers import HttpFileServer
    from slipstream.perf.sharding import run_strategy

    rows = []
    http = HttpFileServer(corpus)
    try:
        cases = [("local shards, in process", [f"--data.dir={corpus}", "--data.num_workers=0"]),
                 (f"local shards, {WORKERS} workers", [f"--data.dir={corpus}", f"--data.num_workers={WORKERS}"]),
                 ("streaming, HTTP server", [f"--data.dir={http.url}", "--data.streaming=true",
                                             f"--data.cache_dir={tmp / 'job-cache'}"])]
        for i, (name, reader) in enumerate(cases):
            run_dir = tmp / f"job{i}"
            summary = run_strategy("none", 1, [*reader, *overrides, "--train.device=cpu", "--train.threads=1"],
                                   str(run_dir), steps=steps)
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            timed = [r for r in records if "step_time_s" in r and r["step"] >= 3] or \
                [r for r in records if "step_time_s" in r]
            step = sum(r["step_time_s"] for r in timed) / len(timed)
            wait = sum(r.get("data_wait_s", 0.0) for r in timed) / len(timed)
            rows.append({"reader": name, "steps": len(timed), "step_time_s": step, "data_wait_s": wait,
                         "wait_share": wait / step if step else None, "tokens_per_s": summary.get("tokens_per_s")})
    finally:
        http.close()
    return rows


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    g = result["gpt2_shape"]
    table = Table(title=f"readers, GPT-2 batches ({g['micro_batch']} x {g['seq_len']}); an H100 step consumes "
                        f"{g['consumed_tokens_per_s']:,.0f} tokens/s")
    for col in ("reader", "tokens/s", "x consumption", "data wait, H100 step", "without handoff thread"):
        table.add_column(col)
    for r in result["readers"]:
        if "skipped" in r:
            table.add_row(r["reader"], "skipped", "", r["skipped"], "")
            continue
        table.add_row(r["reader"], f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / g['consumed_tokens_per_s']:.1f}",
                      f"{100 * r['wait_share_gpt2']:.2f} %", f"{100 * r['wait_share_gpt2_no_handoff_thread']:.2f} %")
    console = Console()
    console.print(table)
    jobs = Table(title="default job on this CPU: data wait / step")
    for col in ("reader", "step s", "data wait s", "share"):
        jobs.add_column(col)
    for r in result["default_job"]:
        jobs.add_row(r["reader"], f"{r['step_time_s']:.3f}", f"{r['data_wait_s'] * 1e3:.2f} ms",
                     f"{100 * r['wait_share']:.2f} %")
    console.print(jobs)
    prep = Table(title="data prepare (byte tokenizer, 2 workers)")
    for col in ("input", "MB", "tokens/s"):
        prep.add_column(col)
    for r in result["prepare"]:
        prep.add_row(r["input"], f"{r['input_bytes'] / 1e6:.1f}", f"{r['tokens_per_s']:,.0f}")
    console.print(prep)
