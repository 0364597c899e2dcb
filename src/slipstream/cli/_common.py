"""Helpers shared by the command-group modules: config loading from `--config` + overrides, common flags."""

from __future__ import annotations

import argparse

from slipstream.errors import UserError


def no_extra(extra: list[str]) -> None:
    """A command without config overrides refuses leftover arguments."""
    if extra:
        raise UserError(f"unexpected arguments: {' '.join(extra)}")


def load(args: argparse.Namespace, extra: list[str]):
    """The Config of `--config FILE` plus the `--section.key=value` leftovers."""
    from slipstream.config import load_config
    from slipstream.config.load import split_overrides

    return load_config(args.config, split_overrides(extra))


def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--config", help="TOML config file (may `extends` another)")
    return p


def add_force(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--force: the one way to replace an existing output file (slipstream/outputs.py)."""
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    return p
