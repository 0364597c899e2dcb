"""The hardware flags of `slipstream plan` and `slipstream cost`: which GPUs and how many, the
links between them, probe results, and a GPU of one's own.

    --gpus 8xH100 [--nodes 4] [--intra nvlink4 | 300GB/s] [--inter ib-ndr | ib:400Gb/s@5us | 12.5GB/s]
                  [--nics-per-node 4] [--probe node.json --probe net.json] [--memory-gib 70]
    --gpus 8xmy_gpu.toml                                  a GPU described by a small TOML file
    --gpus 8xacme --peak-tflops bf16=400,fp8=800 --gpu-memory-gib 64 --gpu-mem-bw 2000
    --gpus 8xH100 --gpu-memory-gib 96                     a known GPU with some numbers changed
(plan.hardware.make_cluster documents what each one means.)
"""

from __future__ import annotations

import argparse


def add_hardware_arguments(p: argparse.ArgumentParser) -> None:
    """Register the cluster flags on a command's parser."""
    p.add_argument("--gpus", required=True,
                   help="GPUs per node and their kind: COUNTxNAME (e.g. 8xH100, 8xMI300X, 2xcpu) or COUNTxFILE.toml "
                        "for a GPU described by a file")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--intra", default=None,
                   help="link between the GPUs of a node: a name (nvlink4, pcie5, xgmi-mi300x, ...) or an achievable "
                        "bus bandwidth such as 300GB/s (default: the GPU's usual one)")
    p.add_argument("--inter", default=None,
                   help="network between nodes, per NIC: a name (ib-ndr, roce-400g, ethernet-100g, ...), an achievable "
                        "bus bandwidth (12.5GB/s, 100Gb/s: GB = bytes, Gb = bits) or a wire rate with its kind "
                        "(ib:400Gb/s, roce:/eth:...), optionally @LATENCY (e.g. @5us)")
    p.add_argument("--nics-per-node", type=int, default=None,
                   help="NICs per node; each GPU then gets NICS x the --inter link / GPUs per node (default: one "
                        "per GPU, or one per node for ethernet-*)")
    p.add_argument("--probe", action="append", default=None, metavar="FILE",
                   help="a `slipstream probe --out FILE` result: measured rates and links replace the defaults; "
                        "give it again for more files (e.g. one node's and a multi-node one), which are merged")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="usable memory per GPU (default: datasheet minus a reserve)")
    p.add_argument("--peak-tflops", default=None, metavar="DTYPE=TFLOPS,...",
                   help="dense peak TFLOP/s per dtype (bf16, fp16, tf32, fp32, fp8) of the GPU, e.g. bf16=400,fp8=800: "
                        "describes a GPU not in the table, or changes a known one")
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="the GPU's datasheet memory, GiB")
    p.add_argument("--gpu-mem-bw", type=float, default=None, metavar="GB/S", help="the GPU's memory bandwidth, GB/s")
    p.add_argument("--gpu-generation", default=None,
                   help="the GPU's architecture (volta, turing, ampere, ada, hopper, blackwell, cdna2, cdna3)")


def cluster_from_args(args: argparse.Namespace, cpu=None):
    """The plan.hardware.Cluster these flags describe. `cpu` is observe.peaks.this_cpu(), used
    by a `cpu` cluster only."""
    from slipstream.plan.gpus import gpu_from_flags
    from slipstream.plan.hardware import make_cluster

    described = gpu_from_flags(args.peak_tflops, args.gpu_memory_gib, args.gpu_mem_bw, args.gpu_generation)
    return make_cluster(args.gpus, nodes=args.nodes, intra=args.intra, inter=args.inter, probe=args.probe,
                        memory_gib=args.memory_gib, cpu=cpu, gpu=described, nics_per_node=args.nics_per_node)


def hardware_input_files(args: argparse.Namespace) -> list[str]:
    """The files these flags read (probe results, a GPU description), e.g. for refuse_same_file."""
    from slipstream.errors import UserError
    from slipstream.plan.hardware import parse_gpus

    files = list(args.probe or [])
    try:
        name = parse_gpus(args.gpus)[1]
    except UserError:  # a bad --gpus is reported by cluster_from_args, with its fix
        return files
    return files + ([name] if name.lower().endswith(".toml") else [])
