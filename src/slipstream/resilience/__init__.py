"""Surviving failures: preemption signals, a step watchdog, NaN/spike guards, checkpoint-interval advice."""
