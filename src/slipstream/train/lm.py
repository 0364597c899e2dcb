"""The language-model job behind `slipstream train` and `slipstream generate`.

config -> data (prepared once, cached) -> model (meta -> materialize -> init) -> Trainer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any

import torch

from slipstream.config.schema import Config, ModelConfig
from slipstream.errors import UserError
from slipstream.train.lm_loss import fused_lm_loss_fn, lm_loss_fn, lm_sequence_losses


def resolve_vocab(model_cfg: ModelConfig, data_vocab: int, data_dir: str | Path = "the data") -> ModelConfig:
    """The model's vocabulary: the data's when model.vocab_size = 0; never smaller than the
    data's, whose ids the embedding must be able to index."""
    if model_cfg.vocab_size == 0:
        return dataclasses.replace(model_cfg, vocab_size=data_vocab)
    if model_cfg.vocab_size < data_vocab:
        raise UserError(f"model.vocab_size = {model_cfg.vocab_size} is smaller than the vocabulary of {data_dir} "
                        f"({data_vocab}, from its manifest); set model.vocab_size >= {data_vocab}, or 0 to take it "
                        "from the data")
    return model_cfg


def check_tokenizer_vocab(tokenizer, manifest: dict[str, Any], data_dir: str | Path) -> None:
    """The manifest's vocab_size is what the model is sized by and the loader checks ids
    against: it must be its tokenizer's, or the manifest is wrong."""
    if tokenizer.vocab_size != manifest["vocab_size"]:
        raise UserError(f"the manifest of {data_dir} declares vocab_size {manifest['vocab_size']}, but its tokenizer "
                        f"{manifest['tokenizer']} has {tokenizer.vocab_size} tokens; the manifest is wrong: run "
                        "`slipstream data prepare` again")


def describe_model(cfg: Config) -> str:
    from slipstream.models.flops import flops_per_token, param_count

    m = cfg.model
    n = param_count(m)
    return (f"model {m.preset}: {n.total / 1e6:.2f}M parameters ({n.matmul / 1e6:.2f}M in matmuls), "
            f"{m.n_layer} layers, {m.n_head} heads, width {m.d_model}, vocab {m.vocab_size}; "
            f"{flops_per_token(m, cfg.train.seq_len) / 1e6:.1f} MFLOPs/token")


def build_lm_trainer(cfg: Config):
    """Everything `slipstream train` needs, assembled in the one documented order."""
    from slipstream.data import get_tokenizer
    from slipstream.data.train_data import check_same_data, make_train_loader, make_val_windows, open_train_data
    from slipstream.distributed.data_parallel import materialize_sharded
    from slipstream.distributed.mesh import init_parallel
    from slipstream.distributed.tensor_parallel import check_model_splits
    from slipstream.models.transformer import Transformer, materialize
    from slipstream.models.flops import flops_per_token
    from slipstream.runtime import seed_all
    from slipstream.train.rundir import check_run_dir, make_run_dir, on_rank0
    from slipstream.train.trainer import JobInfo, Trainer

    check_model_splits(cfg.model, cfg.parallel.tp)  # heads, MLP, vocabulary: before any rank waits for the others
    check_document_packing(cfg)
    par = init_parallel(cfg)  # under torchrun: join the job first; errors in the layout stop every rank
    device = par.device
    # Rank 0 names the run directory (a default name holds a timestamp) and every rank uses it.
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=par.broadcast(str(make_run_dir(cfg)))))
    on_rank0(par, check_run_dir, make_run_dir(cfg))  # fail before preparing data or building the model
    # Pre-flight: a run that cannot fit in memory stops here, before any data or model work,
    # when its vocabulary is already known (set, or in the prepared folder's manifest).
    early_vocab = known_vocab(cfg)
    planned = None
    if early_vocab:
        planned = plan_step_memory(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=early_vocab)),
                                   par, device)
    if par.env.local_rank != 0:
        par.barrier()  # one process per node prepares (or finds) the cached data; the others wait
    data = open_train_data(cfg, check=par.env.local_rank == 0)
    if par.env.local_rank == 0:
        par.barrier()
    check_same_data(data, par.broadcast)
    data_dir, manifest, tokenizer = data.location, data.manifest, data.tokenizer
    # A missing tokenizer file fails now, not when the first checkpoint is saved.
    check_tokenizer_vocab(get_tokenizer(tokenizer), manifest, data_dir)
    train_cfg = cfg.train
    evaluating = train_cfg.eval_steps and train_cfg.eval_tokens
    if evaluating and data.val_tokens <= train_cfg.seq_len:  # a mixture: its largest source's val split
        print(f"note: {data_dir} has no validation split long enough for one sequence; evaluation is off "
              "(prepare with data.val_fraction > 0 to get one)")
        train_cfg = dataclasses.replace(train_cfg, eval_steps=0)
    # The run's config.toml records what was actually used: data folder, its tokenizer and vocabulary.
    cfg = dataclasses.replace(cfg, model=resolve_vocab(cfg.model, manifest["vocab_size"], data_dir), train=train_cfg,
                              data=dataclasses.replace(cfg.data, dir=str(data_dir), tokenizer=manifest["tokenizer"]))
    if not early_vocab:  # the vocabulary came with the data: check before building the model
        planned = plan_step_memory(cfg, par, device)
    seed_all(cfg.train.seed)
    with torch.device("meta"):  # no memory yet: the parallelize chain materializes it
        model = Transformer(cfg.model)
    # Draws exactly the weights a single process would from the seed; a sharded rank writes
    # only its own shards of them (called after fully_shard).
    init_model = functools.partial(materialize_sharded, materialize=materialize, cfg=cfg, device=device,
                                   seed=cfg.train.seed)

    t = cfg.train
    train_loader = make_train_loader(cfg, data, rank=par.dp_rank, world_size=par.dims.dp, device=device)
    val_windows = None
    if t.eval_steps and t.eval_tokens:
        val_windows = make_val_windows(cfg, data, rank=par.dp_rank, world_size=par.dims.dp, device=device)
    meta, files = {"tokenizer": tokenizer}, {}
    if tokenizer.startswith("bpe:"):  # ship the tokenizer with the checkpoint so generate works anywhere
        files["tokenizer.json"] = tokenizer[4:]
        meta["tokenizer"] = "bpe:tokenizer.json"
    # data.packing = document: the loss fns give the model the document ids of each row, a new
    # document after each end-of-text token of this data's tokenizer.
    eot_id = manifest["eot_id"] if cfg.data.packing == "document" else None
    loss_fn = (functools.partial(fused_lm_loss_fn, chunk_size=t.fused_loss_chunk, eot_id=eot_id) if t.fused_loss
               # The plain loss itself when no ids are needed: the pipeline recognizes it (its last stage computes it).
               else lm_loss_fn if eot_id is None else functools.partial(lm_loss_fn, eot_id=eot_id))
    sequence_loss_fn = functools.partial(lm_sequence_losses, fused_chunk=t.fused_loss_chunk if t.fused_loss else None,
                                         eot_id=eot_id)
    calibration = None
    if cfg.sparsity.method != "none" and cfg.sparsity.criterion == "wanda":
        from slipstream.data.train_data import CalibrationInputs

        calibration = CalibrationInputs(data.local_dir, t.micro_batch_size, t.seq_len, cfg.sparsity.calibration_tokens,
                                        device)
    job = JobInfo(checkpoint_meta=meta, checkpoint_files=files, model_summary=describe_model(cfg),
                  planned_peak_bytes=planned, calibration=calibration, calibration_eot_id=eot_id)
    return Trainer(model, train_loader, loss_fn, config=cfg, val_data=val_windows, sequence_loss_fn=sequence_loss_fn,
                   tokens_per_batch=t.micro_batch_size * t.seq_len,
                   flops_per_token=flops_per_token(cfg.model, t.seq_len), device=device, parallel=par,
                   init_model=init_model, job=job)


def check_document_packing(cfg: Config) -> None:
    """data.packing = document needs every attention call to take the document mask: refuse the
    layouts whose attention or stage path does not carry it."""
    if cfg.data.packing != "document":
        return
    p = cfg.parallel
    if p.cp > 1:
        raise UserError(f"data.packing = document with parallel.cp = {p.cp} is not supported yet (context "
                        "parallelism's attention knows only the causal mask); use --parallel.cp=1 or "
                        "--data.packing=eos")
    if p.pp > 1:
        raise UserError(f"data.packing = document with parallel.pp = {p.pp} is not supported yet (pipeline stages "
                        "do not pass the document mask between stages); use --parallel.pp=1 or --data.packing=eos")
    if p.tp > 1 and p.sequence_parallel and cfg.model.position == "learned":
        # The tensor-parallel plan splits the position table's (T, d) output along dim 0, the
        # sequence; per-document positions are (B, T): that split would cut the batch instead.
        raise UserError("data.packing = document with parallel.tp > 1, parallel.sequence_parallel and learned "
                        "positions (model.position = learned) is not supported yet; use "
                        "--parallel.sequence_parallel=false, a RoPE model, or --data.packing=eos")


def known_vocab(cfg: Config) -> int:
    """The run's vocabulary before its data is prepared: set in the config, or recorded in the
    manifest of data.dir (0: known only once the data is prepared; a bad folder is reported there)."""
    from slipstream.data import load_manifest

    if cfg.model.vocab_size or not cfg.data.dir or cfg.data.streaming or cfg.data.mixture:
        return cfg.model.vocab_size  # remote data: its manifest is read once, with the data
    try:
        return int(load_manifest(cfg.data.dir)["vocab_size"])
    except (UserError, KeyError, TypeError, ValueError):
        return 0


def plan_step_memory(cfg: Config, par, device: torch.device) -> int | None:
    """The planner's step peak for this run (compared with the measured one in summary.json),
    checked against this machine's memory before any is spent: a run that cannot fit is refused
    (a warning instead with train.preflight_memory = false)."""
    import warnings

    from slipstream.plan.preflight import device_memory_limit, plan_training_memory, training_refusal
    from slipstream.train.rundir import on_rank0

    dims = par.dims
    try:
        estimate = plan_training_memory(cfg, dims.dp, dims.strategy, dims.dp_shard, device.type)
    except Exception as e:  # noqa: BLE001 - the prediction is a check; a planner bug must never stop a run
        if par.is_main:
            warnings.warn(f"slipstream plan could not predict this run's memory ({type(e).__name__}: {e})",
                          stacklevel=2)
        return None
    # The CPU ranks of a node share its memory; GPU ranks have a device each.
    processes = par.env.local_world_size if device.type == "cpu" else 1

    def refuse_if_too_big() -> None:
        message = training_refusal(estimate, processes, device_memory_limit(device), device)
        if message is None:
            return
        if device.type == "cuda":
            message += (f" (`slipstream plan --model <this config's TOML> --gpus {par.world_size}x<GPU> --seq "
                        f"{cfg.train.seq_len} --global-batch {cfg.train.micro_batch_size * cfg.train.grad_accum_steps * dims.dp}` "
                        "lists layouts that fit)")
        if cfg.train.preflight_memory:
            raise UserError(message)
        warnings.warn(f"{message.split('; or set train.preflight_memory')[0]}; starting anyway "
                      "(train.preflight_memory = false)", stacklevel=3)

    on_rank0(par, refuse_if_too_big)  # one decision (rank 0 reads the free memory), on every rank
    return estimate.peak_bytes


def train_lm(cfg: Config) -> dict[str, Any]:
    return build_lm_trainer(cfg).fit()


def load_lm_from_checkpoint(path: str | Path, device: str = "auto"):
    """(model, tokenizer, config) from a checkpoint folder or run directory; weights only."""
    from slipstream.checkpoint import manager as ckpt
    from slipstream.config.load import config_from_toml_text
    from slipstream.data import get_tokenizer
    from slipstream.models.transformer import Transformer, materialize
    from slipstream.plan.preflight import check_weights_fit
    from slipstream.runtime import resolve_device

    ckpt_dir = ckpt.resolve_checkpoint(path)
    meta = ckpt.read_meta(ckpt_dir)
    try:
        cfg = config_from_toml_text(ckpt.read_text_inside(ckpt_dir, "config.toml"))
    except OSError as e:
        raise UserError(f"checkpoint '{ckpt_dir}' has no readable config.toml ({e.strerror}); it is damaged") from None
    spec = ckpt.checkpoint_tokenizer(ckpt_dir, meta, cfg.data.tokenizer)  # only the copy inside the checkpoint
    target = resolve_device(device, what="--device")
    check_weights_fit(cfg.model, target, f"checkpoint '{ckpt_dir}'")  # its config may be crafted: before building
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model = materialize(model, target, seed=0)
    ckpt.load_checkpoint(ckpt_dir, model)
    return model, get_tokenizer(spec), cfg


# Generation has no natural end (the model conditions on its last max_seq_len tokens, so it can
# run on forever): one call writes at most this many tokens, a few hundred KB of text.
MAX_NEW_TOKENS = 100_000


def check_prompt(prompt: str) -> None:
    """A prompt must be text. Non-UTF-8 bytes in argv reach Python as lone surrogates
    ("surrogateescape"), which no tokenizer can encode: name the byte instead of crashing."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(prompt[e.start])
        at = len(prompt[:e.start].encode("utf-8", "surrogateescape"))
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise UserError(f"--prompt is not valid UTF-8 text ({what} at byte {at}); pass the prompt as UTF-8, "
                        "e.g. convert it with `iconv -t UTF-8`") from None


class TextStream:
    """Decodes ids one at a time and hands the text on as soon as it is complete. A character
    can span several tokens (UTF-8 bytes of the byte tokenizer, byte-level BPE pieces): the
    byte tokenizer goes through an incremental UTF-8 decoder (exactly tokenizer.decode of all
    ids); other tokenizers hold back text ending in U+FFFD (an unfinished character) for up to
    HOLD tokens."""

    HOLD = 8  # tokens; no character needs more

    def __init__(self, tokenizer, on_text=None) -> None:
        import codecs

        from slipstream.data.tokenizers import ByteTokenizer

        self.tokenizer, self.on_text = tokenizer, on_text
        self.pieces: list[str] = []
        self._pending: list[int] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if isinstance(tokenizer, ByteTokenizer) else None

    def feed(self, ids) -> None:
        for i in ids:
            self._emit(self._decode_one(int(i)))

    def close(self) -> None:
        if self._utf8 is not None:
            self._emit(self._utf8.decode(b"", final=True))
        elif self._pending:
            self._emit(self.tokenizer.decode(self._pending))
            self._pending = []

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def _decode_one(self, i: int) -> str:
        if self._utf8 is not None:
            from slipstream.data.tokenizers import EOT_TEXT

            if 0 <= i < 256:
                return self._utf8.decode(bytes([i]))
            if i == self.tokenizer.eot_id:
                return self._utf8.decode(b"", final=True) + EOT_TEXT
            return ""  # padded vocabulary rows have no text
        self._pending.append(i)
        text = self.tokenizer.decode(self._pending)
        if text.endswith("\ufffd") and len(self._pending) < self.HOLD:
            return ""
        self._pending = []
        return text

    def _emit(self, text: str) -> None:
        if text:
            self.pieces.append(text)
            if self.on_text is not None:
                self.on_text(text)


def generate_text(checkpoint: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: int | None = 50, seed: int = 0, device: str = "auto", on_text=None,
                  quantize: str | None = None, on_stats=None, sparse_kernel: bool = False) -> str:
    """Prompt + continuation as text. on_text(piece) receives it piece by piece as the tokens
    are sampled (the CLI prints them as they come).

    quantize: "int8" or "int4" weight-only quantization of the blocks' linears before sampling
    (optimize/weight_quant.py). on_stats(dict) receives, once the text is done: quantize,
    weight_bytes_before / weight_bytes_after (size of the model's saved state dict, before and
    after quantization; equal without it), tokens and seconds of the timed part, device and
    tokens_per_s. The first token is a warm-up and is not timed (with max_new_tokens = 1 it is
    the only one and is timed). sparse_kernel: a 2:4 model's blocks run torchao's semi-structured
    sparse matmul (CUDA sm80+, bf16; optimize/sparsity.py use_sparse_kernel)."""
    import time

    from slipstream.models.transformer import generate
    from slipstream.optimize.weight_quant import KINDS, quantize_weights, weight_bytes

    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if max_new_tokens > MAX_NEW_TOKENS:
        raise UserError(f"--max-new-tokens {max_new_tokens:,} is above the limit of {MAX_NEW_TOKENS:,} per call: the "
                        "model only sees its last max_seq_len tokens anyway, so continue from this output with a "
                        "new --prompt instead")
    if not math.isfinite(temperature) or temperature < 0:
        raise UserError(f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k must be >= 1, got {top_k}")
    if quantize is not None and quantize not in KINDS:
        raise UserError(f"--quantize must be one of {', '.join(KINDS)}, got '{quantize}'")
    if quantize is not None and sparse_kernel:
        raise UserError("--quantize and --sparse-kernel cannot be combined yet (each converts the blocks' linears); "
                        "choose one")
    check_prompt(prompt)
    model, tokenizer, cfg = load_lm_from_checkpoint(checkpoint, device)
    bytes_before = weight_bytes(model) if on_stats is not None else None
    if quantize is not None:
        quantize_weights(model, quantize)
    if sparse_kernel:
        from slipstream.optimize.sparsity import use_sparse_kernel

        use_sparse_kernel(model)
    ids = tokenizer.encode(prompt)
    start = 0
    if not ids:  # an empty prompt starts a new document: after the end-of-text token, which we don't print
        ids, start = [tokenizer.eot_id], 1
    if max(ids) >= model.cfg.vocab_size:
        raise UserError("the prompt encodes to ids outside the model's vocabulary; wrong tokenizer for this checkpoint")
    device_ = next(model.parameters()).device
    context = model.cfg.max_seq_len
    stream = TextStream(tokenizer, on_text)
    stream.feed(ids[start:])  # the prompt is part of the output, as before
    # One token per call, keeping only the context the model sees: the same samples as one
    # generate(model, idx, max_new_tokens) call (same crop, one draw per token from gen),
    # with memory bounded by the context instead of growing with the output.
    window = torch.tensor([ids[-context:]], dtype=torch.long, device=device_)
    gen = torch.Generator(device=device_).manual_seed(seed)
    # A document-packed model continues the document after the last end-of-text token as training
    # saw documents: alone (attention inside it, positions from 0).
    eot_id = tokenizer.eot_id if cfg.data.packing == "document" else None
    started = time.perf_counter()
    for i in range(max_new_tokens):
        if i == 1:  # the first token warmed up the kernels and allocator: time the rest
            started = time.perf_counter()
        window = generate(model, window, 1, temperature=temperature, top_k=top_k, generator=gen,
                          eot_id=eot_id)[:, -context:]
        stream.feed([window[0, -1].item()])  # the sync streaming needs: the token goes to the screen now
    seconds = time.perf_counter() - started  # .item() above synchronized every token with the device
    stream.close()
    if on_stats is not None:
        timed = max(max_new_tokens - 1, 1)
        on_stats({"quantize": quantize, "weight_bytes_before": bytes_before, "weight_bytes_after": weight_bytes(model),
                  "tokens": timed, "seconds": seconds, "device": str(device_),
                  "tokens_per_s": timed / seconds if seconds > 0 else None})
    return stream.text
