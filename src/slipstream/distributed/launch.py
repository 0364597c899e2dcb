"""`slipstream launch`: local torchrun, Slurm sbatch scripts, Kubernetes PyTorchJobs (being written)."""


def add_launch_parser(sub) -> None:
    """Register `slipstream launch ...` on the top-level subparsers."""
