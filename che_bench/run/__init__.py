"""Executing runs: the runner, packs, sweeps and their backends, kept models."""
