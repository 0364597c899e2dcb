"""`slipstream checkpoint inspect|export` (being written)."""


def add_checkpoint_parser(sub) -> None:
    """Register `slipstream checkpoint ...` on the top-level subparsers."""
