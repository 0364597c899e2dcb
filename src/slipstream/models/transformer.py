"""One decoder-only transformer: GPT-2 and Llama-style variants from the same code.

GPT-2: learned positions, LayerNorm, GELU(tanh) MLP, biases, tied embeddings.
Llama:  RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no biases, untied head.
Others people trained, from the same switches: ALiBi (model.position = alibi) and a norm after
the embedding (model.embedding_norm) for BLOOM / MPT; partial rotary (model.rotary_fraction) and
the parallel block (model.parallel_block) for GPT-J / GPT-NeoX / Pythia / Falcon; a ReLU MLP
(model.mlp = relu) for OPT.
Speed-run switches (modded-nanogpt): ReLU² MLP (model.mlp = relu2), soft-capped logits
(model.logit_softcap) and zero-initialized output projections (model.zero_init_proj).

The model holds no parallelism, precision or checkpointing logic; those are applied from
outside. It is built on the meta device (no memory), then `materialize()` allocates it on
the target device and initializes every parameter deterministically from a seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from slipstream.config.schema import ModelConfig
from slipstream.errors import UserError
from slipstream.models.doc_mask import DocumentMask


def padded_vocab_size(cfg: ModelConfig) -> int:
    """Rows of the embedding/head: the vocabulary rounded up to `vocab_multiple`."""
    return math.ceil(cfg.vocab_size / cfg.vocab_multiple) * cfg.vocab_multiple


def kv_heads(cfg: ModelConfig) -> int:
    return cfg.n_kv_head or cfg.n_head


def mlp_hidden(cfg: ModelConfig) -> int:
    if cfg.d_ff:
        return cfg.d_ff
    if cfg.mlp in ("gelu", "relu2", "relu"):
        return 4 * cfg.d_model
    # SwiGLU has three matrices; 2/3 of 4*d keeps the parameter count of a GELU MLP.
    return math.ceil(int(8 * cfg.d_model / 3) / 64) * 64


def relu2(x: torch.Tensor) -> torch.Tensor:
    """ReLU squared (Primer). r * r, not square(): square runs as pow, which CUDA autocast computes
    in fp32 (twice the saved bytes); mul keeps the autocast dtype, and relu's output is the one
    tensor that relu's and mul's backward both keep."""
    r = F.relu(x)
    return r * r


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap) (Gemma 2): logits stay in (-cap, cap), nearly unchanged while small.
    cap <= 0: the logits unchanged. Elementwise, so a vocabulary shard can be capped on its own."""
    if cap <= 0:
        return logits
    return torch.tanh(logits / cap) * cap


def finish_logits(logits: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The output head's (..., padded vocab) result -> the logits every loss and sampler sees:
    soft-capped (model.logit_softcap), then the padded columns -inf. In this order: a capped -inf
    would be -cap, a probability the padded columns must not take."""
    logits = softcap(logits, cfg.logit_softcap)
    if logits.shape[-1] > cfg.vocab_size:
        # Padded rows are storage for faster matmuls, not tokens: they take no probability
        # (exp(-inf) = 0, no gradient). In place: neither linear's nor the cap's backward needs
        # this tensor (the cap's tanh keeps its own output).
        logits[..., cfg.vocab_size:] = float("-inf")
    return logits


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables in the "rotate half" layout used by Hugging Face Llama checkpoints."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotary_dims(cfg: ModelConfig) -> int:
    """How many of each head's dimensions RoPE rotates: the first head_dim x model.rotary_fraction,
    rounded to the nearest integer and then down to an even one (they rotate in pairs), at least
    2; the rest carry no position. GPT-NeoX: 128 x 0.25 = 32 of 128."""
    head_dim = cfg.d_model // cfg.n_head
    nearest = math.floor(head_dim * cfg.rotary_fraction + 0.5)
    return max(2, nearest - nearest % 2)


def model_rope_tables(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE tables (max_seq_len, rotary_dims): as wide as the rotated part of a head
    (its frequencies spread over that part, as GPT-NeoX computes them)."""
    return rope_tables(rotary_dims(cfg), cfg.max_seq_len, cfg.rope_theta, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dimensions of every head of x; a narrower table than the
    head (partial rotary, model.rotary_fraction < 1) leaves the other dimensions as they are."""
    width = cos.shape[-1]
    if width < x.shape[-1]:
        # Written into a tensor of x's memory layout, not torch.cat's contiguous one: q and k keep
        # their projection's (B, T, heads, D) order, as a full rotation keeps it, so the attention
        # output reaches o_proj as a view (a copy of it would be saved for backward, measured on CPU).
        out = torch.empty_like(x)
        out[..., :width] = apply_rope(x[..., :width], cos, sin)
        out[..., width:] = x[..., width:]
        return out
    half = width // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def alibi_slopes(n_head: int) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al. 2022, https://arxiv.org/abs/2108.12409, section 3):
    the geometric sequence 2^(-8/n), 2^(-16/n), ... for n heads. For n not a power of two, the
    slopes of the largest power of two c below n, then every other slope of 2c (2^(-8/2c),
    2^(-24/2c), ...) up to n: the paper's code and BLOOM's build_alibi_tensor / MPT's gen_slopes."""
    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    closest = 2 ** int(math.log2(n_head))
    slopes = geometric(closest)
    if closest < n_head:
        slopes += geometric(2 * closest)[0::2][: n_head - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """The (1, heads, T, T) additive attention bias of ALiBi with the causal mask in it: query i,
    key j <= i gets slope x (j - i) (0 on the diagonal, more negative with distance), a later key
    -inf. Built in the attention's dtype, once per forward, and shared by every layer (and by
    their saved tensors for backward): a per-layer cast would keep a copy per layer. 4-D on
    purpose: SDPA's fused kernels take 2-D or 4-D masks only and fall back to the MATH kernel
    (which keeps every layer's B x heads x T x T softmax) for a 3-D one."""
    index = torch.arange(seq_len, device=slopes.device)
    distance = (index[None, :] - index[:, None]).float()  # (T, T): j - i
    bias = slopes.float()[:, None, None] * distance
    return bias.masked_fill(distance > 0, float("-inf")).to(dtype).unsqueeze(0)


def attention_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the attention kernel sees for hidden states x: autocast's when it is on."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, kv_heads(cfg)
        self.head_dim = cfg.d_model // cfg.n_head
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * self.head_dim, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv_head * self.head_dim, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv_head * self.head_dim, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.n_head * self.head_dim, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout
        # Per-head RMSNorm of queries and keys (Qwen3, OLMo 2), before RoPE.
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        # The attention kernel, an attribute so a technique applied from outside can replace it
        # (context parallelism attends over the keys of every sequence shard).
        self.attend = F.scaled_dot_product_attention

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: DocumentMask | torch.Tensor | None = None) -> torch.Tensor:
        """mask: None (causal), a DocumentMask, or a float (heads, T, T) additive bias with the
        causal mask in it (ALiBi: alibi_bias)."""
        B, T, _ = x.shape
        # Heads from the projections' widths (-1), not the config: a tensor-parallel rank holds
        # n_head / tp of them (their ratio, hence GQA, is unchanged).
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # (T, rotary_dims) tables, or (B, 1, T, rotary_dims) of per-document positions
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        dropout_p, gqa = self.dropout if self.training else 0.0, self.n_kv_head != self.n_head
        if isinstance(mask, DocumentMask):
            if self.attend is not F.scaled_dot_product_attention:
                # A replaced kernel (context parallelism) knows only the causal mask.
                raise UserError("a document mask cannot go through a replaced attention kernel (context "
                                "parallelism); use data.packing = eos with parallel.cp > 1")
            y = mask.attend(q, k, v, dropout_p=dropout_p, enable_gqa=gqa)
        elif mask is not None:  # an additive bias that holds the causal mask (ALiBi)
            y = self.attend(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)
        else:
            y = self.attend(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or mlp_hidden(cfg)
        self.kind = cfg.mlp
        self.swiglu = cfg.mlp == "swiglu"
        self.up_proj = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.gate_proj = nn.Linear(cfg.d_model, hidden, bias=cfg.bias) if self.swiglu else None
        self.down_proj = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.kind == "relu2":
            return self.down_proj(relu2(self.up_proj(x)))
        if self.kind == "relu":
            return self.down_proj(F.relu(self.up_proj(x)))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        from slipstream.models.moe import MoE, is_moe_layer

        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MoE(cfg) if is_moe_layer(cfg, index) else MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        self.parallel = cfg.parallel_block

    def forward(self, x: torch.Tensor, rope, mask: DocumentMask | torch.Tensor | None = None) -> torch.Tensor:
        if self.parallel:  # GPT-J / GPT-NeoX: both read the block's input, one residual add
            attn = self.attn(self.attn_norm(x), rope=rope, mask=mask)
            return x + self.dropout(attn) + self.dropout(self.mlp(self.mlp_norm(x)))
        x = x + self.dropout(self.attn(self.attn_norm(x), rope=rope, mask=mask))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (resolve it from the data first)")
        self.cfg = cfg
        vocab = padded_vocab_size(cfg)
        self.tok_emb = nn.Embedding(vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.emb_norm = make_norm(cfg) if cfg.embedding_norm else None  # BLOOM's word_embeddings_layernorm
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.final_norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # Position buffers: non-persistent (derived from the config), recomputed by init_weights
        # after to_empty().
        register_position_buffers(self, cfg)
        # True when the head caps and masks its logits itself (a vocabulary-sharded head, per shard).
        self.logits_masked_by_head = False

    def forward(self, idx: torch.Tensor, return_hidden: bool = False, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | DocumentMask | None = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, padded vocab; soft-capped by model.logit_softcap, padded
        columns -inf); with return_hidden, the final normalized hidden states (B, T, d_model)
        instead, for a loss that applies the output head itself (the fused linear + cross-entropy
        never materializes all logits; it caps each chunk the same way).
        positions: the (T,) positions of the tokens in their sequence (default 0..T-1), e.g. for a
        piece of a longer sequence.
        doc_ids: the (B, T) document ids of packed rows (or a DocumentMask built from them):
        attention stays inside each document and positions restart at each (models/doc_mask.py).
        ALiBi (model.position = alibi) biases by the distance between two tokens of the row, which
        is their distance inside their document too; given positions leave it alone."""
        T = idx.shape[1]
        mask = None
        if doc_ids is not None:
            if positions is not None:
                raise UserError("doc_ids and positions are exclusive: a document mask sets the positions itself "
                                "(context parallelism does not carry document masks; use data.packing = eos)")
            if T > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
            mask = doc_ids if isinstance(doc_ids, DocumentMask) else DocumentMask(
                doc_ids, dropout=self.cfg.dropout if self.training else 0.0)
            positions = mask.positions
        given = positions
        if positions is None:
            if T > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
            positions = torch.arange(T, device=idx.device)
        x = embed(self, idx, positions)
        if self.alibi_slopes is not None:  # one bias for every layer (documents: inside the mask)
            dtype = attention_dtype(x)
            mask = mask.with_alibi(self.alibi_slopes, dtype) if mask is not None else \
                alibi_bias(self.alibi_slopes, T, dtype)
        rope = None
        if self.rope_cos is not None:  # the default positions are a slice (a view); given ones a gather
            where = slice(0, T) if given is None else given
            rope = (self.rope_cos[where], self.rope_sin[where])
            if rope[0].dim() == 3:  # per-row positions (B, T): one table per row, broadcast over heads
                rope = (rope[0][:, None], rope[1][:, None])
        for block in self.blocks:
            # Without a mask the call is the one it always was (compiled blocks' guards, wrappers).
            x = block(x, rope) if mask is None else block(x, rope, mask)
        x = self.final_norm(x)
        if return_hidden:
            return x
        logits = self.lm_head(x)
        return logits if self.logits_masked_by_head else finish_logits(logits, self.cfg)

    def head_weight(self) -> torch.Tensor:
        """The output head's rows of real tokens (a view: padded rows excluded)."""
        return self.lm_head.weight[: self.cfg.vocab_size]

    @torch.no_grad()
    def init_weights(self, seed: int, write: Callable[[torch.Tensor, torch.Tensor], Any] | None = None) -> None:
        """Deterministic init from `seed`, independent of the global RNG and of device.

        Parameters are drawn on CPU in name order from one generator, then copied, so the
        same seed gives the same weights on every device and world size. `write(param,
        full_values)` does the copy (default: param.copy_); a sharded parameter's writer
        keeps only its own shard, so one full parameter exists at a time, never the model.
        model.zero_init_proj: the residual output projections and an untied head are written as
        zeros (drawn all the same, so every other parameter is the one it is without the switch);
        a tied head is the embedding and keeps the embedding's init.
        """
        write = write or (lambda param, values: param.copy_(values))
        gen = torch.Generator(device="cpu").manual_seed(seed)
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layer)
        residual = ("o_proj.weight", "down_proj.weight", "experts.w_down")
        zeroed = residual if self.cfg.tie_embeddings else residual + ("lm_head.weight",)
        for name, param in self.named_parameters():
            if name.endswith(residual):
                values = torch.randn(param.shape, generator=gen) * residual_std
            elif name.endswith(".bias"):
                values = torch.zeros(param.shape)
            elif "norm" in name:
                values = torch.ones(param.shape)
            else:
                values = torch.randn(param.shape, generator=gen) * std
            if self.cfg.zero_init_proj and name.endswith(zeroed):
                # A zero projection still learns: its gradient is (its input)^T x (output gradient).
                values = torch.zeros(param.shape)
            write(param, values)
        for module in self.modules():  # derived state (MoE balancing bias and statistics) starts fresh
            if module is not self and hasattr(module, "reset_state"):
                module.reset_state()
        reset_position_buffers(self)


def register_position_buffers(module: nn.Module, cfg: ModelConfig, device=None) -> None:
    """The buffers a position encoding needs, on `module` (a Transformer or a pipeline stage):
    rope_cos / rope_sin (position = rope) and alibi_slopes (position = alibi), None otherwise.
    `alibi_heads` is which of the model's heads the module's attention computes (all of them;
    tensor parallelism keeps a rank's own, `keep_alibi_heads`)."""
    if cfg.position == "rope":
        cos, sin = model_rope_tables(cfg, device=device)
        module.register_buffer("rope_cos", cos, persistent=False)
        module.register_buffer("rope_sin", sin, persistent=False)
    else:
        module.rope_cos = module.rope_sin = None
    module.alibi_heads = slice(0, cfg.n_head)
    if cfg.position == "alibi":
        slopes = alibi_slopes(cfg.n_head)
        module.register_buffer("alibi_slopes", slopes if device is None else slopes.to(device), persistent=False)
    else:
        module.alibi_slopes = None


@torch.no_grad()
def reset_position_buffers(module: nn.Module) -> None:
    """Recompute the buffers of register_position_buffers in place (after to_empty())."""
    if module.rope_cos is not None:
        cos, sin = model_rope_tables(module.cfg, device=module.rope_cos.device)
        module.rope_cos.copy_(cos)
        module.rope_sin.copy_(sin)
    if module.alibi_slopes is not None:
        module.alibi_slopes.copy_(alibi_slopes(module.cfg.n_head)[module.alibi_heads])


def keep_alibi_heads(module: nn.Module, heads: slice) -> None:
    """The module's attention computes only the model's heads `heads` (a tensor-parallel rank's):
    its ALiBi slopes become theirs."""
    if module.alibi_slopes is None:
        return
    module.alibi_heads = heads
    module.alibi_slopes = alibi_slopes(module.cfg.n_head)[heads].to(module.alibi_slopes.device)


def embed(module: nn.Module, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Token ids -> the residual stream entering the first block: token embedding (+ learned
    positions), the embedding norm (model.embedding_norm), dropout. `module` is a Transformer or
    the first pipeline stage (the same submodules under the same names)."""
    x = module.tok_emb(idx)
    if module.pos_emb is not None:
        x = x + module.pos_emb(positions)
    if module.emb_norm is not None:
        x = module.emb_norm(x)
    return module.emb_dropout(x)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int = 0) -> Transformer:
    """Build on the meta device (no allocation), then materialize on `device` and init."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return materialize(model, device, seed)


def block_slots(model: nn.Module) -> list[tuple[int | str, nn.Module]]:
    """(key, block) for every block of `model.blocks`: a ModuleList (a whole model) or a ModuleDict
    keyed by each block's index in the whole model (a pipeline stage). `model.blocks[key] = m`
    replaces one (activation checkpointing wraps blocks so)."""
    blocks = model.blocks
    return list(blocks.items()) if isinstance(blocks, nn.ModuleDict) else list(enumerate(blocks))


def materialize(model: Transformer, device: str | torch.device, seed: int,
                write: Callable[[torch.Tensor, torch.Tensor], Any] | None = None) -> Transformer:
    model.to_empty(device=device)
    if model.cfg.tie_embeddings and model.lm_head.weight is not model.tok_emb.weight:
        model.lm_head.weight = model.tok_emb.weight  # to_empty() re-created the parameters: re-tie them
    model.init_weights(seed, write)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32 for stability under autocast) over the targets that are
    not -100; 0 when every target is -100 (see no_target_loss_is_zero)."""
    return no_target_loss_is_zero(F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1)),
                                  targets)


def no_target_loss_is_zero(loss: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """A batch whose targets are all ignored (a window inside a long fine-tuning prompt) has no loss:
    0 instead of the mean's 0 / 0 = NaN, which would stop the run ("loss became nan"). Its gradient
    is 0 either way. Without a host sync; a loss-parallel DTensor loss stays one (a scalar
    condition counts as replicated)."""
    has_target = (targets != ignore_index).any()
    return torch.where(has_target, loss, torch.zeros((), dtype=loss.dtype, device=targets.device))


@torch.inference_mode()
def generate(model: Transformer, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None,
             eot_id: int | None = None) -> torch.Tensor:
    """Sample continuations of `idx` (B, T). temperature 0 = greedy. Padded vocab rows are never sampled.
    `generator` must live on the model's device. eot_id: for a model trained with document packing
    (data.packing = document), a new document starts after each end-of-text token, as in training:
    attention stays inside it and positions restart (models/doc_mask.py)."""
    was_training = model.training
    model.eval()
    try:
        return _sample(model, idx, max_new_tokens, temperature, top_k, generator, eot_id)
    finally:
        model.train(was_training)


def _sample(model, idx, max_new_tokens, temperature, top_k, generator, eot_id=None):
    from slipstream.models.doc_mask import doc_ids_after

    vocab = model.cfg.vocab_size
    for _ in range(max_new_tokens):
        context = idx[:, -model.cfg.max_seq_len:]
        if eot_id is None:
            logits = model(context)[:, -1, :vocab].float()
        else:  # dense: the context grows by a token per call, a shape a compiled flex kernel would recompile for
            logits = model(context, doc_ids=DocumentMask(doc_ids_after(context, eot_id), kernel="dense"))
            logits = logits[:, -1, :vocab].float()
        if temperature <= 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, vocab)).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            next_id = torch.multinomial(probs, 1, generator=generator)
        idx = torch.cat([idx, next_id], dim=1)
    return idx
