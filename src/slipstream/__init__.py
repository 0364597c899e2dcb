"""slipstream: a PyTorch-native training system that measures, explains, plans and applies
performance optimizations as config switches."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so `slipstream --help` and config tools start without importing torch.
    if name in ("Trainer", "JobInfo"):
        from slipstream.train import trainer

        return getattr(trainer, name)
    if name in ("Config", "load_config"):
        from slipstream import config

        return getattr(config, name)
    raise AttributeError(name)


__all__ = ["Trainer", "JobInfo", "Config", "load_config", "__version__"]
