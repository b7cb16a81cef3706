"""The one exception type the CLI turns into a one-line message and exit code 2."""

from collections.abc import Iterable


class CheBenchError(ValueError):
    """A user-facing error: bad input, impossible combination, unusable store."""


def accepted_text(names: Iterable[str], noun: str = "options", verb: str = "takes") -> str:
    """What an error says a thing accepts: "its options: a, b", or "it takes no options"
    (never "options: none", which reads as an option, or the encoding, named none)."""
    listed = ", ".join(names)
    return f"its {noun}: {listed}" if listed else f"it {verb} no {noun}"


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line: its first non-blank line, joined to the next when it
    only announces what follows (ends with ":"), as in load_state_dict's "Error(s) in loading
    state_dict for Encoder:" above the size mismatch that says what is wrong."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"
    return lines[0] if lines else ""
