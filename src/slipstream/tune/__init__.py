"""Tuners: tools that run real trainings to choose settings. `system` measures layouts, `hparams`
searches hyper-parameters with Optuna, `lr_finder` and `batch_finder` measure the learning-rate
range and the batch size; `process` starts and stops their trial processes."""
