"""Pinned run ids: the id of a stored run must never change by accident.

The ids below were computed before the settings were declared in one place
(``che_bench.settings``); a change here must be deliberate (stored runs would no longer be
found by their configuration).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from che_bench.cli import build_parser
from che_bench.commands.run import cell_configs
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


@pytest.mark.parametrize(
    "arch, options",
    [
        ("deltanet", {"negative_eigenvalues": False}),
        ("mamba", {"negative_eigenvalues": False, "d_state": 16}),
        ("deltaproduct", {"householder": 2}),
        ("tape_rnn", {"n_tapes": 1, "computation_steps_mult": 0}),
    ],
)
def test_an_option_spelt_out_at_its_default_is_the_run_without_it(arch, options):
    """``--arch-option negative_eigenvalues=false`` is the plain model: the same run id, the same
    recorded options; another value, or another type (left to the option's check), is not."""
    plain = make_config("parity_check", arch=arch)
    spelt = make_config("parity_check", arch=arch, arch_options=options)
    assert spelt.run_id() == plain.run_id() and spelt.arch_options == {}
    key, value = next(iter(options.items()))
    changed = {key: not value if isinstance(value, bool) else value + 1}
    assert make_config("parity_check", arch=arch, arch_options=changed).run_id() != plain.run_id()


@pytest.mark.parametrize(
    "pe, options, changed",
    [
        ("alibi", {"alibi_mode": "symmetric_offset"}, {"alibi_mode": "symmetric"}),
        ("rope", {"rope_base": 10000}, {"rope_base": 500}),  # an integer for a float default
        ("t5", {"t5_num_buckets": 32, "share_across_layers": True}, {"t5_num_buckets": 16}),
    ],
)
def test_an_encoding_option_spelt_out_at_its_default_is_the_run_without_it(pe, options, changed):
    """``--pe-option alibi_mode=symmetric_offset`` is plain ALiBi: the same run id and recorded
    options, for the transformer and for CHE's autoregressive transformer alike."""
    plain = make_config("parity_check", pe)
    spelt = make_config("parity_check", pe, pe_options=options)
    assert spelt.run_id() == plain.run_id() and spelt.pe_options == {}
    assert make_config("parity_check", pe, pe_options=changed).run_id() != plain.run_id()
    arch = "autoregressive_transformer"
    plain = make_config("reverse_string", pe, arch=arch)
    spelt = make_config("reverse_string", pe, arch=arch, pe_options=options)
    assert spelt.run_id() == plain.run_id() and spelt.arch_options == {"pe": pe}


def test_a_switch_given_as_a_number_is_not_its_default():
    """0 for a switch whose default is false reaches the encoding's check, not the run id."""
    config = make_config("parity_check", "sin_cos", pe_options={"sin_cos_backward": 0})
    assert config.pe_options == {"sin_cos_backward": 0}


def test_the_long_runs_documented_in_results_resume_under_their_ids():
    """docs/results.md's commands for the long modular-arithmetic runs name the runs whose
    checkpoints are committed beside their stores (while they last): another id would start
    them again from step 0."""
    results = Path(__file__).parents[1] / "docs" / "results.md"
    commands = {
        line: cell_configs(build_parser().parse_args(shlex.split(line)[1:]))[0].run_id()
        for line in results.read_text().splitlines()
        if line.startswith("che-bench run") and "state_tracking_budget/" in line
    }
    long_runs = {run_id for line, run_id in commands.items() if "long.sqlite" in line}
    assert long_runs == {"ee9229c8f2f4", "9965b4bf8060", "9e8c47c26c2e"}
    checkpoints = results.parents[1] / "results/laptop/state_tracking_budget/checkpoints"
    assert {path.stem for path in checkpoints.glob("*.pt")} <= set(commands.values())
