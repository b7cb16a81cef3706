"""Fixtures shared by the tests of plugins and conformance checks, and DAPE's filter at
evaluation in either implementation."""

from __future__ import annotations

import os
import sys

import pytest

from che_bench import plugins
from che_bench.encodings.base import ENCODINGS
from che_bench.model.architectures import ARCHITECTURES
from che_bench.model.dape import native
from che_bench.tasks import TASKS


@pytest.fixture
def scratch_registries(monkeypatch):
    """Encodings, tasks, architectures and plugins a test registers or loads disappear after it
    (and so do the plugin modules it imported, the CHE_BENCH_PLUGINS and CHE_BENCH_NO_PLUGINS
    it set and the folders it added to sys.path)."""
    for registry in (ENCODINGS, TASKS, ARCHITECTURES):
        for attribute in ("_entries", "_aliases", "_origins"):
            monkeypatch.setattr(registry, attribute, dict(getattr(registry, attribute)))
    monkeypatch.setattr(plugins, "_loaded", dict(plugins._loaded))
    monkeypatch.setattr(plugins, "_loaded_modules", set(plugins._loaded_modules))
    # Installed plugins are scanned once per process; a test that wants a scan asks for one.
    monkeypatch.setattr(plugins, "_configured", True)
    # Set, then deleted: undoing both also deletes what add_modules writes there.
    monkeypatch.setenv(plugins.ENVIRONMENT_VARIABLE, "")
    monkeypatch.delenv(plugins.ENVIRONMENT_VARIABLE)
    monkeypatch.setenv(plugins.DISABLE_VARIABLE, "")  # (--no-plugins sets it)
    monkeypatch.delenv(plugins.DISABLE_VARIABLE)
    monkeypatch.setattr(sys, "path", list(sys.path))  # (plugins search the current folder)
    modules = set(sys.modules)
    yield
    for name in set(sys.modules) - modules:
        if name.startswith(("che_bench_loglength", "plugin_", "my_plugin")):
            del sys.modules[name]


#: CI sets it: there DAPE's native filter must build, and its tests must run.
REQUIRED_NATIVE_FILTER = os.environ.get("CHE_BENCH_REQUIRE_NATIVE_FILTER") == "1"


def require_native_filter(monkeypatch) -> native.NativeFilter:
    """The kernel, switched on and built afresh for the test; a skip without a compiler (a
    failure where CI requires it)."""
    monkeypatch.setenv(native.SWITCH, "1")
    native.native_filter.cache_clear()
    kernel = native.native_filter()
    if kernel is None:
        message = "no C compiler built DAPE's native filter"
        if REQUIRED_NATIVE_FILTER:
            pytest.fail(message)
        pytest.skip(message)
    return kernel


@pytest.fixture
def native_kernel(monkeypatch):
    """DAPE's native filter, for its own tests."""
    yield require_native_filter(monkeypatch)
    native.native_filter.cache_clear()


@pytest.fixture(params=["chunks", "native"])
def filter_implementation(request, monkeypatch):
    """The test's DAPE filter at evaluation: ``chunks`` or the native kernel."""
    if request.param == "native":
        require_native_filter(monkeypatch)
    else:
        monkeypatch.setenv(native.SWITCH, "0")
        native.native_filter.cache_clear()
    yield request.param
    native.native_filter.cache_clear()
