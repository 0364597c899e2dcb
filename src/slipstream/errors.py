"""User-facing errors: the CLI prints these as one clear message and exits non-zero."""


class UserError(Exception):
    """A problem with the user's input (config, data, checkpoint, CLI argument).

    The message must name what is wrong and how to fix it. The CLI prints it without
    a traceback and exits with code 2.
    """
