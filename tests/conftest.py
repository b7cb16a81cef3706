"""Fixtures shared by the tests of plugins and conformance checks."""

from __future__ import annotations

import sys

import pytest

from che_bench import plugins
from che_bench.encodings.base import ENCODINGS
from che_bench.model.architectures import ARCHITECTURES
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
