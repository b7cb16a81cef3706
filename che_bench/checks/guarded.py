"""How every conformance check runs (``guarded``): on one torch thread, with the caller's
random state and thread count left as they were, an exception turned into one failure line."""

from __future__ import annotations

from collections.abc import Callable

import torch

from che_bench.errors import one_line


def guarded(
    check: str, run: Callable[[], list[str]], diagnose: Callable[[], str | None] | None = None
) -> list[str]:
    """``run()`` on one torch thread (these tiny models slow down many-fold with more on a
    busy machine), leaving the caller's global RNG and thread count as they were; an
    exception is one line, with ``diagnose()``'s finding (if any) on what caused it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            return run()
    except Exception as exc:
        line = f"{check}: expected to run, got {type(exc).__name__}: {one_line(exc)}"
        cause = _diagnosis(diagnose)
        return [line if cause is None else f"{line} ({cause})"]
    finally:
        torch.set_num_threads(threads)


def _diagnosis(diagnose: Callable[[], str | None] | None) -> str | None:
    try:
        return None if diagnose is None else diagnose()
    except Exception:  # the diagnosis itself failed: the error line stands alone
        return None
