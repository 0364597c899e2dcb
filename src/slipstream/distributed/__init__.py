"""Scale-out: the parallel dimensions, data-parallel wrapping, DDP communication hooks and launchers.

Everything runs on `torch.distributed` (NCCL on GPUs, gloo on CPU) started by torchrun:
slipstream writes no collective and no launcher protocol of its own.
"""
