"""Published runs added for issue 19: 2021-2023 runs on A100 / H100 clusters (Megatron-DeepSpeed,
metaseq, Megatron-LM, composer / llm-foundry), 8 to 2,520 GPUs, non-power-of-two layouts, and
the whole set, ALL_PUBLISHED_RUNS. A module of their own so that each file of run records reads
in one sitting; the record type and how to read its figures are in plan/published.py.

Kept apart from PUBLISHED_RUNS until the report's fit and its committed pins move to the whole
set (ALL_PUBLISHED_RUNS); then the two names can become one.
"""

from __future__ import annotations

# The Megatron-LM SC21 paper's source, hardware and common note: both sets quote it.
from slipstream.plan.published import (MEGATRON_COMMON_NOTE, MEGATRON_HW, MEGATRON_PAPER, PUBLISHED_RUNS,
                                       PublishedRun)

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

_MEGATRON_TABLE2 = MEGATRON_PAPER.replace("Table 1 (weak-scaling throughput), Sec. 5 and 5.1",
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
        source=MEGATRON_PAPER,
        n_layer=24, d_model=2304, n_head=24, n_kv_head=24, d_ff=4 * 2304, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        gpu="A100", gpus=32, gpus_per_node=8, network=MEGATRON_HW,
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
            "model.' dp = 32 (derived). " + MEGATRON_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="megatron-gpt-310b-1920gpu",
        stack="megatron",
        source=MEGATRON_PAPER,
        n_layer=96, d_model=16384, n_head=128, n_kv_head=128, d_ff=4 * 16384, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        gpu="A100", gpus=1920, gpus_per_node=8, network=MEGATRON_HW,
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
            "non-power-of-two data-parallel degree). " + MEGATRON_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="megatron-gpt-530b-2520gpu",
        stack="megatron",
        source=MEGATRON_PAPER,
        n_layer=105, d_model=20480, n_head=128, n_kv_head=128, d_ff=4 * 20480, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        gpu="A100", gpus=2520, gpus_per_node=8, network=MEGATRON_HW,
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
            + MEGATRON_COMMON_NOTE
        ),
    ),
    # ---- Megatron-LM SC21 Table 2: DeepSpeed ZeRO-3 without model parallelism ------------------
    PublishedRun(
        name="megatron-zero3-gpt3-175b-384gpu",
        stack="deepspeed",
        source=_MEGATRON_TABLE2,
        n_layer=96, d_model=12288, n_head=96, n_kv_head=96, d_ff=4 * 12288, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        gpu="A100", gpus=384, gpus_per_node=8, network=MEGATRON_HW,
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
            "which count the recomputed forward either way. " + MEGATRON_COMMON_NOTE
        ),
    ),
    PublishedRun(
        name="megatron-zero3-gpt3-175b-1536gpu",
        stack="deepspeed",
        source=_MEGATRON_TABLE2,
        n_layer=96, d_model=12288, n_head=96, n_kv_head=96, d_ff=4 * 12288, vocab_size=51200,
        mlp="gelu", tie_embeddings=True,
        gpu="A100", gpus=1536, gpus_per_node=8, network=MEGATRON_HW,
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
            "the rest. " + MEGATRON_COMMON_NOTE
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
