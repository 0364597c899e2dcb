"""data.mixture: weighted sources, drawn per step from the seed, resumable (data/mixture.py).

The sources are tiny byte-tokenized corpora over disjoint alphabets (a: lowercase, b: digits,
c: uppercase), so every window says which source it came from.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from slipstream.config.load import load_config
from slipstream.data import prepare_dataset
from slipstream.data.eval_windows import EvalWindows
from slipstream.data.loader import TokenLoader
from slipstream.data.mixture import (BLOCK, MixtureLoader, eval_shares, mixture_val_windows, open_mixture,
                                     source_seed)
from slipstream.errors import UserError

SEQ, B = 16, 4
ALPHABETS = {"a": "abcdefghijklm", "b": "0123456789", "c": "NOPQRSTUVWXYZ"}
EOT = 256


def _corpus(folder, alphabet: str, n_docs: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for i in range(n_docs):
        text = "".join(rng.choice(list(alphabet), size=int(rng.integers(200, 400))))
        (folder / f"doc{i:03d}.txt").write_text(text)
    return str(folder)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    out = {}
    for i, (name, alphabet) in enumerate(ALPHABETS.items()):
        raw = _corpus(root / f"raw_{name}", alphabet, 40, seed=i)
        out[name] = str(root / name)
        prepare_dataset([raw], "byte", out[name], val_fraction=0.2, num_workers=1, progress=False)
    return out


def _cfg(sources, mixture: dict[str, float], *extra: str):
    args = [f"--data.sources.{n}={sources[n]}" for n in mixture]
    args += [f"--data.mixture.{n}={w}" for n, w in mixture.items()]
    return load_config(None, ["--model.preset=tiny", f"--train.seq_len={SEQ}", f"--train.micro_batch_size={B}",
                              "--train.seed=7", *args, *extra])


def _loader(sources, mixture, rank=0, world_size=1, *extra):
    return MixtureLoader.from_config(_cfg(sources, mixture, *extra), rank=rank, world_size=world_size)


def _source_of(row: torch.Tensor) -> str:
    ids = set(row.tolist()) - {EOT}
    owners = [name for name, alphabet in ALPHABETS.items() if ids <= set(alphabet.encode())]
    assert len(owners) == 1, f"window mixes sources: {bytes(sorted(ids))!r}"
    return owners[0]


def _own_windows(path: str, name: str, start: int = 0, **kw):
    """A source's windows in the order the mixture reads them: rows of its own TokenLoader of
    BLOCK sequences, seeded by (train.seed, name), from window `start` on."""
    loader = TokenLoader(path, "train", BLOCK, SEQ, seed=source_seed(7, name), prefetch=0, **kw)
    loader.load_state_dict({**loader.state_dict(), "batch_index": start // BLOCK})
    skip = start % BLOCK
    while True:
        x, _ = next(loader)
        yield from x[skip:]
        skip = 0


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _same(batches1, batches2):
    return all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(batches1, batches2))


def test_batches_are_a_pure_function_of_seed_rank_and_index(sources):
    mix = {"a": 0.5, "b": 0.5}
    first, again = _take(_loader(sources, mix), 6), _take(_loader(sources, mix), 6)
    assert _same(first, again)
    for x, y in first:
        assert x.dtype == torch.int64 and x.shape == (B, SEQ)
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    other_seed = _take(_loader(sources, mix, 0, 1, "--train.seed=8"), 6)
    assert not _same(first, other_seed)
    r0, r1 = _take(_loader(sources, mix, 0, 2), 6), _take(_loader(sources, mix, 1, 2), 6)
    assert not _same(r0, r1)
    # Either rank's state resumes the other (rank 0's is the one a checkpoint stores).
    rank0 = _loader(sources, mix, 0, 2)
    _take(rank0, 3)
    rank1 = _loader(sources, mix, 1, 2)
    rank1.load_state_dict(json.loads(json.dumps(rank0.state_dict())))
    assert _same(_take(rank1, 3), r1[3:])


def test_each_window_comes_from_its_drawn_source_and_proportions_match_the_weights(sources):
    mix = {"a": 0.7, "b": 0.3}
    loader = _loader(sources, mix, 0, 1, "--data.sampling=sequential")
    n_batches = 300
    counts = {"a": 0, "b": 0}
    for i in range(n_batches):
        x, y = next(loader)
        drawn = [loader.names[k] for k in loader.draws(i)[0]]
        got = [_source_of(torch.cat([row_x, row_y[-1:]])) for row_x, row_y in zip(x, y)]
        assert got == drawn
        for name in got:
            counts[name] += 1
    n = n_batches * B
    sigma = math.sqrt(0.7 * 0.3 / n)
    assert abs(counts["a"] / n - 0.7) < 4 * sigma, counts
    metrics = loader.metrics()
    assert metrics["data/tokens/a"] == counts["a"] * SEQ and metrics["data/tokens/b"] == counts["b"] * SEQ
    assert metrics["data/weight/a"] == pytest.approx(0.7) and metrics["data/share/a"] == counts["a"] / n


def test_sources_read_in_their_own_order_and_two_ranks_log_the_jobs_tokens(sources):
    """A source's windows are its own TokenLoader's, in order (seed from (train.seed, name));
    each rank's metrics count every rank's sequences."""
    mix = {"a": 0.5, "c": 0.5}
    loaders = [_loader(sources, mix, r, 2, "--data.sampling=sequential") for r in range(2)]
    inner = _own_windows(sources["c"], "c", mode="sequential", rank=1, world_size=2)
    from_c = []
    for _ in range(10):
        x, _ = next(loaders[1])
        next(loaders[0])
        from_c += [row for row in x if _source_of(row) == "c"]
    assert len(from_c) > BLOCK and all(torch.equal(row, next(inner)) for row in from_c)
    m0, m1 = loaders[0].metrics(), loaders[1].metrics()
    assert m0 == m1 and m0["data/tokens/a"] + m0["data/tokens/c"] == 10 * 2 * B * SEQ


@pytest.mark.parametrize("sampling", ["random", "sequential"])
def test_resume_is_exact(sources, sampling):
    mix = {"a": 0.6, "b": 0.3, "c": 0.1}
    straight = _loader(sources, mix, 0, 1, f"--data.sampling={sampling}")
    batches = _take(straight, 12)
    first = _loader(sources, mix, 0, 1, f"--data.sampling={sampling}")
    _take(first, 7)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = _loader(sources, mix, 0, 1, f"--data.sampling={sampling}")
    resumed.load_state_dict(state)
    assert _same(_take(resumed, 5), batches[7:])
    assert resumed.metrics() == straight.metrics()


def test_changed_weights_on_resume_keep_positions_and_apply_from_the_next_batch(sources, capsys):
    old = _loader(sources, {"a": 0.5, "b": 0.5})
    _take(old, 20)
    state = json.loads(json.dumps(old.state_dict()))
    taken = {name: state["sources"][name]["taken"][0] for name in ("a", "b")}
    assert min(taken.values()) > 0
    new = _loader(sources, {"a": 0.9, "b": 0.1})
    new.load_state_dict(state)
    out = capsys.readouterr().out
    assert "data.mixture weights changed on resume: {'a': 0.5, 'b': 0.5} -> {'a': 0.9, 'b': 0.1}" in out
    # Each source continues where it was: its next windows are its own stream's next ones.
    assert any(n % BLOCK for n in taken.values())  # resumes inside a block
    streams = {name: _own_windows(sources[name], name, taken[name]) for name in ("a", "b")}
    counts = {"a": 0, "b": 0}
    for _ in range(150):
        x, _ = next(new)
        for row in x:
            name = _source_of(row)
            counts[name] += 1
            assert torch.equal(row, next(streams[name]))
    n = sum(counts.values())
    assert abs(counts["a"] / n - 0.9) < 4 * math.sqrt(0.9 * 0.1 / n), counts
    metrics = new.metrics()
    assert metrics["data/weight/a"] == pytest.approx(0.9)
    assert metrics["data/tokens/a"] == (taken["a"] + counts["a"]) * SEQ  # counted since the run began
    # The same weights again (e.g. a rollback inside the run): nothing printed.
    again = _loader(sources, {"a": 0.9, "b": 0.1})
    again.load_state_dict(new.state_dict())
    assert "changed" not in capsys.readouterr().out


def test_a_removed_source_is_dropped_and_a_new_one_starts_at_its_beginning(sources, capsys):
    old = _loader(sources, {"a": 0.5, "b": 0.5})
    _take(old, 5)
    new = _loader(sources, {"a": 0.5, "c": 0.5})
    new.load_state_dict(old.state_dict())
    out = capsys.readouterr().out
    assert "b of the checkpoint are no longer in the mixture; dropped" in out
    assert "new source(s) c start at their beginning" in out
    state = new.state_dict()["sources"]
    assert state["a"]["taken"] == old.state_dict()["sources"]["a"]["taken"] and state["c"]["taken"] == [0]


def test_resume_at_another_number_of_ranks_continues_after_every_rank(sources):
    mix = {"a": 0.5, "b": 0.5}
    ranks = [_loader(sources, mix, r, 2, "--data.sampling=sequential") for r in range(2)]
    for loader in ranks:
        _take(loader, 4)
    one = _loader(sources, mix, 0, 1, "--data.sampling=sequential")
    one.load_state_dict(ranks[0].state_dict())
    for name in ("a", "b"):
        assert one.state_dict()["sources"][name]["taken"][0] >= max(ranks[0].state_dict()["sources"][name]["taken"])
    assert one.metrics()["data/tokens/a"] == ranks[0].metrics()["data/tokens/a"]
    next(one)


def test_open_mixture_checks_every_source_and_their_tokenizers(sources, tmp_path):
    data = open_mixture(_cfg(sources, {"b": 1.0, "a": 2.0}))
    assert data.location == data.local_dir == sources["a"] and data.tokenizer == "byte"  # first in name order
    other = tmp_path / "other"
    shutil.copytree(sources["b"], other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest.update(tokenizer="tiktoken:gpt2", tokenizer_fingerprint="tiktoken:gpt2")
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"data.sources.a \(.*\) and data.sources.b \(.*other\) were prepared with "
                                        r"different tokenizers.*prepare b again"):
        open_mixture(_cfg({**sources, "b": str(other)}, {"a": 0.5, "b": 0.5}))
    damaged = tmp_path / "damaged"
    shutil.copytree(sources["c"], damaged)
    shard = sorted(damaged.glob("train_*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(UserError, match=r"data.sources.c: train shard .* has \d+ bytes"):
        open_mixture(_cfg({**sources, "c": str(damaged)}, {"a": 0.5, "c": 0.5}))
    with pytest.raises(UserError, match=r"data.sources.b: no prepared data"):
        open_mixture(_cfg({**sources, "b": str(tmp_path / "nothing")}, {"a": 0.5, "b": 0.5}))


def test_a_source_too_small_for_one_window_is_named(sources, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "short.txt").write_text("0123456789")
    prepare_dataset([str(raw)], "byte", str(tmp_path / "short"), val_fraction=0.1, num_workers=1, progress=False)
    with pytest.raises(UserError, match=r"data.sources.b: split 'train' in .*short.* is too small"):
        _loader({**sources, "b": str(tmp_path / "short")}, {"a": 0.5, "b": 0.5})


def test_config_errors_name_the_fix(sources):
    with pytest.raises(UserError, match=r"data.mixture names web, which data.sources does not define.*"
                                        r"--data.sources.web="):
        load_config(None, [f"--data.sources.a={sources['a']}", "--data.mixture={a=0.5,web=0.5}"])
    with pytest.raises(UserError, match=r"weights must be >= 0"):
        _cfg(sources, {"a": 0.5, "b": -0.5})


def test_validation_windows_share_eval_tokens_by_weight_and_stay_fixed(sources):
    cfg = _cfg(sources, {"a": 0.75, "b": 0.25, "c": 0.0}, f"--train.eval_tokens={20 * SEQ}")
    assert eval_shares({"a": 0.75, "b": 0.25, "c": 0.0}, 20 * SEQ, SEQ) == {"a": 15 * SEQ, "b": 5 * SEQ}
    assert eval_shares({"a": 0.99, "b": 0.01}, 20 * SEQ, SEQ)["b"] == SEQ  # at least one window
    windows = mixture_val_windows(cfg)
    assert isinstance(windows, EvalWindows)  # the trainer's Evaluator scores it as fixed windows
    assert windows.n_windows == 20 and windows.tokens == 20 * SEQ and len(windows) == 4 + 2
    batches = list(windows)
    assert len(batches) == len(windows)
    seen = [_source_of(row) for (x, _), w in batches for row, wt in zip(x, w) if wt > 0]
    assert seen.count("a") == 15 and seen.count("b") == 5
    again = list(mixture_val_windows(cfg))
    assert all(torch.equal(x1, x2) for ((x1, _), _), ((x2, _), _) in zip(batches, again))
    # Two ranks: the same number of batches each, together every window once.
    per_rank = [mixture_val_windows(cfg, rank=r, world_size=2) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])
    weights = sum(float(w.sum()) for p in per_rank for _, w in p)
    assert weights == 20


def test_a_zero_weight_source_is_never_drawn_until_its_weight_grows(sources):
    loader = _loader(sources, {"a": 1.0, "b": 0.0})
    assert all(_source_of(row) == "a" for x, _ in _take(loader, 30) for row in x)
    assert loader.metrics()["data/tokens/b"] == 0
    grown = _loader(sources, {"a": 0.5, "b": 0.5})
    grown.load_state_dict(loader.state_dict())
    assert {_source_of(row) for x, _ in _take(grown, 10) for row in x} == {"a", "b"}


def test_a_damaged_saved_state_is_a_clear_error(sources):
    loader = _loader(sources, {"a": 0.5, "b": 0.5})
    _take(loader, 2)
    state = loader.state_dict()
    state["sources"]["a"]["taken"] = []
    with pytest.raises(UserError, match="data mixture state is malformed"):
        _loader(sources, {"a": 0.5, "b": 0.5}).load_state_dict(state)
    with pytest.raises(UserError, match="TokenLoader"):
        _loader(sources, {"a": 0.5, "b": 0.5}).load_state_dict({"kind": "TokenLoader", "batch_index": 3})


@pytest.mark.parametrize("resume_at", [3, 5])
def test_streamed_sources_mix_and_resume_exactly(sources, tmp_path, resume_at):
    """data.streaming = true reads every source through the streaming loader (here from local
    folders, which it reads like URLs); a source resumes at its own window count."""
    pytest.importorskip("slipstream.data.streaming")
    mix = {"a": 0.6, "b": 0.4}
    extra = ("--data.streaming=true", f"--data.cache_dir={tmp_path / 'cache'}")
    data = open_mixture(_cfg(sources, mix, *extra))
    assert data.location == sources["a"] and data.local_dir is None
    straight = _loader(sources, mix, 0, 1, *extra)
    batches = _take(straight, 8)
    assert {_source_of(row) for x, _ in batches for row in x} == {"a", "b"}
    first = _loader(sources, mix, 0, 1, *extra)
    _take(first, resume_at)
    resumed = _loader(sources, mix, 0, 1, *extra)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert _same(_take(resumed, 8 - resume_at), batches[resume_at:])
    windows = mixture_val_windows(_cfg(sources, mix, *extra, f"--train.eval_tokens={10 * SEQ}"))
    assert windows.n_windows == 10 and sum(1 for _ in windows) == len(windows)
    for loader in (straight, first, resumed):
        loader.close()


def test_an_unreachable_url_source_is_named(sources):
    pytest.importorskip("slipstream.data.streaming")
    cfg = _cfg({**sources, "b": "http://127.0.0.1:9/nothing"}, {"a": 0.5, "b": 0.5}, "--data.retries=1")
    with pytest.raises(UserError, match=r"data.sources.b: .*http://127.0.0.1:9/nothing"):
        open_mixture(cfg)


def test_sources_without_a_validation_split_are_skipped_streamed_or_not(sources, tmp_path):
    """A source prepared without a val split is left out of evaluation whether it is read
    locally or streamed (a streamed one used to stop the run); the run's TrainData says how
    many val tokens the mixture has, not only its first source."""
    pytest.importorskip("slipstream.data.streaming")
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(10):
        (raw / f"{i}.txt").write_text("0123456789" * 30)
    prepare_dataset([str(raw)], "byte", str(tmp_path / "noval"), val_fraction=0.0, num_workers=1, progress=False)
    mix = {"a": 0.5, "b": 0.5}
    both = {**sources, "a": str(tmp_path / "noval")}  # the first source (name order) has no val split
    for extra in ((), ("--data.streaming=true", f"--data.cache_dir={tmp_path / 'cache'}")):
        cfg = _cfg(both, mix, f"--train.eval_tokens={10 * SEQ}", *extra)
        windows = mixture_val_windows(cfg)
        assert list(windows.parts) == ["b"], extra
        data = open_mixture(cfg)
        assert data.val_tokens == load_manifest_val(sources["b"]) > SEQ, extra


def load_manifest_val(path: str) -> int:
    return json.loads((__import__("pathlib").Path(path) / "manifest.json").read_text())["splits"]["val"]["tokens"]


def test_streamed_sources_share_the_cache_bound(sources, tmp_path):
    """data.cache_bytes bounds the read-ahead cache of a process: the streamed sources of a
    mixture split it instead of each taking all of it."""
    pytest.importorskip("slipstream.data.streaming")
    extra = ("--data.streaming=true", f"--data.cache_dir={tmp_path / 'cache'}", "--data.cache_bytes=400000")
    loader = _loader(sources, {"a": 0.5, "b": 0.3, "c": 0.2}, 0, 1, *extra)
    caps = [inner.cache.cap for inner in loader.sources.values()]
    assert sum(caps) <= 400000 and len(set(caps)) == 1
    loader.close()
    with pytest.raises(UserError, match=r"data.sources.a: .*3 streamed sources of data.mixture share data.cache_bytes"):
        _loader(sources, {"a": 0.5, "b": 0.3, "c": 0.2}, 0, 1, *extra[:2], "--data.cache_bytes=3000")


def test_a_failing_source_stops_the_download_threads_of_those_opened_before_it(sources, tmp_path):
    import threading

    pytest.importorskip("slipstream.data.streaming")
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "short.txt").write_text("0123456789")
    prepare_dataset([str(raw)], "byte", str(tmp_path / "short"), val_fraction=0.1, num_workers=1, progress=False)
    before = {t for t in threading.enumerate() if t.name.startswith("slipstream-stream")}
    extra = ("--data.streaming=true", f"--data.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(UserError, match=r"data.sources.b: "):
        _loader({**sources, "b": str(tmp_path / "short")}, {"a": 0.5, "b": 0.5}, 0, 1, *extra)
    after = {t for t in threading.enumerate() if t.name.startswith("slipstream-stream") and t.is_alive()}
    assert after <= before


def test_streamed_sources_resume_at_another_number_of_ranks(sources, tmp_path):
    """The module doc promises every source continues at another number of data-parallel
    ranks; a streamed source's windows depend on the layout, so it continues at the first
    epoch no rank had begun (nothing read twice) instead of refusing the checkpoint."""
    pytest.importorskip("slipstream.data.streaming")
    mix = {"a": 0.5, "b": 0.5}
    chunked = {}
    for i, name in enumerate(mix):  # chunks of 1000 tokens: every rank gets some
        raw = _corpus(tmp_path / f"raw_{name}", ALPHABETS[name], 40, seed=i)
        chunked[name] = str(tmp_path / name)
        prepare_dataset([raw], "byte", chunked[name], val_fraction=0.2, num_workers=1, progress=False,
                        chunk_tokens=1000)
    sources = chunked
    extra = ("--data.streaming=true", f"--data.cache_dir={tmp_path / 'cache'}")
    ranks = [_loader(sources, mix, r, 2, *extra) for r in range(2)]
    for loader in ranks:
        _take(loader, 4)
    state = json.loads(json.dumps(ranks[0].state_dict()))
    one = _loader(sources, mix, 0, 1, *extra)
    one.load_state_dict(state)
    for name in mix:
        # The old ranks were inside epoch 0: the source continues at epoch 1 of the new layout.
        position = one._streams[one.names.index(name)].position
        assert position == one.sources[name].windows_per_rank(0, 1) == one.sources[name]._plan(0)[2]
        assert one.state_dict()["sources"][name]["taken"][0] == position
    assert one.metrics() == ranks[0].metrics()
    from slipstream.data.streaming import StreamingTokenLoader

    refs = {}
    for name in mix:  # each source's own stream at one rank, from epoch 1 on
        ref = StreamingTokenLoader(chunked[name], "train", BLOCK, SEQ, seed=source_seed(7, name),
                                   cache_dir=str(tmp_path / "ref"))
        ref.load_state_dict({**ref.state_dict(), "epoch": 1, "position": 0})
        refs[name] = (row for x, _ in iter(lambda r=ref: next(r), None) for row in x)
    for x, _ in _take(one, 6):
        for row in x:
            assert torch.equal(row, next(refs[_source_of(row)]))
    for loader in (*ranks, one):
        loader.close()
