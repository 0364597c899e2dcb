"""`slipstream report` and `slipstream compare` (being written)."""


def add_commands(sub) -> None:
    pass
