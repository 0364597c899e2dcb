"""What a plan is made of: the model to train, the work, and one parallel layout (a Strategy).

A Strategy is everything the memory and time models need to know about how a step runs
on the cluster. `not_runnable()` says why slipstream cannot run it today (empty: it can); the
planner still plans the layouts it cannot run (the combinations the trainer refuses), and
flags them, so that a user sees what they would buy.

Pipeline schedules carry the trainer's names (parallel.pp_schedule); a pipeline micro-batch of
Strategy(micro_batch=mb, grad_accum=m) is the config's train.micro_batch_size=mb,
train.grad_accum_steps=m, parallel.pp_microbatches=m (the pipeline splits the mb x m sequences
of a data-parallel rank into m micro-batches).

A layout is written as its label, e.g. "zero1:8 tp4+sp pp12:1f1b mb2x16 ac:full": `Strategy.label()`
prints it (the table's layout column) and `parse_layout` reads it back (`slipstream plan --layout`),
exact inverses for every layout the search proposes (LAYOUT_SYNTAX lists the tokens).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from slipstream.config.dims import PP_ONE_STAGE, PP_SPLIT_BACKWARD, PP_V_SHAPED, SHARDED
from slipstream.config.dims import pp_layers as configured_pp_layers
from slipstream.config.schema import ModelConfig, ParallelConfig
from slipstream.errors import UserError

DP_STRATEGIES = ("none", "ddp", "zero1", "zero2", "fsdp", "hsdp")
# The strategies that run as FSDP2 (low precision through FSDP mixed precision): config.dims.SHARDED.
FSDP_FAMILY = SHARDED
# How much each data-parallel strategy shards: (optimizer state, gradients, parameters).
# zero2 runs as FSDP2 without resharding after forward: the parameters' storage is sharded,
# and a gathered copy lives from the forward until each block's backward (plan/memory.py).
SHARDS = {
    "none": (False, False, False),
    "ddp": (False, False, False),
    "zero1": (True, False, False),
    "zero2": (True, True, True),
    "fsdp": (True, True, True),
    "hsdp": (True, True, True),
}
# The schedules the trainer runs (parallel.pp_schedule's choices) -> the stages per pipeline rank
# each runs by default (parallel.pp_virtual_stages = 0, as config.dims.virtual_stages reads it).
SCHEDULE_VIRTUAL = {name: 1 if name in PP_ONE_STAGE else 2
                    for f in dataclasses.fields(ParallelConfig) if f.name == "pp_schedule"
                    for name in f.metadata["choices"]}
# Deferred weight gradients fill the warm-up and cool-down (plan/timing.pipeline_bubble).
ZERO_BUBBLE_SCHEDULES = ("interleaved-zero-bubble", "zbv", "dualpipev")
# Schedules torch cuts into rounds of m // pp micro-batches: m must be a multiple of the round count.
ROUND_SCHEDULES = ("interleaved-1f1b", "interleaved-zero-bubble")
# The planner's short names (`slipstream plan --pp-schedule`), accepted anywhere a schedule is.
SCHEDULE_ALIASES = {"interleaved": "interleaved-1f1b", "zero-bubble": "zbv"}
PP_SCHEDULES = (*SCHEDULE_VIRTUAL, *SCHEDULE_ALIASES)
AC_MODES = ("none", "selective", "full")
DEFAULT_LOSS_CHUNK = 4096  # the planner's fused-loss chunk (tokens per chunk of the linear + cross-entropy)
# How attention is computed (a planner input, `--attention`): flash (fused kernel, the T x T scores
# never reach memory; backward recomputes them: FlashAttention, torch SDPA, what slipstream runs),
# efficient (memory-efficient fused kernel: the same memory, a slower kernel) or materialized (the
# scores and softmax written out and kept for backward: pre-2022 stacks, Megatron's unfused softmax).
ATTENTION_IMPLEMENTATIONS = ("flash", "efficient", "materialized")
PRECISIONS = ("fp32", "bf16", "fp16")
# What slipstream runs today; the rest is planned and flagged. Tensor parallelism runs at any
# degree the model divides (the search only proposes those), with dp_strategy none, fsdp or hsdp.
TP_DP_STRATEGIES = ("none", "fsdp", "hsdp")
# Context parallelism runs when the cp ranks average gradients with the data-parallel ones.
CP_DP_STRATEGIES = ("ddp", "fsdp", "hsdp")
# Pipeline parallelism runs with these over the data-parallel ranks; not with cp, nor (yet) with
# tp: config.dims.check_compatibility refuses pp x tp until the trainer composes them (issue 14).
PP_DP_STRATEGIES = ("none", "ddp", "fsdp", "hsdp")
# Expert parallelism (distributed/expert_parallel.py) runs over the data-parallel ranks: the ranks
# that hold the same experts are averaged by FSDP (fsdp, hsdp, zero2: sharded over the dp / ep of
# them); DDP only where no two ranks hold the same experts (ep = dp); not with zero1, nor with cp.
EP_DP_STRATEGIES = ("ddp", "zero2", "fsdp", "hsdp")


def schedule_name(name: str) -> str:
    """The trainer's name of a pipeline schedule (a planner alias resolved), or a UserError."""
    name = SCHEDULE_ALIASES.get(name, name)
    if name not in SCHEDULE_VIRTUAL:
        raise UserError(f"unknown pipeline schedule {name!r}; valid: {', '.join(PP_SCHEDULES)}")
    return name


@dataclass(frozen=True)
class PlanModel:
    """The model a plan is for: a transformer config (mixture of experts: its model.moe_* fields),
    or a traced user module."""

    name: str
    cfg: ModelConfig
    # A user nn.Module measured on fake tensors (see plan/trace.py); None for transformer configs.
    traced: object | None = None

    @property
    def moe(self) -> bool:
        """Whether the model has routed experts (cfg.moe_experts > 0; plan/experts.py sizes them)."""
        return self.traced is None and self.cfg.moe_experts > 0


@dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch: int          # sequences per optimizer step, over all data-parallel ranks
    tokens: float = 0.0        # tokens to train (for cost and wall time); 0 = unknown

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.global_batch < 1:
            raise UserError(f"sequence length and global batch must be >= 1, got seq {self.seq_len}, "
                            f"global batch {self.global_batch}")


@dataclass(frozen=True)
class Strategy:
    """One way to lay a training step out on `world` GPUs: world = dp x tp x pp x cp.

    dp is the data-parallel degree (ranks that see different data); for hsdp it is
    dp_replicate x dp_shard. ep (experts) splits each MoE layer's routed experts over ep
    consecutive data-parallel ranks (it divides dp and the experts).
    """

    dp_strategy: str = "none"
    dp: int = 1
    dp_shard: int = 0          # hsdp: ranks per shard group (0 = not hsdp)
    tp: int = 1
    sequence_parallel: bool = True   # with tp > 1: norms/residuals split along the sequence too
    pp: int = 1
    pp_schedule: str = "1f1b"  # parallel.pp_schedule (an alias of PP_SCHEDULES becomes the trainer's name)
    pp_virtual: int = 0        # stages per pipeline rank; 0 = the schedule's default (SCHEDULE_VIRTUAL)
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1
    grad_accum: int = 1        # micro-batches per step per data-parallel rank
    ac: str = "none"
    precision: str = "bf16"    # autocast dtype for compute; sharded strategies use FSDP mixed precision
    offload: bool = False      # fsdp/zero2/hsdp: sharded state in host memory
    # fsdp/zero2/hsdp in low precision: FSDP mixed precision (bf16 gathers, no autocast), the
    # planner's choice; False = fp32 gathers under autocast, as a config may also ask for
    fsdp_mixed: bool = True
    fused_loss: bool = False   # chunked linear + cross-entropy: logits never materialized whole
    loss_chunk: int = DEFAULT_LOSS_CHUNK
    # pp > 1: blocks per stage (pp x virtual stages of them, in stage order); () = the trainer's
    # balanced split (plan/stages.split_layers). The busiest rank sizes memory and time.
    pp_layers: tuple[int, ...] = ()
    attention: str = "flash"   # ATTENTION_IMPLEMENTATIONS

    def __post_init__(self) -> None:
        schedule = schedule_name(self.pp_schedule)
        object.__setattr__(self, "pp_schedule", schedule)
        if self.pp_virtual < 1:
            object.__setattr__(self, "pp_virtual", SCHEDULE_VIRTUAL[schedule])
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise UserError(f"unknown attention implementation {self.attention!r}; valid: "
                            f"{', '.join(ATTENTION_IMPLEMENTATIONS)}")
        object.__setattr__(self, "pp_layers", tuple(self.pp_layers))

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shard_group(self) -> int:
        """Ranks over which sharded state is split (the whole dp group, or hsdp's shard group)."""
        if self.dp_strategy == "hsdp":
            return self.dp_shard
        return self.dp if SHARDS[self.dp_strategy][0] else 1

    @property
    def state_shard_group(self) -> int:
        """Ranks over which a rank's model state is split: the shard group times cp (the run's
        FSDP / ZeRO shards over the data-parallel dims with the cp ranks folded in). The timing
        model keeps `shard_group` for the communication groups."""
        return self.shard_group * self.cp if SHARDS[self.dp_strategy][0] else 1

    @property
    def expert_shard_group(self) -> int:
        """Ranks over which a rank's routed experts' state is split. ep = 1: the experts are part
        of their block (state_shard_group). ep > 1: the dp x cp / ep ranks that hold the same
        experts (FSDP over them, under hsdp too: the run's `dp_mod_ep` mesh dim)."""
        if self.ep == 1:
            return self.state_shard_group
        return max(1, self.dp * self.cp // self.ep) if SHARDS[self.dp_strategy][0] else 1

    def shards(self) -> tuple[bool, bool, bool]:
        return SHARDS[self.dp_strategy]

    def not_runnable(self) -> list[str]:
        """Why slipstream cannot run this layout yet (empty: it can)."""
        reasons = []
        if self.precision == "fp16" and self.dp_strategy in FSDP_FAMILY:
            # Planned as it would run (FSDP mixed precision in fp16, a sharded grad scaler: the memory
            # of bf16), but config.dims.check_compatibility refuses fp16 loss scaling on FSDP2.
            reasons.append(f"fp16 loss scaling with {self.dp_strategy} (bf16 runs it)")
        if self.tp > 1 and self.dp_strategy not in TP_DP_STRATEGIES:
            reasons.append(f"tensor parallel {self.tp} with {self.dp_strategy}")
        if self.tp > 1 and self.fused_loss:
            reasons.append(f"tensor parallel {self.tp} with the fused loss")
        if self.cp > 1 and (self.dp_strategy not in CP_DP_STRATEGIES or (self.tp > 1 and self.dp_strategy == "ddp")):
            reasons.append(f"context parallel {self.cp} with {self.dp_strategy}")
        if self.pp > 1:
            reasons += self._pipeline_reasons()
        if self.ep > 1:
            reasons += self._expert_reasons()
        return reasons

    def _expert_reasons(self) -> list[str]:
        """What the trainer refuses in an expert-parallel layout (distributed/expert_parallel.py).
        That ep divides the experts is search.evaluate's (the model's side)."""
        reasons = []
        if self.cp > 1:
            reasons.append(f"expert parallel {self.ep} with context parallel {self.cp}")
        if self.dp % self.ep:
            reasons.append(f"expert parallel {self.ep} over {self.dp} data-parallel ranks (ep must divide them)")
        elif self.dp_strategy not in EP_DP_STRATEGIES:
            reasons.append(f"expert parallel {self.ep} with {self.dp_strategy}")
        elif self.dp_strategy == "ddp" and self.dp != self.ep:
            reasons.append(f"expert parallel {self.ep} with ddp over {self.dp} ranks (ddp needs ep = dp; "
                           "fsdp or hsdp average the ranks holding the same experts)")
        return reasons

    def _pipeline_reasons(self) -> list[str]:
        """What the trainer refuses in a pipeline layout (config.dims, distributed/pipeline_parallel.py,
        torch's schedules). The model's side (blocks >= stages) is search.evaluate's."""
        pp, v, m, name = self.pp, self.pp_virtual, self.grad_accum, self.pp_schedule
        reasons = []
        if self.cp > 1:
            reasons.append(f"pipeline parallel {pp} with context parallel {self.cp}")
        if self.dp_strategy not in PP_DP_STRATEGIES:
            reasons.append(f"pipeline parallel {pp} with {self.dp_strategy}")
        if self.fused_loss:
            reasons.append(f"pipeline parallel {pp} with the fused loss")
        if self.precision == "fp16":
            reasons.append(f"pipeline parallel {pp} with fp16 loss scaling")
        if name in PP_SPLIT_BACKWARD and self.ac == "selective":
            # config.dims.check_pipeline_config: the split backward runs the saved values twice
            reasons.append(f"pipeline parallel {pp}: {name} with selective checkpointing")
        if (name in PP_ONE_STAGE and v != 1) or (name in PP_V_SHAPED and v != 2):
            reasons.append(f"pipeline parallel {pp}: {name} with {v} stages per rank "
                           f"(it runs {1 if name in PP_ONE_STAGE else 2})")
        # torch's minimums (config.dims.check_pipeline_config): 1F1B at least pp micro-batches,
        # DualPipeV at least its stages; the round schedules a multiple of their m // pp rounds
        least = {"1f1b": pp, "dualpipev": pp * v}.get(name, 1)
        if m < least:
            reasons.append(f"pipeline parallel {pp}: {name} with {m} micro-batches (needs {least})")
        elif name in ROUND_SCHEDULES and m % max(1, m // pp):
            reasons.append(f"pipeline parallel {pp}: {name} with {m} micro-batches "
                           f"(not a multiple of its {m // pp} rounds)")
        return reasons

    def label(self) -> str:
        """The layout in `slipstream plan`'s syntax (LAYOUT_SYNTAX); parse_layout reads it back. The
        plan-wide inputs (precision, attention) are not repeated: parse_layout takes them as arguments."""
        if self.dp_strategy == "hsdp":
            parts = [f"hsdp:{self.dp // max(1, self.dp_shard)}x{self.dp_shard}"]
        else:
            parts = [self.dp_strategy + (f":{self.dp}" if self.dp > 1 else "")]
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sequence_parallel else ""))
        if self.pp > 1:
            # Chunks per rank written for the looping schedules, and wherever they are not the schedule's own
            fixed = self.pp_schedule in PP_ONE_STAGE or self.pp_schedule in PP_V_SHAPED
            chunks = "" if fixed and self.pp_virtual == SCHEDULE_VIRTUAL[self.pp_schedule] else f"x{self.pp_virtual}"
            parts.append(f"pp{self.pp}:{self.pp_schedule}{chunks}")
            if self.pp_layers:
                parts.append("layers:" + ",".join(map(str, self.pp_layers)))
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"mb{self.micro_batch}x{self.grad_accum}")
        if self.ac != "none":
            parts.append(f"ac:{self.ac}")
        if self.offload:
            parts.append("offload")
        if self.fused_loss:
            parts.append("fused-loss")
        return " ".join(parts)

    def replace(self, **changes) -> Strategy:
        return dataclasses.replace(self, **changes)


LAYOUT_SYNTAX = ("a layout is words in any order: the data-parallel strategy and degree (none, ddp:8, zero1:8, "
                 "zero2:8, fsdp:64, hsdp:8x8 = replicas x shard; the degree may be left out), tp4 (tp4+sp: with "
                 "sequence parallel), pp12 or pp12:SCHEDULE[xCHUNKS] (pp12:1f1b, pp12:interleaved-1f1bx3, pp4:zbv), "
                 "layers:9,10,10,9 (blocks per stage), cp2, ep8, mb2 or mb2x16 (micro-batch x accumulation), "
                 "ac:none|selective|full, offload, fused-loss, attn:flash|efficient|materialized, bf16|fp16|fp32; "
                 "e.g. \"zero1:8 tp4 pp12 mb2 ac:full\" (the table's layout column is this syntax)")

# One pattern per kind of word (LAYOUT_SYNTAX); a layout names each kind at most once.
_LAYOUT_WORDS = {
    "data-parallel strategy": re.compile(r"(none|ddp|zero1|zero2|fsdp|hsdp)(?::(\d+)(?:x(\d+))?)?"),
    "tensor parallel": re.compile(r"tp(\d+)(\+sp)?"),
    "pipeline": re.compile(r"pp(\d+)(?::([a-z0-9-]+?)(?:x(\d+))?)?"),
    "pipeline layers": re.compile(r"layers:(\d+(?:,\d+)*)"),
    "context parallel": re.compile(r"cp(\d+)"),
    "expert parallel": re.compile(r"ep(\d+)"),
    "micro-batch": re.compile(r"mb(\d+)(?:x(\d+))?"),
    "activation checkpointing": re.compile(r"ac:([a-z]+)"),
    "offload": re.compile(r"offload"),
    "fused loss": re.compile(r"fused-loss"),
    "attention": re.compile(r"attn:([a-z]+)"),
    "precision": re.compile(r"(bf16|fp16|fp32)"),
}


def parse_layout(text: str, world: int, global_batch: int | None = None, *, precision: str = "bf16",
                 attention: str = "flash", n_layer: int | None = None) -> Strategy:
    """The Strategy a layout label names on `world` GPUs (the inverse of Strategy.label()).

    Left out: tp, pp, cp, ep 1; the data-parallel degree world / (tp x pp x cp), its strategy ddp
    when there are several data-parallel (or context-parallel) ranks, else none; micro-batch 1,
    accumulation global_batch / (dp x micro-batch); no checkpointing. `precision` and `attention`
    are the plan's, unless the layout names its own. n_layer (when known) checks layers:...
    """
    def bad(what: str) -> UserError:
        return UserError(f"--layout {text!r}: {what}. Syntax: {LAYOUT_SYNTAX}")

    found: dict[str, tuple[str, re.Match]] = {}
    for word in text.lower().split():
        kind, match = next(((k, m) for k, pattern in _LAYOUT_WORDS.items() if (m := pattern.fullmatch(word))),
                           (None, None))
        if kind is None:
            raise bad(f"unknown word {word!r}")
        if kind in found:
            raise bad(f"{word!r} names the {kind} again (after {found[kind][0]!r})")
        found[kind] = (word, match)
    if not found:
        raise bad("it is empty")

    def group(kind: str, i: int, default: int | str | None = None):
        if kind not in found or found[kind][1].group(i) is None:
            return default
        value = found[kind][1].group(i)
        if value.isdigit():
            if int(value) < 1:
                raise bad(f"{found[kind][0]!r}: degrees and counts are at least 1")
            return int(value)
        return value

    tp, pp, cp, ep = group("tensor parallel", 1, 1), group("pipeline", 1, 1), group("context parallel", 1, 1), \
        group("expert parallel", 1, 1)
    schedule = group("pipeline", 2, "1f1b")
    try:
        schedule = schedule_name(schedule)
    except UserError:
        raise bad(f"{found['pipeline'][0]!r}: unknown pipeline schedule {schedule!r} (valid: "
                  f"{', '.join(PP_SCHEDULES)})") from None
    virtual = group("pipeline", 3, SCHEDULE_VIRTUAL[schedule])
    if (schedule in PP_ONE_STAGE or schedule in PP_V_SHAPED) and virtual != SCHEDULE_VIRTUAL[schedule]:
        # Only the looping schedules take a chunk count: a fixed one would plan its own count under
        # a label that says another (and the trainer refuses it, config.dims.check_pipeline_config).
        runs = SCHEDULE_VIRTUAL[schedule]
        raise bad(f"{found['pipeline'][0]!r}: {schedule} runs exactly {runs} stage(s) per rank, not {virtual}; "
                  f"write pp{pp}:{schedule} (or x{runs}), or a looping schedule for {virtual} chunks "
                  "(interleaved-1f1b, interleaved-zero-bubble, looped-bfs)")
    strategy, dp, shard = group("data-parallel strategy", 1), group("data-parallel strategy", 2), \
        group("data-parallel strategy", 3)
    if world % (tp * pp * cp):
        raise bad(f"tp{tp} x pp{pp} x cp{cp} = {tp * pp * cp} does not divide the {world} GPUs")
    derived = world // (tp * pp * cp)
    if strategy == "hsdp":
        if dp is None or shard is None:
            raise bad(f"{found['data-parallel strategy'][0]!r}: hsdp needs replicas x shard, e.g. hsdp:2x8")
        dp, shard = dp * shard, shard
        if shard < 2 or dp == shard:
            raise bad(f"{found['data-parallel strategy'][0]!r}: hsdp needs at least 2 replicas of shard groups "
                      "of at least 2 ranks (else write fsdp)")
    elif shard is not None:
        raise bad(f"{found['data-parallel strategy'][0]!r}: only hsdp takes replicas x shard")
    dp = derived if dp is None else dp
    if dp * tp * pp * cp != world:
        raise bad(f"{strategy}:{dp} x tp{tp} x pp{pp} x cp{cp} = {dp * tp * pp * cp} GPUs, the cluster has {world} "
                  f"(the data-parallel degree here is {derived})")
    replicated = dp > 1 or cp > 1   # the cp ranks average gradients like data-parallel ranks
    strategy = strategy or ("ddp" if replicated else "none")
    if replicated and strategy == "none":
        raise bad(f"{dp} data-parallel x {cp} context-parallel ranks need a data-parallel strategy (ddp, zero1, "
                  "zero2, fsdp, hsdp), not none")
    if not replicated and strategy != "none":
        raise bad(f"{strategy} with one data-parallel rank: write none (or give the GPUs to data parallelism)")
    micro_batch, accum = group("micro-batch", 1, 1), group("micro-batch", 2)
    if accum is None:
        if global_batch is None:
            accum = 1
        elif global_batch % (dp * micro_batch):
            raise bad(f"global batch {global_batch} is not a multiple of dp {dp} x micro-batch {micro_batch}")
        else:
            accum = global_batch // (dp * micro_batch)
    elif global_batch is not None and dp * micro_batch * accum != global_batch:
        raise bad(f"dp {dp} x mb{micro_batch}x{accum} = {dp * micro_batch * accum} sequences per step, the global "
                  f"batch is {global_batch}")
    ac = group("activation checkpointing", 1, "none")
    if ac not in AC_MODES:
        raise bad(f"{found['activation checkpointing'][0]!r}: checkpointing is one of {', '.join(AC_MODES)}")
    attention = group("attention", 1, attention)
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise bad(f"{found['attention'][0]!r}: attention is one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
    layers: tuple[int, ...] = ()
    if "pipeline layers" in found:
        word = found["pipeline layers"][0]
        layers = tuple(int(n) for n in found["pipeline layers"][1].group(1).split(","))
        if pp == 1:
            raise bad(f"{word!r} splits a pipeline: give its degree too (e.g. pp{len(layers)})")
        if len(layers) != pp * virtual:
            raise bad(f"{word!r} gives {len(layers)} stages, pp{pp} x {virtual} per rank has {pp * virtual}")
        if min(layers) < 1 or (n_layer is not None and sum(layers) != n_layer):
            raise bad(f"{word!r}: every stage needs at least one block and the blocks add up to the model's "
                      f"{n_layer} layers")
    if "offload" in found and strategy not in FSDP_FAMILY:
        raise bad(f"offload is FSDP's CPU offload: it needs zero2, fsdp or hsdp, not {strategy}")
    return Strategy(dp_strategy=strategy, dp=dp, dp_shard=shard if strategy == "hsdp" else 0, tp=tp,
                    sequence_parallel=tp == 1 or group("tensor parallel", 2) is not None, pp=pp,
                    pp_schedule=schedule if pp > 1 else "1f1b", pp_virtual=virtual if pp > 1 else 0, cp=cp, ep=ep,
                    micro_batch=micro_batch, grad_accum=accum, ac=ac, precision=group("precision", 1, precision),
                    offload="offload" in found, fused_loss="fused loss" in found,
                    pp_layers=layers, attention=attention)


def strategy_overrides(s: Strategy, seq_len: int) -> dict[str, object]:
    """The `slipstream train` config values that run layout `s` (runnable layouts only)."""
    reasons = s.not_runnable()
    if reasons:
        raise UserError(f"layout {s.label()} needs {', '.join(reasons)}, which slipstream cannot run yet")
    sharded = s.dp_strategy in ("zero2", "fsdp", "hsdp") and s.fsdp_mixed
    low = s.precision != "fp32"
    values: dict[str, object] = {
        "train.seq_len": seq_len,
        "train.micro_batch_size": s.micro_batch,
        "train.grad_accum_steps": s.grad_accum,
        "train.fused_loss": s.fused_loss,
        "parallel.dp_strategy": s.dp_strategy,
        "activations.checkpointing": s.ac,
        # Sharded strategies compute in low precision through FSDP's mixed precision
        # (parameters gathered in bf16, gradients reduced in fp32), the others through autocast.
        "precision.autocast": s.precision if (low and not sharded) else "none",
        "parallel.param_dtype": s.precision if (low and sharded) else "none",
        "parallel.reduce_dtype": "fp32" if (low and sharded) else "none",
        "parallel.offload": s.offload,
        # fp32 is planned at the TF32 tensor-core rate (GPUs; no effect on CPU)
        "precision.tf32": s.precision == "fp32",
    }
    if s.fused_loss:
        values["train.fused_loss_chunk"] = s.loss_chunk
    if s.dp_strategy == "hsdp":
        values["parallel.dp_shard"] = s.dp_shard
        values["parallel.dp_replicate"] = s.dp // s.dp_shard
    # Always written, so a layout laid over a config replaces its degrees (tp 1 over a tp 2 config too).
    values["parallel.cp"] = s.cp
    values["parallel.tp"] = s.tp
    values["parallel.ep"] = s.ep
    # The pipeline: one planner micro-batch is one pipeline micro-batch (the mb x grad_accum
    # sequences of a step split into grad_accum); without one, the defaults (a pp config reset).
    piped = s.pp > 1
    values["parallel.pp"] = s.pp
    values["parallel.pp_schedule"] = s.pp_schedule if piped else "1f1b"
    values["parallel.pp_microbatches"] = s.grad_accum if piped else 0
    values["parallel.pp_virtual_stages"] = s.pp_virtual if piped else 0
    values["parallel.pp_layers"] = ",".join(map(str, s.pp_layers)) if piped else ""  # "": the balanced split
    values["parallel.sequence_parallel"] = s.sequence_parallel
    values["parallel.loss_parallel"] = True  # what the planner's memory model assumes: logits stay sharded
    return values


def precision_of(cfg) -> str:
    """The compute dtype a training Config runs in (the planner's `precision`)."""
    for value in (cfg.precision.autocast, cfg.parallel.param_dtype):
        if value in ("bf16", "fp16"):
            return value
    return "fp32"


def strategy_from_config(cfg, world: int, dp_strategy: str | None = None, dp_shard: int = 0) -> Strategy:
    """The layout a training Config runs on `world` processes (the inverse of strategy_overrides);
    with dp_strategy given, `world` is the data-parallel degree the caller resolved.

    The data-parallel strategy and hsdp's shard size are resolved exactly as the trainer
    resolves them (config.dims.resolve_parallel_dims: dp = world / (tp x pp x cp)), unless given.
    A pipeline's micro-batches are parallel.pp_microbatches (0: one sequence each), each of
    mb x grad_accum / pp_microbatches sequences. Activation offload is not modelled: it is
    planned as "none", which over-states its memory, never under-states.
    """
    dp = world  # a caller that resolved the degrees passes the data-parallel degree
    if dp_strategy is None:
        from slipstream.config.dims import resolve_parallel_dims

        dims = resolve_parallel_dims(cfg.parallel, world, world)
        dp_strategy, dp_shard, dp = dims.strategy, dims.dp_shard, dims.dp
    ac = cfg.activations.checkpointing if cfg.activations.checkpointing in AC_MODES else "none"
    p = cfg.parallel
    micro_batch, grad_accum = cfg.train.micro_batch_size, cfg.train.grad_accum_steps
    if p.pp > 1:
        # The pipeline splits a rank's mb x grad_accum sequences into pp_microbatches (0: one each).
        sequences = micro_batch * grad_accum
        grad_accum = p.pp_microbatches or sequences
        micro_batch = max(1, sequences // grad_accum)
    return Strategy(dp_strategy=dp_strategy, dp=dp, dp_shard=dp_shard if dp_strategy == "hsdp" else 0,
                    tp=p.tp, cp=p.cp, ep=p.ep, sequence_parallel=p.sequence_parallel,
                    pp=p.pp, pp_schedule=p.pp_schedule if p.pp > 1 else "1f1b",
                    pp_virtual=p.pp_virtual_stages if p.pp > 1 else 0,
                    pp_layers=tuple(configured_pp_layers(p) or ()) if p.pp > 1 else (),   # the user's split, if pinned
                    micro_batch=micro_batch, grad_accum=grad_accum, ac=ac,
                    precision=precision_of(cfg), offload=cfg.parallel.offload, fused_loss=cfg.train.fused_loss,
                    loss_chunk=cfg.train.fused_loss_chunk, fsdp_mixed=cfg.parallel.param_dtype in ("bf16", "fp16"))
