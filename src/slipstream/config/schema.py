"""The typed configuration tree: every field has a default and a one-line doc string.

Each field is declared with `option(default, doc, ...)`, which stores the doc string and
the validation rules (minimum, maximum, allowed choices) in the dataclass field metadata.
The loader (`load.py`) validates values against these rules, and the README config
reference is generated from them (`slipstream config reference`), so code, errors and
docs never disagree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def option(default: Any, doc: str, *, min: float | None = None, max: float | None = None,
           choices: tuple | None = None, min_exclusive: bool = False) -> Any:
    """A config field with its doc string and validation rules."""
    meta = {"doc": doc, "min": min, "max": max, "choices": choices, "min_exclusive": min_exclusive}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunConfig:
    """Where the run writes its files."""

    name: str = option("quickstart", "Run name (letters, digits, . _ -); used in the default run directory name and in loggers.")
    dir: str = option("", "Run directory. Empty: runs/<name>-<timestamp> (runs/latest points at the newest).")


@dataclass
class ModelConfig:
    """Decoder-only transformer shape: GPT-2 and Llama-style options.

    `preset` fills every field the config does not set explicitly.
    """

    preset: str = option("gpt-mini", "Model preset (see `slipstream.models.PRESETS`); explicit fields override it.")
    n_layer: int = option(6, "Number of transformer blocks.", min=1)
    n_head: int = option(6, "Number of attention (query) heads.", min=1)
    n_kv_head: int = option(0, "Key/value heads for grouped-query attention; 0 = n_head (plain multi-head).", min=0)
    d_model: int = option(192, "Residual stream width; must be divisible by n_head.", min=1)
    d_ff: int = option(0, "MLP hidden width; 0 = 4*d_model for gelu and relu2, ~8/3*d_model (multiple of 64) for swiglu.", min=0)
    max_seq_len: int = option(512, "Longest sequence the model accepts (size of the learned position table).", min=1)
    vocab_size: int = option(0, "Vocabulary size; 0 = take it from the prepared data's tokenizer.", min=0)
    vocab_multiple: int = option(64, "Pad the embedding/head rows to a multiple of this (faster matmuls).", min=1)
    position: str = option("learned", "Position encoding: learned (GPT-2's table), rope (rotary, Llama), or alibi (a per-head linear bias on the attention scores, no position parameters: BLOOM, MPT; Press et al. 2022).", choices=("learned", "rope", "alibi"))
    rotary_fraction: float = option(1.0, "position = rope: the fraction of each head's dimensions the rotation applies to (the first ones; the rest carry no position): GPT-NeoX and Pythia 0.25 (rotate-half layout, as GPT-NeoX). 1 = all (Llama).", min=0.0, max=1.0, min_exclusive=True)
    rope_theta: float = option(10000.0, "RoPE base frequency (position=rope).", min=1.0)
    norm: str = option("layernorm", "Normalization layer.", choices=("layernorm", "rmsnorm"))
    norm_eps: float = option(1e-5, "Epsilon of the normalization layers.", min=0.0, min_exclusive=True)
    mlp: str = option("gelu", "MLP type: GPT-2 GELU (tanh), Llama SwiGLU, relu = down(relu(up x)) (OPT), or relu2 = down(relu(up x)^2) (Primer, So et al. 2021; the modded-nanogpt speed runs): the matmuls of gelu, often a lower loss for the same steps.", choices=("gelu", "swiglu", "relu2", "relu"))
    bias: bool = option(True, "Biases in linear and norm layers (GPT-2: true, Llama: false).")
    parallel_block: bool = option(False, "Attention and MLP read the same block input (each through its own norm) and their outputs are added to the residual together: x + attn(norm1 x) + mlp(norm2 x) (GPT-J, GPT-NeoX, PaLM, Falcon). false = the sequential GPT-2/Llama block.")
    embedding_norm: bool = option(False, "A norm (model.norm) right after the token embedding (BLOOM's word_embeddings_layernorm): steadier early training.")
    tie_embeddings: bool = option(True, "Share the token embedding with the output head.")
    dropout: float = option(0.0, "Dropout probability (embeddings, attention output, MLP output).", min=0.0, max=0.99)
    init_std: float = option(0.02, "Std of the normal init; residual projections get std/sqrt(2*n_layer).", min=0.0)
    qk_norm: bool = option(False, "RMSNorm over each head of the queries and keys before RoPE (Qwen3, OLMo 2): steadier attention logits.")
    logit_softcap: float = option(0.0, "Soft-cap the output logits: cap x tanh(logits / cap), on every path that makes logits or a loss (Gemma 2 uses 30, modded-nanogpt 15-30): bounds over-confident logits, which steadies short high-learning-rate runs. 0 = off.", min=0.0)
    zero_init_proj: bool = option(False, "Start the residual output projections (attention o_proj, MLP down_proj, MoE experts' w_down) and an untied output head at exactly zero (modded-nanogpt): each block begins as the identity and the first steps are steadier. A tied head is the embedding and is not zeroed.")
    # Mixture of experts (models/moe.py): the MLP of chosen blocks becomes routed experts.
    moe_experts: int = option(0, "Mixture of experts: routed experts per MoE layer; 0 = a dense model (every other moe_* field is ignored).", min=0)
    moe_top_k: int = option(2, "MoE: experts each token is routed to (at most moe_experts).", min=1)
    moe_every: int = option(1, "MoE: every k-th block (counted from the first block after moe_first_dense) has experts; the others keep a dense MLP.", min=1)
    moe_first_dense: int = option(0, "MoE: the first n blocks keep a dense MLP (DeepSeek keeps 1-3).", min=0)
    moe_expert_hidden: int = option(0, "MoE: hidden width of one expert; 0 = the dense MLP width (d_ff). Smaller, more experts = fine-grained experts (DeepSeek).", min=0)
    moe_shared_experts: int = option(0, "MoE: shared experts every token passes through besides its routed ones (DeepSeek), each moe_expert_hidden wide.", min=0)
    moe_router: str = option("softmax", "MoE router: softmax (softmax over the experts, then top-k: Mixtral, Qwen) or sigmoid (sigmoid scores, top-k, weights normalized over the chosen: DeepSeek-V3).",
                             choices=("softmax", "sigmoid"))
    moe_norm_topk: bool = option(True, "MoE, softmax router: renormalize the top-k weights to sum to 1 (Mixtral); false keeps the raw probabilities (OLMoE). The sigmoid router always normalizes.")
    moe_route_scale: float = option(1.0, "MoE: the routed experts' weights are multiplied by this (DeepSeek-V3: 2.5).", min=0.0, min_exclusive=True)
    moe_aux_loss: float = option(0.01, "MoE: coefficient of the auxiliary load-balancing loss (Switch/GShard: n_experts x sum_i tokens_i x mean_prob_i); 0 = off.", min=0.0)
    moe_z_loss: float = option(0.0, "MoE: coefficient of the router z-loss (ST-MoE: mean squared logsumexp of the router logits; 1e-3 is usual); 0 = off.", min=0.0)
    moe_bias_rate: float = option(0.0, "MoE: auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert's routing bias moves by this toward balance (-rate if over-loaded, +rate if under); the bias only picks experts, never weighs them. 0 = off; 1e-3 is DeepSeek's.", min=0.0)
    moe_dropless: bool = option(True, "MoE: every routed token is computed (dropless). false: an expert takes at most moe_capacity_factor x its fair share of a batch's tokens and drops the rest (they pass on through the residual).")
    moe_capacity_factor: float = option(1.25, "MoE with moe_dropless = false: expert capacity = factor x tokens x top_k / experts (per process and micro-batch; training only: evaluation and generation are dropless).", min=0.0, min_exclusive=True)
    moe_gemm: str = option("auto", "MoE expert computation: grouped (one torch._grouped_mm over all experts), loop (one matmul per expert) or auto (grouped where torch supports it for the device and dtype). Same results either way.",
                           choices=("auto", "grouped", "loop"))


@dataclass
class DataConfig:
    """What to train on and how to cut it into batches."""

    inputs: list[str] = option(["stdlib"], "What `data prepare` reads: text files, folders, .jsonl (.gz, .zst), Parquet files, Hugging Face `datasets` folders (save_to_disk) and .arrow files, fsspec URLs (s3://, gs://, hf://, file://) of any of them, or `stdlib` (the embedded corpus: Python's standard-library sources).")
    tokenizer: str = option("byte", "Tokenizer: `byte`, `bpe:FILE` (tokenizers JSON) or `tiktoken:NAME`.")
    text_field: str = option("text", "Field (JSONL) or column (Parquet, Arrow) holding the text. Records without it but with `prompt` and `completion` strings are supervised fine-tuning pairs: only the completion is trained on (a loss mask).")
    dir: str = option("", "Prepared token-shard folder (from `slipstream data prepare`), used as is. Empty: prepare `inputs` on first use into data/<tokenizer>-<inputs>-<hash>.")
    val_fraction: float = option(0.01, "Fraction of documents held out for validation.", min=0.0, max=0.5)
    sampling: str = option("random", "Training windows: random (seeded) or sequential epochs (shuffled window order).",
                           choices=("random", "sequential"))
    prepare_workers: int = option(0, "Processes for tokenization; 0 = all cores.", min=0)
    num_workers: int = option(0, "DataLoader worker processes building training batches (and running data.augment); 0 = in the training process.", min=0, max=256)
    pin_memory: bool = option(True, "CUDA: build batches in pinned host memory and copy them with non_blocking=True.")
    prefetch: int = option(2, "Batches prepared ahead of the step (CUDA prefetch thread, or per worker: at least 1 with workers); 0 = none.", min=0, max=64)
    augment: str = option("none", "CPU-side augmentation of input tokens: none, or swap_tokens (per-token Python loop: CPU-bound on purpose; fix with num_workers).",
                          choices=("none", "swap_tokens"))
    augment_prob: float = option(0.1, "swap_tokens: probability of swapping each token with its neighbour.", min=0.0, max=1.0)
    augment_cost_ms: float = option(0.0, "swap_tokens: extra CPU time per sequence (ms), emulating an expensive preprocessing pipeline to reproduce a data-bound run.", min=0.0, max=10000.0)
    streaming: bool = option(False, "Read the prepared shards of data.dir (a local path or an fsspec URL: s3://, gs://, hf://, http://) while training, chunk by chunk, without copying the whole set first: each rank downloads only its own chunks into a read-ahead cache on local disk (data.cache_dir, at most data.cache_bytes), checks each chunk's sha256 and resumes at the exact shard and offset.")
    cache_dir: str = option("", "streaming: local folder of the read-ahead cache (chunks, the manifest, the tokenizer). Empty: ~/.cache/slipstream/stream/<hash of the URL>.")
    cache_bytes: int = option(1 << 30, "streaming: most bytes of chunks kept in the local cache per rank; consumed chunks are deleted first (at least readahead + 1 chunks must fit).", min=1)
    readahead: int = option(4, "streaming: chunks downloaded ahead of the one being read.", min=0, max=1024)
    stream_threads: int = option(2, "streaming: threads downloading chunks in the background.", min=1, max=64)
    retries: int = option(5, "streaming: attempts per remote read before giving up with an error; waits double from 0.5 s between attempts (transient errors only).", min=1, max=100)
    sources: dict[str, str] = option({}, "Named prepared-data locations for data.mixture (folders or URLs; each from `slipstream data prepare` with the same tokenizer), e.g. {web = \"data/web\", code = \"s3://bucket/code\"}.")
    mixture: dict[str, float] = option({}, "Weights of the data.sources to sample from, e.g. {web = 0.7, code = 0.2, math = 0.1} (normalized to sum 1). Each sequence of a batch draws its source from the seed; tokens per source are logged. Empty: one source (data.dir / data.inputs). Weights may change on resume (logged).")
    packing: str = option("eos", "How documents fill a training sequence: eos (concatenated with EOS separators; attention crosses documents) or document (concatenated, but attention never crosses a document boundary and positions restart at each document: FlexAttention block mask on CUDA, an exact masked SDPA elsewhere).",
                          choices=("eos", "document"))
    dedup: bool = option(False, "data prepare: drop exact duplicate documents (hash of the text; the first occurrence is kept).")
    verify: str = option("auto", "Check the prepared shards at train start: full (sha256 of every shard, ~1 s per GB), size (sizes and recorded max ids only), auto (full up to 1 GiB of shards, else size). Every batch is checked for ids outside the vocabulary either way.",
                         choices=("auto", "full", "size"))


@dataclass
class TrainConfig:
    """The training loop."""

    max_steps: int = option(500, "Optimizer steps to train.", min=1)
    micro_batch_size: int = option(16, "Sequences per forward/backward pass.", min=1)
    seq_len: int = option(256, "Tokens per training sequence (<= model.max_seq_len).", min=1)
    grad_accum_steps: int = option(1, "Micro-batches accumulated per optimizer step.", min=1)
    seed: int = option(1337, "Seed for model init, data order and dropout.", min=0, max=2**32 - 1)
    device: str = option("auto", "Device: auto (the accelerator if present, else cpu), cpu, cuda, cuda:N.")
    deterministic: bool = option(False, "torch.use_deterministic_algorithms(True): bitwise repeatable (slower on GPU).")
    eval_interval: int = option(200, "Evaluate on the val split every N steps (and at the end); 0 = only at the end.", min=0)
    eval_steps: int = option(20, "Batches per evaluation of a Python-API validation loader (language-model jobs use eval_tokens); 0 disables evaluation for every job.", min=0)
    eval_tokens: int = option(1_048_576, "Language-model jobs: target tokens per evaluation. Every seq_len window of the val split when it holds fewer; otherwise one window from each of eval_tokens / seq_len equal strata of the split, drawn with a fixed seed. The same windows at every evaluation, resume, seed and world size; the loss is logged with its standard error. 0 disables evaluation.", min=0)
    fused_loss: bool = option(False, "Language models: chunked fused linear + cross-entropy (slipstream::fused_linear_cross_entropy), never materializing all logits.")
    fused_loss_chunk: int = option(4096, "fused_loss: tokens per chunk; peak extra memory is about chunk x vocabulary logits.", min=1)
    threads: int = option(0, "CPU threads for torch (torch.set_num_threads); 0 = torch's default (all cores).", min=0, max=1024)
    early_stop_patience: int = option(0, "Stop training when the val loss has not improved by early_stop_min_delta for this many evaluations in a row (the summary says why and at which step; the final checkpoint is written as usual). 0 = never stop early.", min=0)
    early_stop_min_delta: float = option(0.0, "Early stopping: the least decrease of the val loss, from the best so far, that counts as an improvement.", min=0.0)
    target_val_loss: float = option(0.0, "Stop at the first evaluation whose val loss is at or below this (time-to-target runs, MLPerf style; summary.json's stopped_early says at which step). 0 = no target.", min=0.0)
    preflight_memory: bool = option(True, "Before preparing data or building the model, refuse a run whose planned step memory (slipstream plan's estimate, per process) exceeds what this machine has: CPU MemAvailable (or the container's limit) shared by the local ranks, or the GPU's memory. false: start anyway (e.g. when the plan over-states an unusual setup).")


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = option(1e-3, "Peak learning rate.", min=0.0, min_exclusive=True)
    min_lr: float = option(1e-4, "Learning rate at the end of the decay.", min=0.0)
    weight_decay: float = option(0.1, "AdamW weight decay (applied to matrices only; biases, norms excluded).", min=0.0)
    beta1: float = option(0.9, "AdamW beta1.", min=0.0, max=0.999999)
    beta2: float = option(0.95, "AdamW beta2.", min=0.0, max=0.999999)
    eps: float = option(1e-8, "AdamW epsilon.", min=0.0, min_exclusive=True)
    grad_clip: float = option(1.0, "Clip the global gradient norm to this; 0 = no clipping (norm still logged).", min=0.0)
    schedule: str = option("cosine", "LR schedule after warmup: cosine, wsd (warmup-stable-decay), constant, or range_test (the learning-rate range test of `slipstream tune lr`: exponential from min_lr at the first step to lr at the last, no warmup).",
                           choices=("cosine", "wsd", "constant", "range_test"))
    warmup_steps: int = option(50, "Linear warmup steps from 0 to lr.", min=0)
    decay_fraction: float = option(0.2, "wsd: fraction of max_steps spent in the final linear decay.", min=0.0, max=1.0)
    implementation: str = option("auto", "AdamW implementation: auto (fused where possible), fused, foreach or for-loop.",
                                 choices=("auto", "fused", "foreach", "for-loop"))
    in_backward: bool = option(False, "Step each parameter inside backward (post-accumulate-grad hooks), so all gradients never coexist (with grad_accum_steps = 1). Needs grad_clip = 0.")
    state_dtype: str = option("fp32", "Dtype of the Adam moments: fp32, bf16 (half the optimizer-state memory), or int8 / int4 (torchao's block-quantized low-bit AdamW: about 1/4 and 1/8 of fp32's moment bytes).", choices=("fp32", "bf16", "int8", "int4"))
    offload: bool = option(False, "Keep fp32 master weights and Adam state in CPU memory and run the optimizer step there.")
    optimizer: str = option("adamw", "adamw, or muon: Muon (torch.optim.Muon: momentum orthogonalized by Newton-Schulz iterations) for the 2-D weight matrices of the hidden layers (attention and MLP projections), AdamW with the settings above for the rest (embeddings, output head, norms, biases, MoE routers and experts). Newton-Schulz needs whole matrices: single process, ddp or pp; not with optim.offload, in_backward or state_dtype = bf16.", choices=("adamw", "muon"))
    muon_lr: float = option(0.0, "Muon: peak learning rate of the hidden matrices, on the same schedule (the same warmup and decay multipliers); 0 = optim.lr, which carries over with muon_adjust_lr = match_rms_adamw.", min=0.0)
    muon_momentum: float = option(0.95, "Muon: momentum of the matrices' update (Nesterov).", min=0.0, max=0.999999)
    muon_adjust_lr: str = option("match_rms_adamw", "Muon: per-matrix scale of the lr: match_rms_adamw (0.2 x sqrt(max(rows, cols)): updates with the RMS of AdamW's, so AdamW's lr and weight decay carry over; Moonshot 2025) or original (sqrt(max(1, rows / cols)); Keller Jordan's, which wants an lr near 0.02).", choices=("match_rms_adamw", "original"))
    muon_ns_steps: int = option(5, "Muon: Newton-Schulz iterations that orthogonalize each matrix's update.", min=1, max=99)


@dataclass
class PrecisionConfig:
    """Numerics of the forward/backward pass."""

    autocast: str = option("none", "Autocast dtype for forward/backward: none (fp32), bf16, or fp16 (with dynamic loss scaling).",
                           choices=("none", "bf16", "fp16"))
    fp16_init_scale: float = option(65536.0, "fp16: initial loss scale of the dynamic loss scaler.", min=1.0)
    fp16_growth_interval: int = option(2000, "fp16: steps without overflow before the loss scale doubles.", min=1)
    tf32: bool = option(False, "CUDA: run fp32 matmuls and convolutions on TF32 tensor cores (no effect on CPU).")
    fp8: bool = option(False, "CUDA, compute capability >= 8.9: fp8 linear layers through torchao (error elsewhere).")


@dataclass
class QuantConfig:
    """Quantization-aware training (torchao): fake-quantized weights (and activations) in the
    forward, so the model learns to live with the rounding `slipstream checkpoint export
    --quantize` later applies for real."""

    qat: str = option("none", "none, int8-dynact-int4-weight (int8 per-token dynamic activations + int4 grouped weights: the usual LLM edge recipe) or int8-weight (int8 per-channel weights).",
                      choices=("none", "int8-dynact-int4-weight", "int8-weight"))
    qat_group_size: int = option(32, "qat = int8-dynact-int4-weight: weights quantized in groups of this many input features (divides every linear's input width).", min=1)
    qat_start_step: int = option(0, "Train in full precision until this step, then fake-quantize (QAT from a warm start).", min=0)


@dataclass
class SparsityConfig:
    """Pruning during training: masks on the blocks' linears, saved in checkpoints (optimize/sparsity.py).

    The masks are model state: checkpoints save them, resume is exact, export writes the masked weights."""

    method: str = option("none", "none, magnitude (unstructured: the smallest abs(w) zeroed), 2:4 (semi-structured: exactly two zeros in every block of four along the input dimension; all at once at start_step; training runs the masked weights as dense matmuls on every device), heads (structured: whole attention heads, by the L2 norm of their weights; k/v kept with GQA) or channels (structured: whole MLP hidden channels). The blocks' linears only (embedding and head stay dense); not with tp, pp, FSDP/zero2, local SGD or MoE.",
                         choices=("none", "magnitude", "2:4", "heads", "channels"))
    target: float = option(0.5, "Final fraction of the pruned weights zeroed (magnitude), of heads (heads) or of MLP channels (channels); 2:4 needs 0.5.", min=0.0, max=0.99)
    scope: str = option("layer", "magnitude only: rank the weights per layer (each layer reaches the target) or globally (one threshold over all pruned layers).", choices=("layer", "global"))
    start_step: int = option(0, "Step of the first pruning; dense before it.", min=0)
    end_step: int = option(0, "Step at which the target is reached, on the cubic schedule of Zhu & Gupta 2017 (s_t = s_f (1 - (1 - (t - t0) / (t1 - t0))^3)); 0 or <= start_step = all at once at start_step. The cubic is 0 at start_step, so the first weights go at start_step + every.", min=0)
    every: int = option(100, "Recompute the masks every this many steps between start_step and end_step (and at end_step).", min=1)
    criterion: str = option("magnitude", "How methods magnitude and 2:4 rank the weights: magnitude (abs(w)) or wanda (abs(w) x the L2 norm of its input feature over calibration_tokens of the train split, compared within each output row: Sun et al. 2023, one-shot pruning without retraining). wanda: scope layer only; language-model jobs on a local prepared folder.",
                           choices=("magnitude", "wanda"))
    calibration_tokens: int = option(65_536, "criterion = wanda: tokens of the train split whose input norms rank the weights (fixed windows: the same at every pruning step, on every rank and after resume).", min=1)


@dataclass
class CompileConfig:
    """torch.compile, applied after activation checkpointing."""

    scope: str = option("off", "What to compile: off, model (whole model) or blocks (each transformer block: regional, fast cold start).",
                        choices=("off", "model", "blocks"))
    mode: str = option("default", "torch.compile mode.",
                       choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    fullgraph: bool = option(False, "Fail on graph breaks instead of falling back to eager for that region.")
    cache_dir: str = option("", "Inductor cache folder, kept across runs so repeat runs start fast. Empty: per user (~/.cache/slipstream/inductor).")


@dataclass
class ActivationsConfig:
    """Activation memory: recompute or offload what the backward pass needs."""

    checkpointing: str = option("none", "none, full (recompute blocks), selective (save matmul outputs, recompute pointwise ops) or offload (saved activations in CPU memory; not with parallel.cp_attention = ring).",
                                choices=("none", "full", "selective", "offload"))
    every: int = option(1, "full: checkpoint every k-th block (1 = all).", min=1)


@dataclass
class ParallelConfig:
    """Data parallelism over torch.distributed (launch with `slipstream launch` or torchrun).

    The degrees multiply to the world size: dp_replicate x dp_shard x tp x pp x cp. One named
    DeviceMesh is built from them, outermost first: dp_replicate / dp_shard, then tp (innermost,
    so a tensor-parallel group is consecutive ranks: one node).
    """

    dp_strategy: str = option("auto", "auto (none for one data-parallel rank, ddp for more; fsdp for more with tp > 1), none, ddp, zero1 (DDP + sharded optimizer state), zero2 (FSDP2, gradients and optimizer state sharded, parameters kept gathered), fsdp (FSDP2 / ZeRO-3: parameters sharded too) or hsdp (replicate x shard).",
                              choices=("auto", "none", "ddp", "zero1", "zero2", "fsdp", "hsdp"))
    dp_replicate: int = option(0, "Replicas (DDP-style all-reduce groups); 0 = derived: the data-parallel degree for ddp/zero1, 1 for zero2/fsdp, world / dp_shard for hsdp.", min=0)
    dp_shard: int = option(0, "Shards per replica (FSDP groups); 0 = derived: the data-parallel degree for zero2/fsdp, 1 for ddp/zero1, the processes per node for hsdp.", min=0)
    tp: int = option(1, "Tensor-parallel degree (Megatron-style, on DTensor): each block's matmuls, the embedding and the head are split over tp ranks, which read the same batch. Must divide the heads, KV heads, MLP width and padded vocabulary; a user nn.Module needs a `tensor_parallel_plan` method (README).", min=1)
    sequence_parallel: bool = option(True, "tp > 1: norms and the residual stream between the TP regions run on sequence shards (activations 1/tp per rank; all-gather + reduce-scatter instead of all-reduce). train.seq_len must be divisible by tp.")
    loss_parallel: bool = option(True, "tp > 1: the cross-entropy runs on the vocabulary-sharded logits (torch's loss_parallel); the full logits are never gathered on one rank.")
    async_tp: bool = option(False, "CUDA, tp > 1 with sequence parallel and compile: async tensor parallel (Inductor's micro-pipelined all-gather / reduce-scatter matmuls over symmetric memory), which overlaps tp communication with the matmuls; refused elsewhere.")
    pp: int = option(1, "Pipeline-parallel degree: the blocks are cut into pp x pp_virtual_stages stages (the embedding with the first, the final norm, head and loss with the last), each pp rank runs its stages and passes activations on (torch.distributed.pipelining). slipstream transformers only.", min=1)
    pp_schedule: str = option("1f1b", "pp > 1: the pipeline schedule: gpipe or 1f1b (one stage per rank), interleaved-1f1b, looped-bfs or interleaved-zero-bubble (pp_virtual_stages per rank), zbv or dualpipev (zero-bubble V schedules: exactly 2 stages per rank).",
                              choices=("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble", "zbv", "dualpipev"))
    pp_microbatches: int = option(0, "pp > 1: micro-batches the pipeline splits one step's batch (micro_batch_size x grad_accum_steps sequences per data-parallel rank) into; must divide it. 0 = one sequence each (the smallest bubble; at least the number of stages).", min=0)
    pp_virtual_stages: int = option(0, "pp > 1: stages per pipeline rank; 0 = 1 for gpipe / 1f1b, 2 for the others (the V schedules need exactly 2).", min=0)
    pp_layers: str = option("", "pp > 1: blocks per stage, comma-separated in stage order (e.g. \"4,4,3,3\"); empty = split to balance the stages' training FLOPs (the embedding weighs on the first stage, the head on the last).")
    cp: int = option(1, "Context-parallel degree: the sequence of every batch is split over cp ranks (attention meets the other ranks' keys and values as parallel.cp_attention says); the cp ranks average gradients with the data-parallel ones (dp_strategy fsdp, hsdp or ddp). slipstream transformers only.", min=1)
    cp_load_balance: bool = option(True, "cp > 1: cut the sequence into 2 x cp chunks and give each rank one early and one late chunk, so causal attention costs every rank the same; train.seq_len must be divisible by 2 x cp (x tp with sequence parallel).")
    cp_attention: str = option("allgather", "cp > 1: the attention kernel. allgather: every rank all-gathers the keys and values of the whole sequence over the cp group (Llama 3's context parallelism; any device). ring: torch's ring attention (torch.distributed.tensor.experimental context parallel): each rank keeps its K/V shard and the shards rotate around the cp ring while each step runs torch's fused SDPA kernel (flash, efficient or cuDNN) and merges by log-sum-exp, so no rank holds the whole sequence's K/V; per layer and micro-batch it sends cp - 1 K/V hops forward (again under full AC) and cp - 1 K/V hops plus cp fp32 dK/dV hops backward. CUDA only, causal attention only (no document masks, no ALiBi), model.dropout = 0, not with activations.checkpointing = offload, and every chunk of the sequence a multiple of 32 tokens (train.seq_len divisible by 32 x 2 x cp with cp_load_balance, else 32 x cp: the efficient kernel pads its log-sum-exp to 32); GQA keys and values are repeated to the query heads before the ring; under compile the ring runs eagerly (a graph break: not with compile.fullgraph). slipstream plan times the allgather kernel for either.", choices=("allgather", "ring"))
    ep: int = option(1, "Expert-parallel degree for MoE models: each MoE layer's experts are split over ep data-parallel ranks, which send every token to the rank holding its experts and back (all-to-all). Must divide the data-parallel degree and model.moe_experts.", min=1)
    backend: str = option("auto", "Process-group backend: auto (nccl on CUDA, gloo on CPU), nccl or gloo.", choices=("auto", "nccl", "gloo"))
    init_timeout_s: float = option(120.0, "Start-up timeout (s): joining the process group and the first collectives; a rank that never shows up fails the run with an error instead of a hang.", min=1.0)
    timeout_s: float = option(600.0, "Collective timeout (s) once training runs; a stuck collective then fails the job (CUDA: with a flight-recorder dump).", min=1.0)
    bucket_mb: float = option(25.0, "DDP: gradient bucket size in MiB (larger: fewer all-reduces; smaller: earlier overlap).", min=0.0, min_exclusive=True)
    static_graph: bool = option(False, "DDP: the set of used parameters never changes (enables more overlap); needs train.grad_accum_steps = 1.")
    grad_as_bucket_view: bool = option(True, "DDP: gradients are views into the all-reduce buckets (saves one gradient copy).")
    find_unused_parameters: bool = option(False, "DDP: tolerate parameters that get no gradient in a step (costs a graph traversal per step).")
    comm_hook: str = option("none", "DDP/zero1 gradient communication: none (fp32 all-reduce), fp16 or bf16 (compressed all-reduce), powersgd (low-rank).",
                            choices=("none", "fp16", "bf16", "powersgd"))
    powersgd_rank: int = option(1, "powersgd: rank of the low-rank approximation (higher: more accurate, more traffic).", min=1)
    powersgd_start_step: int = option(10, "powersgd: plain all-reduce for this many steps first (PowerSGD's warm-up).", min=2)
    local_sgd_period: int = option(0, "DDP: local SGD: after local_sgd_start_step, ranks step on their own gradients and average parameters every N steps; 0 = off.", min=0)
    local_sgd_start_step: int = option(0, "local SGD: steps of ordinary synchronous DDP before local SGD starts (post-local SGD).", min=0)
    param_dtype: str = option("none", "zero2/fsdp/hsdp: dtype of the gathered parameters for compute (FSDP mixed precision); none = the parameters' dtype.",
                              choices=("none", "bf16", "fp16", "fp32"))
    reduce_dtype: str = option("none", "zero2/fsdp/hsdp: dtype of the gradient reduce-scatter; none = param_dtype.",
                               choices=("none", "bf16", "fp16", "fp32"))
    offload: bool = option(False, "zero2/fsdp/hsdp: keep sharded parameters, gradients and optimizer state in CPU memory; the optimizer steps on CPU.")
    sync_batchnorm: bool = option(True, "With more than one process on GPUs: convert BatchNorm layers to SyncBatchNorm (statistics over the global batch; torch supports it on accelerators only).")


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    interval: int = option(0, "Save every N steps (0 = no step trigger; see interval_minutes and save_final).", min=0)
    interval_minutes: float = option(0.0, "Also save when this many minutes passed since the last save (0 = off); decided by rank 0, checked every step.", min=0.0)
    resume: str = option("none", "none, auto (newest intact checkpoint in the run dir, if any; damaged ones are skipped) or a checkpoint path.")
    keep_last: int = option(3, "Keep the newest K checkpoints (the final one is always kept).", min=1)
    keep_every: int = option(0, "Also keep every checkpoint whose step is a multiple of M forever (0 = none).", min=0)
    save_final: bool = option(True, "Save a checkpoint when training ends.")
    async_save: bool = option(True, "Write checkpoints in a background thread: training stalls only while the state is copied to host memory (the stall is logged as checkpoint_stall_s).")
    verify: bool = option(True, "Check every file of a checkpoint against its manifest (sizes and CRC32) before loading it.")


@dataclass
class ResilienceConfig:
    """Surviving preemption and hangs."""

    preemption: bool = option(True, "On SIGUSR1 (and SIGTERM in a single process; under torchrun SIGTERM stays the launcher's stop order): finish the current step, save a checkpoint and exit with code 75 (resume with --checkpoint.resume=auto).")
    grace_s: float = option(120.0, "Seconds the scheduler allows between the signal and SIGKILL; a warning is printed when a save takes longer.", min=0.0)
    watchdog_s: float = option(1800.0, "Exit with code 124 after dumping every thread's stack to the run directory when no training step finishes for this many seconds (evaluation, checkpointing and the first step excepted); 0 = off.", min=0.0)


@dataclass
class StabilityConfig:
    """Guards against NaN/Inf and loss spikes, checked every step (one small host sync per step)."""

    policy: str = option("none", "none (only stop when a logged loss is not finite), skip (drop the update of a step with a NaN/Inf loss or gradient norm, or a loss spike), rollback (reload the last checkpoint and skip the offending batches) or stop (count events, stop at max_events).",
                         choices=("none", "skip", "rollback", "stop"))
    max_events: int = option(10, "Stop the run after this many guard events.", min=1)
    spike_threshold: float = option(6.0, "A loss is a spike when it exceeds the running median by more than this many robust deviations (MAD, at least 5% of the median).", min=0.0, min_exclusive=True)
    window: int = option(50, "Steps in the running median of the loss.", min=2)


@dataclass
class LoggingConfig:
    """Console, metrics.jsonl, TensorBoard and W&B."""

    log_interval: int = option(10, "Log metrics every N steps (the only host-device sync points).", min=1)
    progress: bool = option(True, "Show a progress bar (plain lines when not a terminal).")
    tensorboard: bool = option(True, "Write TensorBoard events into the run directory's tensorboard/ folder.")
    wandb: bool = option(False, "Log to Weights & Biases (needs `pip install wandb`).")
    wandb_project: str = option("slipstream", "W&B project name.")
    wandb_mode: str = option("offline", "W&B mode.", choices=("online", "offline"))
    rank_logs: bool = option(False, "Distributed runs: every rank also writes logs/rank<R>.jsonl (its own speed, data wait, loss, memory) to find slow or diverging ranks.")


@dataclass
class MetricsConfig:
    """How MFU is computed."""

    peak_tflops: float = option(0.0, "Device peak TFLOP/s for MFU; 0 = GPU table / measured CPU probe.", min=0.0)
    memory_breakdown: bool = option(True, "Measure one training step's memory by phase and category (at step 2) for the summary and metrics.jsonl.")
    comm_volume: bool = option(True, "Distributed runs: count the bytes every collective of one training step moves (step 2, with the memory breakdown), by mesh dim and kind, for the summary's `comm` next to the planner's prediction. Not under torch.compile.")
    memory_snapshot: bool = option(False, "CUDA: record an allocator snapshot of steps 2-3 into the run directory (for pytorch.org/memory_viz).")


@dataclass
class TuneConfig:
    """`slipstream tune hparams`: the search space, objective and study (training ignores this section)."""

    space: dict[str, Any] = option({}, "Search space: config key -> range, e.g. optim.lr = {log_uniform = [1e-4, 1e-2]}, optim.weight_decay = {uniform = [0.0, 0.2]}, train.micro_batch_size = {choices = [8, 16, 32]}, optim.warmup_steps = {int = [0, 100], step = 10}; a conditional one adds when = {\"optim.schedule\" = \"wsd\"} (sampled only when that key has that value). A grid sampler takes no when-parameters. Empty: optim.lr log-uniform over [max(lr / 10, optim.min_lr), lr x 10] and optim.weight_decay uniform over [0, 0.2].")
    objective: str = option("val_loss", "What a trial scores: val_loss (at the end, minimized), best_val_loss (lowest of the evaluations), tokens_per_s (maximized; the speed after the first logging interval), or val_loss,tokens_per_s (both: a multi-objective study with a Pareto front; no pruning).",
                            choices=("val_loss", "best_val_loss", "tokens_per_s", "val_loss,tokens_per_s"))
    sampler: str = option("tpe", "Optuna sampler: tpe, random, grid (every combination; float ranges take tune.grid_points values) or cmaes.", choices=("tpe", "random", "grid", "cmaes"))
    pruner: str = option("median", "Stop unpromising trials on the val loss they report at each evaluation: median, halving (successive halving), hyperband, or none.", choices=("median", "halving", "hyperband", "none"))
    prune_warmup_evals: int = option(1, "Evaluations a trial reports before the pruner may stop it (pruning starts at the next one; never at the trial's last step).", min=0)
    grid_points: int = option(3, "sampler = grid: values per float range (log-spaced for log ranges).", min=2)
    seed: int = option(0, "Seed of the sampler (trials' own training seed is train.seed).", min=0, max=2**32 - 1)
    study_name: str = option("", "Optuna study name; empty: the run name (run.name).")
    storage: str = option("", "Where the study lives: an SQLAlchemy URL (sqlite:///path/study.db, postgresql://...) or journal:PATH (Optuna's journal file, for file systems without SQLite locking). Empty: sqlite in the study folder. `--storage` overrides it.")
    dir: str = option("", "Study folder (the trials' run directories, the database, the results). Empty: runs/tune-<study name>.")


@dataclass
class ProfileConfig:
    """torch.profiler over a few training steps: chrome traces and a top-ops table."""

    enabled: bool = option(False, "Profile a window of training steps; writes the chrome trace `traces/rank<R>.json` into the run directory (open it at ui.perfetto.dev).")
    start_step: int = option(3, "First profiled step, counted from the first step this process runs; the steps before are wait and one warm-up step.", min=2)
    steps: int = option(3, "Profiled (active) steps.", min=1)
    record_shapes: bool = option(True, "Record operator input shapes.")
    profile_memory: bool = option(True, "Record tensor allocations and frees.")
    with_stack: bool = option(False, "Record Python stacks of operators (larger traces, more overhead).")
    memory_timeline: bool = option(False, "Also write `memory_timeline_rank<R>.json` into the run directory (memory by category over the profiled steps); implies record_shapes, profile_memory and with_stack.")
    nvtx: bool = option(False, "CUDA: also emit the slipstream/* ranges as NVTX ranges for Nsight Systems (error on other devices).")


@dataclass
class Config:
    """The whole resolved configuration of a run."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)


def sections() -> dict[str, type]:
    """Section name -> dataclass type, in declaration order."""
    return {f.name: f.default_factory().__class__ for f in dataclasses.fields(Config)}


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)
