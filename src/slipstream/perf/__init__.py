"""Performance tools that sit above the trainer: they build and run training jobs (or their
parts) to measure them. Benchmarks (the optimization ladder, overhead, sharding, checkpoint
and fused-loss benchmarks), the environment probe, `slipstream profile` (profile_run),
the doctor that reads traces and names bottlenecks, the timer, and the reproducibility
record. The building blocks they measure live in lower layers; the Trainer's own step
profiler is slipstream.observe.profiling, and seeds/determinism are slipstream.runtime.
"""
