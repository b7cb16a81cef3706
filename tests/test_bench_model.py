"""benchmarks/bench_model.py's architectures part: one row per registered architecture (the
transformer beside CHE's baselines), each with its parameter count and both timings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from che_bench.model.architectures import ARCHITECTURES

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_model.py"
TINY = ["--task", "parity_check", "--batch", "2", "--train-length", "3", "--steps", "1",
        "--eval-batch", "2", "--eval-length", "5"]


def test_the_architectures_part_times_every_registered_architecture():
    done = subprocess.run([sys.executable, str(SCRIPT), "architectures", *TINY],
                          capture_output=True, text=True, check=True, timeout=600)
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[3:]}
    assert list(rows) == ARCHITECTURES.names()
    # Parameter counts of a 2-symbol task (docs/baselines.md), then both timings (seconds; the
    # tiny evaluation may round to 0.00).
    assert [rows[name][0] for name in ("rnn", "lstm", "stack_rnn", "stack_lstm", "tape_rnn")] == [
        "67330", "266754", "72205", "277773", "91791"]
    assert all(len(values) == 3 and float(values[1]) > 0 and float(values[2]) >= 0
               for values in rows.values())
    assert "1 thread(s)" in done.stdout.splitlines()[0]
