"""The one exception type the CLI turns into a one-line message and exit code 2."""


class CheBenchError(ValueError):
    """A user-facing error: bad input, impossible combination, unusable store."""


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line: its first non-blank line, joined to the next when it
    only announces what follows (ends with ":"), as in load_state_dict's "Error(s) in loading
    state_dict for Encoder:" above the size mismatch that says what is wrong."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"
    return lines[0] if lines else ""
