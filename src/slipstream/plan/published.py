"""Published large-scale training results the planner is checked against (docs/planner.md,
"Published runs: sources and quoted figures").

Every number is quoted from its source; fields the source does not state are None (or the
default that keeps the planner's historic reading, noted per field). A value the source only
implies, or that we derived from stated ones, says so in the run's notes, marked "implied" or
"derived". `plan_model(run)` and `plan_strategy(run)` turn a run into the planner's inputs.

How to read the speed figures (each as the source states it):
    tflops_per_gpu   TFLOP/s per GPU; `flops_convention` says what the source counted:
                     "hardware" = the FLOPs the GPUs executed, including what the run recomputes
                     (Megatron's eq. 3 assumes full recompute: one more forward of every block,
                     8 instead of 6 FLOPs per parameter and token; BigScience's "4*2 co-efficient"),
                     "model" = the FLOPs of one forward and backward (6 per parameter and token +
                     attention), whatever the run recomputes; None = not stated.
    mfu / hfu        model / hardware FLOPs utilization (fractions) as the source defines them
                     (Korthikanti et al. 2022, after Chowdhery et al. 2022): hfu counts the
                     recomputation the run did (full AC: ~4/3 of mfu; selective: ~1 + s/6h).
    tokens_per_s_per_gpu, step_time_s   measured throughput / seconds per optimizer step.
Where a source gives several of these for one measurement, all are kept; they are one run.
"""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.config.schema import ModelConfig
from slipstream.errors import UserError
from slipstream.plan.space import ATTENTION_IMPLEMENTATIONS, PlanModel, Strategy

# 1 decimal gigabyte (10**9 bytes) in GiB. Used only where a source states memory in GB and
# the value is stored in `memory_gib_per_gpu`; the stated GB figure stays visible in the code.
_GB = 1e9 / 2**30


@dataclass(frozen=True)
class PublishedRun:
    name: str  # short id, e.g. "llama3-405b-8k-16384gpu"
    source: str  # "Title, authors/org, year, Table N / section; URL"
    # model shape (enough to rebuild a transformer config); 0 where the source gives no shape
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int | None
    d_ff: int | None
    vocab_size: int
    mlp: str  # "gelu" (GPT) or "swiglu" (Llama); "" where the source gives no architecture
    tie_embeddings: bool
    n_experts: int = 0
    experts_top_k: int = 0
    # hardware and layout
    gpu: str = ""  # short name: "H100", "A100" (80GB SXM), "H100-96GB" (HBM2e, 500 W), ...
    gpus: int = 0
    gpus_per_node: int = 8
    network: str | None = None  # as stated
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    # "ddp", "zero1", "zero2", "zero3", "fsdp", as stated or clearly implied
    dp_strategy: str | None = None
    pp_schedule: str | None = None
    virtual_stages: int | None = None
    micro_batch: int | None = None  # sequences per micro-batch per data-parallel rank
    global_batch: int | None = None  # sequences per optimizer step
    seq_len: int = 0
    activation_checkpointing: str | None = None  # "none", "selective", "full", as stated
    precision: str = "bf16"
    # reported results (as stated; None when not stated)
    tflops_per_gpu: float | None = None
    mfu: float | None = None  # fraction, e.g. 0.43
    tokens_per_s_per_gpu: float | None = None
    memory_gib_per_gpu: float | None = None  # peak memory per GPU
    notes: str = ""  # anything needed to interpret the numbers; derived values live here
    n_params: float | None = None  # total parameter count, only where the source states one
    # ---- architecture options (defaults: the historic reading, GPT-2 style unless mlp is swiglu)
    position: str | None = None  # "learned", "rope", "alibi"; None: rope for swiglu, else learned
    rotary_fraction: float = 1.0  # rope: fraction of each head's dimensions rotated (GPT-NeoX 0.25)
    parallel_block: bool = False  # attention and MLP read the same input (GPT-J / NeoX / PaLM)
    embedding_norm: bool = False  # a LayerNorm right after the token embedding (BLOOM)
    bias: bool | None = None  # biases in linears and norms; None: not for swiglu, else yes
    norm: str | None = None  # "layernorm" / "rmsnorm"; None: rmsnorm for swiglu, else layernorm
    # ---- how the step ran
    # "flash" (fused kernel, scores never in memory), "efficient" (memory-efficient fused kernel) or
    # "materialized" (scores and softmax written out: pre-2022 Megatron / DeepSpeed / metaseq stacks
    # with the fused scale-mask-softmax kernel); None: not stated (planned as flash)
    attention: str | None = None
    # tensor parallel with Megatron's sequence parallelism (Korthikanti et al. 2022); the 2021 stacks
    # had none. None: not stated (planned as the planner's default: on whenever tp > 1)
    sequence_parallel: bool | None = None
    pp_layers: tuple[int, ...] = ()  # blocks per pipeline stage where the source states the split
    fused_loss: bool = False  # a chunked linear + cross-entropy; no published run here uses one
    # ---- more reported results
    hfu: float | None = None  # hardware FLOPs utilization (fraction), where stated next to mfu
    step_time_s: float | None = None  # seconds per optimizer step (iteration), as stated
    flops_convention: str | None = None  # of tflops_per_gpu: "hardware", "model" or None (see above)
    # the training stack the run names (plan.hardware.STACKS): its gradient buckets and ZeRO
    # collectives (plan/timing.py). "torch" where the source names PyTorch DDP / FSDP or a stack on
    # them (torchtitan, llm-foundry, metaseq's FSDP, Meta's Llama 3 stack), or names none.
    stack: str = "torch"
    # whether the run overlapped its gradient reduction with backward, where the source says
    # (Cluster.overlap_grad_reduce); None: the stack's default (hardware.STACK_OVERLAPS_GRAD_REDUCE).
    overlap_grad_reduce: bool | None = None


# ---------------------------------------------------------------------------------------------
# Shared shapes and sources
# ---------------------------------------------------------------------------------------------

_LLAMA3_PAPER = (
    "The Llama 3 Herd of Models, Llama Team, AI @ Meta, 2024, Table 4 (scaling configurations "
    "and MFU of Llama 3 405B pre-training), Table 3 (shapes), Sec. 3.3.1-3.3.2; "
    "https://arxiv.org/abs/2407.21783"
)
# Table 3: 405B = 126 layers, model dimension 16,384, FFN dimension 53,248, 128 attention heads,
# 8 key/value heads, SwiGLU. Table 3 rounds the vocabulary to "128,000" ("128K tokens");
# the released config.json (meta-llama/Llama-3.1-405B) has vocab_size 128256 and
# tie_word_embeddings false.
_LLAMA3_405B = dict(
    n_layer=126, d_model=16384, n_head=128, n_kv_head=8, d_ff=53248, vocab_size=128256,
    mlp="swiglu", tie_embeddings=False,
)
_LLAMA3_70B = dict(
    n_layer=80, d_model=8192, n_head=64, n_kv_head=8, d_ff=28672, vocab_size=128256,
    mlp="swiglu", tie_embeddings=False,
)
_LLAMA3_8B = dict(
    n_layer=32, d_model=4096, n_head=32, n_kv_head=8, d_ff=14336, vocab_size=128256,
    mlp="swiglu", tie_embeddings=False,
)
_LLAMA3_SHAPE_NOTE = (
    "Shape from Llama 3 paper Table 3; vocab 128256 and untied output from the released HF "
    "config.json (Table 3 prints 'Vocabulary Size 128,000')."
)
_LLAMA3_HW = (
    "RoCE (Arista 7800 / Minipack2 OCP switches), 400 Gbps interconnects between GPUs; "
    "8 GPUs per server connected via NVLink; 3,072-GPU pods at full bisection, 1:7 "
    "oversubscribed above the pod"
)
_LLAMA3_COMMON_NOTE = (
    "H100 80GB HBM3 at 700W TDP (Grand Teton). Parallelism order [TP, CP, PP, DP], DP is FSDP "
    "that shards optimizer states and gradients but does not reshard parameters after forward "
    "(Sec. 3.3.2). Pipeline: modified interleaved schedule with a tunable number N of consecutive "
    "micro-batches; first and last stages hold one fewer transformer layer; V (virtual stages) "
    "and micro-batch size not stated. MFU is 'BF16 Model FLOPs Utilization (Chowdhery et al.)'. "
    "Peak memory per GPU not stated. "
)

_MEGATRON_PAPER = (
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, Narayanan, "
    "Shoeybi, Casper, LeGresley, Patwary, Korthikanti, Vainbrand, Kashinkunti, Bernauer, "
    "Catanzaro, Phanishayee, Zaharia (NVIDIA et al.), SC21 / 2021, Table 1 (weak-scaling "
    "throughput), Sec. 5 and 5.1; https://arxiv.org/abs/2104.04473"
)
_MEGATRON_HW = (
    "Selene: 8x NVIDIA 80-GB A100 per node over NVLink/NVSwitch; eight 200Gbps HDR InfiniBand "
    "HCAs per node for application communication (+2 for storage); three-level fat tree"
)
# The 2021 Megatron stack materializes the attention scores: Sec. 4.2 of the paper describes
# "custom kernels to enable the fusion of scale, mask, and softmax (reduction) operations"
# (no flash attention before 2022), and it has no sequence parallelism (added by Korthikanti et
# al. 2022, below). Both are recorded as attention="materialized", sequence_parallel=False.
_MEGATRON_COMMON_NOTE = (
    "All Table 1 models: vocabulary 51,200, sequence length 2048, interleaved pipeline schedule "
    "with scatter/gather optimization. Throughput is end-to-end (data loading, optimizer, "
    "communication, logging). FLOPs are counted with eq. (3) F = 96*B*s*l*h^2*(1 + s/6h + "
    "V/16lh), which the paper says assumes activation recomputation and includes its extra "
    "forward pass, so the stated '% of theoretical peak' (peak 312 TFLOP/s, 16-bit) is not MFU "
    "in the 6ND sense; mfu is left None. d_ff = 4h and tied input/output embeddings are implied "
    "by eq. (2) P = 12*l*h^2*(1 + 13/12h + (V+s)/12lh); MHA (GPT). dp derived from n = t*p*d. "
    "activation_checkpointing 'full' is implied by eq. (3), not stated per run. Precision "
    "stated only as 'mixed precision' (fp16 vs bf16 not stated). Micro-batch size, chunks per "
    "device and memory not stated in Table 1. dp_strategy 'ddp' is implied (plain data "
    "parallelism with gradient all-reduce; no optimizer sharding is used in these runs)."
)

_TORCHTITAN_DOC = (
    "torchtitan docs/performance.md, PyTorch team (Meta), measured Dec 2024 (torch 1963fc8, "
    "torchao eab345c, torchtitan 9dec370); "
    "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"
)
_TORCHTITAN_HW = (
    "Grand Teton: 8 H100 per host fully connected with NVLink; backend RDMA network with "
    "400 Gb/s per GPU"
)
_TORCHTITAN_COMMON_NOTE = (
    "H100 here has 96GB HBM2e (2.4 TB/s) and runs at the default 500W power limit, i.e. not the "
    "80GB/700W SXM part. TPS/GPU read at iteration 90; memory is stable over training and is the "
    "maximum across GPUs. Sequence length is not stated in performance.md; 8192 is the seq_len "
    "of torchtitan's llama3 train_config presets (inferred, not stated). MFU not reported "
    "(Float8 mixes BF16 and FP8 tensor-core peaks). "
)

_ZERO_PAPER = (
    "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models, Rajbhandari, Rasley, "
    "Ruwase, He (Microsoft), SC20 / 2020, Figure 1; https://arxiv.org/abs/1910.02054"
)
_ZERO_COMMON = dict(
    n_layer=0, d_model=0, n_head=0, n_kv_head=None, d_ff=None, vocab_size=0, mlp="",
    tie_embeddings=False, gpu="", gpus=64, dp=64, seq_len=0, precision="fp16",
    n_params=7.5e9, stack="deepspeed",  # ZeRO's own stack: fp16 weights and gradients, fp32 master copy
)
_ZERO_COMMON_NOTE = (
    "Figure 1 caption: 'Comparing the per-device memory consumption of model states, with three "
    "stages of ZeRO-DP optimizations ... we assume a model size of Psi=7.5B and DP of N_d=64 "
    "with K=12 based on mixed-precision training with Adam optimizer.' Analytic, not measured: "
    "model states only (fp16 params 2 bytes + fp16 grads 2 bytes + K=12 bytes Adam states per "
    "parameter), no activations, buffers or fragmentation. No model shape, GPU or sequence "
    "length is given (shape fields are 0). The figure values are in decimal GB as transcribed "
    "from the figure image (120GB / 31.4GB / 16.6GB / 1.9GB); memory_gib_per_gpu stores them "
    "converted to GiB. "
)


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    # ---- 4D / 3D parallelism on H100: Llama 3 405B pre-training (Meta) -----------------------
    PublishedRun(
        name="llama3-405b-8k-8192gpu",
        source=_LLAMA3_PAPER,
        **_LLAMA3_405B,
        gpu="H100", gpus=8192, gpus_per_node=8, network=_LLAMA3_HW,
        tp=8, pp=16, cp=1, dp=64, dp_strategy="fsdp",
        pp_schedule="interleaved (tunable N)", virtual_stages=None,
        micro_batch=None, global_batch=2048, seq_len=8192,
        activation_checkpointing="none", precision="bf16",
        tflops_per_gpu=430.0, mfu=0.43, flops_convention="model",
        notes=(
            "Table 4 row: GPUs 8,192 | TP 8 | CP 1 | PP 16 | DP 64 | Seq. Len. 8,192 | "
            "Batch size/DP 32 | Tokens/Batch 16M | TFLOPs/GPU 430 | BF16 MFU 43%. "
            "global_batch = DP x Batch size/DP = 2048 sequences (derived; matches 16M tokens). "
            "Sec. 3.3.2: 'we could pre-train Llama 3 on sequences of 8K tokens without "
            "activation checkpointing'. " + _LLAMA3_COMMON_NOTE + _LLAMA3_SHAPE_NOTE
        ),
    ),
    PublishedRun(
        name="llama3-405b-8k-16384gpu",
        source=_LLAMA3_PAPER,
        **_LLAMA3_405B,
        gpu="H100", gpus=16384, gpus_per_node=8, network=_LLAMA3_HW,
        tp=8, pp=16, cp=1, dp=128, dp_strategy="fsdp",
        pp_schedule="interleaved (tunable N)", virtual_stages=None,
        micro_batch=None, global_batch=2048, seq_len=8192,
        activation_checkpointing="none", precision="bf16",
        tflops_per_gpu=400.0, mfu=0.41, flops_convention="model",
        notes=(
            "Table 4 row: GPUs 16,384 | TP 8 | CP 1 | PP 16 | DP 128 | Seq. Len. 8,192 | "
            "Batch size/DP 16 | Tokens/Batch 16M | TFLOPs/GPU 400 | BF16 MFU 41%. "
            "global_batch = 128 x 16 = 2048 sequences (derived). The paper attributes the drop "
            "from 43% (8K GPUs, DP=64) to 41% to 'the lower batch size per DP group needed to "
            "keep the global tokens per batch constant'. Activation checkpointing: 8K-token "
            "pre-training without it (Sec. 3.3.2). " + _LLAMA3_COMMON_NOTE + _LLAMA3_SHAPE_NOTE
        ),
    ),
    PublishedRun(
        name="llama3-405b-128k-16384gpu-cp16",
        source=_LLAMA3_PAPER,
        **_LLAMA3_405B,
        gpu="H100", gpus=16384, gpus_per_node=8, network=_LLAMA3_HW,
        tp=8, pp=16, cp=16, dp=4, dp_strategy="fsdp",
        pp_schedule="interleaved (tunable N)", virtual_stages=None,
        micro_batch=None, global_batch=None, seq_len=131072,
        activation_checkpointing=None, precision="bf16",
        tflops_per_gpu=380.0, mfu=0.38, flops_convention="model",
        notes=(
            "Table 4 row as printed: GPUs 16,384 | TP 8 | CP 16 | PP 16 | DP 4 | Seq. Len. "
            "131,072 | Batch size/DP 16 | Tokens/Batch 16M | TFLOPs/GPU 380 | BF16 MFU 38%. "
            "CAUTION: the row is internally inconsistent: TP*CP*PP*DP = 8*16*16*4 = 8,192, not "
            "16,384, and 4*16*131,072 = 8.4M tokens, not 16M. DP = 8 would make both agree "
            "(our reading, not stated); dp is stored as printed and global_batch left None. "
            "CP is all-gather based (K/V all-gathered; sequence split into 2*CP chunks for load "
            "balance). Activation checkpointing for the 128K stage: not stated. "
            + _LLAMA3_COMMON_NOTE + _LLAMA3_SHAPE_NOTE
        ),
    ),
    # ---- TP + PP on A100: Megatron-LM weak scaling (NVIDIA) ----------------------------------
    PublishedRun(
        name="megatron-gpt-1t-3072gpu",
        stack="megatron",
        source=_MEGATRON_PAPER,
        n_layer=128, d_model=25600, n_head=160, n_kv_head=160, d_ff=4 * 25600, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        gpu="A100", gpus=3072, gpus_per_node=8, network=_MEGATRON_HW,
        tp=8, pp=64, cp=1, dp=6, dp_strategy="ddp",
        pp_schedule="interleaved-1f1b", virtual_stages=None,
        micro_batch=None, global_batch=3072, seq_len=2048,
        activation_checkpointing="full", precision="mixed-16bit",
        tflops_per_gpu=163.0, mfu=None,
        n_params=1008.0e9,
        flops_convention="hardware", attention="materialized", sequence_parallel=False,
        notes=(
            "Table 1 row: 1008.0B parameters | 160 attention heads | hidden 25600 | 128 layers | "
            "TP 8 | PP 64 | 3072 GPUs | batch 3072 | 163 teraFLOP/s per GPU | 52% of theoretical "
            "peak FLOP/s | 502.0 petaFLOP/s aggregate. Abstract: '1 trillion parameters at 502 "
            "petaFLOP/s on 3072 GPUs with achieved per-GPU throughput of 52% of theoretical "
            "peak'. dp = 3072/(8*64) = 6 (derived). " + _MEGATRON_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="megatron-gpt-145b-1536gpu",
        stack="megatron",
        source=_MEGATRON_PAPER,
        n_layer=80, d_model=12288, n_head=96, n_kv_head=96, d_ff=4 * 12288, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        gpu="A100", gpus=1536, gpus_per_node=8, network=_MEGATRON_HW,
        tp=8, pp=8, cp=1, dp=24, dp_strategy="ddp",
        pp_schedule="interleaved-1f1b", virtual_stages=None,
        micro_batch=None, global_batch=2304, seq_len=2048,
        activation_checkpointing="full", precision="mixed-16bit",
        tflops_per_gpu=148.0, mfu=None,
        n_params=145.6e9,
        flops_convention="hardware", attention="materialized", sequence_parallel=False,
        notes=(
            "Table 1 row: 145.6B parameters | 96 attention heads | hidden 12288 | 80 layers | "
            "TP 8 | PP 8 | 1536 GPUs | batch 2304 | 148 teraFLOP/s per GPU | 47% of theoretical "
            "peak FLOP/s | 227.1 petaFLOP/s aggregate. "
            "dp = 1536/(8*8) = 24 (derived). " + _MEGATRON_COMMON_NOTE
        ),
    ),
    # ---- FSDP / 2D / 3D on H100: torchtitan Llama 3.1 (PyTorch) ------------------------------
    PublishedRun(
        name="torchtitan-llama3.1-8b-fsdp-8gpu",
        source=_TORCHTITAN_DOC + " (Table 1)",
        **_LLAMA3_8B,
        gpu="H100-96GB", gpus=8, gpus_per_node=8, network=_TORCHTITAN_HW,
        tp=1, pp=1, cp=1, dp=8, dp_strategy="fsdp",
        micro_batch=2, global_batch=16, seq_len=8192,
        activation_checkpointing="selective", precision="bf16",
        tokens_per_s_per_gpu=5762.0, memory_gib_per_gpu=82.4,
        notes=(
            "Table 1 '1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, "
            "global batch size 16. Selective activation checkpointing.' Row 'FSDP': 5,762 TPS/GPU, "
            "82.4 GiB. Other rows: 'FSDP + torch.compile' 6,667 / 77.0 GiB; 'FSDP + "
            "torch.compile + Float8' 8,532 / 76.8 GiB. Table 3 (same, 128 GPUs, global batch "
            "256): FSDP 5,605 / 67.0 GiB; + compile 6,514 / 62.0 GiB; + Float8 8,380 / 61.8 GiB. "
            "The doc says 1D 8B training on 8 or 128 H100 without Float8 'achieves 33% to 39% "
            "MFU' against the SXM peak (understated for this part). micro_batch = local batch "
            "(no gradient accumulation stated). Precision: this row has no Float8; bf16 mixed "
            "precision is torchtitan's FSDP default (implied). Selective AC flavour (op/layer) "
            "not stated. " + _TORCHTITAN_COMMON_NOTE
            + "Shape: Llama 3 paper Table 3 (8B); vocab 128256 from the released config."
        ),
    ),
    PublishedRun(
        name="torchtitan-llama3.1-70b-fsdp32-tp8-256gpu",
        source=_TORCHTITAN_DOC + " (Table 4)",
        **_LLAMA3_70B,
        gpu="H100-96GB", gpus=256, gpus_per_node=8, network=_TORCHTITAN_HW,
        tp=8, pp=1, cp=1, dp=32, dp_strategy="fsdp",
        micro_batch=16, global_batch=512, seq_len=8192,
        activation_checkpointing="full", precision="fp8",
        tokens_per_s_per_gpu=829.0, memory_gib_per_gpu=71.9,
        notes=(
            "Table 4 '2D parallelism (FSDP + TP) + torch.compile + Float8. Llama 3.1 70B model. "
            "256 GPUs (FSDP 32, TP 8). Local batch size 16, global batch size 512. Full "
            "activation checkpointing.' Row '2D': 829 TPS/GPU, 71.9 GiB; row '2D + AsyncTP': "
            "876 TPS/GPU, 67.6 GiB. precision 'fp8' = Float8 on nn.Linear, the rest bf16. "
            "micro_batch = local batch (gradient accumulation not stated). "
            + _TORCHTITAN_COMMON_NOTE + "Shape: Llama 3 paper Table 3 (70B)."
        ),
    ),
    PublishedRun(
        name="torchtitan-llama3.1-405b-fsdp8-tp8-pp8-512gpu",
        source=_TORCHTITAN_DOC + " (Table 5)",
        **_LLAMA3_405B,
        gpu="H100-96GB", gpus=512, gpus_per_node=8, network=_TORCHTITAN_HW,
        tp=8, pp=8, cp=1, dp=8, dp_strategy="fsdp",
        pp_schedule="interleaved-1f1b", virtual_stages=None,
        micro_batch=None, global_batch=256, seq_len=8192,
        activation_checkpointing="full", precision="fp8",
        tokens_per_s_per_gpu=128.0, memory_gib_per_gpu=72.7,
        notes=(
            "Table 5 '3D parallelism (FSDP + TP + PP) + torch.compile + Float8 + AsyncTP. "
            "Llama 3.1 405B model. 512 GPUs (FSDP 8, TP 8, PP8). Local batch size 32, global "
            "batch size 256. Full activation checkpointing.' Row 'Interleaved 1F1B': 128 TPS/GPU, "
            "72.7 GiB; row '1F1B': 100 TPS/GPU, 82.5 GiB. Local batch 32 is per DP rank; "
            "pipeline micro-batch size and virtual stages per rank not stated. Footnote: "
            "different PP ranks can have different peak memory; the maximum is reported. "
            "Table 6 (same 512 GPUs, TP 8, PP 8, local batch 8, 1F1B): FSDP 8 CP 1 seq 32768 "
            "76 TPS/GPU 75.3 GiB; FSDP 4 CP 2 seq 65536 47 / 75.9; FSDP 2 CP 4 seq 131072 "
            "31 / 77.1; FSDP 1 CP 8 seq 262144 16 / 84.9. " + _TORCHTITAN_COMMON_NOTE
            + _LLAMA3_SHAPE_NOTE
        ),
    ),
    # ---- Small model, plain data parallel: llm.c GPT-2 124M on one 8xA100 node ---------------
    PublishedRun(
        name="llmc-gpt2-124m-8xa100",
        source=(
            "llm.c, Andrej Karpathy, 2024: 'Reproducing GPT-2 (124M) in llm.c in 90 minutes for "
            "$20' (GitHub discussion #481, 2024-05-28) and scripts/run_gpt2_124M.sh; "
            "https://github.com/karpathy/llm.c/discussions/481"
        ),
        n_layer=12, d_model=768, n_head=12, n_kv_head=12, d_ff=3072, vocab_size=50257,
        mlp="gelu", tie_embeddings=True,
        gpu="A100", gpus=8, gpus_per_node=8, network=None,
        tp=1, pp=1, cp=1, dp=8, dp_strategy="zero1",
        micro_batch=64, global_batch=512, seq_len=1024,
        activation_checkpointing="none", precision="bf16",
        mfu=0.60,
        n_params=124e6,
        notes=(
            "Discussion: 'training a 12-layer GPT-2 (124M), from scratch, on 10B tokens of "
            "FineWeb, with max sequence length of 1024 tokens ... With llm.c, which is quite "
            "efficient at up to ~60% model flops utilization, reproducing this model on one 8X "
            "A100 80GB SXM node takes ~90 minutes.' Karpathy's announcement: '90 minutes (at "
            "~60% MFU)'. mfu 0.60 is that approximate figure. run_gpt2_124M.sh: '18,865 steps "
            "of 524,288 tokens/step on 8X A100 80GB SXM ($14/hr) steps in ~300ms/iter => "
            "training time 18,865 * 300ms = 94.3 min'; flags -b 64 -t 1024 -d 524288 -r 0 -z 1 "
            "(-z = ZeRO stage, -r 0 = no recompute), so 8 x 64 x 1024 = 524,288 tokens with no "
            "gradient accumulation. Derived (not reported): 524,288 / 0.3 s / 8 GPUs ~= 218K "
            "tokens/s per GPU. Precision: llm.c Makefile default PRECISION ?= BF16 (the script "
            "does not override it). Shape from llm.c (channels 768, 12 heads, MLP 4*C, vocab "
            "50257 padded to 50304 in the kernels; classifier reuses wte, i.e. tied). Network, "
            "memory and TFLOP/s not stated."
        ),
    ),
    # ---- Memory only: ZeRO Figure 1 model-state bytes per GPU (Microsoft) ---------------------
    PublishedRun(
        name="zero-fig1-7.5b-64gpu-baseline-dp",
        source=_ZERO_PAPER,
        **_ZERO_COMMON,
        dp_strategy="ddp",
        memory_gib_per_gpu=120 * _GB,
        notes=(
            "Figure 1 'Baseline': (2 + 2 + K) * Psi = 120GB per device (stated as 120GB; "
            "stored in GiB). " + _ZERO_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="zero-fig1-7.5b-64gpu-pos",
        source=_ZERO_PAPER,
        **_ZERO_COMMON,
        dp_strategy="zero1",
        memory_gib_per_gpu=31.4 * _GB,
        notes=(
            "Figure 1 'P_os' (optimizer-state partitioning, ZeRO stage 1): 2Psi + 2Psi + "
            "K*Psi/N_d = 31.4GB per device (stored in GiB). The figure's 'P_os+g' (stage 2) "
            "column: 2Psi + (2 + K)*Psi/N_d = 16.6GB. " + _ZERO_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="zero-fig1-7.5b-64gpu-pos-g-p",
        source=_ZERO_PAPER,
        **_ZERO_COMMON,
        dp_strategy="zero3",
        memory_gib_per_gpu=1.9 * _GB,
        notes=(
            "Figure 1 'P_os+g+p' (ZeRO stage 3): (2 + 2 + K)*Psi/N_d = 1.9GB per device as "
            "transcribed (the formula gives 16 * 7.5e9 / 64 = 1.875e9 bytes); stored in GiB. "
            "Sec. 1: 'splitting across 64 GPUs (N_d = 64) will yield a 64x memory reduction. "
            "There is a modest 50% increase in communication volume.' " + _ZERO_COMMON_NOTE
        ),
    ),
)


# ---------------------------------------------------------------------------------------------
# Added for issue 19: 2021-2023 runs on A100 / H100 clusters (Megatron-DeepSpeed, metaseq,
# Megatron-LM, composer / llm-foundry), 8 to 2,520 GPUs, non-power-of-two layouts.
# Kept apart from PUBLISHED_RUNS until the report's fit and its committed pins move to the whole
# set (ALL_PUBLISHED_RUNS); then the two names can become one.
# ---------------------------------------------------------------------------------------------

_BLOOM_README = (
    "BigScience tr11-176B-ml README (BLOOM-176B training on Jean Zay), BigScience Workshop, "
    "2022, sections 'Hardware', 'Architecture', 'Replica setup', 'Global batch size', "
    "'Throughput', 'Data type', 'Important checkpoints'; "
    "https://github.com/bigscience-workshop/bigscience/blob/master/train/tr11-176B-ml/README.md "
    "(TFLOP formula: math/README.md 'Calculate TFLOPs' in the same repository)"
)

_OPT_PAPER = (
    "OPT: Open Pre-trained Transformer Language Models, Zhang, Roller, Goyal et al. (Meta AI), "
    "2022, Table 1, Sec. 2.2 and 2.4 (Training Efficiency); https://arxiv.org/abs/2205.01068; "
    "layout from metaseq projects/OPT/chronicles/10_percent_update.md and "
    "metaseq/launcher/opt_baselines.py + opt_job_constants.py, "
    "https://github.com/facebookresearch/metaseq"
)

_MEGATRON_TABLE2 = _MEGATRON_PAPER.replace("Table 1 (weak-scaling throughput), Sec. 5 and 5.1",
                                           "Table 2 (PTD parallelism vs ZeRO-3), Sec. 5.2")

_KORTHIKANTI_PAPER = (
    "Reducing Activation Recomputation in Large Transformer Models, Korthikanti, Casper, Lym, "
    "McAfee, Andersch, Shoeybi, Catanzaro (NVIDIA), 2022 (MLSys 2023), Table 3 (model "
    "configurations), Table 5 (end-to-end iteration time, MFU, HFU), Sec. 6 and 6.3; "
    "https://arxiv.org/abs/2205.05198"
)
_KORTHIKANTI_COMMON_NOTE = (
    "Sec. 6: 'the tensor parallel size is set to 8. We use the interleaving schedule with three "
    "interleaving stages (m = 3) for the 175B and 530B models. For all the cases, sequence length "
    "is set to s = 2048 and vocabulary size is set to v = 51200. ... no data parallelism is "
    "considered in these evaluations ... All of our results are run with mixed precision on the "
    "Selene supercomputer'. Table 3 caption: 'no data parallelism is used in our evaluations'. "
    "Table 5 columns: Iteration Time (seconds) Full Recompute | Present Work, Throughput Increase, "
    "Model FLOPs Utilization, Hardware FLOPs Utilization (MFU/HFU are for 'Present Work'); Sec. "
    "6.3: the improvement is 'over performing full recomputation without sequence parallelism'. "
    "'Present Work' = sequence parallelism + selective activation recomputation (the attention "
    "core QK^T, softmax, dropout, attention over V is recomputed; Sec. 5). 'For our method, the "
    "hardware to model FLOPs ratio is approximately 1 + s/6h.' Shape (Sec. 3): learned positions, "
    "MLP 4h with GeLU, word embedding and output layer shared (tied); MHA. The attention scores "
    "are materialized (Sec. 4.1 counts the softmax output 2as^2b and its dropout mask as stored "
    "activations). Precision stated only as 'mixed precision' (fp16 implied by Megatron-LM's "
    "examples of the time, e.g. examples/pretrain_gpt3_175B.sh --fp16). "
)
_KORTHIKANTI_HW = (
    "Selene: 8 NVIDIA 80GB A100 per node over NVLink/NVSwitch; eight 200Gbps HDR InfiniBand HCAs "
    "per node for application communication"
)

_MPT_README = (
    "llm-foundry 'MPT Training Benchmarks', MosaicML, 2023, scripts/train/benchmarking/README.md "
    "(tables 'H100 80GB BF16', 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)', 'A100 "
    "40GB with 1600 Gbps node-node interconnect (RoCE)'); shapes from scripts/train/yamls/"
    "pretrain/mpt-*.yaml; https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/"
    "benchmarking/README.md"
)
_MPT_HW = "8 GPUs per node; 1600 Gbps node-node interconnect (RoCE) for the A100 tables"
_MPT_COMMON_NOTE = (
    "README 'MFU and HFU': mfu = (3 * flops_per_seq + 3 * attn_flops_per_seq) * seq_per_sec / "
    "(gpu_num * GPU_AVAILABLE_FLOPS) with flops_per_token = 2 * n_params and attn_flops_per_seq = "
    "n_layers * 2 * 2 * (d_model * (seq_len**2)); 'The HFU numbers shown below account for the fact "
    "that the networks use checkpointing and recomputes activations' (hfu = 4/3 mfu when "
    "Activation Checkpointing is True, = mfu when False). n_params is the table's NumParams, "
    "which includes the learned position table (so MFU here counts it as matmul FLOPs). 'Our "
    "models use Flash Attention' (yamls: attn_impl triton / flash). Sharding Strategy FULL_SHARD "
    "= PyTorch FSDP (dp_strategy fsdp). Shape from the mpt-*.yaml files: expansion_ratio 4, vocab "
    "50368, MPT's defaults otherwise (GELU MLP, LayerNorm, biases, learned positions, tied "
    "embedding: the NumParams column equals L*(12d^2+13d) + 2d + 50368d + seq*d exactly, which "
    "also shows these benchmark models ran with learned positions, not ALiBi). The 'Model TFLOP' "
    "column is not used (its units differ between rows). "
)
_MPT_70B = dict(n_layer=80, d_model=8192, n_head=64, n_kv_head=None, d_ff=4 * 8192, vocab_size=50368,
                mlp="gelu", tie_embeddings=True)
_MPT_30B = dict(n_layer=48, d_model=7168, n_head=56, n_kv_head=None, d_ff=4 * 7168, vocab_size=50368,
                mlp="gelu", tie_embeddings=True)
_MPT_13B = dict(n_layer=40, d_model=5120, n_head=40, n_kv_head=None, d_ff=4 * 5120, vocab_size=50368,
                mlp="gelu", tie_embeddings=True)
_MPT_7B = dict(n_layer=32, d_model=4096, n_head=32, n_kv_head=None, d_ff=4 * 4096, vocab_size=50368,
               mlp="gelu", tie_embeddings=True)
_MPT_125M = dict(n_layer=12, d_model=768, n_head=12, n_kv_head=None, d_ff=4 * 768, vocab_size=50368,
                 mlp="gelu", tie_embeddings=True)
_MPT_COMMON = dict(position="learned", attention="flash", dp_strategy="fsdp", gpus_per_node=8,
                   network=_MPT_HW, sequence_parallel=False)


MORE_PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    # ---- Megatron-DeepSpeed, TP4 PP12 ZeRO-1 on 384 A100: BLOOM-176B (BigScience) -------------
    PublishedRun(
        name="bloom-176b-384gpu",
        stack="deepspeed",
        source=_BLOOM_README,
        n_layer=70, d_model=14336, n_head=112, n_kv_head=None, d_ff=4 * 14336, vocab_size=250880,
        mlp="gelu", tie_embeddings=True,
        position="alibi", embedding_norm=True, attention="materialized", sequence_parallel=False,
        gpu="A100", gpus=384, gpus_per_node=8,
        network="8 GPUs per node over NVLink; inter-node Omni-Path Architecture (OPA), 4 OmniPath links",
        tp=4, pp=12, cp=1, dp=8, dp_strategy="zero1",
        pp_layers=(5,) + (6,) * 10 + (5,),
        micro_batch=2, global_batch=2048, seq_len=2048,
        activation_checkpointing="full", precision="bf16",
        tflops_per_gpu=149.77, flops_convention="hardware", step_time_s=104.70,
        n_params=176e9,
        notes=(
            "Log line at the end of the first epoch ('Important checkpoints'): 'iteration 85376/ "
            "115311 | consumed samples: 158692272 | consumed tokens: 325001773056 | elapsed time per "
            "iteration (s): 104.70 | learning rate: 1.150E-05 | global batch size: 2048 | ... | "
            "samples per second: 19.561 | TFLOPs: 149.77'. 'Estimated run time': 'running at ~150 "
            "TFLOPs per GPU'. 'Throughput': 'Since we use activation check-pointing ... it's the "
            "hardware TFLOPs that we calculate - using the 4*2 co-efficient, instead of the 3*2 "
            "coefficient to calculate \"model TFLOPs\"' (math/README.md: TFLOPs = model_size_in_B * 4 "
            "* 2 * seqlen * global_batch_size / (time_in_sec_per_interation * total_gpus * 1e3); "
            "'The exact formula is in Equation 3 of Section 5.1' of Megatron-LM SC21). 'Hardware': "
            "'416 A100 80GB GPUs (52 nodes) - using 384 gpus (48 nodes)'. 'Replica setup': 'TP=4 "
            "PP=12 DP=8 MBS=2'. 'Global batch size': GLOBAL_BATCH_SIZE=2048 at seqlen 2048 (after a "
            "ramp-up; the log line is at the full 2048). Architecture: NHIDDEN=14336 NLAYERS=70 "
            "NHEADS=112; pipeline partition 'pp rank 0: [embed | 5 transformer blocks] ... pp rank "
            "1..10: [6 transformer blocks] ... pp rank 11: [5 transformer blocks | embed]' (the tied "
            "embedding weighs as a block on both end stages): pp_layers. 'embedding size: v*h: "
            "250880*14336' (the tokenizer's 250,680 tokens padded to 250,880 rows: vocab_size); one "
            "layer '12*h**2 + 13*h' (MLP 4h, biases: implied). '--position-embedding-type alibi', "
            "'--embed-layernorm', activation 'torch.nn.functional.gelu', '--bf16', "
            "'--deepspeed-activation-checkpointing' (full), ZeRO stage 1 via DeepSpeed's "
            "BF16_Optimizer ('due to ZeRO-1 sharding'). Model size 176B ('Model size: 176B'). Not "
            "stated, implied by the 2022 Megatron-DeepSpeed stack: materialized attention scores "
            "(fused scale-mask-softmax, no flash attention), no sequence parallelism; fused loss "
            "no; pipeline schedule not stated. Derived (not reported): 19.561 samples/s x 2048 / "
            "384 GPUs = 104.3 tokens/s per GPU."
        ),
    ),
    # ---- metaseq, TP8 + FSDP on 992 A100: OPT-175B (Meta AI) -----------------------------------
    PublishedRun(
        name="opt-175b-992gpu",
        source=_OPT_PAPER,
        n_layer=96, d_model=12288, n_head=96, n_kv_head=None, d_ff=4 * 12288, vocab_size=50272,
        mlp="relu", tie_embeddings=True,
        position="learned", attention="materialized", sequence_parallel=False,
        gpu="A100", gpus=992, gpus_per_node=8, network=None,
        tp=8, pp=1, cp=1, dp=124, dp_strategy="zero2",
        micro_batch=8, global_batch=992, seq_len=2048,
        activation_checkpointing="full", precision="fp16",
        tflops_per_gpu=147.0, flops_convention=None,
        n_params=175e9,
        notes=(
            "Sec. 2.4: 'We trained OPT-175B on 992 80GB A100 GPUs, by utilizing Fully Sharded Data "
            "Parallel (Artetxe et al., 2021) with Megatron-LM Tensor Parallelism (Shoeybi et al., "
            "2019). We achieve utilization of up to 147 TFLOP/s per GPU. We keep Adam state in FP32, "
            "since we shard it across all hosts, while the model weights remained in FP16. To avoid "
            "under-flows, we used dynamic loss scaling'. 'Up to': a best figure, and whether it "
            "counts recomputation is not stated (flops_convention None). Table 1: 175B | #L 96 | #H "
            "96 | d_model 12288 | LR 1.2e-4 | Batch 2M (tokens). Sec. 2.2: 'all models are trained "
            "with ReLU activation and a sequence length of 2048'. Tensor parallel 8: chronicles "
            "10_percent_update.md ('8x Tensor Parallelism', the 175B lineage) and opt_job_constants.py "
            "('175b': model_parallel 8). From opt_baselines.py (the released launcher): "
            "'--ddp-backend fully_sharded', '--no-reshard-after-forward' (save-dir key 'zero2': "
            "dp_strategy zero2), '--checkpoint-activations' (full AC: implied for the paper's run), "
            "'--memory-efficient-fp16', '--activation-fn relu', '--decoder-learned-pos', "
            "'--share-decoder-input-output-embed' (tied), ffn 4 x emb. Derived: dp = 992 / 8 = 124; "
            "the launcher's per-rank batch ddp_bsz = (batch_tokens // dp) // 2048 with the paper's "
            "2M = 2 x 1024 x 1024 tokens gives 8 sequences per rank and update-freq 1, so "
            "micro_batch 8 and global_batch 124 x 8 = 992 sequences (2,031,616 tokens). vocab 50272: "
            "the released OPT configs (e.g. facebook/opt-66b config.json, vocab_size 50272; GPT-2 "
            "BPE per Sec. 2.3), implied. Implied by the 2021 stack: materialized attention scores, "
            "no sequence parallelism. Pipeline parallelism: none (metaseq ran without it). n_params: "
            "the model's name (175B)."
        ),
    ),
    # ---- Megatron-LM SC21, more Table 1 rows (weak scaling on Selene) --------------------------
    PublishedRun(
        name="megatron-gpt-1.7b-32gpu",
        stack="megatron",
        source=_MEGATRON_PAPER,
        n_layer=24, d_model=2304, n_head=24, n_kv_head=24, d_ff=4 * 2304, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        gpu="A100", gpus=32, gpus_per_node=8, network=_MEGATRON_HW,
        tp=1, pp=1, cp=1, dp=32, dp_strategy="ddp",
        micro_batch=None, global_batch=512, seq_len=2048,
        activation_checkpointing="full", precision="mixed-16bit",
        tflops_per_gpu=137.0, mfu=None, flops_convention="hardware",
        attention="materialized", sequence_parallel=False,
        n_params=1.7e9,
        notes=(
            "Table 1 row: 1.7B parameters | 24 attention heads | hidden 2304 | 24 layers | TP 1 | PP "
            "1 | 32 GPUs | batch 512 | 137 teraFLOP/s per GPU | 44% of theoretical peak FLOP/s | 4.4 "
            "petaFLOP/s aggregate. 'We achieve ... 44% of peak device throughput for the smallest "
            "model.' dp = 32 (derived). " + _MEGATRON_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="megatron-gpt-310b-1920gpu",
        stack="megatron",
        source=_MEGATRON_PAPER,
        n_layer=96, d_model=16384, n_head=128, n_kv_head=128, d_ff=4 * 16384, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        gpu="A100", gpus=1920, gpus_per_node=8, network=_MEGATRON_HW,
        tp=8, pp=16, cp=1, dp=15, dp_strategy="ddp",
        pp_schedule="interleaved-1f1b", virtual_stages=None,
        micro_batch=None, global_batch=2160, seq_len=2048,
        activation_checkpointing="full", precision="mixed-16bit",
        tflops_per_gpu=155.0, mfu=None, flops_convention="hardware",
        attention="materialized", sequence_parallel=False,
        n_params=310.1e9,
        notes=(
            "Table 1 row: 310.1B parameters | 128 attention heads | hidden 16384 | 96 layers | TP 8 | "
            "PP 16 | 1920 GPUs | batch 2160 | 155 teraFLOP/s per GPU | 50% of theoretical peak "
            "FLOP/s | 297.4 petaFLOP/s aggregate. dp = 1920 / (8 x 16) = 15 (derived; a "
            "non-power-of-two data-parallel degree). " + _MEGATRON_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="megatron-gpt-530b-2520gpu",
        stack="megatron",
        source=_MEGATRON_PAPER,
        n_layer=105, d_model=20480, n_head=128, n_kv_head=128, d_ff=4 * 20480, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        gpu="A100", gpus=2520, gpus_per_node=8, network=_MEGATRON_HW,
        tp=8, pp=35, cp=1, dp=9, dp_strategy="ddp",
        pp_schedule="interleaved-1f1b", virtual_stages=None,
        micro_batch=None, global_batch=2520, seq_len=2048,
        activation_checkpointing="full", precision="mixed-16bit",
        tflops_per_gpu=163.0, mfu=None, flops_convention="hardware",
        attention="materialized", sequence_parallel=False,
        n_params=529.6e9,
        notes=(
            "Table 1 row: 529.6B parameters | 128 attention heads | hidden 20480 | 105 layers | TP 8 "
            "| PP 35 | 2520 GPUs | batch 2520 | 163 teraFLOP/s per GPU | 52% of theoretical peak "
            "FLOP/s | 410.2 petaFLOP/s aggregate. dp = 2520 / (8 x 35) = 9 (derived). 105 layers over "
            "35 stages = 3 per stage; chunks per stage of the interleaved schedule not stated. "
            + _MEGATRON_COMMON_NOTE
        ),
    ),
    # ---- Megatron-LM SC21 Table 2: DeepSpeed ZeRO-3 without model parallelism ------------------
    PublishedRun(
        name="megatron-zero3-gpt3-175b-384gpu",
        stack="deepspeed",
        source=_MEGATRON_TABLE2,
        n_layer=96, d_model=12288, n_head=96, n_kv_head=96, d_ff=4 * 12288, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        gpu="A100", gpus=384, gpus_per_node=8, network=_MEGATRON_HW,
        tp=1, pp=1, cp=1, dp=384, dp_strategy="zero3",
        micro_batch=4, global_batch=1536, seq_len=2048,
        activation_checkpointing="full", precision="mixed-16bit",
        tflops_per_gpu=144.0, mfu=None, flops_convention="hardware",
        attention="materialized", sequence_parallel=False,
        n_params=174.6e9,
        notes=(
            "Table 2 row 'ZeRO-3 without Model Parallelism': 174.6B parameters | model-parallel size "
            "1 | batch 1536 | 384 GPUs | microbatch 4 | 144 teraFLOP/s per GPU | 90 days for 300B "
            "tokens. Same model, 768 GPUs microbatch 2: 88; 1536 GPUs microbatch 1: 44 (next run). "
            "The PTD rows of the same table: 384 / 768 / 1536 GPUs at 153 / 149 / 141. Sec. 5.2: 'We "
            "integrated ZeRO into our codebase using the DeepSpeed Python library. We keep the global "
            "batch size the same as we increase the number of GPUs.' Shape: 'the GPT-3 model with 175 "
            "billion parameters (96 layers, 96 attention heads, hidden size of 12288)' (Sec. 5.3.2). "
            "dp_strategy zero3 = DeepSpeed ZeRO stage 3 (parameters, gradients and optimizer state "
            "sharded over all 384 ranks). Gradient accumulation: 1536 / (384 x 4) = 1 (derived). "
            "Whether this run recomputed activations is not stated; the teraFLOP/s are eq. (3)'s, "
            "which count the recomputed forward either way. " + _MEGATRON_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="megatron-zero3-gpt3-175b-1536gpu",
        stack="deepspeed",
        source=_MEGATRON_TABLE2,
        n_layer=96, d_model=12288, n_head=96, n_kv_head=96, d_ff=4 * 12288, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        gpu="A100", gpus=1536, gpus_per_node=8, network=_MEGATRON_HW,
        tp=1, pp=1, cp=1, dp=1536, dp_strategy="zero3",
        micro_batch=1, global_batch=1536, seq_len=2048,
        activation_checkpointing="full", precision="mixed-16bit",
        tflops_per_gpu=44.0, mfu=None, flops_convention="hardware",
        attention="materialized", sequence_parallel=False,
        n_params=174.6e9,
        notes=(
            "Table 2 row 'ZeRO-3 without Model Parallelism': 174.6B parameters | model-parallel size "
            "1 | batch 1536 | 1536 GPUs | microbatch 1 | 44 teraFLOP/s per GPU | 74 days for 300B "
            "tokens. Sec. 5.2: 'by doubling the number of GPUs (keeping the batch size the same), "
            "PTD-P outperforms ZeRO-3 by 70% for both models due to less cross-node communication.' "
            "A communication-bound point: one sequence per rank per step. See the 384-GPU row for "
            "the rest. " + _MEGATRON_COMMON_NOTE
        ),
    ),
    # ---- Megatron-LM with sequence parallelism + selective recompute (Korthikanti et al.) -------
    PublishedRun(
        name="korthikanti-22b-8gpu-selective-sp",
        stack="megatron",
        source=_KORTHIKANTI_PAPER,
        n_layer=48, d_model=6144, n_head=64, n_kv_head=64, d_ff=4 * 6144, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        position="learned", attention="materialized", sequence_parallel=True,
        gpu="A100", gpus=8, gpus_per_node=8, network=_KORTHIKANTI_HW,
        tp=8, pp=1, cp=1, dp=1, dp_strategy=None,
        micro_batch=4, global_batch=4, seq_len=2048,
        activation_checkpointing="selective", precision="mixed-16bit",
        mfu=0.415, hfu=0.437, step_time_s=1.10,
        n_params=22e9,
        notes=(
            "Table 3 row: 22B | 64 attention heads | hidden 6144 | 48 layers | TP 8 | PP 1 | 8 GPUs | "
            "global batch 4 | micro batch 4. Table 5 row: 22B | full recompute 1.42 s | present work "
            "1.10 s | throughput increase 29.0% | MFU 41.5% | HFU 43.7%. Table 4 (one layer of this "
            "model): baseline no recompute 19.6 ms fwd+bwd, sequence parallelism 19.0, baseline with "
            "recompute 27.2 (39% overhead), selective 20.9, selective + sequence 20.3 (4%). "
            + _KORTHIKANTI_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="korthikanti-22b-8gpu-full-recompute",
        stack="megatron",
        source=_KORTHIKANTI_PAPER,
        n_layer=48, d_model=6144, n_head=64, n_kv_head=64, d_ff=4 * 6144, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        position="learned", attention="materialized", sequence_parallel=False,
        gpu="A100", gpus=8, gpus_per_node=8, network=_KORTHIKANTI_HW,
        tp=8, pp=1, cp=1, dp=1, dp_strategy=None,
        micro_batch=4, global_batch=4, seq_len=2048,
        activation_checkpointing="full", precision="mixed-16bit",
        step_time_s=1.42,
        n_params=22e9,
        notes=(
            "Table 5 row 22B, column 'Full Recompute': 1.42 s per iteration (full activation "
            "recomputation, no sequence parallelism), the same layout and batch as "
            "korthikanti-22b-8gpu-selective-sp. MFU not stated for this column; derived (not "
            "reported): 41.5% x 1.10 / 1.42 = 32.1%. " + _KORTHIKANTI_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="korthikanti-175b-64gpu-selective-sp",
        stack="megatron",
        source=_KORTHIKANTI_PAPER,
        n_layer=96, d_model=12288, n_head=96, n_kv_head=96, d_ff=4 * 12288, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        position="learned", attention="materialized", sequence_parallel=True,
        gpu="A100", gpus=64, gpus_per_node=8, network=_KORTHIKANTI_HW,
        tp=8, pp=8, cp=1, dp=1, dp_strategy=None,
        pp_schedule="interleaved-1f1b", virtual_stages=3,
        micro_batch=1, global_batch=64, seq_len=2048,
        activation_checkpointing="selective", precision="mixed-16bit",
        mfu=0.514, hfu=0.528, step_time_s=13.75,
        n_params=175e9,
        notes=(
            "Table 3 row: 175B (GPT-3) | 96 attention heads | hidden 12288 | 96 layers | TP 8 | PP 8 "
            "| 64 GPUs | global batch 64 | micro batch 1. Table 5 row: 175B | full recompute 18.13 s | "
            "present work 13.75 s | 31.8% | MFU 51.4% | HFU 52.8%. Interleaved schedule with m = 3 "
            "(virtual_stages 3: 96 layers / (8 x 3) = 4 per chunk). " + _KORTHIKANTI_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="korthikanti-530b-280gpu-selective-sp",
        stack="megatron",
        source=_KORTHIKANTI_PAPER,
        n_layer=105, d_model=20480, n_head=128, n_kv_head=128, d_ff=4 * 20480, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        position="learned", attention="materialized", sequence_parallel=True,
        gpu="A100", gpus=280, gpus_per_node=8, network=_KORTHIKANTI_HW,
        tp=8, pp=35, cp=1, dp=1, dp_strategy=None,
        pp_schedule="interleaved-1f1b", virtual_stages=3,
        micro_batch=1, global_batch=280, seq_len=2048,
        activation_checkpointing="selective", precision="mixed-16bit",
        mfu=0.560, hfu=0.570, step_time_s=37.83,
        n_params=530e9,
        notes=(
            "Table 3 row: 530B (MT-NLG) | 128 attention heads | hidden 20480 | 105 layers | TP 8 | "
            "PP 35 | 280 GPUs | global batch 280 | micro batch 1. Table 5 row: 530B | full recompute "
            "49.05 s | present work 37.83 s | 29.7% | MFU 56.0% | HFU 57.0%. Interleaved, m = 3: 105 "
            "layers / (35 x 3) = 1 per chunk. " + _KORTHIKANTI_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="korthikanti-530b-280gpu-full-recompute",
        stack="megatron",
        source=_KORTHIKANTI_PAPER,
        n_layer=105, d_model=20480, n_head=128, n_kv_head=128, d_ff=4 * 20480, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        position="learned", attention="materialized", sequence_parallel=False,
        gpu="A100", gpus=280, gpus_per_node=8, network=_KORTHIKANTI_HW,
        tp=8, pp=35, cp=1, dp=1, dp_strategy=None,
        pp_schedule="interleaved-1f1b", virtual_stages=3,
        micro_batch=1, global_batch=280, seq_len=2048,
        activation_checkpointing="full", precision="mixed-16bit",
        step_time_s=49.05,
        n_params=530e9,
        notes=(
            "Table 5 row 530B, column 'Full Recompute': 49.05 s per iteration (full recomputation, no "
            "sequence parallelism), the same layout as korthikanti-530b-280gpu-selective-sp. Derived "
            "(not reported): MFU 56.0% x 37.83 / 49.05 = 43.2%. Sec. 6.2: 'For the 530B and 1T cases, "
            "the overhead is just 2%, compared to 36% overhead for full recompute' (per layer). "
            + _KORTHIKANTI_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="korthikanti-1t-512gpu-selective-sp",
        stack="megatron",
        source=_KORTHIKANTI_PAPER,
        n_layer=128, d_model=25600, n_head=160, n_kv_head=160, d_ff=4 * 25600, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        position="learned", attention="materialized", sequence_parallel=True,
        gpu="A100", gpus=512, gpus_per_node=8, network=_KORTHIKANTI_HW,
        tp=8, pp=64, cp=1, dp=1, dp_strategy=None,
        pp_schedule=None, virtual_stages=None,
        micro_batch=1, global_batch=512, seq_len=2048,
        activation_checkpointing="selective", precision="mixed-16bit",
        mfu=0.563, hfu=0.570, step_time_s=71.49,
        n_params=1e12,
        notes=(
            "Table 3 row: 1T | 160 attention heads | hidden 25600 | 128 layers | TP 8 | PP 64 | 512 "
            "GPUs | global batch 512 | micro batch 1. Table 5 row: 1T | full recompute 94.42 s | "
            "present work 71.49 s | 32.1% | MFU 56.3% | HFU 57.0%; 'for the one trillion parameter "
            "model, we reach a MFU and HFU of 56.3% and 57.0%'. The interleaved schedule is stated "
            "only for the 175B and 530B models: the schedule here is not stated. "
            + _KORTHIKANTI_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="korthikanti-530b-2240gpu-selective-sp",
        stack="megatron",
        overlap_grad_reduce=False,   # Sec. 6.3: "we do not use any overlapping of gradient all-reduces"
        source=_KORTHIKANTI_PAPER,
        n_layer=105, d_model=20480, n_head=128, n_kv_head=128, d_ff=4 * 20480, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        position="learned", attention="materialized", sequence_parallel=True,
        gpu="A100", gpus=2240, gpus_per_node=8, network=_KORTHIKANTI_HW,
        tp=8, pp=35, cp=1, dp=8, dp_strategy="ddp",
        pp_schedule="interleaved-1f1b", virtual_stages=3,
        micro_batch=1, global_batch=2240, seq_len=2048,
        activation_checkpointing="selective", precision="mixed-16bit",
        mfu=0.542, step_time_s=39.15,
        n_params=530e9,
        notes=(
            "Sec. 6.3: 'if we scale the 530B model to 8-way data parallellism (2240 GPUs) while "
            "keeping batch size per model instance constant - i.e., the batch size is also "
            "multiplied by the data parallel size - the time per iteration increases slightly from "
            "37.83 seconds to 39.15 seconds. This results in an MFU drop from 56.0% to 54.2% ... we "
            "do not use any overlapping of gradient all-reduces with back-propagation'. Abstract: "
            "'when training a 530B parameter GPT-3 style model on 2240 NVIDIA A100 GPUs, we achieve a "
            "Model Flops Utilization of 54.2%, which is 29% faster than the 42.1% we achieve using "
            "recomputation'. global_batch = 8 x 280 = 2240 (derived); dp_strategy ddp (plain "
            "data-parallel gradient all-reduce, implied). HFU not stated for this run. "
            + _KORTHIKANTI_COMMON_NOTE
        ),
    ),
    # ---- composer / llm-foundry FSDP: MPT benchmarks (MosaicML) --------------------------------
    PublishedRun(
        name="mpt-70b-h100-64gpu",
        source=_MPT_README + " (H100 80GB BF16)",
        **_MPT_70B, **_MPT_COMMON,
        gpu="H100", gpus=64, tp=1, pp=1, cp=1, dp=64,
        micro_batch=8, global_batch=2048, seq_len=2048,
        activation_checkpointing="full", precision="bf16",
        mfu=0.4257, hfu=0.5676, tokens_per_s_per_gpu=1039.0,
        n_params=64862437376,
        notes=(
            "Row: 70b | SeqLen 2048 | 64 GPUs | h100_80gb | MFU 42.57 | HFU 56.76 | MicroBatchSize 8 | "
            "GradAccum 4 | GlobalBatchSize 2048 | Throughput 32 S/s | 66523 T/s | 1039 T/s/GPU | "
            "4194304 tokens | amp_bf16 | DEFAULT | FULL_SHARD | Activation Checkpointing True | "
            "CPUOffload False | NumParams 64862437376. " + _MPT_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="mpt-13b-h100-64gpu",
        source=_MPT_README + " (H100 80GB BF16)",
        **_MPT_13B, **_MPT_COMMON,
        gpu="H100", gpus=64, tp=1, pp=1, cp=1, dp=64,
        micro_batch=2, global_batch=128, seq_len=2048,
        activation_checkpointing="none", precision="bf16",
        mfu=0.3986, hfu=0.3986, tokens_per_s_per_gpu=4800.0,
        n_params=12853954560,
        notes=(
            "Row: 13b | SeqLen 2048 | 64 GPUs | h100_80gb | MFU 39.86 | HFU 39.86 | MicroBatchSize 2 | "
            "GradAccum 1 | GlobalBatchSize 128 | Throughput 150 S/s | 307209 T/s | 4800 T/s/GPU | "
            "262144 tokens | amp_bf16 | DEFAULT | FULL_SHARD | Activation Checkpointing False | "
            "CPUOffload False | NumParams 12853954560. A small per-GPU batch (2 sequences) over 64 "
            "GPUs. " + _MPT_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="mpt-70b-a100-80gb-64gpu",
        source=_MPT_README + " (A100 80GB)",
        **_MPT_70B, **_MPT_COMMON,
        gpu="A100", gpus=64, tp=1, pp=1, cp=1, dp=64,
        micro_batch=8, global_batch=2048, seq_len=2048,
        activation_checkpointing="full", precision="bf16",
        mfu=0.5333, hfu=0.711, tokens_per_s_per_gpu=410.0,
        n_params=64862437376,
        notes=(
            "Row: 70b | SeqLen 2048 | 64 GPUs | a100_80gb | MFU 53.33 | HFU 71.1 | MicroBatchSize 8 | "
            "GradAccum 4 | GlobalBatchSize 2048 | Throughput 12 S/s | 26274 T/s | 410 T/s/GPU | "
            "4194304 tokens | bf16 | PURE | FULL_SHARD | Activation Checkpointing True | CPUOffload "
            "False | NumParams 64862437376. " + _MPT_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="mpt-7b-a100-80gb-8gpu",
        source=_MPT_README + " (A100 80GB)",
        **_MPT_7B, **_MPT_COMMON,
        gpu="A100", gpus=8, tp=1, pp=1, cp=1, dp=8,
        micro_batch=6, global_batch=96, seq_len=2048,
        activation_checkpointing="none", precision="bf16",
        mfu=0.6423, hfu=0.6423, tokens_per_s_per_gpu=4641.0,
        n_params=6658859008,
        notes=(
            "Row: 7b | SeqLen 2048 | 8 GPUs | a100_80gb | MFU 64.23 | HFU 64.23 | MicroBatchSize 6 | "
            "GradAccum 2 | GlobalBatchSize 96 | Throughput 18 S/s | 37130 T/s | 4641 T/s/GPU | 196608 "
            "tokens | amp_bf16 | DEFAULT | FULL_SHARD | Activation Checkpointing False | CPUOffload "
            "False | NumParams 6658859008. " + _MPT_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="mpt-7b-a100-80gb-8gpu-seq65536",
        source=_MPT_README + " (A100 80GB)",
        **_MPT_7B, **_MPT_COMMON,
        gpu="A100", gpus=8, tp=1, pp=1, cp=1, dp=8,
        micro_batch=1, global_batch=16, seq_len=65536,
        activation_checkpointing="full", precision="bf16",
        mfu=0.4697, hfu=0.6263, tokens_per_s_per_gpu=1013.0,
        n_params=6918905856,
        notes=(
            "Row: 7b | SeqLen 65536 | 8 GPUs | a100_80gb | MFU 46.97 | HFU 62.63 | MicroBatchSize 1 | "
            "GradAccum 2 | GlobalBatchSize 16 | Throughput 0 S/s | 8108 T/s | 1013 T/s/GPU | 1048576 "
            "tokens | amp_bf16 | DEFAULT | FULL_SHARD | Activation Checkpointing True | CPUOffload "
            "False | NumParams 6918905856 (includes a 65536 x 4096 learned position table). Long "
            "context: attention is most of the FLOPs. " + _MPT_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="mpt-125m-a100-80gb-8gpu",
        source=_MPT_README + " (A100 80GB)",
        **_MPT_125M, **_MPT_COMMON,
        gpu="A100", gpus=8, tp=1, pp=1, cp=1, dp=8,
        micro_batch=40, global_batch=640, seq_len=2048,
        activation_checkpointing="none", precision="bf16",
        mfu=0.4479, hfu=0.4479, tokens_per_s_per_gpu=142830.0,
        n_params=125311488,
        notes=(
            "Row: 125m | SeqLen 2048 | 8 GPUs | a100_80gb | MFU 44.79 | HFU 44.79 | MicroBatchSize 40 "
            "| GradAccum 2 | GlobalBatchSize 640 | Throughput 557 S/s | 1142641 T/s | 142830 T/s/GPU | "
            "1310720 tokens | amp_bf16 | DEFAULT | FULL_SHARD | Activation Checkpointing False | "
            "CPUOffload False | NumParams 125311488. A small model: memory-bound work weighs more. "
            + _MPT_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="mpt-30b-a100-40gb-128gpu",
        source=_MPT_README + " (A100 40GB)",
        **_MPT_30B, **_MPT_COMMON,
        gpu="A100-40GB", gpus=128, tp=1, pp=1, cp=1, dp=128,
        micro_batch=6, global_batch=768, seq_len=2048,
        activation_checkpointing="full", precision="bf16",
        mfu=0.5225, hfu=0.6966, tokens_per_s_per_gpu=865.0,
        n_params=29975214080,
        notes=(
            "Row: 30b | SeqLen 2048 | 128 GPUs | a100_40gb | MFU 52.25 | HFU 69.66 | MicroBatchSize 6 "
            "| GradAccum 1 | GlobalBatchSize 768 | Throughput 54 S/s | 110803 T/s | 865 T/s/GPU | "
            "1572864 tokens | bf16 | PURE | FULL_SHARD | Activation Checkpointing True | CPUOffload "
            "False | NumParams 29975214080. " + _MPT_COMMON_NOTE
        ),
    ),
)

ALL_PUBLISHED_RUNS: tuple[PublishedRun, ...] = PUBLISHED_RUNS + MORE_PUBLISHED_RUNS


# ---------------------------------------------------------------------------------------------
# A published run as the planner's inputs
# ---------------------------------------------------------------------------------------------

# The planner's names of the data-parallel strategies (plan.space.DP_STRATEGIES): DeepSpeed ZeRO-3
# shards like FSDP; an unstated strategy over several ranks is plain DDP.
_DP_STRATEGY_NAMES = {"zero3": "fsdp", None: "ddp"}
# The planner's compute dtype for a stated precision. fp8 runs (Float8 on the linears) are planned
# at the bf16 rate (the planner has no fp8 training model); "mixed-16bit" (Megatron 2021 / 2022,
# "mixed precision") as fp16: Megatron-LM's examples of the time train with --fp16
# (examples/pretrain_gpt3_175B.sh). bf16 and fp16 plan at the same tensor-core rate.
_PLAN_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp8": "bf16", "mixed-16bit": "fp16"}
# Sequences per optimizer step where the source states none: 4 micro-batches per pipeline stage
# per data-parallel rank (a pipeline kept busy), as the report planned them before issue 19.
_UNSTATED_BATCH_MICROBATCHES_PER_STAGE = 4


def plan_model(run: PublishedRun) -> PlanModel:
    """The run's model as a transformer config: its shape and the architecture options it states.

    Options the run leaves unset keep the historic reading: a swiglu MLP means a Llama block
    (RoPE, RMSNorm, no biases), anything else a GPT-2 block (learned positions, LayerNorm, biases).
    The learned position table is sized to the run's sequence length."""
    if not run.n_layer:
        raise UserError(f"published run {run.name!r} states model-state memory only, no model shape: "
                        "there is no transformer to plan; pick a run with a shape (n_layer > 0)")
    llama = run.mlp == "swiglu"
    cfg = ModelConfig(preset="llama-8b" if llama else "gpt2", n_layer=run.n_layer, d_model=run.d_model,
                      n_head=run.n_head, n_kv_head=run.n_kv_head or 0, d_ff=run.d_ff or 0,
                      vocab_size=run.vocab_size, max_seq_len=run.seq_len, mlp=run.mlp,
                      tie_embeddings=run.tie_embeddings,
                      position=run.position or ("rope" if llama else "learned"),
                      rotary_fraction=run.rotary_fraction,
                      norm=run.norm or ("rmsnorm" if llama else "layernorm"),
                      bias=(not llama) if run.bias is None else run.bias,
                      parallel_block=run.parallel_block, embedding_norm=run.embedding_norm,
                      # a mixture of experts in every block, each expert as wide as d_ff
                      moe_experts=run.n_experts, moe_top_k=run.experts_top_k or 2)
    return PlanModel(run.name, cfg)


def _virtual_stages(run: PublishedRun) -> int:
    """Stages per pipeline rank of an interleaved schedule whose source does not state them: the
    fewest (above one) that split each rank's blocks evenly, else 2 (the historic default). A
    105-layer model on 35 stages gets 3 chunks of one block, not 2 uneven ones."""
    if run.virtual_stages:
        return run.virtual_stages
    per_rank = run.n_layer // run.pp if run.n_layer % run.pp == 0 else 0
    return next((v for v in range(2, per_rank + 1) if per_rank % v == 0), 2)


def plan_strategy(run: PublishedRun) -> Strategy:
    """The run's parallel layout as a planner Strategy: degrees, micro-batch and gradient
    accumulation, schedule, activation checkpointing, precision, sequence parallelism, the
    stated pipeline split and the attention implementation.

    Unstated values: micro-batch 1; global batch 4 micro-batches per pipeline stage per
    data-parallel rank; schedule 1F1B; attention flash; sequence parallelism on with tp > 1."""
    dp_strategy = _DP_STRATEGY_NAMES.get(run.dp_strategy, run.dp_strategy) if run.dp > 1 else "none"
    micro = run.micro_batch or 1
    global_batch = run.global_batch or run.dp * micro * max(run.pp, 1) * _UNSTATED_BATCH_MICROBATCHES_PER_STAGE
    accum = max(1, global_batch // (run.dp * micro))
    schedule = (run.pp_schedule or "1f1b").lower()
    schedule = "interleaved-1f1b" if "interleaved" in schedule else ("gpipe" if "gpipe" in schedule else "1f1b")
    virtual = _virtual_stages(run) if schedule == "interleaved-1f1b" else 1
    if run.precision not in _PLAN_PRECISION:
        raise UserError(f"published run {run.name!r}: precision {run.precision!r} has no planner dtype; "
                        f"use one of {', '.join(_PLAN_PRECISION)}")
    if run.attention is not None and run.attention not in ATTENTION_IMPLEMENTATIONS:
        raise UserError(f"published run {run.name!r}: attention {run.attention!r} is not one of "
                        f"{', '.join(ATTENTION_IMPLEMENTATIONS)}")
    sequence_parallel = run.tp > 1 if run.sequence_parallel is None else (run.sequence_parallel and run.tp > 1)
    return Strategy(dp_strategy=dp_strategy, dp=run.dp, tp=run.tp, pp=run.pp, cp=run.cp, ep=run.ep,
                    sequence_parallel=sequence_parallel, micro_batch=micro, grad_accum=accum,
                    ac=run.activation_checkpointing or "none", precision=_PLAN_PRECISION[run.precision],
                    pp_schedule=schedule, pp_virtual=virtual, pp_layers=run.pp_layers,
                    attention=run.attention or "flash", fused_loss=run.fused_loss)


def plan_gpu(run: PublishedRun) -> str:
    """The GPU name to plan the run's cluster with (plan.hardware.make_cluster("8x<name>")).
    torchtitan's 96 GB HBM2e H100 plans as the H100: capacity does not enter the predicted speed."""
    return run.gpu.replace("-96GB", "")
