"""The pieces of streaming (streaming.py) that deal in chunks: the chunk list of a split, as
the manifest defines it, and the local read-ahead cache that download threads fill.

Chunks. A manifest with "chunk_tokens": C cuts every shard into chunks of C tokens (the last
one shorter), each with its sha256 in the shard's "chunk_sha256" list; without it a whole
shard is one chunk, checked by the shard's "sha256". With "loss_mask": true every shard also
has a "mask_file" (one uint8 per token, 1 = the token counts as a target) and "mask_sha256";
a chunk's mask bytes are checked by "mask_chunk_sha256"[i] when the manifest has it, by
"mask_sha256" when the chunk is the whole shard, and otherwise only for holding 0s and 1s.

The cache folder holds one file per chunk (its tokens, then its mask bytes), named by a hash
of what the chunk is (its sha256, shard and offset), so a chunk already there from an earlier
run or epoch is not downloaded again. A chunk is written under a temporary name, checked,
and renamed into place: a file with a chunk's name is complete and verified. Before each
download the cache makes room by deleting the chunks not in use (the current one and the
read-ahead ones are in use), those used longest ago first, so the folder never holds more
than cache_bytes. It deletes only chunk files and its own temporary files, and only in a
folder carrying its marker file (MARKER), which it writes when it creates the folder.

One live process per folder: a cache holds an exclusive lock (flock on LOCK) on its folder
while it is open. Another process that would use the same folder (a second job streaming the
same URL on this machine, or a rank of the same model-parallel group on another node sharing
the cache folder) takes the next free one, <folder>.1, .2, ...: it never evicts the chunks the
first one reads nor deletes its downloads in flight. A restarted job finds its folder again.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import os
import queue
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from slipstream.data.remote import Remote
from slipstream.errors import UserError

MARKER = ".slipstream-stream-cache"
MARKER_TEXT = "A read-ahead cache of slipstream's data streaming: chunk files it downloaded and may delete.\n"
SUFFIX = ".chunk"
TMP_PREFIX = ".tmp-"
LOCK = ".slipstream-stream-cache.lock"
MAX_SHARERS = 64  # live processes that may stream into copies of one cache folder at once


@dataclass(frozen=True)
class Chunk:
    """Tokens [start, start + tokens) of one shard of a split."""

    index: int  # position in the split's chunk list
    shard: int  # position of its shard in the split's shard list
    file: str
    start: int
    tokens: int
    sha256: str
    mask_file: str | None = None
    mask_sha256: str | None = None  # of this chunk's mask bytes; None: not recorded per chunk

    @property
    def name(self) -> str:
        key = f"{self.sha256}|{self.file}|{self.start}|{self.tokens}|{self.mask_file}|{self.mask_sha256}"
        return hashlib.sha256(key.encode()).hexdigest()[:40] + SUFFIX

    def nbytes(self, itemsize: int) -> int:
        return self.tokens * itemsize + (self.tokens if self.mask_file else 0)


def _bad(where: str, what: str) -> UserError:
    return UserError(f"{where}: {what}; the manifest is damaged or not written by slipstream: "
                     "run `slipstream data prepare` again and upload the whole folder")


def _hex_list(value, n: int) -> bool:
    return isinstance(value, list) and len(value) == n and all(isinstance(v, str) for v in value)


def split_chunks(manifest: dict, split: str, where: str) -> list[Chunk]:
    """The chunks of a split's non-empty shards, in shard order (see module doc)."""
    if split not in manifest["splits"]:
        raise UserError(f"split {split!r} not found in {where}; available: {', '.join(manifest['splits'])}")
    size = manifest.get("chunk_tokens")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise _bad(where, f"chunk_tokens {size!r} is not a positive integer")
    masked = manifest.get("loss_mask") is True
    chunks: list[Chunk] = []
    for s, shard in enumerate(manifest["splits"][split]["shards"]):
        n = shard["tokens"]
        if n == 0:
            continue
        mask_file = shard.get("mask_file") if masked else None
        if masked and not (isinstance(mask_file, str) and os.path.basename(mask_file) == mask_file
                           and mask_file not in ("", ".", "..") and isinstance(shard.get("mask_sha256"), str)):
            raise _bad(where, f"split {split!r} shard {shard['file']!r} has no valid mask_file / mask_sha256 "
                              "though the manifest sets loss_mask")
        if size is None:
            chunks.append(Chunk(len(chunks), s, shard["file"], 0, n, shard["sha256"], mask_file,
                                shard.get("mask_sha256") if masked else None))
            continue
        count = math.ceil(n / size)
        hashes = shard.get("chunk_sha256")
        if not _hex_list(hashes, count):
            raise _bad(where, f"split {split!r} shard {shard['file']!r} of {n} tokens needs {count} chunk_sha256 "
                              f"entries (chunk_tokens {size})")
        mask_hashes = shard.get("mask_chunk_sha256") if masked else None
        if mask_hashes is not None and not _hex_list(mask_hashes, count):
            raise _bad(where, f"split {split!r} shard {shard['file']!r} needs {count} mask_chunk_sha256 entries")
        for i in range(count):
            start = i * size
            mask_sha = mask_hashes[i] if mask_hashes else (shard["mask_sha256"] if masked and count == 1 else None)
            chunks.append(Chunk(len(chunks), s, shard["file"], start, min(size, n - start), hashes[i],
                                mask_file, mask_sha))
    return chunks


def prepare_folder(folder: str) -> None:
    """Create (or adopt) a cache folder: ours only if it carries the marker. Callers mark a
    folder before making any folder inside it (streaming.cache_root first)."""
    if os.path.isdir(folder) and os.listdir(folder) and not os.path.isfile(os.path.join(folder, MARKER)):
        raise UserError(f"{folder} exists and was not made by slipstream's streaming cache (no {MARKER} file); "
                        "it is not used, so nothing in it is deleted: choose another data.cache_dir")
    try:
        os.makedirs(folder, exist_ok=True)
        if not os.path.isfile(os.path.join(folder, MARKER)):
            # Created in place, never under another name: a process preparing the same folder
            # at this moment sees it empty or marked, not holding a stranger's file.
            try:
                fd = os.open(os.path.join(folder, MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return
            with os.fdopen(fd, "wb") as f:
                f.write(MARKER_TEXT.encode())
    except OSError as e:
        raise UserError(f"cannot create the streaming cache folder {folder} ({e.strerror}); choose a writable "
                        "data.cache_dir") from None


def _release(fd: list[int]) -> None:
    if fd and fd[0] >= 0:
        os.close(fd[0])  # releases the flock
        fd[0] = -1


def claim_folder(folder: str) -> tuple[str, list[int]]:
    """`folder`, or the first of folder.1, folder.2, ... that no live process holds (see the
    module doc), prepared and locked; the lock is held by the returned descriptor (in a list,
    so that close and the finalizer release it once)."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform: one process per folder is then the user's to ensure
        prepare_folder(folder)
        return folder, [-1]
    for i in range(MAX_SHARERS):
        candidate = folder if i == 0 else f"{folder}.{i}"
        prepare_folder(candidate)
        try:
            fd = os.open(os.path.join(candidate, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"cannot create {os.path.join(candidate, LOCK)} ({e.strerror}); choose a writable "
                            "data.cache_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # a live process streams into this one: try the next
            continue
        except OSError:
            pass  # a filesystem without locks (some network mounts): used unlocked, as before
        return candidate, [fd]
    raise UserError(f"{MAX_SHARERS} live processes already use copies of the streaming cache folder {folder}; "
                    "give this run its own data.cache_dir")


def write_atomic(path: str, data: bytes | memoryview) -> None:
    """Write a file under a temporary name and rename it: no reader ever sees half of it."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f"{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{name}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class ChunkCache:
    """The read-ahead cache of one loader (see module doc): `want` the chunks about to be read,
    `get` one of them (waiting for its download)."""

    def __init__(self, folder: str, cap_bytes: int, remote: Remote, itemsize: int, threads: int) -> None:
        folder, self._lock_fd = claim_folder(folder)
        self.folder, self.cap, self.remote, self.itemsize = folder, cap_bytes, remote, itemsize
        for entry in os.scandir(folder):  # a killed run's partial downloads: ours (marked folder, our prefix)
            if entry.name.startswith(TMP_PREFIX) and entry.is_file():
                os.remove(entry.path)
        self._lock = threading.Lock()
        self._in_use: set[str] = set()
        self._reserved = 0  # bytes of downloads in flight
        self._last_use: dict[str, int] = {}
        self._uses = 0
        self._futures: dict[str, concurrent.futures.Future] = {}
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        self.downloads = 0  # chunks fetched in this session (for tests and logs)
        # Daemon threads: an exiting run does not wait for read-ahead it will never use; the
        # temporary file a thread leaves behind is removed by the next run (above).
        self._threads = [threading.Thread(target=_download_worker, args=(weakref.ref(self), self._jobs),
                                          name=f"slipstream-stream-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()
        weakref.finalize(self, _stop_workers, self._jobs, len(self._threads))
        weakref.finalize(self, _release, self._lock_fd)

    def path(self, chunk: Chunk) -> str:
        return os.path.join(self.folder, chunk.name)

    def _present(self, chunk: Chunk) -> bool:
        """The chunk's file is here, whole. One of another size (cut short on this disk by a
        crash) is deleted, to be downloaded again: the caller holds the lock."""
        try:
            size = os.path.getsize(self.path(chunk))
        except OSError:
            return False
        if size == chunk.nbytes(self.itemsize):
            return True
        os.remove(self.path(chunk))  # a chunk file (our name, our marked and locked folder)
        return False

    def want(self, chunks: list[Chunk]) -> None:
        """These chunks are read next (the first now): keep them, download those not here."""
        with self._lock:
            if self._closed:  # no thread would ever download it: get() would wait forever
                raise UserError("the streaming loader was closed; open a new one to read more batches")
            self._in_use = {c.name for c in chunks}
            for c in chunks:
                if c.name in self._futures or self._present(c):
                    continue
                future: concurrent.futures.Future = concurrent.futures.Future()
                self._futures[c.name] = future
                self._jobs.put((c, future))

    def get(self, chunk: Chunk) -> str:
        """The local file of a chunk in use (tokens, then mask bytes), downloading it if needed."""
        with self._lock:
            future = self._futures.get(chunk.name)
        if future is None:
            with self._lock:
                present = self._present(chunk)
            if not present:
                self.want([chunk])
                with self._lock:
                    future = self._futures.get(chunk.name)
        if future is not None:
            # Blocks on a download thread: the step needs this chunk and read-ahead did not finish it in time.
            future.result()
            with self._lock:
                self._futures.pop(chunk.name, None)
        with self._lock:
            self._uses += 1
            self._last_use[chunk.name] = self._uses
        return self.path(chunk)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        while True:  # read-ahead not started is dropped: close waits only for the downloads in flight
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[1].cancel()
        _stop_workers(self._jobs, len(self._threads))
        for t in self._threads:
            # Blocks until a download in flight ends (bounded by data.retries): then no thread writes here.
            t.join()
        self._threads = []
        _release(self._lock_fd)  # after the joins: the folder is another process's only once we are done

    # -- download threads

    def download(self, chunk: Chunk) -> None:
        nbytes = chunk.nbytes(self.itemsize)
        self._make_room(nbytes)
        tmp = os.path.join(self.folder, f"{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{chunk.name}")
        try:
            data = self._fetch_checked(chunk)
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())  # the data reaches the disk before the rename says the chunk is whole
                with self._lock:  # rename and release together: the bytes are never counted twice or not at all
                    os.replace(tmp, self.path(chunk))
                    self._reserved -= nbytes
                    nbytes = 0
                    self.downloads += 1
            except OSError as e:
                raise UserError(f"cannot write chunk {chunk.index} of {self.remote.where(chunk.file)} to the streaming "
                                f"cache {self.folder} ({e.strerror or e}); free space there, choose another "
                                "data.cache_dir, or lower data.cache_bytes") from None
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
            with self._lock:
                self._reserved -= nbytes

    def _fetch_checked(self, chunk: Chunk) -> bytes:
        """The chunk's bytes, checked against the manifest; a mismatch is read once more (a
        torn read), then reported as a remote shard that changed."""
        itemsize = self.itemsize
        for attempt in (1, 2):
            tokens = self.remote.read_range(chunk.file, chunk.start * itemsize, (chunk.start + chunk.tokens) * itemsize)
            mask = (self.remote.read_range(chunk.mask_file, chunk.start, chunk.start + chunk.tokens)
                    if chunk.mask_file else b"")
            problem = _chunk_problem(chunk, tokens, mask)
            if problem is None:
                return tokens + mask
        raise UserError(
            f"{self.remote.where(problem[0])} changed since its manifest was written: chunk {chunk.index} "
            f"(tokens {chunk.start:,} to {chunk.start + chunk.tokens:,} of the shard) {problem[1]}, twice; run "
            "`slipstream data prepare` again and upload the whole folder (manifest and shards together)")

    def _make_room(self, nbytes: int) -> None:
        """Delete chunks not in use, least recently used first, until nbytes more fit under the cap."""
        with self._lock:
            files = {e.name: e.stat().st_size for e in os.scandir(self.folder)
                     if e.name.endswith(SUFFIX) and not e.name.startswith(TMP_PREFIX) and e.is_file()}
            used = sum(files.values()) + self._reserved
            spare = sorted((n for n in files if n not in self._in_use), key=lambda n: self._last_use.get(n, -1))
            while used + nbytes > self.cap and spare:
                name = spare.pop(0)
                os.remove(os.path.join(self.folder, name))  # a chunk file in our marked folder, not in use
                self._last_use.pop(name, None)
                used -= files[name]
            if used + nbytes > self.cap:
                raise UserError(f"the streaming cache {self.folder} cannot hold the chunks in use within "
                                f"data.cache_bytes = {self.cap:,}; raise data.cache_bytes or lower data.readahead")
            self._reserved += nbytes


def _chunk_problem(chunk: Chunk, tokens: bytes, mask: bytes) -> tuple[str, str] | None:
    if hashlib.sha256(tokens).hexdigest() != chunk.sha256:
        return chunk.file, "fails its sha256 checksum"
    if chunk.mask_file:
        if chunk.mask_sha256 is not None:
            if hashlib.sha256(mask).hexdigest() != chunk.mask_sha256:
                return chunk.mask_file, "fails its mask sha256 checksum"
        elif len(mask) and int(np.frombuffer(mask, dtype=np.uint8).max()) > 1:
            return chunk.mask_file, "holds mask values other than 0 and 1"
    return None


def _stop_workers(jobs: queue.Queue, n: int) -> None:
    for _ in range(n):
        jobs.put(None)


def _download_worker(cache_ref, jobs: queue.Queue) -> None:
    while True:
        # Blocks until the loader asks for a chunk (or closes): this thread only downloads.
        job = jobs.get()
        if job is None:
            return
        chunk, future = job
        cache = cache_ref()
        if cache is None:
            return
        try:
            cache.download(chunk)
            future.set_result(None)
        except BaseException as e:  # handed to the training thread, which raises it at this chunk
            future.set_exception(e)
        del cache
