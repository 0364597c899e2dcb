"""data.streaming: train on prepared shards at a URL (or a local folder) without copying the
whole set first. Each rank downloads only its own chunks, a few ahead of the one it reads,
into a bounded local cache (stream_cache.py); remote reads are retried (remote.py).

Order (a pure function of seed, world size and the manifest, so it resumes exactly):
  - epoch e permutes all chunks of the split by (seed, e); rank r takes positions
    r, r + W, ... of that order.
  - a chunk of n tokens holds (n - 1) // seq_len non-overlapping windows (seq_len + 1 tokens
    read, stride seq_len, never crossing the chunk's end), visited in an order permuted by
    (seed, e, chunk).
  - every rank reads the same number of windows in epoch e, the smallest total over the
    ranks (computable from the manifest), so ranks stay in lockstep; the windows a rank
    has beyond that are skipped that epoch. Batches run on into the next epoch.
The loader's state is (epoch, windows read in it, batch index), the same on every rank; it
also names the shard, the chunk's token offset and the window in it, for people.

With a loss mask (manifest "loss_mask": true) a target whose mask byte is 0 becomes -100.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import hashlib
import io
import os
from pathlib import Path

import numpy as np
import torch

from slipstream.config.schema import Config
from slipstream.data.eval_windows import EvalWindows, window_starts
from slipstream.data.loader import IGNORE_INDEX
from slipstream.data.loader_checks import check_positive, check_rank, check_state, seed_key
from slipstream.data.manifest import FORMAT, FORMAT_VERSION, MANIFEST, _check_fields
from slipstream.data.remote import Remote, RemoteMissing
from slipstream.data.stream_cache import ChunkCache, prepare_folder, split_chunks, write_atomic
from slipstream.data.train_data import TrainData
from slipstream.errors import UserError
from slipstream.safe_read import DATA_MANIFEST, TOKENIZER, loads_bounded



def cache_root(url: str, cache_dir: str = "") -> str:
    """This URL's cache folder: under data.cache_dir, else $SLIPSTREAM_CACHE_DIR or
    ~/.cache/slipstream, in stream/<hash of the URL> (mixture sources each get their own)."""
    base = cache_dir or os.path.join(os.environ.get("SLIPSTREAM_CACHE_DIR") or Path.home() / ".cache" / "slipstream",
                                     "stream")
    return os.path.join(os.path.abspath(base), hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16])


def cache_folder_name(split: str, rank: int) -> str:
    """One folder per process: the ranks of a model-parallel group share a data-parallel rank
    (and read the same chunks) but must not evict each other's files. LOCAL_RANK (torchrun)
    tells the processes of a node apart; a restarted job finds its folders again. Processes
    that still share a name (two jobs at once, peers on two nodes sharing the cache folder)
    are kept apart by the cache's folder lock: the second takes <name>.1 (stream_cache.py)."""
    return f"{split}-rank{rank}-local{os.environ.get('LOCAL_RANK') or 0}"


def fetch_manifest(remote: Remote) -> dict:
    """The manifest at a URL, checked as load_manifest checks a local one (bounded: untrusted)."""
    where = remote.where(MANIFEST)
    try:
        raw = remote.read_small(MANIFEST, DATA_MANIFEST)  # blocks on the network: the run cannot start without it
    except RemoteMissing:
        raise UserError(f"no prepared data at {remote.url} (no {MANIFEST}); run `slipstream data prepare` and "
                        "upload its whole output folder there, or fix data.dir") from None
    try:
        manifest = loads_bounded(raw, where)
    except ValueError as e:
        raise UserError(f"{where} is not valid JSON ({e}); upload the manifest written by `slipstream data prepare` "
                        "again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{where} is not a slipstream data manifest; point data.dir at a folder made by "
                        "`slipstream data prepare`")
    if manifest.get("version") != FORMAT_VERSION:
        raise UserError(f"{where} has data format version {manifest.get('version')}, this slipstream reads version "
                        f"{FORMAT_VERSION}; run `slipstream data prepare` again and upload the result")
    _check_fields(manifest, where)
    for split in manifest["splits"]:
        split_chunks(manifest, split, where)  # the chunk fields too, before any training starts
    return manifest


def open_stream(cfg: Config, check: bool) -> TrainData:
    if not cfg.data.dir:
        raise UserError("data.streaming = true needs data.dir: the URL (or folder) of data prepared with "
                        "`slipstream data prepare`, e.g. --data.dir=s3://bucket/prefix")
    return open_stream_url(cfg.data.dir, cfg, check)


def open_stream_url(url: str, cfg: Config, check: bool) -> TrainData:
    """The manifest and tokenizer of the data at `url`; check=True also compares every
    remote shard's size with its manifest (one metadata request each, no data read)."""
    d = cfg.data
    remote = Remote(url, d.retries)
    manifest = fetch_manifest(remote)
    root = cache_root(url, d.cache_dir)
    tokenizer = manifest["tokenizer"]
    name = manifest.get("tokenizer_file")
    if name:
        if not isinstance(name, str) or os.path.basename(name) != name or name in (".", ".."):
            raise UserError(f"{remote.where(MANIFEST)} names a malformed tokenizer_file {str(name)[:80]!r}; run "
                            "`slipstream data prepare` again")
        raw = remote.read_small(name, TOKENIZER)  # blocks on the network: once per run, before training
        local = os.path.join(root, f"tokenizer-{hashlib.sha256(raw).hexdigest()[:16]}.json")
        if not os.path.isfile(local):
            prepare_folder(root)
            write_atomic(local, raw)
        tokenizer = f"bpe:{local}"
    if check:
        _check_sizes(remote, manifest, d.stream_threads)
        train = manifest["splits"]["train"]
        print(f"[data] streaming {url}: {train['tokens']:,} train tokens in "
              f"{len(split_chunks(manifest, 'train', url))} chunks (sizes checked; each chunk's sha256 is checked "
              f"as it arrives), cache {root} (at most {d.cache_bytes:,} bytes per process)", flush=True)
    return TrainData(url, manifest, tokenizer, None)


def _check_sizes(remote: Remote, manifest: dict, threads: int) -> None:
    itemsize = np.dtype(manifest["dtype"]).itemsize
    expected = []
    for split, info in manifest["splits"].items():
        for shard in info["shards"]:
            if shard.get("max_id") is not None and shard["max_id"] >= manifest["vocab_size"]:
                raise UserError(f"{split} shard {remote.where(shard['file'])} holds token id {shard['max_id']} (its "
                                f"max_id), outside the vocabulary of {manifest['vocab_size']}; run `slipstream data "
                                "prepare` again")
            expected.append((split, shard["file"], shard["tokens"] * itemsize))
            if manifest.get("loss_mask") is True:
                expected.append((split, shard["mask_file"], shard["tokens"]))
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        # Blocks on the network: one metadata request per file, a few in flight at once.
        sizes = list(pool.map(lambda e: remote.size(e[1]), expected))
    for (split, name, want), got in zip(expected, sizes):
        if got != want:
            raise UserError(f"{split} shard {remote.where(name)} has {got:,} bytes, its manifest says {want:,}: the "
                            "remote data changed since its manifest was written (or the upload is incomplete); "
                            "upload the whole folder written by `slipstream data prepare` again")


class StreamingTokenLoader:
    """Infinite, resumable (x, y) batches streamed from prepared data at a URL (module doc)."""

    def __init__(self, url: str, split: str, batch_size: int, seq_len: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1, device: str | torch.device = "cpu", cache_dir: str = "",
                 cache_bytes: int = 1 << 30, readahead: int = 4, threads: int = 2, retries: int = 5,
                 pin_memory: bool = True, manifest: dict | None = None) -> None:
        check_positive(batch_size=batch_size, seq_len=seq_len, threads=threads, cache_bytes=cache_bytes)
        check_rank(rank, world_size)
        if readahead < 0:
            raise UserError(f"data.readahead={readahead} must be >= 0")
        self.remote = Remote(url, retries)
        # A manifest handed in was fetched from this URL already: the host is reachable, so a
        # connection error from now on is a transient one, retried.
        self.remote.reached = manifest is not None
        self.manifest = manifest if manifest is not None else fetch_manifest(self.remote)  # network: once
        self.url, self.split, self.batch_size, self.seq_len, self.seed = url, split, batch_size, seq_len, seed
        self.rank, self.world_size, self.readahead = rank, world_size, readahead
        self.device = torch.device(device)
        self.vocab_size: int = self.manifest["vocab_size"]
        self.eot_id: int = self.manifest["eot_id"]
        self._dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        self.chunks = split_chunks(self.manifest, split, self.remote.where(MANIFEST))
        self.total_tokens = sum(c.tokens for c in self.chunks)
        self._windows = np.array([(c.tokens - 1) // seq_len for c in self.chunks], dtype=np.int64)
        n, size = len(self.chunks), self.manifest.get("chunk_tokens")
        what = f"chunks of at most {size:,} tokens" if size else "shards (one chunk each: no chunk_tokens)"
        if n < world_size:
            raise UserError(f"split {split!r} at {url} has {n} chunk(s) ({what}), fewer than the {world_size} "
                            f"data-parallel ranks: rank {n} would get none; prepare with a smaller --chunk-tokens, or "
                            "use fewer data-parallel ranks")
        biggest = max(c.nbytes(self._dtype.itemsize) for c in self.chunks)
        if (readahead + 1) * biggest > cache_bytes:
            raise UserError(f"data.cache_bytes = {cache_bytes:,} cannot hold the chunk being read and "
                            f"data.readahead = {readahead} more ({readahead + 1} x {biggest:,} bytes); raise "
                            "data.cache_bytes, lower data.readahead, or prepare with a smaller --chunk-tokens")
        self._plans: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}
        self._order: tuple[tuple[int, int] | None, np.ndarray | None] = (None, None)  # window order of the chunk read
        self._plan(0)  # a split too small for this layout fails here, not at the first step
        root = cache_root(url, cache_dir)
        prepare_folder(root)  # marked before the folder inside it exists (see prepare_folder)
        folder = os.path.join(root, cache_folder_name(split, rank))
        self.cache = ChunkCache(folder, cache_bytes, self.remote, self._dtype.itemsize, threads)
        self._pin = pin_memory and self.device.type == "cuda"
        self._epoch = self._position = self._batch_index = 0
        self._loaded: tuple[int, np.ndarray, np.ndarray | None] | None = None  # (chunk index, tokens, mask)

    @classmethod
    def from_config(cls, cfg: Config, data: TrainData, split: str, rank: int, world_size: int,
                    device: str | torch.device) -> StreamingTokenLoader:
        t, d = cfg.train, cfg.data
        return cls(data.location, split, t.micro_batch_size, t.seq_len, seed=t.seed, rank=rank,
                   world_size=world_size, device=device, cache_dir=d.cache_dir, cache_bytes=d.cache_bytes,
                   readahead=d.readahead, threads=d.stream_threads, retries=d.retries, pin_memory=d.pin_memory,
                   manifest=data.manifest)

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    # -- the order (pure functions of seed, epoch and the manifest)

    def _epoch_order(self, epoch: int, world_size: int) -> tuple[np.ndarray, list[int]]:
        """(the epoch's chunk order, the windows of each of world_size ranks' chunks in it)."""
        order = np.random.default_rng([seed_key(self.seed), epoch]).permutation(len(self.chunks))
        return order, [int(self._windows[order[r::world_size]].sum()) for r in range(world_size)]

    def windows_per_rank(self, epoch: int, world_size: int) -> int:
        """The windows every rank reads in `epoch` at `world_size` data-parallel ranks (another
        layout's too: a mixture resuming at another number of ranks asks)."""
        return min(self._epoch_order(epoch, world_size)[1])

    def _plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(this rank's chunks of the epoch that it reads, cumulative windows of them, windows per rank)."""
        if epoch not in self._plans:
            order, totals = self._epoch_order(epoch, self.world_size)
            per_rank = min(totals)
            if per_rank == 0:
                poor = int(np.argmin(totals))
                raise UserError(
                    f"split {self.split!r} at {self.url}: in epoch {epoch} rank {poor} of {self.world_size} gets chunks "
                    f"holding no window of seq_len + 1 = {self.seq_len + 1} tokens ({len(self.chunks)} chunks, "
                    f"{self.total_tokens:,} tokens); use a smaller seq_len, fewer data-parallel ranks, or prepare more "
                    "data (or a larger --chunk-tokens)")
            mine = order[self.rank::self.world_size]
            cum = np.cumsum(self._windows[mine])
            used = int(np.searchsorted(cum, per_rank)) + 1  # chunks up to the one holding window per_rank - 1
            self._plans = {k: v for k, v in self._plans.items() if k >= epoch - 1}
            self._plans[epoch] = (mine[:used], cum[:used], per_rank)
        return self._plans[epoch]

    def _locate(self, epoch: int, position: int) -> tuple[int, int, int]:
        """(position of the chunk in this rank's epoch list, chunk index, window offset in the chunk)."""
        mine, cum, _ = self._plan(epoch)
        j = int(np.searchsorted(cum, position, side="right"))
        chunk = int(mine[j])
        k = position - (int(cum[j - 1]) if j else 0)
        if self._order[0] != (epoch, chunk):  # one permutation per chunk read, not per window
            rng = np.random.default_rng([seed_key(self.seed), epoch, chunk])
            self._order = ((epoch, chunk), rng.permutation(int(self._windows[chunk])))
        return j, chunk, int(self._order[1][k]) * self.seq_len

    def _upcoming(self, epoch: int, j: int) -> list:
        """Chunk j of the epoch and the next `readahead` chunks of this rank's sequence."""
        out = []
        while len(out) <= self.readahead:
            mine = self._plan(epoch)[0]
            for c in mine[j:].tolist():
                if len(out) > self.readahead:
                    break
                if self._windows[c] > 0 or not out:  # a chunk shorter than one window is never read
                    out.append(self.chunks[c])
            epoch, j = epoch + 1, 0
        return out

    # -- batches

    def _chunk_data(self, epoch: int, j: int, chunk_index: int) -> tuple[np.ndarray, np.ndarray | None]:
        if self._loaded is None or self._loaded[0] != chunk_index:
            chunk = self.chunks[chunk_index]
            self.cache.want(self._upcoming(epoch, j))
            raw = np.fromfile(self.cache.get(chunk), dtype=np.uint8)
            n_bytes = chunk.tokens * self._dtype.itemsize
            tokens = raw[:n_bytes].view(self._dtype)
            self._loaded = (chunk_index, tokens, raw[n_bytes:] if chunk.mask_file else None)
        return self._loaded[1], self._loaded[2]

    def _host_batch(self) -> torch.Tensor:
        T = self.seq_len
        host = torch.empty((2, self.batch_size, T), dtype=torch.int64, pin_memory=self._pin)
        out = host.numpy()
        epoch, position = self._epoch, self._position
        for b in range(self.batch_size):
            j, chunk_index, offset = self._locate(epoch, position)
            tokens, mask = self._chunk_data(epoch, j, chunk_index)
            window = tokens[offset:offset + T + 1]
            if int(window.max()) >= self.vocab_size:
                raise self._bad_token(chunk_index, offset, window)
            out[0, b] = window[:-1]
            out[1, b] = window[1:]
            if mask is not None:
                out[1, b][mask[offset + 1:offset + T + 1] == 0] = IGNORE_INDEX
            position += 1
            if position == self._plan(epoch)[2]:
                epoch, position = epoch + 1, 0
        self._epoch, self._position = epoch, position
        return host

    def _bad_token(self, chunk_index: int, offset: int, window: np.ndarray) -> UserError:
        chunk = self.chunks[chunk_index]
        at = chunk.start + offset + int(np.argmax(window >= self.vocab_size))
        return UserError(f"{self.split} shard {self.remote.where(chunk.file)} holds token id {int(window.max())} near "
                         f"token {at:,}, outside the vocabulary of {self.vocab_size} its manifest declares; the data "
                         "is damaged or its manifest is wrong: run `slipstream data prepare` again and upload it")

    def __iter__(self) -> StreamingTokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        host = self._host_batch()
        self._batch_index += 1
        if self.device.type != "cpu":
            host = host.to(self.device, non_blocking=self._pin)
        return host[0], host[1]

    def close(self) -> None:
        """Stop the download threads (a download in flight finishes first)."""
        self.cache.close()

    # -- resume

    def _identity(self) -> dict:
        return {"split": self.split, "seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "world_size": self.world_size, "tokens": self.total_tokens, "chunks": len(self.chunks)}

    def state_dict(self) -> dict:
        """JSON-serialisable position; epoch, position and batch index are the same on every rank."""
        _, chunk_index, offset = self._locate(self._epoch, self._position)
        chunk = self.chunks[chunk_index]
        return {"kind": "StreamingTokenLoader", **self._identity(), "rank": self.rank, "epoch": self._epoch,
                "position": self._position, "batch_index": self._batch_index, "shard": chunk.file,
                "chunk_offset": chunk.start, "window": offset // self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position: the next batch is the one the saved loader would have built next."""
        if isinstance(state, dict) and state.get("kind") == "StreamingTokenLoader" and \
                state.get("world_size") != self.world_size:
            raise UserError(f"the streaming loader state was saved by {state.get('world_size')} data-parallel rank(s), "
                            f"this run has {self.world_size}: streaming resumes only at the same number of "
                            "data-parallel ranks (each rank's chunks depend on it); resume with that many, or start "
                            "a fresh run")
        check_state("StreamingTokenLoader", state, self._identity())
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._batch_index = int(state["batch_index"])
        if not 0 <= self._position < self._plan(self._epoch)[2]:
            raise UserError(f"streaming loader state position {self._position} is outside epoch {self._epoch}; the "
                            "checkpoint is damaged or from other data: start a fresh run")


class StreamingEvalWindows(EvalWindows):
    """EvalWindows (same windows, weights and attributes the Evaluator reads) of a split at a
    URL: this rank's windows are read once by byte ranges into the cache and reused."""

    MERGE_GAP = 1 << 16  # tokens: ranges closer than this are read as one request (fewer round trips) ...
    MAX_RANGE_BYTES = 8 << 20  # ... of at most this many bytes (more only for one window's piece): bounded memory

    def __init__(self, url: str, split: str, batch_size: int, seq_len: int, max_tokens: int, rank: int = 0,
                 world_size: int = 1, device: str | torch.device = "cpu", cache_dir: str = "", retries: int = 5,
                 threads: int = 2, manifest: dict | None = None) -> None:
        check_positive(batch_size=batch_size, seq_len=seq_len, max_tokens=max_tokens)
        check_rank(rank, world_size)
        self.remote = Remote(url, retries)
        self.remote.reached = manifest is not None  # as in StreamingTokenLoader
        manifest = manifest if manifest is not None else fetch_manifest(self.remote)  # network: once
        if split not in manifest["splits"]:
            raise UserError(f"split {split!r} not found in {url}; available: {', '.join(manifest['splits'])}")
        self._manifest, self._threads = manifest, threads
        self._dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        self._shards = [s for s in manifest["splits"][split]["shards"] if s["tokens"] > 0]
        self._ends = np.cumsum([s["tokens"] for s in self._shards], dtype=np.int64)
        total = int(self._ends[-1]) if self._shards else 0
        self.split, self.seq_len, self.batch_size = split, seq_len, batch_size
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.vocab_size = manifest["vocab_size"]
        self._masked = manifest.get("loss_mask") is True
        starts = window_starts(total, seq_len, max_tokens)
        self.n_windows = len(starts)
        self.tokens = self.n_windows * seq_len
        self.sampled = self.n_windows < max(total - 1, 0) // seq_len
        mine = starts[rank::world_size]
        per_rank = -(-self.n_windows // world_size)
        self.n_batches = -(-per_rank // batch_size)
        pad = per_rank - len(mine)
        self._starts = np.concatenate([mine, np.repeat(starts[:1], pad)])
        self._weights = np.concatenate([np.ones(len(mine)), np.zeros(pad)]).astype(np.float32)
        self._folder = os.path.join(cache_root(url, cache_dir), cache_folder_name(f"{split}-windows", rank))
        self._rows: np.ndarray | None = None  # (windows, seq_len + 1) tokens, then the same of mask

    def _pieces(self, start: int) -> list[tuple[int, int, int]]:
        """(shard, first token, end token) pieces of tokens [start, start + seq_len + 1) of the split."""
        out, pos, end = [], start, start + self.seq_len + 1
        while pos < end:
            k = int(np.searchsorted(self._ends, pos, side="right"))
            lo = int(self._ends[k]) - self._shards[k]["tokens"]
            stop = min(end, int(self._ends[k]))
            out.append((k, pos - lo, stop - lo))
            pos = stop
        return out

    def _read_all(self, starts: np.ndarray) -> np.ndarray:
        """Tokens (and mask) of the windows starting at `starts`: (1 or 2, len(starts), seq_len + 1).
        Each merged range is copied into the rows as it arrives and dropped: at most a few
        requests of MAX_RANGE_BYTES are held at once, whatever the size of the split."""
        width = self.seq_len + 1
        item = self._dtype.itemsize
        pieces = sorted({p for s in starts.tolist() for p in self._pieces(s)})
        ranges: list[list[int]] = []  # [shard, lo, hi] merged
        for k, lo, hi in pieces:
            if (ranges and ranges[-1][0] == k and lo - ranges[-1][2] <= self.MERGE_GAP
                    and (max(ranges[-1][2], hi) - ranges[-1][1]) * item <= self.MAX_RANGE_BYTES):
                ranges[-1][2] = max(ranges[-1][2], hi)
            else:
                ranges.append([k, lo, hi])
        keys = [(k, lo) for k, lo, _ in ranges]
        targets: list[list[tuple[int, int, int, int]]] = [[] for _ in ranges]  # per range: (row, col, lo, hi)
        for i, s in enumerate(starts.tolist()):
            col = 0
            for k, lo, hi in self._pieces(s):
                targets[bisect.bisect_right(keys, (k, lo)) - 1].append((i, col, lo, hi))  # the range holding it
                col += hi - lo

        def fetch(r):
            k, lo, hi = ranges[r]
            shard = self._shards[k]
            # Blocks on the network (a download thread of this pool): byte ranges of the windows only.
            toks = np.frombuffer(self.remote.read_range(shard["file"], lo * item, hi * item), dtype=self._dtype)
            mask = (np.frombuffer(self.remote.read_range(shard["mask_file"], lo, hi), dtype=np.uint8)
                    if self._masked else None)
            return toks, mask

        rows = np.empty((2 if self._masked else 1, len(starts), width), dtype=np.int64)
        ahead = 2 * max(1, self._threads)
        with concurrent.futures.ThreadPoolExecutor(max(1, self._threads)) as pool:
            pending = {r: pool.submit(fetch, r) for r in range(min(ahead, len(ranges)))}
            for r in range(len(ranges)):
                # Blocks on the network, once per run: the first evaluation reads this rank's windows.
                toks, mask = pending.pop(r).result()
                if r + ahead < len(ranges):
                    pending[r + ahead] = pool.submit(fetch, r + ahead)
                a = ranges[r][1]
                for i, col, lo, hi in targets[r]:
                    rows[0, i, col:col + hi - lo] = toks[lo - a:hi - a]
                    if mask is not None:
                        rows[1, i, col:col + hi - lo] = mask[lo - a:hi - a]
        return rows

    def _load(self) -> None:
        key = hashlib.sha256(repr((self.remote.url, self.split, self.seq_len, self._starts.tolist(),
                                   self._manifest["splits"][self.split]["shards"])).encode()).hexdigest()[:24]
        path = os.path.join(self._folder, f"windows-{key}.npy")
        prepare_folder(os.path.dirname(self._folder))  # the URL's cache root, marked first
        prepare_folder(self._folder)
        starts = np.unique(self._starts)
        shape = (2 if self._masked else 1, len(starts), self.seq_len + 1)
        rows = None
        if os.path.isfile(path):
            try:
                rows = np.load(path, allow_pickle=False)  # written below by this code: one int64 array
            except (OSError, ValueError):
                rows = None  # damaged on this disk: read the windows again
            rows = rows if rows is not None and rows.shape == shape else None
        if rows is None:
            rows = self._read_all(starts)
            for entry in os.scandir(self._folder):  # windows of other settings: ours (marked folder, our prefix)
                if entry.name.startswith("windows-") and entry.name.endswith(".npy"):
                    os.remove(entry.path)
            buf = io.BytesIO()
            np.save(buf, rows, allow_pickle=False)
            write_atomic(path, buf.getbuffer())
        self._rows = rows[:, np.searchsorted(starts, self._starts)]
        if int(self._rows[0].max()) >= self.vocab_size:
            raise UserError(f"{self.split} windows at {self.remote.url} hold token id {int(self._rows[0].max())}, "
                            f"outside the vocabulary of {self.vocab_size}; the data is damaged or its manifest is "
                            "wrong: run `slipstream data prepare` again and upload it")

    def __iter__(self):
        if self._rows is None:
            self._load()
        B = self.batch_size
        for b in range(self.n_batches):
            block = self._rows[:, b * B:(b + 1) * B]
            tokens = torch.from_numpy(block[0].copy())
            x, y = tokens[:, :-1], tokens[:, 1:].clone()
            weights = self._weights[b * B:(b + 1) * B].copy()
            if self._masked:
                masked = block[1][:, 1:] == 0
                y[torch.from_numpy(masked)] = IGNORE_INDEX
                weights[masked.all(axis=1)] = 0.0  # a window without targets has no loss to average (as EvalWindows)
            weight = torch.from_numpy(weights)
            yield (x.to(self.device), y.to(self.device)), weight.to(self.device)


def streaming_val_windows(cfg: Config, data: TrainData, rank: int, world_size: int,
                          device: str | torch.device) -> StreamingEvalWindows:
    t, d = cfg.train, cfg.data
    return StreamingEvalWindows(data.location, "val", t.micro_batch_size, t.seq_len, t.eval_tokens, rank=rank,
                                world_size=world_size, device=device, cache_dir=d.cache_dir, retries=d.retries,
                                threads=d.stream_threads, manifest=data.manifest)
