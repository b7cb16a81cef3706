"""benchmarks/gpu_check.py, the prepared GPU check (issue 44, item 14), rehearsed on the CPU so
that it cannot rot: every step runs with tiny sizes and both summaries are written; a step that
fails or hangs is recorded and the check goes on; a missing dependency is named."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from che_bench.checks.architecture_check import built_in_architectures

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
STEP_NAMES = ["environment", "selftest", "training_speed", "evaluation", "deterministic",
              "cuda_tests", "pack"]


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check

    return gpu_check


def test_the_rehearsal_runs_every_step_on_the_cpu_and_writes_both_summaries(tmp_path):
    out = tmp_path / "gpu"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--device", "cpu",
                           "--rehearse", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    # Three files: within what a device machine's $OUT gives back (8).
    assert sorted(path.name for path in out.iterdir()) == [
        "gpu_check.json", "gpu_check.log", "gpu_check.md"]
    summary = json.loads((out / "gpu_check.json").read_text())
    steps = {step["step"]: step for step in summary["steps"]}
    assert list(steps) == STEP_NAMES and summary["rehearsal"] and summary["passed"]
    # No GPU here: every cuda test skips, which is no verdict.
    assert [step["status"] for step in steps.values()] == ["passed"] * 5 + ["not run", "passed"]
    results = {name: step["result"] for name, step in steps.items()}
    assert results["environment"]["torch"] and results["environment"]["missing"] == []
    assert results["selftest"]["checks"] == ["h"] and results["selftest"]["cases"]
    speed = results["training_speed"]["rows"]
    assert [row["model"] for row in speed] == [
        "transformer kerple + DAPE V2 k=3", "gated_deltanet", "mlstm"]
    assert all(row["ms_per_step"] > 0 and row["hours"] > 0 for row in speed)
    assert [row["full_steps"] for row in speed] == [200_000, 20_000, 20_000]
    evaluated = [(row["architecture"], row["members"]) for row in results["evaluation"]["rows"]]
    assert evaluated == [(name, members) for name in built_in_architectures()
                         for members in (1, 4)]
    assert results["deterministic"]["largest_loss_difference"] == 0.0
    assert "skipped" in results["cuda_tests"]["summary"] and results["cuda_tests"]["note"]
    assert "test_cuda.py" in results["cuda_tests"]["command"]
    assert results["pack"]["members"] == 3 and results["pack"]["eval_ms"] > 0
    text = (out / "gpu_check.md").read_text()
    assert text.startswith("# che-bench GPU check (REHEARSAL")
    assert all(f"## {name}: passed" in text for name in STEP_NAMES if name != "cuda_tests")
    assert "## cuda_tests: not run" in text
    assert "| transformer kerple + DAPE V2 k=3 | missing_duplicate_string |" in text


def test_a_failing_and_a_hanging_step_are_recorded_and_the_check_goes_on(gpu_check, monkeypatch,
                                                                         tmp_path):
    def failing(device, rehearse, timeout_s, record):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def hanging(device, rehearse, timeout_s, record):
        record({"rows": [{"model": "measured before the hang"}]})
        time.sleep(3600)

    def passing(device, rehearse, timeout_s, record):
        return {"passed": True, "device": device}

    steps = types.SimpleNamespace(selftest=failing, training_speed=hanging, evaluation=passing)
    monkeypatch.setattr(gpu_check, "load_steps", lambda: (steps, ""))
    monkeypatch.setattr(gpu_check, "STEPS", (("selftest", 60), ("training_speed", 1),
                                             ("evaluation", 60)))
    seen = []
    result = gpu_check.run_all("cpu", True, time.monotonic() + 600, {},
                               lambda step: seen.append(step["step"]))
    assert seen == ["selftest", "training_speed", "evaluation"]
    assert [step["status"] for step in result] == ["error", "timed out", "passed"]
    assert result[0]["error"].startswith("RuntimeError: CUDA error: an illegal memory access")
    assert "Traceback" in result[0]["output_tail"]
    assert result[1]["result"] == {"rows": [{"model": "measured before the hang"}]}
    assert result[2]["result"] == {"passed": True, "device": "cpu"}
    summary = {"device": "cpu", "rehearsal": False, "budget_s": 600, "started": "now",
               "seconds": 2.0, "passed": False, "steps": result}
    gpu_check.write_summaries(summary, tmp_path)
    text = (tmp_path / "gpu_check.md").read_text()
    assert "| training_speed | timed out |" in text and "## selftest: error" in text


def test_a_spent_budget_skips_the_steps_left(gpu_check, monkeypatch):
    monkeypatch.setattr(gpu_check, "load_steps", lambda: (types.SimpleNamespace(), ""))
    result = gpu_check.run_all("cpu", True, time.monotonic(), {}, lambda step: None)
    assert {step["status"] for step in result} == {"skipped"}


def test_a_missing_dependency_is_named(gpu_check, monkeypatch):
    """Where che-bench cannot import (a dependency missing on the GPU machine), every step
    that needs it fails with the import's error, and the environment names what is missing."""
    import gpu_check_environment

    error = "ModuleNotFoundError: No module named 'rich'"
    monkeypatch.setattr(gpu_check, "load_steps", lambda: (None, error))
    monkeypatch.setattr(gpu_check, "STEPS", (("environment", 60), ("selftest", 60)))
    real_version = gpu_check_environment._version
    monkeypatch.setattr(gpu_check_environment, "_version",
                        lambda name: None if name == "rich" else real_version(name))
    environment, selftest = gpu_check.run_all("cpu", True, time.monotonic() + 600, {},
                                              lambda step: None)
    assert environment["status"] == "FAILED" and environment["result"]["missing"] == ["rich"]
    assert selftest["status"] == "error" and selftest["error"].endswith(error)


def test_a_bad_timeout_is_refused(gpu_check):
    with pytest.raises(SystemExit, match="--timeout takes STEP=SECONDS"):
        gpu_check.parse_timeouts(["selftests=10"])
    assert gpu_check.parse_timeouts(["pack=90", "selftest=120.5"]) == {
        "pack": 90.0, "selftest": 120.5}


def test_the_environment_names_the_gpu_its_driver_and_cuda(gpu_check, monkeypatch, tmp_path):
    """The environment step on a (faked) GPU machine: the GPU as torch sees it, the driver as
    nvidia-smi gives it, and both in the Markdown summary."""
    import gpu_check_environment
    import torch

    properties = types.SimpleNamespace(name="NVIDIA H200", total_memory=143 * 2**30, major=9,
                                       minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    real_output = gpu_check_environment._output
    monkeypatch.setattr(gpu_check_environment, "_output", lambda command: (
        "NVIDIA H200, 580.159.03, 143771 MiB" if command[0] == "nvidia-smi"
        else real_output(command)))
    facts = gpu_check_environment.environment("cuda", False, 30, lambda partial: None)
    assert facts["passed"] and facts["driver"] == "580.159.03"
    assert (facts["gpu"], facts["compute_capability"], facts["multiprocessors"]) == (
        "NVIDIA H200", "9.0", 132)
    step = {"step": "environment", "status": "passed", "seconds": 1.0, "result": facts}
    summary = {"device": "cuda", "rehearsal": False, "budget_s": 460, "started": "now",
               "seconds": 1.0, "passed": True, "steps": [step]}
    gpu_check.write_summaries(summary, tmp_path)
    text = (tmp_path / "gpu_check.md").read_text()
    assert "- device: NVIDIA H200, 143.0 GiB, compute capability 9.0" in text
    assert "- driver: 580.159.03; CUDA (torch's build): " in text
