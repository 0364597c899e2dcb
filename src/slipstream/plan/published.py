"""Published large-scale training results the planner is checked against (docs/planner.md,
"Published runs: sources and quoted figures"): the record type, PublishedRun, and the first
set of runs, PUBLISHED_RUNS (Llama 3, Megatron-LM SC21, torchtitan, llm.c, ZeRO Figure 1).

Every number is quoted from its source; fields the source does not state are None (or the
default that keeps the planner's historic reading, noted per field). A value the source only
implies, or that we derived from stated ones, says so in the run's notes, marked "implied" or
"derived". The runs added later (issue 19) and the whole set, ALL_PUBLISHED_RUNS, are in
plan/published_more.py; plan/published_inputs.py turns a run into the planner's inputs
(`plan_model(run)`, `plan_strategy(run)`).

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
    # collectives (plan/timing_comm.py). "torch" where the source names PyTorch DDP / FSDP or a
    # stack on them (torchtitan, llm-foundry, metaseq's FSDP, Meta's Llama 3 stack), or names none.
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

MEGATRON_PAPER = (
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, Narayanan, "
    "Shoeybi, Casper, LeGresley, Patwary, Korthikanti, Vainbrand, Kashinkunti, Bernauer, "
    "Catanzaro, Phanishayee, Zaharia (NVIDIA et al.), SC21 / 2021, Table 1 (weak-scaling "
    "throughput), Sec. 5 and 5.1; https://arxiv.org/abs/2104.04473"
)
MEGATRON_HW = (
    "Selene: 8x NVIDIA 80-GB A100 per node over NVLink/NVSwitch; eight 200Gbps HDR InfiniBand "
    "HCAs per node for application communication (+2 for storage); three-level fat tree"
)
# The 2021 Megatron stack materializes the attention scores: Sec. 4.2 of the paper describes
# "custom kernels to enable the fusion of scale, mask, and softmax (reduction) operations"
# (no flash attention before 2022), and it has no sequence parallelism (added by Korthikanti et
# al. 2022, below). Both are recorded as attention="materialized", sequence_parallel=False.
MEGATRON_COMMON_NOTE = (
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
        source=MEGATRON_PAPER,
        n_layer=128, d_model=25600, n_head=160, n_kv_head=160, d_ff=4 * 25600, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        gpu="A100", gpus=3072, gpus_per_node=8, network=MEGATRON_HW,
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
            "peak'. dp = 3072/(8*64) = 6 (derived). " + MEGATRON_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="megatron-gpt-145b-1536gpu",
        stack="megatron",
        source=MEGATRON_PAPER,
        n_layer=80, d_model=12288, n_head=96, n_kv_head=96, d_ff=4 * 12288, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        gpu="A100", gpus=1536, gpus_per_node=8, network=MEGATRON_HW,
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
            "dp = 1536/(8*8) = 24 (derived). " + MEGATRON_COMMON_NOTE
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
