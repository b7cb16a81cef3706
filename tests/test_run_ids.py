"""Pinned run ids: the id of a stored run must never change by accident.

The ids below were computed before the settings were declared in one place
(``che_bench.settings``); a change here must be deliberate (stored runs would no longer be
found by their configuration).
"""

from __future__ import annotations

import pytest

from che_bench.config import make_config

PINNED = [
    ("872b963053d2", ("reverse_string", "alibi", None, "quick"), {}),
    ("8e8dffbe5f5b", ("missing_duplicate", "kerple", None, "paper"), {"seed": 3, "lr": 3e-4}),
    # A member of a packed table cell: --seeds/--lrs give it a length seed.
    ("0b61ad320727", ("reverse_string", "rope", None, "paper"),
     {"seed": 2, "lr": 5e-4, "length_seed": 0}),
    ("36324374efed", ("parity_check", "fire", 3, "smoke"),
     {"dape_width": 16, "dape_variant": "concat", "steps": 50}),
    ("47f1f0d32f84", ("associative_recall", "random_alibi", 1, "smoke"),
     {"task_params": {"value_mode": "iid"}, "pe_options": {"randomize_at_eval": False},
      "dropout_at_eval": True, "score_from_42": True, "test_lengths": "41:60"}),
]


@pytest.mark.parametrize("run_id, arguments, overrides", PINNED)
def test_run_ids_are_pinned(run_id, arguments, overrides):
    assert make_config(*arguments, **overrides).run_id() == run_id
