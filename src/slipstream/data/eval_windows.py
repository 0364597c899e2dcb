"""The fixed evaluation windows of a split: the same tokens at every evaluation, across
resumes, seeds and world sizes, so two validation losses are comparable.

A split of N tokens holds W = (N - 1) // seq_len non-overlapping windows (seq_len inputs,
targets shifted by one). When W * seq_len <= max_tokens every window is evaluated: the
exact loss of the split. Otherwise W is cut into K = max_tokens // seq_len equal strata and
one window is drawn from each with a fixed seed (EVAL_SEED, not train.seed: runs with
different seeds must see the same windows). The sample is spread over the whole split, and
its standard error is the per-window loss std / sqrt(K) (stratification only lowers it).

Ranks take windows r, r + world, ...; each rank runs the same number of batches (a rank
with fewer windows repeats a window with weight 0), because FSDP's forward is a collective.

A split with a loss mask (see loader.py) gives y = -100 where the target's mask byte is 0, as
training does; a window whose targets are all masked has weight 0 (it has no loss).
"""

from __future__ import annotations

import numpy as np
import torch

from slipstream.data.loader import IGNORE_INDEX, TokenLoader
from slipstream.errors import UserError

EVAL_SEED = 20240611  # fixed on purpose: the windows must not depend on train.seed


def window_starts(split_tokens: int, seq_len: int, max_tokens: int) -> np.ndarray:
    """Start offsets of the evaluation windows (sorted), each reading seq_len + 1 tokens."""
    n_windows = max(split_tokens - 1, 0) // seq_len
    if n_windows == 0:
        raise UserError(f"the split has {split_tokens:,} tokens, fewer than one window of seq_len + 1 = "
                        f"{seq_len + 1}; prepare more validation data or use a smaller seq_len")
    k = max(1, max_tokens // seq_len)
    if k >= n_windows:
        return np.arange(n_windows, dtype=np.int64) * seq_len
    edges = np.linspace(0, n_windows, k + 1).astype(np.int64)  # k strata of (almost) equal size
    rng = np.random.default_rng(EVAL_SEED)
    picks = edges[:-1] + (rng.random(k) * (edges[1:] - edges[:-1])).astype(np.int64)
    return picks * seq_len


class EvalWindows:
    """Batches of this rank's evaluation windows: (x, y, weight) with weight 0 for padding."""

    def __init__(self, data_dir: str, split: str, batch_size: int, seq_len: int, max_tokens: int,
                 rank: int = 0, world_size: int = 1, device: str | torch.device = "cpu") -> None:
        if batch_size < 1 or seq_len < 1 or max_tokens < 1:
            raise UserError(f"batch_size={batch_size}, seq_len={seq_len} and max_tokens={max_tokens} must be >= 1")
        # The split's shards, memory-mapped and size-checked exactly as training reads them.
        self._source = TokenLoader(data_dir, split, 1, seq_len, mode="sequential", prefetch=0)
        total = self._source.total_tokens
        self.split, self.seq_len, self.batch_size = split, seq_len, batch_size
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.vocab_size, self.eot_id = self._source.vocab_size, self._source.eot_id
        starts = window_starts(total, seq_len, max_tokens)
        self.n_windows = len(starts)  # over all ranks
        self.tokens = self.n_windows * seq_len  # target tokens evaluated over all ranks
        if self._source.loss_mask:  # only the unmasked ones count (a read of seq_len bytes per window)
            tokens, mask = np.empty(seq_len + 1, dtype=np.int64), np.empty(seq_len + 1, dtype=np.uint8)
            self.tokens = 0
            for start in starts.tolist():
                self._source.read(int(start), tokens, mask)
                self.tokens += int(np.count_nonzero(mask[1:]))
        self.sampled = self.n_windows < max(total - 1, 0) // seq_len
        mine = starts[rank::world_size]
        per_rank = -(-self.n_windows // world_size)  # the most windows any rank has
        self.n_batches = -(-per_rank // batch_size)
        pad = per_rank - len(mine)
        self._starts = np.concatenate([mine, np.repeat(starts[:1], pad)])
        self._weights = np.concatenate([np.ones(len(mine)), np.zeros(pad)]).astype(np.float32)

    def __len__(self) -> int:
        return self.n_batches

    def __iter__(self):
        T, B = self.seq_len, self.batch_size
        for b in range(self.n_batches):
            starts = self._starts[b * B:(b + 1) * B]
            buf = np.empty((len(starts), T + 1), dtype=np.int64)
            masks = np.ones((len(starts), T + 1), dtype=np.uint8)
            for row, mask, start in zip(buf, masks, starts):
                self._source.read(int(start), row, mask)
            weights = self._weights[b * B:(b + 1) * B].copy()
            x, y = buf[:, :-1], buf[:, 1:].copy()
            if self._source.loss_mask:
                y[masks[:, 1:] == 0] = IGNORE_INDEX
                weights[(masks[:, 1:] != 0).sum(axis=1) == 0] = 0.0
            x, y, weight = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y), torch.from_numpy(weights)
            yield (x.to(self.device), y.to(self.device)), weight.to(self.device)
