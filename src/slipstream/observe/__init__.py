"""Observability: environment capture, device peaks (for MFU), memory, loggers, console, step profiler.

Submodules are imported explicitly by their users (e.g. `from slipstream.observe.loggers
import JsonlLogger`) so that importing this package stays cheap and optional
dependencies such as tensorboard or wandb are only touched when they are used.
"""
