"""TarShards / TarShardLoader: webdataset-written shards read back equal, the per-rank split,
workers giving the in-process batches, exact resume, bad inputs named by shard and member, and
the image-classification example end to end (Trainer, workers, resume)."""

from __future__ import annotations

import importlib.util
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from slipstream.data.tar_shards import TarShardLoader, TarShards, expand_sources
from slipstream.errors import UserError

wds = pytest.importorskip("webdataset")
ROOT = Path(__file__).resolve().parents[2]


def write_shards(folder: Path, shards: int = 3, per_shard: int = 7, extra: bool = True) -> list[Path]:
    paths = []
    for s in range(shards):
        path = folder / f"shard-{s:03d}.tar"
        with wds.TarWriter(str(path)) as writer:
            for i in range(per_shard):
                k = s * per_shard + i
                sample = {"__key__": f"{k:06d}", "png": Image.fromarray(np.full((4, 5, 3), k, np.uint8)), "cls": k}
                if extra:
                    sample.update({"json": {"k": k, "name": f"s{k}"}, "npy": np.arange(3, dtype=np.int64) + k,
                                   "txt": f"text {k}", "jpg": Image.fromarray(np.full((6, 6, 3), 100, np.uint8))})
                writer.write(sample)
        paths.append(path)
    return paths


def noisy(sample):
    """An augmentation drawing from torch's, Python's and numpy's global generators (albumentations
    and many hand-written pipelines draw from numpy's)."""
    import random

    return torch.tensor([sample["cls"]]), torch.rand(2), torch.tensor([random.random()]), torch.tensor(np.random.rand(2))


def batches(loader, n):
    return [next(loader) for _ in range(n)]


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x, y, strict=True):
            torch.testing.assert_close(u, v, rtol=0, atol=0)


def test_webdataset_written_shards_read_back_equal(tmp_path):
    write_shards(tmp_path, shards=2, per_shard=3)
    data = TarShards(str(tmp_path / "shard-{000..001}.tar"))
    samples = list(data)
    assert len(data) == len(samples) == 6
    for k, s in enumerate(samples):
        assert s["__key__"] == f"{k:06d}" and s["__url__"].endswith(f"shard-{k // 3:03d}.tar")
        assert s["cls"] == k and s["txt"] == f"text {k}" and s["json"] == {"k": k, "name": f"s{k}"}
        assert s["png"].dtype == torch.uint8 and s["png"].shape == (3, 4, 5) and (s["png"] == k).all()
        assert s["jpg"].shape == (3, 6, 6)  # lossy: only the shape is exact
        torch.testing.assert_close(s["npy"], torch.arange(3) + k)
    pil = next(iter(TarShards(tmp_path, decode="pil", fields=("png",))))
    assert isinstance(pil["png"], Image.Image) and set(pil) == {"__key__", "__url__", "png"}
    raw = next(iter(TarShards(tmp_path / "shard-000.tar", decode=False)))
    assert raw["cls"] == b"0"
    assert expand_sources(str(tmp_path / "*.tar")) == expand_sources(tmp_path)


def test_ranks_disjoint_covering_equal_counts(tmp_path):
    write_shards(tmp_path, extra=False)  # 21 samples: 10 per rank, 1 sits out each epoch
    data = TarShards(tmp_path, transform=lambda s: s["cls"])
    loaders = [TarShardLoader(data, batch_size=3, rank=r, world_size=2, seed=5) for r in range(2)]
    assert [ld.batches_per_epoch for ld in loaders] == [3, 3]
    seen = [torch.cat(batches(ld, 3)).tolist() for ld in loaders]
    assert not set(seen[0]) & set(seen[1]) and len(set(seen[0] + seen[1])) == 18
    epoch1 = [torch.cat(batches(ld, 3)).tolist() for ld in loaders]
    assert epoch1 != seen  # reshuffled by (seed, epoch)
    unshuffled = TarShardLoader(data, batch_size=4, shuffle=False, drop_last=False, rank=1, world_size=2)
    assert [b.tolist() for b in batches(unshuffled, 3)] == [[1, 3, 5, 7], [9, 11, 13, 15], [17, 19]]


def test_workers_give_the_in_process_batches_augmentations_included(tmp_path):
    write_shards(tmp_path, extra=False)
    data = TarShards(tmp_path, transform=noisy)
    np.random.seed(5)
    ours = np.random.get_state()[1].copy()
    ref = batches(TarShardLoader(data, batch_size=4, rank=1, world_size=2, seed=3), 7)  # crosses an epoch
    assert np.array_equal(np.random.get_state()[1], ours)  # the training process's numpy generator: restored
    multi = TarShardLoader(data, batch_size=4, rank=1, world_size=2, seed=3, num_workers=2, prefetch=1)
    assert_same(batches(multi, 7), ref)
    multi.close()


@pytest.mark.parametrize("cut", [1, 2, 4])  # mid-epoch, at the epoch's end (2 batches), in epoch 1
def test_exact_resume_with_workers(tmp_path, cut):
    write_shards(tmp_path, extra=False)
    data = TarShards(tmp_path, transform=noisy)
    ref = batches(TarShardLoader(data, batch_size=5, seed=1, world_size=2, rank=0), 6)
    first = TarShardLoader(data, batch_size=5, seed=1, world_size=2, rank=0, num_workers=2)
    assert_same(batches(first, cut), ref[:cut])
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    assert state["num_workers"] == 2 and state["num_samples"] == 21 and state["world_size"] == 2
    again = TarShardLoader(TarShards(tmp_path, transform=noisy), batch_size=5, seed=1, world_size=2, rank=0,
                           num_workers=1)
    again.load_state_dict(state)
    assert_same(batches(again, 6 - cut), ref[cut:])
    again.close()


def test_shards_by_url_read_the_same_batches(tmp_path):
    """file:// and a plain HTTP server (Python's http.server: no Range support) through fsspec."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    write_shards(tmp_path)
    ref = batches(TarShardLoader(TarShards(tmp_path, transform=noisy), batch_size=4, seed=2), 5)

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for url in (f"file://{tmp_path}/shard-{{000..002}}.tar",
                    f"http://127.0.0.1:{server.server_port}/shard-{{000..002}}.tar"):
            data = TarShards(url, transform=noisy)
            assert [s.path for s in data.shards][0].endswith("shard-000.tar")
            assert_same(batches(TarShardLoader(data, batch_size=4, seed=2), 5), ref)
        with pytest.raises(UserError, match="globs are not expanded in URLs"):
            TarShards(f"http://127.0.0.1:{server.server_port}/*.tar")
    finally:
        server.shutdown()


def test_resume_checks_identity(tmp_path):
    write_shards(tmp_path, extra=False)
    data = TarShards(tmp_path)
    state = TarShardLoader(data, batch_size=4, seed=1).state_dict()
    TarShardLoader(data, batch_size=2, seed=1, world_size=2).load_state_dict(state)  # same global batch
    with pytest.raises(UserError, match="seed"):
        TarShardLoader(data, batch_size=4, seed=2).load_state_dict(state)
    with pytest.raises(UserError, match="num_samples"):
        TarShardLoader(TarShards(tmp_path / "shard-000.tar"), batch_size=4, seed=1).load_state_dict(state)


def test_bad_inputs_are_named(tmp_path, monkeypatch):
    good = write_shards(tmp_path, shards=1, per_shard=4)[0]
    with pytest.raises(UserError, match="does not exist"):
        TarShards(tmp_path / "nope.tar")
    with pytest.raises(UserError, match="no tar shards match"):
        TarShards(str(tmp_path / "x-*.tar"))
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(UserError, match="junk.tar is corrupt or not an uncompressed tar"):
        TarShards(junk)
    blob = bytearray(good.read_bytes())
    second = blob.index(b"000001.", 1)  # the header of a later member: damaged checksum
    damaged = tmp_path / "damaged.tar"
    damaged.write_bytes(bytes(blob[:second + 120]) + b"X" * 8 + bytes(blob[second + 128:]))
    with pytest.raises(UserError, match=r"damaged.tar is corrupt or not an uncompressed tar \(after member '000000\.\w+': bad checksum"):
        TarShards(damaged)
    # A zeroed header reads as the end of the archive: members after it must not vanish quietly.
    damaged.write_bytes(bytes(blob[:second]) + bytes(512) + bytes(blob[second + 512:]))
    with pytest.raises(UserError, match=r"damaged.tar is corrupt.*member '000000\.\w+'"):
        TarShards(damaged)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(bytes(blob[:second + 512 + 10]))
    with pytest.raises(UserError, match="cut.tar (is truncated|is corrupt)"):
        TarShards(cut)
    with pytest.raises(UserError, match=r"shard-000.tar, member '000000\.jpg', is 631B, over the 16B limit.*SLIPSTREAM_MAX_TAR_MEMBER_BYTES"):
        TarShards(good, max_member_bytes=16)
    monkeypatch.setenv("SLIPSTREAM_MAX_TAR_MEMBER_BYTES", "16")
    with pytest.raises(UserError, match="over the 16B limit"):
        TarShards(good)
    monkeypatch.delenv("SLIPSTREAM_MAX_TAR_MEMBER_BYTES")
    gz = tmp_path / "packed.tar"
    with tarfile.open(gz, "w:gz") as tar:
        tar.add(good, arcname="inner.tar")
    with pytest.raises(UserError, match="uncompressed"):
        TarShards(gz)
    # A field the transform needs and a sample lacks: named at the first read, or at indexing with fields=.
    for workers in (0, 1):  # raised in a worker process, it reaches the step as the same UserError
        loader = TarShardLoader(TarShards(good, transform=lambda s: s["label"]), batch_size=2, num_workers=workers)
        with pytest.raises(UserError, match=r"shard-000.tar: sample '0000\d\d' has no field 'label' \(it has: cls"):
            next(loader)
        loader.close()
    with pytest.raises(UserError, match=r"sample '000000' lacks field\(s\) \['label'\]"):
        TarShards(good, fields=("png", "label"))
    with pytest.raises(UserError, match="less than batch_size=8"):
        TarShardLoader(TarShards(good), batch_size=8)


def write_members(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("000000.lnk")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    return path


def test_untrusted_members_are_never_unpickled_or_followed(tmp_path, monkeypatch):
    obj = io.BytesIO()
    np.save(obj, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    shard = write_members(tmp_path / "evil.tar", {"000000.npy": obj.getvalue(), "000000.pyd": b"\x80\x04K\x01."})
    with pytest.raises(UserError, match=r"lacks field\(s\) \['lnk'\] \(it has: npy, pyd\)"):
        TarShards(shard, fields=("pyd", "lnk"))  # the symlink member is no field: never followed
    sample = next(iter(TarShards(shard, fields=("pyd",))))
    assert sample["pyd"] == b"\x80\x04K\x01."  # bytes: not unpickled
    with pytest.raises(UserError, match=r"evil.tar, member '000000.npy': cannot decode the 'npy' field"):
        next(iter(TarShards(shard, fields=("npy",))))
    big = io.BytesIO()
    Image.new("L", (64, 64)).save(big, format="PNG")
    bomb = write_members(tmp_path / "bomb.tar", {"000000.png": big.getvalue()})
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(UserError, match=r"bomb.tar, member '000000.png': cannot decode the 'png' field \(Decompression"):
        next(iter(TarShards(bomb)))


def test_header_records_are_capped_before_they_are_read(tmp_path, monkeypatch):
    """tarfile reads a pax extended header or a GNU long name whole into memory: a crafted shard
    could make the index scan hold a record as large as the shard. Such a record is capped like a
    member (at least 1 MiB, so long names pass under a small member cap)."""
    shard = tmp_path / "pax.tar"
    with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(4):
            info = tarfile.TarInfo(f"{i:06d}.cls")
            info.size = 1
            if i == 2:
                info.pax_headers = {"comment": "x" * (3 << 20)}
            tar.addfile(info, io.BytesIO(str(i).encode()))
    reads = []

    class Recording(io.BufferedReader):
        def read(self, n=-1):
            reads.append(n)
            return super().read(n)

    from slipstream.data import tar_shards

    monkeypatch.setattr(tar_shards, "open", lambda path, mode: Recording(io.FileIO(path, mode)), raising=False)
    with pytest.raises(UserError, match=r"pax.tar: a tar header record after member '000001.cls'.*is 3[.\d]*MiB, over "
                                         r"the 2MiB limit.*SLIPSTREAM_MAX_TAR_MEMBER_BYTES"):
        TarShards(shard, max_member_bytes=2 << 20)
    assert max(n for n in reads if n is not None) <= 2 << 20  # refused before it was read
    monkeypatch.undo()
    assert len(TarShards(shard, max_member_bytes=4 << 20)) == 4  # a genuine one under the cap: read
    long_name = tmp_path / "long.tar"  # long member names (pax records) pass a small member cap
    with tarfile.open(long_name, "w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("d" * 300 + "/000000.cls")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"7"))
    assert next(iter(TarShards(long_name, max_member_bytes=16)))["cls"] == 7


def test_trainer_takes_tar_shards_as_train_and_val_data(tmp_path):
    from slipstream.train.setup import as_loader
    from slipstream.config.load import load_config

    write_shards(tmp_path, extra=False)
    cfg = load_config(None, ["--data.num_workers=2", "--data.prefetch=3", "--train.micro_batch_size=4"])
    train = as_loader(TarShards(tmp_path), cfg, torch.device("cpu"), shuffle=True)
    assert train.num_workers == 2 and train._loader.prefetch_factor == 3 and not train._loader.pin_memory  # CPU
    val = as_loader(TarShards(tmp_path), cfg, torch.device("cpu"), shuffle=False)
    assert isinstance(train, TarShardLoader) and train.producer.shuffle and train.producer.drop_last
    assert not val.producer.shuffle and val.batches_per_epoch == 6  # 21 samples: the last batch of 1 kept
    from types import SimpleNamespace

    parallel = SimpleNamespace(dims=SimpleNamespace(dp=2), dp_rank=1)  # rank and world from the parallel state
    ranked = as_loader(TarShards(tmp_path), cfg, torch.device("cpu"), shuffle=True, parallel=parallel)
    assert (ranked.rank, ranked.world_size, ranked.batches_per_epoch) == (1, 2, 2)
    assert as_loader(ranked, cfg, torch.device("cpu"), shuffle=True, parallel=parallel) is ranked


def load_example():
    spec = importlib.util.spec_from_file_location("image_classification", ROOT / "examples" / "image_classification.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_image_classification_example_trains_and_resumes(tmp_path):
    ex = load_example()
    shards = ex.make_shards(tmp_path, train_shards=2, per_shard=96, val=96)
    assert sum(1 for _ in wds.WebDataset(str(shards / "val.tar"), shardshuffle=False)) == 96  # webdataset reads them
    tiny = ("--checkpoint.interval=4", "--checkpoint.async_save=false", "--metrics.memory_breakdown=false",
            "--logging.log_interval=4")
    full = ex.train(shards, tmp_path / "full", workers=2, steps=8, batch=16, overrides=tiny)
    assert full["intervals"] == 1 and full["data_wait_s"] >= 0 and 0 <= full["accuracy"] <= 1
    # Resumed from the step-4 checkpoint in another folder, in the training process this time.
    resumed = ex.train(shards, tmp_path / "again", workers=0, steps=8, batch=16, overrides=tiny,
                       resume=str(tmp_path / "full" / "checkpoints" / "step_00000004"))
    assert resumed["steps_this_run"] == 4
    for a, b in zip(full["model"].parameters(), resumed["model"].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # workers 2 == 0 after a resume, augmentations too
