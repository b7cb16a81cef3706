"""Fixtures shared by the tests of plugins and conformance checks, DAPE's filter at
evaluation and the delta rule of Gated DeltaNet and DeltaProduct in either implementation."""

from __future__ import annotations

import os
import sys

import pytest

from che_bench import plugins
from che_bench.encodings.base import ENCODINGS
from che_bench.model.architectures import ARCHITECTURES
from che_bench.model.dape import native
from che_bench.model.state_tracking import delta_rule_native
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
    monkeypatch.setattr(plugins, "_sources", dict(plugins._sources))
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


#: CI sets it: there the native kernels must build, and their tests must run.
REQUIRED_NATIVE_KERNELS = os.environ.get("CHE_BENCH_REQUIRE_NATIVE_KERNELS") == "1"


def require_native(monkeypatch, module, loader, what):
    """``loader()``'s kernel, switched on and built afresh for the test; a skip without a
    compiler (a failure where CI requires it)."""
    monkeypatch.setenv(module.SWITCH, "1")
    loader.cache_clear()
    kernel = loader()
    if kernel is None:
        message = f"no C compiler built {what}"
        if REQUIRED_NATIVE_KERNELS:
            pytest.fail(message)
        pytest.skip(message)
    return kernel


def require_native_filter(monkeypatch) -> native.NativeFilter:
    return require_native(monkeypatch, native, native.native_filter, "DAPE's native filter")


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


@pytest.fixture
def native_delta_rule(monkeypatch):
    """The delta rule's native kernel, for its own tests."""
    loader = delta_rule_native.native_delta_rule
    yield require_native(monkeypatch, delta_rule_native, loader, "the delta rule's native kernel")
    loader.cache_clear()


@pytest.fixture(params=["chunkwise", "native"])
def delta_rule_implementation(request, monkeypatch):
    """How ``delta_product`` runs a gated rule or a product: ``chunkwise`` or ``native``."""
    loader = delta_rule_native.native_delta_rule
    if request.param == "native":
        require_native(monkeypatch, delta_rule_native, loader, "the delta rule's native kernel")
    else:
        monkeypatch.setenv(delta_rule_native.SWITCH, "0")
        loader.cache_clear()
    yield request.param
    loader.cache_clear()
