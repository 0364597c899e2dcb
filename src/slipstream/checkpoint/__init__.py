"""Checkpoint save/load/resume (DCP-based, atomic)."""
