"""benchmarks/bench_model.py's architectures part: one row per registered architecture (the
transformer beside CHE's baselines and the state-tracking models), each with its parameter
count, its training batch and its timings; ``--isa avx2``, which runs the kernels and torch at
AVX2."""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from che_bench.model.architectures import ARCHITECTURES

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_model.py"
TINY = ["--task", "parity_check", "--train-length", "3", "--steps", "1", "--eval-batch", "2"]


def architectures_part(*arguments: str) -> dict[str, list[str]]:
    done = subprocess.run([sys.executable, str(SCRIPT), "architectures", *TINY, *arguments],
                          capture_output=True, text=True, check=True, timeout=600)
    lines = done.stdout.splitlines()
    assert "1 thread(s)" in lines[0]
    return {line.split()[0]: line.split()[1:] for line in lines[3:]}


def test_the_architectures_part_times_every_registered_architecture():
    rows = architectures_part("--batch", "2", "--eval-lengths", "5")
    assert list(rows) == ARCHITECTURES.names()
    # Parameter counts of a 2-symbol task (docs/baselines.md), then the batch and both timings
    # (seconds; the tiny evaluation may round to 0.00).
    assert [rows[name][0] for name in ("rnn", "lstm", "stack_rnn", "stack_lstm", "tape_rnn")] == [
        "67330", "266754", "72205", "277773", "91791"]
    assert all(len(values) == 4 and values[1] == "2" and float(values[2]) > 0
               and float(values[3]) >= 0 for values in rows.values())


def test_each_row_trains_at_its_protocol_s_batch_and_reports_the_evaluation_s_peak():
    """CHE's baselines at the paper preset's batch 128, the state-tracking models at the xLSTM
    harness's 256; with --peak-memory each length's forward runs in a fresh process and its
    peak resident memory (MiB) follows its time."""
    rows = architectures_part("--architectures", "rnn", "slstm", "--eval-lengths", "5",
                              "--peak-memory")
    assert list(rows) == ["rnn", "slstm"]
    assert [rows[name][1] for name in rows] == ["128", "256"]
    assert all(len(values) == 5 and float(values[4]) >= 0 for values in rows.values())


def test_a_fresh_process_reports_its_own_peak_not_its_large_parent_s(monkeypatch):
    """Linux carries a parent's peak resident set over into a process it spawns
    (``ru_maxrss``): a child of a parent holding 1 GiB must still report the few MiB its tiny
    forward adds."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_model

    ballast = torch.ones(2**28)  # noqa: F841 (1 GiB resident in this process while it spawns)
    options = argparse.Namespace(task="parity_check", members=1, unfused=False, pe="none")
    make = functools.partial(bench_model.build_for_timing, "rnn", options)
    inputs = torch.zeros(1, 2, 5, dtype=torch.long)
    _, _, peak = bench_model.in_fresh_process(bench_model.measure_evaluation, make, inputs, 1, 0, 1)
    assert 0 <= peak < 2**27  # 128 MiB


def test_isa_avx2_runs_the_kernels_and_torch_at_avx2(tmp_path):
    """``--isa avx2`` starts the benchmark again with the kernels built for x86-64-v3 and
    torch, MKL and oneDNN capped at AVX2, and its second line says so (issue 48)."""
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), "").split()
    if not {"avx2", "fma"} <= set(flags) or shutil.which("cc") is None:
        pytest.skip("no AVX2 and FMA, or no C compiler")
    environment = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    environment.pop("CHE_BENCH_NATIVE_MARCH", None)
    done = subprocess.run([sys.executable, str(SCRIPT), "train", "--isa", "avx2", "--encodings",
                           "none", "--kernels", "none", "--steps", "1", "--batch", "2",
                           "--train-length", "3", "--threads", "1"],
                          capture_output=True, text=True, check=True, timeout=600, env=environment)
    built = done.stdout.splitlines()[1]
    assert "-march=x86-64-v3, AVX2, 8 lanes" in built and built.endswith("torch's kernels: AVX2")
