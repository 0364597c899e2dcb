"""The training loop (Trainer), schedules, and the language-model job."""
