"""Conformance checks of plugins and the device self-test."""
