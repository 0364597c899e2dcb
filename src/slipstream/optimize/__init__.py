"""Single-device optimizations, each applied from outside the model as one switch."""
