"""Tuners: tools that run real trainings to choose settings. `system` measures layouts;
`hparams` (with `space`, `study`, `hparams_trial`, `hparams_report`) searches hyper-parameters
with Optuna; `lr_finder` runs the learning-rate range test; `batch_finder` finds the largest
micro-batch and, with `noise_scale`, the critical batch size; `process` starts and stops their
trial processes."""
