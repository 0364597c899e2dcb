"""Pipeline stages: a slipstream Transformer cut into pieces, and which pp rank holds which.

    split_layers         which blocks each stage holds (balanced by cost, or the user's split)
    stage_indices        which stages a pp rank holds (loop placement, or V for zbv / dualpipev)
    TransformerStage     the module of one stage, holding the model's own submodules by their names
    build_stage_modules  the stage modules of one rank, initialized exactly as one process would

The model code (models/transformer.py) knows nothing of this: a stage holds the original
submodules under their original names (`tok_emb`, `blocks.3`, `lm_head`), so the parameter names
of every stage are those of the unsplit model and checkpoints match across pp degrees. The
schedules that run the stages are in distributed/pipeline_parallel.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from slipstream.config.schema import ModelConfig
from slipstream.errors import UserError
from slipstream.models.transformer import (Transformer, alibi_bias, attention_dtype, embed, finish_logits,
                                           register_position_buffers, reset_position_buffers)
from slipstream.plan.stages import StageCosts, split_layers, stage_costs  # noqa: F401  (re-exported)

# parallel.pp_schedule -> the class in torch.distributed.pipelining.schedules
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
ONE_STAGE_PER_RANK = ("gpipe", "1f1b")  # torch's PipelineScheduleSingle
V_SHAPED = ("zbv", "dualpipev")         # exactly 2 stages per rank: rank r holds r and 2*pp-1-r


# --- 1. which layers each stage holds: plan/stages.py (shared with the planner) -------------

# --- 2. which stages a rank holds ----------------------------------------------------------------

def check_schedule(name: str, virtual_stages: int) -> None:
    if name not in SCHEDULES:
        raise UserError(f"parallel.pp_schedule = {name!r} is not a pipeline schedule; "
                        f"valid: {', '.join(SCHEDULES)}")
    import torch.distributed.pipelining.schedules as schedules

    if not hasattr(schedules, SCHEDULES[name]):
        raise UserError(f"parallel.pp_schedule = {name!r} needs torch's {SCHEDULES[name]}, which torch "
                        f"{torch.__version__} lacks; upgrade torch or pick another schedule")
    if name in ONE_STAGE_PER_RANK and virtual_stages != 1:
        raise UserError(f"parallel.pp_schedule = {name!r} runs exactly 1 stage per rank, got "
                        f"parallel.pp_virtual_stages = {virtual_stages}; set it to 1 or use interleaved-1f1b")
    if name in V_SHAPED and virtual_stages != 2:
        raise UserError(f"parallel.pp_schedule = {name!r} runs exactly 2 stages per rank (a V), got "
                        f"parallel.pp_virtual_stages = {virtual_stages}; set it to 2")
    if virtual_stages < 1:
        raise UserError(f"parallel.pp_virtual_stages = {virtual_stages}: need at least 1")


def stage_indices(schedule: str, pp_rank: int, pp_size: int, virtual_stages: int) -> list[int]:
    """The global stage indices of `pp_rank`, in the order its schedule expects them (plan/stages.py)."""
    from slipstream.plan import stages

    check_schedule(schedule, virtual_stages)
    return stages.stage_indices(schedule, pp_rank, pp_size, virtual_stages)


def stage_rank(schedule: str, stage: int, pp_size: int) -> int:
    """The pp rank holding global stage `stage`."""
    if schedule in V_SHAPED:
        return stage if stage < pp_size else 2 * pp_size - 1 - stage
    return stage % pp_size


# --- 3. the stage module ---------------------------------------------------------------------------

class TransformerStage(nn.Module):
    """The part of a Transformer one pipeline stage runs, holding the model's own submodules under
    their own names: `tok_emb`/`pos_emb`/`emb_norm` on the first stage, `blocks.<original index>`, `final_norm`
    and `lm_head` on the last. Its forward is Transformer.forward's part: token ids -> hidden states
    on the first stage, hidden -> hidden in the middle, hidden -> logits (soft-capped, padded columns -inf) on
    the last."""

    def __init__(self, model: Transformer, layers: range, is_first: bool, is_last: bool):
        super().__init__()
        self.cfg = model.cfg
        self.is_first, self.is_last = is_first, is_last
        self.stream_shards = 1                # set by tensor parallelism with sequence parallel
        self.logits_masked_by_head = False    # set by tensor parallelism (its head caps and masks each shard)
        self.layers = layers
        if is_first:
            self.tok_emb = model.tok_emb
            self.pos_emb = model.pos_emb
            self.emb_norm = model.emb_norm
            self.emb_dropout = model.emb_dropout
        # Keyed by the block's index in the unsplit model: the names stay `blocks.3.attn...`.
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if is_last:
            self.final_norm = model.final_norm
            self.lm_head = model.lm_head
        # Every stage's blocks need the position buffers (RoPE tables, ALiBi slopes): derived from
        # the config, not saved; recomputed by init_stage_buffers. On the model's device: meta
        # for a model not yet materialized.
        register_position_buffers(self, model.cfg, device=model.tok_emb.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The full sequence length (the RoPE tables' rows): a later stage's input is the residual
        # stream, cut along the sequence into stream_shards pieces under sequence parallelism.
        T = x.shape[1] * (1 if self.is_first else self.stream_shards)
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
        if self.is_first:  # x: token ids (B, T)
            x = embed(self, x, torch.arange(T, device=x.device))
        rope = None if self.rope_cos is None else (self.rope_cos[:T], self.rope_sin[:T])
        # ALiBi: as Transformer.forward, one bias (over the full sequence) for every block of the stage.
        bias = None if self.alibi_slopes is None else alibi_bias(self.alibi_slopes, T, attention_dtype(x))
        for block in self.blocks.values():  # insertion order = ascending layer index
            x = block(x, rope) if bias is None else block(x, rope, bias)
        if not self.is_last:
            return x
        logits = self.lm_head(self.final_norm(x))
        # As Transformer.forward: model.logit_softcap, then the padded vocabulary rows take no probability.
        return logits if self.logits_masked_by_head else finish_logits(logits, self.cfg)

    @torch.no_grad()
    def init_stage_buffers(self, fresh: bool = True) -> None:
        """fresh: a stage allocated from the meta device (its MoE balancing bias and statistics start
        fresh); a stage of a model with real weights keeps its bias."""
        for module in self.modules():
            if fresh and module is not self and hasattr(module, "reset_state"):
                module.reset_state()
        reset_position_buffers(self)


def build_stage_modules(cfg: ModelConfig, stages: list[int], splits: list[range],
                        device: str | torch.device = "cpu", seed: int = 0) -> list[TransformerStage]:
    """The stage modules for the global stage indices `stages` (of len(splits) stages), each with
    exactly the weights build_model(cfg, seed=seed) gives one process."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return split_stages(model, stages, splits, device, seed)


def split_stages(model: Transformer, stages: list[int], splits: list[range],
                 device: str | torch.device = "cpu", seed: int = 0) -> list[TransformerStage]:
    """This rank's stage modules (global indices `stages` of len(splits)) cut out of `model`.

    A model on the meta device (no memory) is initialized as one process would: its own
    init_weights runs on meta - it draws every parameter in name order from one generator - and
    each stage keeps only the values of its own parameters. A model with real weights keeps them.
    A tied head gets the embedding's values in a parameter of its own (see the module doc)."""
    if not any(p.is_meta for p in model.parameters()):
        return _split_real(model, stages, splits, device)
    n_stages = len(splits)
    modules = [TransformerStage(model, splits[s], s == 0, s == n_stages - 1) for s in stages]

    # id of a (meta) parameter of the full model -> the (stage, name) slots that want its values
    wanted: dict[int, list[tuple[int, str]]] = {}
    for i, module in enumerate(modules):
        for name, param in module.named_parameters(remove_duplicate=False):
            wanted.setdefault(id(param), []).append((i, name))
    values: dict[tuple[int, str], torch.Tensor] = {}

    def keep(param: torch.Tensor, full_values: torch.Tensor) -> None:
        for slot in wanted.get(id(param), ()):
            values[slot] = full_values

    model.init_weights(seed, write=keep)  # every parameter is meta: nothing is written, only drawn

    for module in modules:
        # Allocates this stage's parameters only; a tied head's table becomes a parameter of its own.
        module.to_empty(device=device)
    with torch.no_grad():
        for i, module in enumerate(modules):
            for name, param in module.named_parameters(remove_duplicate=False):
                param.copy_(values[(i, name)])
            module.init_stage_buffers()
    return modules


def _split_real(model: Transformer, stages: list[int], splits: list[range],
                device: str | torch.device) -> list[TransformerStage]:
    """Stages of a model that already holds its weights: they keep them (a tied head gets a copy of
    the table in a parameter of its own)."""
    n_stages = len(splits)
    modules = [TransformerStage(model, splits[s], s == 0, s == n_stages - 1) for s in stages]
    for module in modules:
        if module.is_last and model.cfg.tie_embeddings:
            module.lm_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
        module.to(device)
        module.init_stage_buffers(fresh=False)
    return modules


def named_parameters(modules: list[TransformerStage]) -> dict[str, nn.Parameter]:
    """The unique parameters of a rank's stages by their unsplit names (a weight shared by two
    stages of the rank, the V schedules' tied embedding, once, under its first name)."""
    out: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for module in modules:
        for name, param in module.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                out[name] = param
    return out
