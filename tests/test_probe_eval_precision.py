"""benchmarks/probe_eval_precision.py on a tiny DeltaNet run: its model evaluated in float32,
under bf16 autocast with and without fla's roundings and cast to bf16, and beta's statistics
per layer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from che_bench.cli import main
from che_bench.store import ResultStore

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "probe_eval_precision.py"


def test_the_probe_reads_a_kept_model_in_every_precision(tmp_path):
    store = tmp_path / "runs.sqlite"
    argv = [
        "run", "--task", "modular_arithmetic", "--arch", "deltanet",
        "--arch-option", "negative_eigenvalues=true", "--arch-option", "layers=2",
        "--arch-option", "width=16", "--arch-option", "heads=2", "--preset", "smoke",
        "--steps", "3", "--test-lengths", "41,70", "--store", str(store), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    (run_id,) = ResultStore(store).runs()["run_id"]
    done = subprocess.run([sys.executable, str(SCRIPT), str(store), run_id],
                          capture_output=True, text=True, check=True, timeout=600)
    modes = [line.split(": score")[0] for line in done.stdout.splitlines() if ": score" in line]
    assert modes == [
        f"step 3, {mode}"
        for mode in ("float32", "bf16 autocast", "bf16 autocast, fla's roundings",
                     "bf16 weights", "bf16 weights, fla's roundings")
    ]
    assert [line.split(":")[0] for line in done.stdout.splitlines()[-2:]] == ["layer 0", "layer 1"]
