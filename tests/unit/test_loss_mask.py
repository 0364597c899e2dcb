"""Loss masks: targets equal to -100 are skipped by every LM loss, and a prepared split's loss
mask (one uint8 per token next to each shard) becomes -100 targets in TokenLoader and EvalWindows."""

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from slipstream.config.schema import ModelConfig
from slipstream.data.eval_windows import EvalWindows
from slipstream.data.loader import TokenLoader
from slipstream.errors import UserError
from slipstream.models.transformer import build_model
from slipstream.train.lm_loss import IGNORE_INDEX, fused_lm_loss_fn, lm_loss_fn, lm_sequence_losses

VOCAB = 40


def tiny(position="learned"):
    extra = dict(norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False) if position == "rope" else {}
    return build_model(ModelConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, max_seq_len=64,
                                   position=position, **extra), seed=1)


def batch(masked_fraction=0.4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (3, 24), generator=g)
    y = torch.randint(0, VOCAB, (3, 24), generator=g)
    keep = torch.rand(y.shape, generator=g) >= masked_fraction
    return x, torch.where(keep, y, IGNORE_INDEX), y, keep


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_losses_skip_masked_targets(position):
    model = tiny(position)
    x, y, full, keep = batch()
    logits = model(x)[..., :VOCAB].float()
    subset = F.cross_entropy(logits[keep], full[keep])  # the loss over the unmasked targets only
    plain = lm_loss_fn(model, (x, y))
    assert torch.allclose(plain, subset, atol=1e-6)
    fused = fused_lm_loss_fn(model, (x, y), chunk_size=7)
    assert torch.allclose(fused, plain, atol=1e-5)
    per_row = torch.stack([F.cross_entropy(logits[b][keep[b]], full[b][keep[b]]) for b in range(3)])
    assert torch.allclose(lm_sequence_losses(model, x, y), per_row, atol=1e-5)
    assert torch.allclose(lm_sequence_losses(model, x, y, fused_chunk=5), per_row, atol=1e-5)


def test_fused_and_plain_gradients_agree_with_masks():
    x, y, _, _ = batch(0.5, seed=2)
    grads = []
    for fn in (lm_loss_fn, lambda m, b: fused_lm_loss_fn(m, b, chunk_size=10)):
        model = tiny("rope")
        fn(model, (x, y)).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_all_masked_sequence_has_loss_zero_not_nan():
    model = tiny()
    x, y, _, _ = batch()
    y[1] = IGNORE_INDEX
    for chunk in (None, 8):
        losses = lm_sequence_losses(model, x, y, fused_chunk=chunk)
        assert losses[1] == 0 and torch.isfinite(losses).all()


def test_all_masked_micro_batch_trains_with_loss_zero_not_nan():
    """A micro-batch whose targets are all masked (e.g. a window inside a long prompt of a fine-tuning
    record) has no loss: 0 with zero gradients, not the mean's 0 / 0 = NaN that stops the run ("loss
    became nan"), for the plain, fused and pipeline (models.transformer.lm_loss) losses."""
    from slipstream.models.transformer import lm_loss

    x, _, _, _ = batch()
    y = torch.full_like(x, IGNORE_INDEX)
    for fn in (lm_loss_fn, lambda m, b: fused_lm_loss_fn(m, b, chunk_size=7),
               lambda m, b: lm_loss(m(b[0]), b[1])):
        model = tiny()
        loss = fn(model, (x, y))
        assert loss.item() == 0.0
        loss.backward()
        assert all(p.grad is None or (torch.isfinite(p.grad).all() and not p.grad.any()) for p in model.parameters())
    # A diverged model still reports its NaN: only the no-target case is 0.
    model = tiny()
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    x, y, _, _ = batch()
    assert lm_loss_fn(model, (x, y)).isnan() and fused_lm_loss_fn(model, (x, y), chunk_size=7).isnan()


def pad_collate(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """How a Python-API collate pads: inputs with any id, targets with -100 (never counted)."""
    T = max(len(s) for s in sequences) - 1
    x = torch.zeros(len(sequences), T, dtype=torch.long)
    y = torch.full((len(sequences), T), IGNORE_INDEX, dtype=torch.long)
    for b, s in enumerate(sequences):
        x[b, :len(s) - 1] = torch.tensor(s[:-1])
        y[b, :len(s) - 1] = torch.tensor(s[1:])
    return x, y


def test_padded_targets_are_ignored():
    model = tiny()
    g = torch.Generator().manual_seed(4)
    sequences = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 17, 5)]
    padded = lm_loss_fn(model, pad_collate(sequences))
    # Causal: padding after a sequence changes nothing before it; the mean is over real targets.
    total = sum(lm_loss_fn(model, pad_collate([s])) * (len(s) - 1) for s in sequences)
    assert torch.allclose(padded, total / sum(len(s) - 1 for s in sequences), atol=1e-6)


# -- prepared data with a loss mask


@pytest.fixture(scope="module")
def masked_dir(tmp_path_factory, corpus_file):
    """The corpus prepared in several shards, with a random loss mask per shard added as `data
    prepare` writes one (mask_file, mask_sha256, loss_mask: true)."""
    from slipstream.data import prepare_dataset

    out = tmp_path_factory.mktemp("masked") / "byte"
    prepare_dataset([str(corpus_file)], "byte", str(out), val_fraction=0.1, shard_tokens=20_000, num_workers=1,
                    progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    rng = np.random.default_rng(0)
    for split in manifest["splits"].values():
        assert split is manifest["splits"]["val"] or len(split["shards"]) > 2  # windows cross shard boundaries
        for shard in split["shards"]:
            mask = (rng.random(shard["tokens"]) < 0.7).astype(np.uint8)
            name = shard["file"] + ".mask"
            (out / name).write_bytes(mask.tobytes())
            shard["mask_file"], shard["mask_sha256"] = name, hashlib.sha256(mask.tobytes()).hexdigest()
    manifest["loss_mask"] = True
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def stream(data_dir, split, suffix=""):
    manifest = json.loads((data_dir / "manifest.json").read_text())
    key = "mask_file" if suffix else "file"
    dtype = np.uint8 if suffix else np.dtype(manifest["dtype"])
    return np.concatenate([np.fromfile(data_dir / sh[key], dtype=dtype).astype(np.int64)
                           for sh in manifest["splits"][split]["shards"]])


@pytest.mark.parametrize("mode", ["random", "sequential"])
def test_token_loader_masks_exactly_where_the_mask_says(masked_dir, mode):
    tokens, mask = stream(masked_dir, "train"), stream(masked_dir, "train", ".mask")
    loader = TokenLoader(str(masked_dir), "train", 4, 32, seed=3, mode=mode)
    assert loader.loss_mask
    batches = [next(loader) for _ in range(5)]
    masked = 0
    for index, (x, y) in enumerate(batches):
        for row, start in enumerate(loader._batch_starts(index).tolist()):
            target = tokens[start + 1:start + 33]
            expected = np.where(mask[start + 1:start + 33] == 1, target, IGNORE_INDEX)
            assert x[row].tolist() == tokens[start:start + 32].tolist()
            assert y[row].tolist() == expected.tolist()
            masked += int((expected == IGNORE_INDEX).sum())
    assert 0 < masked < 5 * 4 * 32
    workers = TokenLoader(str(masked_dir), "train", 4, 32, seed=3, mode=mode, num_workers=1)
    try:
        for x, y in batches:
            wx, wy = next(workers)
            assert torch.equal(wx, x) and torch.equal(wy, y)
    finally:
        workers.close()


def test_eval_windows_mask_targets(masked_dir, tmp_path):
    tokens, mask = stream(masked_dir, "val"), stream(masked_dir, "val", ".mask")
    windows = EvalWindows(str(masked_dir), "val", 3, 32, max_tokens=32 * 7)
    seen = 0
    for (x, y), weight in windows:
        for row in range(x.shape[0]):
            start = int(windows._starts[seen])
            target = tokens[start + 1:start + 33]
            assert x[row].tolist() == tokens[start:start + 32].tolist()
            assert y[row].tolist() == np.where(mask[start + 1:start + 33] == 1, target, IGNORE_INDEX).tolist()
            seen += 1
    assert seen >= 7
    assert windows.tokens == sum(int(mask[int(s) + 1:int(s) + 33].sum()) for s in window_starts_of(windows))
    # A window with no unmasked target has no loss: weight 0.
    empty = tmp_path / "empty"
    shutil.copytree(masked_dir, empty)
    manifest = json.loads((empty / "manifest.json").read_text())
    for shard in manifest["splits"]["val"]["shards"]:
        (empty / shard["mask_file"]).write_bytes(bytes(shard["tokens"]))
    assert all(float(w.sum()) == 0 for _, w in EvalWindows(str(empty), "val", 3, 32, max_tokens=64))


def window_starts_of(windows: EvalWindows) -> list[int]:
    from slipstream.data.eval_windows import window_starts

    return window_starts(windows._source.total_tokens, windows.seq_len, 32 * 7).tolist()


def test_bad_mask_files_are_user_errors(masked_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(masked_dir, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    shard = manifest["splits"]["train"]["shards"][0]
    (broken / shard["mask_file"]).write_bytes(b"\x01" * 10)
    with pytest.raises(UserError, match=r"mask.*(10 bytes|one byte per token).*data prepare"):
        TokenLoader(str(broken), "train", 2, 16)
    del shard["mask_file"]
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="has no mask_file"):
        TokenLoader(str(broken), "train", 2, 16)
