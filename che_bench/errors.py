"""The one exception type the CLI turns into a one-line message and exit code 2."""


class CheBenchError(ValueError):
    """A user-facing error: bad input, impossible combination, unusable store."""
