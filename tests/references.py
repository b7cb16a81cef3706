"""The field's reference implementations, imported for tests only (the ``references`` extra:
fla-core with triton, xlstm, mambapy). Without the extra a test skips with the reason; CI sets
``CHE_BENCH_REQUIRE_REFERENCES`` so that a missing package fails instead."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

REQUIRE_REFERENCES = "CHE_BENCH_REQUIRE_REFERENCES"


def reference(module: str) -> ModuleType:
    """``module`` imported, or the test skipped (failed under ``CHE_BENCH_REQUIRE_REFERENCES``)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        reason = f"{module} not importable ({exc}); pip install -e '.[references]'"
        if os.environ.get(REQUIRE_REFERENCES):
            pytest.fail(f"{REQUIRE_REFERENCES} is set but {reason}")
        pytest.skip(reason)
