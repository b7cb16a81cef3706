"""Evaluating trained models: range evaluation, re-evaluation, predictions, maps."""
