"""`slipstream config show|reference`: the resolved config as TOML; the config reference.

    slipstream config show [--config FILE] [--section.key=value ...]
    slipstream config reference
"""

from __future__ import annotations

import argparse

from slipstream.cli._common import load, with_config


def cmd_config_show(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.config.load import config_to_toml

    print(config_to_toml(load(args, extra)), end="")
    return 0


def cmd_config_reference(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.config.load import reference_markdown

    print(reference_markdown())
    return 0


def add_commands(sub) -> None:
    """Register `config show` and `config reference` on the top-level subparsers."""
    config = sub.add_parser("config", help="show the resolved config").add_subparsers(dest="config_cmd", required=True)
    p = with_config(config.add_parser("show", help="print the resolved config as TOML"))
    p.set_defaults(func=cmd_config_show)
    p = config.add_parser("reference", help="print the config reference (markdown)")
    p.set_defaults(func=cmd_config_reference)
