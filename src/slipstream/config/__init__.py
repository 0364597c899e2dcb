"""Typed configuration: schema (dataclasses with doc strings) and loading (TOML + overrides)."""

from slipstream.config.load import config_to_toml, load_config
from slipstream.config.schema import Config

__all__ = ["Config", "load_config", "config_to_toml"]
