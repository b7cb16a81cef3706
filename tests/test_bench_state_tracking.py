"""benchmarks/bench_state_tracking.py on a tiny configuration: each state-tracking model's
training step and evaluation with che-bench's kernel and, where the ``references`` extra is
installed, with the field's reference recurrence swapped into the same model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from che_bench.model.state_tracking import MODELS
from tests.references import reference

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_state_tracking.py"
TINY = ["--width", "8", "--heads", "2", "--layers", "1", "--batch", "4", "--train-length", "5",
        "--steps", "1", "--eval-lengths", "7", "--eval-batch", "2"]
NAMES = [model.name for model in MODELS]


def run_script(*arguments: str) -> list[str]:
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY, *arguments],
                          capture_output=True, text=True, check=True, timeout=600)
    return done.stdout.splitlines()


def kernel_rows(lines: list[str]) -> dict[tuple[str, str], list[str]]:
    """(model, kernel) -> the row's other cells, for the timed rows."""
    rows = {}
    for line in lines:
        cells = line.split()
        if len(cells) > 2 and cells[0] in NAMES and "not installed" not in line:
            rows[cells[0], cells[1]] = cells[2:]
    return rows


@pytest.fixture(scope="module")
def output() -> list[str]:
    return run_script()


def test_every_model_is_timed_with_che_bench_s_kernel(output):
    assert output[0].startswith("CPU: ") and "1 thread(s)" in output[0]
    assert output[1].startswith("load average (1, 5, 15 min) before: ")
    assert output[-1].startswith("load average (1, 5, 15 min) after: ")
    rows = kernel_rows(output)
    ours = {model: cells for (model, kernel), cells in rows.items()
            if kernel.startswith("che-bench:")}
    assert list(ours) == NAMES
    # train ms, ref/ours (1 for ours), kernel ms, its ref/ours, no logit difference,
    # evaluation seconds.
    assert all(float(cells[0]) >= 0 and cells[1] == "1.00" and float(cells[2]) > 0
               and cells[3:5] == ["1.00", "-"] and float(cells[5]) >= 0
               for cells in ours.values())


def test_each_reference_computes_the_same_model_and_is_timed_beside_ours(output):
    for package in ("fla.ops.delta_rule.naive", "xlstm.blocks.mlstm.backends", "mambapy.mamba"):
        reference(package)
    rows = kernel_rows(output)
    references = {(model, kernel): cells for (model, kernel), cells in rows.items()
                  if not kernel.startswith("che-bench:")}
    assert sorted(references) == sorted([
        ("mamba", "mambapy:selective_scan_seq"),
        ("deltanet", "fla:delta_rule_recurrence"),
        ("gated_deltanet", "fla:naive_recurrent_gated_delta_rule"),
        ("deltaproduct", "fla:naive_recurrent_gated_delta_product"),
        ("mlstm", "xlstm:recurrent_step_stabilized_simple"),
        ("mlstm", "xlstm:parallel_stabilized_simple"),
        ("slstm", "xlstm:slstm_forward"),
    ])
    # The swapped kernel computes the same logits (float32), so the timings compare one model.
    assert all(float(cells[4]) < 1e-4 and float(cells[1]) > 0 and float(cells[3]) > 0
               for cells in references.values())
    goals = [line for line in output if line.lstrip().startswith("goal (")]
    assert len(goals) == 6  # every step-by-step reference; not xlstm's parallel form
    verdict = r"training step [0-9.]+x \((met|NOT met)\), kernel alone [0-9.]+x \((met|NOT met)\)$"
    assert all(re.search(verdict, line) for line in goals)
    # Each goal line is followed by the bound the rest of the step sets.
    bounds = [output[output.index(line) + 1] for line in goals]
    bound = r"^  bound: the step without its kernel \(a free stand-in\) takes \d+ ms, so no kernel "
    assert all(re.search(bound + r"gives more than [0-9.]+x$", line) for line in bounds)


def test_the_evaluation_runs_in_a_fresh_process_with_the_kernel_swapped_there():
    reference("xlstm.blocks.slstm.src.vanilla")
    rows = kernel_rows(run_script("--models", "slstm", "--peak-memory"))
    assert list(rows) == [("slstm", "che-bench:slstm_scan"), ("slstm", "xlstm:slstm_forward")]
    # ..., evaluation seconds, its peak MiB
    assert all(len(cells) == 7 and float(cells[6]) >= 0 for cells in rows.values())


def test_deltaproduct_s_lengths_set_the_defaults_that_flags_given_beside_them_override():
    """``--lengths deltaproduct``: word_problem, training at n = 128 (not given here); the
    batch and evaluated length given win over its 64 and 512."""
    arguments = [a for a in TINY if a not in ("--train-length", "5")]
    done = subprocess.run([sys.executable, str(SCRIPT), *arguments, "--lengths", "deltaproduct",
                           "--models", "slstm"], capture_output=True, text=True, check=True,
                          timeout=600)
    lines = done.stdout.splitlines()
    assert lines[2].startswith("word_problem (lengths deltaproduct): training step at n = 128, "
                               "batch 4, median of 1")
    assert lines[3].endswith("eval n=7 s")
    assert ("slstm", "che-bench:slstm_scan") in kernel_rows(lines)
