"""Tensor, sequence and loss parallelism (Megatron-style) for slipstream transformers, on DTensor.

The `tp` dimension of the mesh splits every block's matmuls:

    attention   q/k/v column-parallel (each rank computes n_head/tp heads, GQA: n_kv_head/tp),
                o_proj row-parallel (partial sums reduced)
    MLP         up/gate column-parallel, down row-parallel (GELU and SwiGLU alike)
    embedding   vocab-parallel: each rank holds vocab/tp rows of the table (its norm,
                model.embedding_norm, works on the stream as the block norms do)
    ALiBi       each rank's bias uses the slopes of its own heads
    head        column-parallel over the vocabulary; with loss parallel the cross-entropy runs
                on the vocabulary shards (torch's loss_parallel) and the logits are never gathered

Sequence parallel (parallel.sequence_parallel): between the TP regions the residual stream,
the norms and the dropouts work on sequence shards (B, T/tp, d), so those activations are
1/tp per rank; each attention/MLP input is all-gathered along the sequence and each output
reduce-scattered back to it. Without it the stream is replicated and the row-parallel outputs
are all-reduced. Every collective is DTensor's (parallelize_module's styles): none is written here.

Every parameter becomes a DTensor on the tp mesh: sharded ones as above, the rest (norms, and
learned positions) replicated, so gradient clipping, FSDP on the data-parallel dims and
checkpoints see one kind of tensor. Tied embeddings (GPT-2) stay tied: the table and the head
are sharded the same way (rows = vocabulary) and the head takes the table's DTensor.

A user model (any nn.Module) supplies its own plan: a method

    def tensor_parallel_plan(self, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]

mapping module paths ("layers.*.attn.q_proj" wildcards as parallelize_module reads them) to
torch's styles, applied over the tp mesh with parallelize_module. Every parameter must end up a
DTensor on that mesh (`ReplicateParallel()` from this module for the ones that stay whole).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from typing import Any

import torch
import torch.nn as nn

from slipstream.config.schema import Config
from slipstream.errors import UserError


def __getattr__(name: str):
    # ReplicateParallel is public (user plans need it) but built lazily: importing
    # torch.distributed.tensor costs ~0.4 s that a run without tp should not pay.
    if name == "ReplicateParallel":
        return _styles()[6]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _styles():
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class ReplicateParallel(ParallelStyle):
        """A module whose parameters are replicated over tp and whose input and output are
        replicated local tensors (a norm without sequence parallel): its parameters become
        Replicate DTensors, its input a Replicate DTensor for the computation, its output local."""

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            for name, param in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [Replicate()],
                                                                               src_data_rank=None)))

            def wrap_input(mod, inputs):
                from torch.distributed.tensor import DTensor

                return tuple(DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                             if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

            def local_output(mod, inputs, output):
                return output.to_local() if hasattr(output, "to_local") else output

            module.register_forward_pre_hook(wrap_input)
            module.register_forward_hook(local_output)
            return module

    class VocabParallelHead(ColwiseParallel):
        """The output head, column-parallel over the (padded) vocabulary. Its local logits are the
        rank's vocabulary shard; they are soft-capped (model.logit_softcap: elementwise, so each
        shard on its own) and then the padded columns in that shard get -inf before the logits
        leave, as Transformer.forward does for a whole head (they are storage, not tokens)."""

        def __init__(self, vocab: int, padded_vocab: int, softcap: float = 0.0, **kwargs: Any):
            super().__init__(**kwargs)
            self.vocab, self.padded_vocab, self.softcap = vocab, padded_vocab, softcap

        def _prepare_output_fn(self, output_layouts, use_local_output, mod, outputs, device_mesh):
            from slipstream.models.transformer import softcap

            outputs = softcap(outputs, self.softcap)  # a Shard(-1) DTensor in, the same out
            if self.padded_vocab > self.vocab:
                per_rank = self.padded_vocab // device_mesh.size()
                first = device_mesh.get_local_rank() * per_rank
                pad_from = max(0, self.vocab - first)
                if pad_from < per_rank:
                    # outputs is this rank's Shard(-1) DTensor; its local tensor is written in place,
                    # unseen by autograd, which is exact: neither linear's nor the cap's backward needs
                    # this output, and the gradient of a -inf logit is softmax = 0 (as in the model).
                    outputs._local_tensor[..., pad_from:] = float("-inf")
            return super()._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)

    return (Replicate, Shard, ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput,
            ReplicateParallel, VocabParallelHead)


def check_tensor_parallel(cfg: Config, tp: int) -> None:
    """Refuse run settings tensor parallelism does not support (before any work starts). The
    model's own shapes are checked by `check_model_splits` (the LM job: before it starts; a
    slipstream model given to the Trainer: when it is split)."""
    if tp <= 1:
        return
    if cfg.parallel.sequence_parallel and cfg.train.seq_len % tp:
        raise UserError(f"parallel.sequence_parallel splits the sequence over tp = {tp} ranks: train.seq_len = "
                        f"{cfg.train.seq_len} must be divisible by {tp}")
    if cfg.train.fused_loss:
        raise UserError("train.fused_loss applies the whole output head in one op; with parallel.tp > 1 the head "
                        "is vocabulary-sharded: use --parallel.loss_parallel=true (the cross-entropy runs on the "
                        "shards, logits never gathered) and --train.fused_loss=false")
    if cfg.model.dropout > 0 and cfg.compile.scope != "off":
        # Measured on torch 2.13 (CPU): the per-rank dropout streams (distributed.sharded_dropout)
        # break a compiled block's graph at every hooked module, and an activation-checkpointed
        # block then runs wholly in eager: compile would be silently lost.
        raise UserError(f"model.dropout > 0 with compile.scope = {cfg.compile.scope} and parallel.tp > 1 is not "
                        "supported yet (the per-rank dropout streams cannot be traced); set --compile.scope=off "
                        "or --model.dropout=0")
    if cfg.activations.checkpointing == "full" and cfg.compile.scope != "off":
        # Measured on torch 2.13 (CPU): a compiled block under full checkpointing saves the
        # DTensor's DeviceMesh among its tensors and AOT autograd asserts in forward (GPT-2 and
        # RoPE models alike); selective checkpointing compiles and trains exactly.
        raise UserError(f"activations.checkpointing = full with compile.scope = {cfg.compile.scope} and "
                        "parallel.tp > 1 is not supported yet (torch 2.13 cannot save a compiled tensor-parallel "
                        "block's mesh for recomputation); use --activations.checkpointing=selective or "
                        "--compile.scope=off")
    if cfg.activations.checkpointing == "offload":
        # On CUDA the saved tensors are copied to pinned host memory with plain tensor ops, which
        # DTensors refuse (mixed torch.Tensor and DTensor).
        raise UserError("activations.checkpointing = offload with parallel.tp > 1 is not supported yet; use full "
                        "or selective")


def check_model_splits(m, tp: int) -> None:
    """Refuse a slipstream model config (ModelConfig `m`) whose heads, MLP or vocabulary tp
    cannot split evenly; the messages list the valid degrees."""
    if tp <= 1:
        return
    from slipstream.models.transformer import kv_heads, mlp_hidden, padded_vocab_size

    valid = lambda n: ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)  # noqa: E731
    if m.n_head % tp:
        raise UserError(f"parallel.tp = {tp} must divide model.n_head = {m.n_head} (each rank computes whole "
                        f"heads); valid degrees: {valid(m.n_head)}")
    if kv_heads(m) % tp:
        raise UserError(f"parallel.tp = {tp} must divide the key/value heads (model.n_kv_head = {kv_heads(m)}); "
                        f"valid degrees: {valid(kv_heads(m))}")
    if mlp_hidden(m) % tp:
        raise UserError(f"parallel.tp = {tp} must divide the MLP width {mlp_hidden(m)}; valid degrees: "
                        f"{valid(mlp_hidden(m))}")
    if m.vocab_size > 0 and padded_vocab_size(m) % tp:
        raise UserError(f"parallel.tp = {tp} must divide the padded vocabulary {padded_vocab_size(m)}; set "
                        f"model.vocab_multiple to a multiple of {tp} (e.g. {64 * tp})")


def apply_tensor_parallel(model: nn.Module, tp_mesh, cfg: Config) -> nn.Module:
    """Split a slipstream Transformer (or a user model with a plan) over `tp_mesh`, in place (see
    the module doc)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from slipstream.distributed.pipeline_stages import TransformerStage
    from slipstream.models.moe import MoE
    from slipstream.models.transformer import Transformer, block_slots, keep_alibi_heads, padded_vocab_size

    if not isinstance(model, (Transformer, TransformerStage)):
        return apply_user_plan(model, tp_mesh, cfg)
    # A pipeline stage holds some blocks, the embedding only if it is the first stage, the
    # final norm and head only if it is the last: the plan splits what the module holds.
    has_embedding, has_head = hasattr(model, "tok_emb"), hasattr(model, "lm_head")
    (Replicate, Shard, ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput,
     ReplicateParallel, VocabParallelHead) = _styles()
    Colwise, Rowwise, PrepareInput, input_kwargs = _block_linear_styles(model, tp_mesh.size())
    sp, loss_parallel = cfg.parallel.sequence_parallel, cfg.parallel.loss_parallel
    stream = Shard(1) if sp else Replicate()  # the residual stream between the TP regions
    norm = SequenceParallel if sp else ReplicateParallel

    plan: dict[str, Any] = {}
    if has_embedding:
        # Vocabulary-parallel table: each rank looks up its rows, the partial sums are reduced
        # (reduce-scattered along the sequence with SP, all-reduced without).
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if has_head:
        plan["final_norm"] = norm()
        plan["lm_head"] = VocabParallelHead(model.cfg.vocab_size, padded_vocab_size(model.cfg),
                                            softcap=model.cfg.logit_softcap, input_layouts=stream,
                                            output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                            use_local_output=not loss_parallel)
    if has_embedding and model.pos_emb is not None:
        # The position table split by position: with SP each rank then adds the positions of
        # its own sequence shard (dim 0 of the (T, d) output is the sequence).
        plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0) if sp else Replicate())
    if has_embedding and model.emb_norm is not None:
        # The embedding norm (model.embedding_norm) works on the stream like the block norms:
        # sequence shards with SP, whole without; its output is the residual stream the first
        # block adds to, a local tensor like the row-parallel outputs it meets there.
        plan["emb_norm"] = SequenceParallel(use_local_output=True) if sp else ReplicateParallel()
    if plan:
        parallelize_module(model, tp_mesh, plan)
    for _, block in block_slots(model):
        parallelize_module(block, tp_mesh, {
            "attn_norm": norm(),
            # The block's input arrives on sequence shards (SP) and is gathered for the matmuls
            # (in fp8 with precision.fp8: cast first, then all-gathered, half the bytes of bf16).
            # (The RoPE tables come as a keyword, untouched: a tuple given layout None as a
            # positional input breaks the backward of a compiled block.)
            "attn": PrepareInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),),
                                 **input_kwargs("q_proj")),
            "attn.q_proj": Colwise(),
            "attn.k_proj": Colwise(),
            "attn.v_proj": Colwise(),
            "attn.o_proj": Rowwise(output_layouts=stream),
            "mlp_norm": norm(),
            **(_moe_styles(stream) if isinstance(block.mlp, MoE) else {
                "mlp": PrepareInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),),
                                    **input_kwargs("up_proj")),
                "mlp.up_proj": Colwise(),
                "mlp.down_proj": Rowwise(output_layouts=stream),
                **({"mlp.gate_proj": Colwise()} if block.mlp.gate_proj is not None else {}),
            }),
        })
    # The embedding's output is to_local()'s view of a DTensor's local tensor. A compiled block
    # that takes such a view as its input hands backward a plain-tensor gradient where DTensor's
    # redistribute needs a DTensor (torch 2.13, AttributeError '_local_tensor'), so the stream
    # starts as a tensor of its own: one copy of (B, T, d) per step, exact.
    if has_embedding:
        model.tok_emb.register_forward_hook(lambda module, args, output: output.clone())
    if model.cfg.tie_embeddings and has_embedding and has_head and isinstance(model, Transformer):
        # parallelize_module gave the head its own copy of the shared table: share the table's again.
        # (A pipeline stage's head keeps a copy of its own: distributed/pipeline_parallel.py.)
        model.lm_head.weight = model.tok_emb.weight
    if model.alibi_slopes is not None:
        # ALiBi: this rank computes heads [rank x n_head/tp, (rank + 1) x n_head/tp) (the column-parallel
        # q/k/v hold them in order): its bias takes their slopes.
        local_heads = model.cfg.n_head // tp_mesh.size()
        first = tp_mesh.get_local_rank() * local_heads
        keep_alibi_heads(model, slice(first, first + local_heads))
    model.logits_masked_by_head = True  # VocabParallelHead caps each shard and masks its padded columns
    # How many pieces the residual stream is cut into along the sequence (a pipeline stage that
    # receives the stream rebuilds the full length for its RoPE tables from it).
    model.stream_shards = tp_mesh.size() if sp else 1
    if sp and has_embedding:
        tp = tp_mesh.size()

        def check_sequence(module, args):
            if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2 and args[0].shape[1] % tp:
                raise UserError(f"parallel.sequence_parallel splits every sequence over tp = {tp} ranks; this batch "
                                f"has length {args[0].shape[1]}. Feed sequences whose length is divisible by {tp} "
                                "(train.seq_len) or set --parallel.sequence_parallel=false")

        # Before any collective: an uneven split would otherwise abort inside the all-gather.
        model.register_forward_pre_hook(check_sequence)
    from slipstream.distributed.sharded_dropout import shard_dropout_rng

    # Dropout: the same masks on the replicated stream, a mask per rank on heads (and SP's shards).
    shard_dropout_rng(model, tp_mesh, stream_sharded=sp)
    return model



def _moe_styles(stream) -> dict[str, Any]:
    """An MoE layer is not split over tp (its experts split over ep instead): every tp rank runs it
    on the whole (gathered) sequence of its batch, as plain tensors, and keeps its own shard of
    the result (Replicate -> Shard(1) is a local slice; its backward gathers the gradient). Its
    weights stay plain tensors with full, equal gradients on every tp rank."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    return {"mlp": PrepareModuleInputOutput(input_layouts=(stream,), desired_input_layouts=(Replicate(),),
                                            use_local_input=True, output_layouts=(Replicate(),),
                                            desired_output_layouts=(stream,), use_local_output=True)}


def _block_linear_styles(model: nn.Module, tp: int):
    """(column-parallel, row-parallel, input-preparing style, its extra kwargs by first linear)
    for the blocks' linears: torch's, or torchao's float8 ones when precision.fp8 turned the
    linears into Float8Linear (chain order: fp8 before tp), which all-gather in fp8."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    linears = {name: mod for name, mod in model.blocks.named_modules() if isinstance(mod, nn.Linear)}
    float8 = {name for name, mod in linears.items() if type(mod).__name__ == "Float8Linear"}
    if not float8:
        return ColwiseParallel, RowwiseParallel, PrepareModuleInput, lambda first: {}
    if len(float8) < len(linears):
        # A block half in fp8 cannot take one fp8 input for all of its projections.
        from slipstream.models.transformer import kv_heads, mlp_hidden

        m = model.cfg
        raise UserError(f"precision.fp8 with parallel.tp = {tp}: each rank's shard of every block linear must be "
                        f"fp8-sized (a multiple of 16), so d_model ({m.d_model}), the key/value width "
                        f"({kv_heads(m) * (m.d_model // m.n_head)}) and the MLP width ({mlp_hidden(m)}) must be "
                        f"multiples of 16 x tp = {16 * tp}; not fp8: {', '.join(sorted(set(linears) - float8)[:4])}")
    from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                       PrepareFloat8ModuleInput)

    # The input cast takes its fp8 settings from the module's first projection.
    return (Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput,
            lambda first: {"fwd_config_submodule_fqn": first})


def apply_user_plan(model: nn.Module, tp_mesh, cfg: Config) -> nn.Module:
    """Split a user model by its own `tensor_parallel_plan` (see the module doc)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.distributed.tensor.parallel.style import ParallelStyle

    name = type(model).__name__
    make_plan = getattr(model, "tensor_parallel_plan", None)
    if not callable(make_plan):
        raise UserError(f"parallel.tp > 1 needs a tensor-parallel plan for {name}: define a method "
                        "`tensor_parallel_plan(self, sequence_parallel, loss_parallel)` returning {module path: "
                        "torch.distributed.tensor.parallel style} (README: Tensor and context parallelism), or "
                        "run with --parallel.tp=1")
    plan = make_plan(sequence_parallel=cfg.parallel.sequence_parallel, loss_parallel=cfg.parallel.loss_parallel)
    if not isinstance(plan, dict) or not plan:
        raise UserError(f"{name}.tensor_parallel_plan() returned {type(plan).__name__}; it must return a non-empty "
                        "dict {module path: ParallelStyle}")
    paths = [path for path, _ in model.named_modules()]
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise UserError(f"{name}.tensor_parallel_plan()[{key!r}] is {type(style).__name__}, not a ParallelStyle "
                            "(ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, "
                            "slipstream's ReplicateParallel, ...)")
        # parallelize_module only warns about a path that matches nothing: a typo would leave a
        # layer whole and silently replicated. "" is the model itself.
        if not isinstance(key, str) or not any(fnmatch.fnmatchcase(path, key) for path in paths):
            raise UserError(f"{name}.tensor_parallel_plan() names {key!r}, which is no module of the model; "
                            f"its modules are: {', '.join(p for p in paths if p) or '(none)'}")
    parallelize_module(model, tp_mesh, plan)
    whole = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if whole:
        # A plain parameter next to DTensors fails later inside an op (mixed torch.Tensor and
        # DTensor) or, worse, trains on one rank's gradient only: refuse it here.
        raise UserError(f"{name}.tensor_parallel_plan() leaves {len(whole)} parameter(s) outside the tp mesh: "
                        f"{', '.join(whole[:8])}{' ...' if len(whole) > 8 else ''}. Give their modules a style; "
                        "for ones that stay whole use slipstream.distributed.tensor_parallel.ReplicateParallel()")
    return model


def enable_async_tp(tp_mesh) -> None:
    """parallel.async_tp (CUDA): let Inductor micro-pipeline the tp collectives of the compiled
    graphs (each all-gather -> matmul and matmul -> reduce-scatter becomes a chunked loop that
    overlaps the transfer of one chunk with the matmul of another, over symmetric memory)."""
    import warnings

    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory

    inductor_config._micro_pipeline_tp = True
    with warnings.catch_warnings():
        # Newer torch (2.13 here) sets symmetric memory up by itself and deprecates this call; older needs it.
        warnings.simplefilter("ignore", FutureWarning)
        _symmetric_memory.enable_symm_mem_for_group(tp_mesh.get_group().group_name)


class LossParallel:
    """A re-enterable context for the forward and backward of one micro-batch: torch's
    loss_parallel() (cross-entropy on vocabulary-sharded logits) when enabled, else nothing.
    `inside`: another re-enterable context entered first (the evaluator's autocast)."""

    def __init__(self, enabled: bool, inside: Any = None):
        self.enabled, self.inside = enabled, inside
        self._stack: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        if self.inside is not None:
            stack.enter_context(self.inside)
        if self.enabled:
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        self._stack.append(stack)

    def __exit__(self, *exc) -> None:
        self._stack.pop().__exit__(*exc)
