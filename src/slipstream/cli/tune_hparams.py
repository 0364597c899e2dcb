"""`slipstream tune hparams` (being written)."""


def add_commands(group) -> None:
    pass
