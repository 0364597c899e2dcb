"""The planner accuracy bench's cases (plan/accuracy.py): the CPU grid (default_cases: model
families x AC modes x precisions x strategies, then the architecture options, materialized
attention, pipeline ranks, compression and the stacks' model states), its stratified subset and
the GPU cases (device_cases). Apart from the measurement (plan/accuracy_measure.py): a case is a
description, planned from shapes alone; nothing here runs a step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from slipstream.config.presets import PRESETS
from slipstream.config.schema import ModelConfig
from slipstream.plan.memory import estimate_memory
from slipstream.plan.memory_activations import Compression
from slipstream.plan.memory_states import StackStates
from slipstream.plan.space import PlanModel, Strategy

FAKE_WORLD = 8


@dataclasses.dataclass(frozen=True)
class Case:
    preset: str
    strategy: Strategy
    seq_len: int = 128
    overrides: tuple[tuple[str, Any], ...] = ()
    pp_rank: int | None = None   # pipelines: the pp rank measured (None: the one the planner finds busiest)
    state_dtype: str = "fp32"    # optim.state_dtype: int8 / int4 run torchao's low-bit AdamW
    qat: str = "none"            # quant.qat: the blocks' linears fake-quantized (torchao QAT, optimize/qat.py)
    sparsity: str = "none"       # sparsity.method: masks on the blocks' linears (optimize/sparsity.py)
    # The stack keeping the model states (plan.memory_states.StackStates): torch (slipstream's trainer;
    # reduce_dtype: FSDP2's MixedPrecisionPolicy.reduce_dtype under bf16), or megatron / deepspeed,
    # measured on an emulation of their mixed-precision states (_measure_stack_emulation), with
    # DeepSpeed's reduce bucket of bucket_mb MiB.
    stack: str = "torch"
    reduce_dtype: str = "fp32"
    bucket_mb: float | None = None

    def compression(self) -> Compression:
        return Compression(qat=self.qat, sparsity=self.sparsity)

    def states(self) -> StackStates:
        return StackStates(self.stack, reduce_dtype=self.reduce_dtype, bucket_mb=self.bucket_mb)

    def model_config(self) -> ModelConfig:
        values = {**PRESETS[self.preset], "preset": self.preset, "vocab_size": 512, **dict(self.overrides)}
        values["max_seq_len"] = max(values["max_seq_len"], self.seq_len)
        return ModelConfig(**values)

    def rank(self) -> int:
        """The pp rank measured and planned (0 without a pipeline)."""
        if self.strategy.pp == 1:
            return 0
        if self.pp_rank is not None:
            return self.pp_rank
        model = PlanModel(self.preset, self.model_config())
        return estimate_memory(model, self.strategy, self.seq_len, device="cpu").peak_rank

    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.overrides)
        attention = f" {self.strategy.attention}" if self.strategy.attention != "flash" else ""
        rank = f" rank {self.rank()}" if self.strategy.pp > 1 else ""
        compress = "".join(f" {name} {value}" for name, value, plain in (
            ("state", self.state_dtype, "fp32"), ("qat", self.qat, "none"), ("sparsity", self.sparsity, "none"))
            if value != plain)
        gathers = " fp32-gathers" if self.strategy.dp_strategy in _FSDP and not self.strategy.fsdp_mixed else ""
        stack = "".join(f" {name} {value}" for name, value, plain in (
            ("stack", self.stack, "torch"), ("reduce", self.reduce_dtype, "fp32"), ("bucket-mb", self.bucket_mb, None))
            if value != plain)
        return (f"{self.preset}{'[' + extra + ']' if extra else ''} seq{self.seq_len} {self.strategy.precision} "
                f"{self.strategy.label()}{attention}{rank}{compress}{gathers}{stack}")


_FSDP = ("zero2", "fsdp", "hsdp")   # slipstream runs these as FSDP2


# The grid's model families: a preset and its overrides (the GPT-2 style one widened).
FAMILIES = {"tiny": (("n_layer", 4), ("d_model", 128), ("n_head", 4)), "llama-tiny": (("n_layer", 4),),
            "gpt-mini": ()}


def _family(preset: str, **options: Any) -> tuple[tuple[str, Any], ...]:
    """A family's overrides with `options` on top (replacing a family value of the same name)."""
    base = [(k, v) for k, v in FAMILIES[preset] if k not in options]
    return tuple(base) + tuple(options.items())


def _options(case: Case) -> dict[str, Any]:
    """A case's model options beyond its family's."""
    return {k: v for k, v in case.overrides if (k, v) not in FAMILIES[case.preset]}


def default_cases() -> list[Case]:
    """The grid: three model families x AC modes x precisions x strategies, then the architecture
    options, materialized attention and pipeline ranks (architecture_cases, pipeline_cases)."""
    cases = []
    for preset, overrides in FAMILIES.items():
        for precision in ("fp32", "bf16"):
            for ac in ("none", "selective", "full"):
                cases.append(Case(preset, Strategy(micro_batch=8, ac=ac, precision=precision), overrides=overrides))
        cases.append(Case(preset, Strategy(micro_batch=4, grad_accum=2, precision="fp32"), overrides=overrides))
        cases.append(Case(preset, Strategy(micro_batch=8, precision="fp32", fused_loss=True, loss_chunk=256),
                          overrides=overrides))
        for dp in ("fsdp", "zero2"):
            for precision in ("fp32", "bf16"):
                cases.append(Case(preset, Strategy(dp_strategy=dp, dp=FAKE_WORLD, micro_batch=8, precision=precision),
                                  overrides=overrides))
        for dp in ("ddp", "zero1"):
            for precision in ("fp32", "bf16"):
                cases.append(Case(preset, Strategy(dp_strategy=dp, dp=FAKE_WORLD, micro_batch=8, precision=precision),
                                  overrides=overrides))
        cases.append(Case(preset, Strategy(dp_strategy="fsdp", dp=FAKE_WORLD, micro_batch=4, grad_accum=2,
                                           ac="full", precision="bf16"), overrides=overrides))
    # A larger world: the shards get smaller, the gathered blocks and activations do not.
    cases.append(Case("gpt-mini", Strategy(dp_strategy="fsdp", dp=16, micro_batch=8, precision="bf16")))
    return cases + architecture_cases() + pipeline_cases() + compression_cases() + stack_cases()


def architecture_cases() -> list[Case]:
    """One process, each model option on a family that lacks it (fp32, and bf16 where autocast
    changes what is kept), two published architectures' combinations, and materialized attention."""
    cases = []
    for preset, options in (("tiny", dict(mlp="relu")), ("tiny", dict(parallel_block=True)),
                            ("tiny", dict(position="alibi")), ("llama-tiny", dict(rotary_fraction=0.25)),
                            ("tiny", dict(embedding_norm=True)), ("llama-tiny", dict(embedding_norm=True))):
        for precision in ("fp32", "bf16"):
            cases.append(Case(preset, Strategy(micro_batch=8, precision=precision), overrides=_family(preset, **options)))
    # BLOOM (ALiBi, embedding norm, GELU) and GPT-NeoX / Pythia (parallel block, partial rotary)
    cases.append(Case("tiny", Strategy(micro_batch=8, precision="bf16", ac="selective"),
                      overrides=_family("tiny", position="alibi", embedding_norm=True)))
    cases.append(Case("llama-tiny", Strategy(micro_batch=8, precision="bf16"),
                      overrides=_family("llama-tiny", parallel_block=True, rotary_fraction=0.25, mlp="gelu",
                                        norm="layernorm")))
    # Materialized scores (the MATH kernel; on a CPU it computes a bf16 run's attention in fp32,
    # which no GPU stack does, so fp32 only): MHA, and GQA (k, v repeated to every head), full AC
    for preset, ac in (("tiny", "none"), ("tiny", "full"), ("llama-tiny", "none")):
        cases.append(Case(preset, Strategy(micro_batch=8, precision="fp32", ac=ac, attention="materialized"),
                          overrides=FAMILIES[preset]))
    return cases


def pipeline_cases() -> list[Case]:
    """Pipeline ranks on one process: 1F1B's busiest rank (the first: the embedding and the most
    micro-batches in flight) and its last (head and loss, one in flight), bf16, an uneven split
    of 6 blocks over 4 ranks, a pinned split (parallel.pp_layers) and GPipe (every micro-batch in
    flight)."""
    def piped(**fields) -> Strategy:
        return Strategy(**{"pp": 2, "pp_schedule": "1f1b", "micro_batch": 2, "grad_accum": 4, "precision": "fp32",
                           **fields})

    return [Case("tiny", piped(), overrides=FAMILIES["tiny"]),
            Case("tiny", piped(), overrides=FAMILIES["tiny"], pp_rank=1),
            Case("llama-tiny", piped(precision="bf16"), overrides=FAMILIES["llama-tiny"]),
            Case("llama-tiny", piped(pp=4, ac="full"), overrides=_family("llama-tiny", n_layer=6)),
            Case("tiny", piped(pp_layers=(1, 3)), overrides=FAMILIES["tiny"]),
            Case("tiny", piped(pp_schedule="gpipe"), overrides=FAMILIES["tiny"], pp_rank=1)]


def compression_cases() -> list[Case]:
    """One process on the tiny family: torchao's low-bit AdamW states (int8, int4), QAT's two
    schemes (fp32 and bf16 autocast) and magnitude pruning's masks."""
    def tiny(precision: str = "fp32", **compression) -> Case:
        return Case("tiny", Strategy(micro_batch=8, precision=precision), overrides=FAMILIES["tiny"], **compression)

    return [tiny(state_dtype="int8"), tiny(state_dtype="int4"),
            *(tiny(precision, qat=scheme) for scheme in ("int8-dynact-int4-weight", "int8-weight")
              for precision in ("fp32", "bf16")),
            tiny(sparsity="magnitude")]


def stack_cases() -> list[Case]:
    """Mixed-precision model states as each stack keeps them, on the fake 8-rank world: FSDP2's
    MixedPrecisionPolicy with reduce_dtype bf16 and fp32 gathers under autocast (fsdp_mixed off),
    and emulations of Megatron's distributed optimizer (bf16 weights, an fp32 gradient buffer, the
    fp32 master copy and moments sharded) and of DeepSpeed ZeRO-2 (bf16 weights, a sharded bf16
    gradient partition, its reduce bucket, the fp32 master copy and moments sharded)."""
    def sharded(preset: str, dp_strategy: str, **fields) -> Case:
        case_fields = {k: fields.pop(k) for k in ("stack", "reduce_dtype", "bucket_mb") if k in fields}
        return Case(preset, Strategy(dp_strategy=dp_strategy, dp=FAKE_WORLD, micro_batch=8, precision="bf16", **fields),
                    overrides=FAMILIES[preset], **case_fields)

    return [sharded("tiny", "fsdp", reduce_dtype="bf16"),
            sharded("llama-tiny", "zero2", reduce_dtype="bf16"),
            sharded("tiny", "fsdp", fsdp_mixed=False),
            sharded("tiny", "zero1", stack="megatron"),
            sharded("llama-tiny", "zero1", stack="megatron", ac="full"),
            sharded("tiny", "zero2", stack="deepspeed", bucket_mb=2.0),
            sharded("llama-tiny", "zero2", stack="deepspeed", bucket_mb=2.0, grad_accum=2)]


# (preset, Strategy fields[, model options beyond the family's]) of each case of stratified_cases();
# each names one case of the grid (a field left out: a single process, flash attention, no options).
_STRATIFIED = (
    ("tiny", dict(dp_strategy="none", ac="selective", precision="fp32")),
    ("llama-tiny", dict(dp_strategy="none", ac="full", precision="bf16")),
    ("gpt-mini", dict(dp_strategy="none", ac="selective", precision="bf16")),
    ("llama-tiny", dict(dp_strategy="none", grad_accum=2)),
    ("tiny", dict(fused_loss=True)),
    ("tiny", dict(dp_strategy="ddp", precision="fp32")),
    ("llama-tiny", dict(dp_strategy="zero1", precision="bf16")),
    ("llama-tiny", dict(dp_strategy="zero2", precision="bf16")),
    ("llama-tiny", dict(dp_strategy="fsdp", precision="fp32")),
    ("tiny", dict(dp_strategy="fsdp", precision="bf16", grad_accum=1)),
    ("tiny", dict(dp_strategy="fsdp", grad_accum=2)),
    ("gpt-mini", dict(dp=16)),
    ("llama-tiny", dict(precision="bf16"), dict(parallel_block=True, rotary_fraction=0.25, mlp="gelu", norm="layernorm")),
    ("tiny", dict(attention="materialized", ac="none")),
    ("tiny", dict(pp=2, pp_schedule="1f1b", pp_layers=())),
    ("tiny", dict(precision="bf16", qat="int8-dynact-int4-weight")),
    ("tiny", dict(state_dtype="int4")),
    ("tiny", dict(dp_strategy="zero1", precision="bf16", stack="megatron")),
    ("tiny", dict(dp_strategy="zero2", precision="bf16", stack="deepspeed")),
    ("tiny", dict(dp_strategy="fsdp", precision="bf16", reduce_dtype="bf16")),
    ("tiny", dict(dp_strategy="fsdp", precision="bf16", fsdp_mixed=False)),   # the grid's worst (+7.7 %)
)
# Fields of a Case (not of its Strategy) an entry of _STRATIFIED may name, with their plain values.
COMPRESSION_FIELDS = {"state_dtype": "fp32", "qat": "none", "sparsity": "none"}
_CASE_FIELDS = {**COMPRESSION_FIELDS, "stack": "torch", "reduce_dtype": "fp32"}


def stratified_cases() -> list[Case]:
    """21 of the grid's cases, measured in seconds instead of minutes: every model family,
    data-parallel strategy, AC mode and precision, accumulation with and without sharding, the
    fused loss and the 16-rank world, among them the grid's largest errors (sharded bf16, the
    16-rank world); an architecture combination, materialized attention, a pipeline's busiest
    rank, QAT, low-bit optimizer states, and the stacks' mixed-precision states (Megatron's
    distributed optimizer, DeepSpeed ZeRO-2, FSDP2 reducing in bf16 or gathering fp32). `bench planner --cases
    stratified` and the tests run these."""
    grid = default_cases()
    picked = []
    for preset, fields, *options in _STRATIFIED:
        compression = {k: fields.get(k, plain) for k, plain in _CASE_FIELDS.items()}
        wanted = {"pp": 1, "attention": "flash", "fsdp_mixed": True,
                  **{k: v for k, v in fields.items() if k not in compression}}
        found = [c for c in grid if c.preset == preset and c.pp_rank is None
                 and all(getattr(c.strategy, k) == v for k, v in wanted.items())
                 and all(getattr(c, k) == v for k, v in compression.items())
                 and _options(c) == (options[0] if options else {})]
        if len(found) != 1:
            raise ValueError(f"stratified case {preset} {fields} matches {len(found)} grid cases, not 1")
        picked.append(found[0])
    return picked


def device_cases() -> list[Case]:
    """GPT-2 small and medium at sequence 1024 in bf16: AC modes, micro-batches, fused loss."""
    cases = []
    for preset, micro_batches in (("gpt2", (4, 8, 16)), ("gpt2-medium", (4, 8))):
        for mb in micro_batches:
            for ac in ("none", "selective", "full"):
                cases.append(Case(preset, Strategy(micro_batch=mb, ac=ac, precision="bf16"), seq_len=1024,
                                  overrides=(("vocab_size", 50257),)))
        cases.append(Case(preset, Strategy(micro_batch=8, precision="bf16", fused_loss=True), seq_len=1024,
                          overrides=(("vocab_size", 50257),)))
    return cases
