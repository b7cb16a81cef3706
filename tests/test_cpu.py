"""Numbers across CPUs (issue 26, item 16): every run records its CPU model and the instruction
set of torch's kernels, reports show them ("unknown" for runs stored before), and the portable
CPU mode (``--portable-cpu``) takes effect only where its settings reached torch, MKL and
oneDNN before they started, and is recorded with the runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from test_store import synthetic_result

from che_bench import cpu
from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.reports.export import export_frame
from che_bench.reports.html import render_report
from che_bench.run import device as device_module
from che_bench.run.device import check_portable_device, configure_numerics, numerics_details
from che_bench.run.runner import execute_run
from che_bench.store import ResultStore

TINY = {"steps": 2, "test_lengths": "41", "eval_samples": 2, "eval_batch_size": 2}


def test_the_cpu_model_comes_from_cpuinfo_else_the_platform(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\n"
                       "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t: avx512f\n")
    assert cpu.cpu_model(cpuinfo) == "Intel(R) Xeon(R) Platinum 8480+"
    monkeypatch.setattr(cpu.platform, "processor", lambda: "arm")
    assert cpu.cpu_model(tmp_path / "absent") == "arm"
    monkeypatch.setattr(cpu.platform, "processor", lambda: "")
    assert cpu.cpu_model(tmp_path / "absent") == "unknown"


def test_every_run_records_its_cpu_and_the_instruction_set_of_torchs_kernels(tmp_path):
    result = execute_run(make_config("parity_check", preset="smoke", **TINY), device="cpu",
                         progress=False)
    assert result.versions["cpu"] == cpu.cpu_model()
    assert result.versions["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "portable_cpu" not in result.details
    store = ResultStore(tmp_path / "s.sqlite")
    store.record(result)
    stored = json.loads(store.runs()["versions"].item())
    assert stored["cpu"] == cpu.cpu_model() and stored["cpu_capability"] == result.versions[
        "cpu_capability"]


def test_the_report_names_each_runs_cpu_and_unknown_for_runs_stored_before(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    old = synthetic_result(seed=0)  # versions as stored before the CPU was recorded
    new = synthetic_result(seed=1)
    new.versions = {**new.versions, "cpu": "Intel(R) Xeon(R) CPU", "cpu_capability": "AVX512"}
    portable = synthetic_result(seed=2)
    portable.versions = {**portable.versions, "cpu": "AMD EPYC", "cpu_capability": "AVX2"}
    portable.details = {"portable_cpu": True}
    for result in (old, new, portable):
        store.record(result)
    page = render_report(store)
    what_ran = page[page.index("<h2>What ran</h2>"):page.index("<h2>Reproduce</h2>")]
    line = re.search(r"<b>CPUs \(model, torch kernels\)</b>: ([^<]*)</li>", what_ran).group(1)
    assert sorted(line.split("), ")) == sorted(
        ["Intel(R) Xeon(R) CPU, AVX512 (1", "AMD EPYC, AVX2, portable CPU mode (1", "unknown (1)"])
    software = re.search(r"<b>software</b>: ([^<]*)</li>", what_ran).group(1)
    assert software == "che_bench synthetic"  # the CPU is not software
    exported = export_frame(store).set_index("seed")
    assert exported.loc[0, ["cpu", "cpu_capability"]].tolist() == ["unknown", "unknown"]
    assert exported.loc[1, ["cpu", "cpu_capability"]].tolist() == ["Intel(R) Xeon(R) CPU", "AVX512"]


def test_the_portable_mode_is_refused_unless_its_settings_reached_torch(monkeypatch):
    config = make_config("parity_check", preset="smoke", **TINY)
    for name in cpu.PORTABLE_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(CheBenchError, match="before torch starts: set ATEN_CPU_CAPABILITY=avx2"):
        execute_run(config, device="cpu", progress=False, portable_cpu=True)
    for name, value in cpu.PORTABLE_ENVIRONMENT.items():  # too late for this process's torch
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cpu, "cpu_capability", lambda: "AVX512")
    with pytest.raises(CheBenchError, match="run at AVX512"):
        execute_run(config, device="cpu", progress=False, portable_cpu=True)
    with pytest.raises(CheBenchError, match="for runs on a CPU"):
        check_portable_device(torch.device("cuda"), True)
    check_portable_device(torch.device("cuda"), False)


def test_the_portable_mode_turns_onednn_off_and_is_recorded(monkeypatch):
    monkeypatch.setattr(device_module, "check_portable_cpu", lambda: None)
    try:
        configure_numerics(tf32=False, portable_cpu=True)
        assert not torch.backends.mkldnn.enabled
    finally:
        configure_numerics(tf32=False)
    assert torch.backends.mkldnn.enabled
    assert numerics_details(torch.device("cpu"), False, False, True) == {"portable_cpu": True}
    assert numerics_details(torch.device("cpu"), False, False) == {}


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_the_command_line_runs_and_records_the_portable_mode(tmp_path, command):
    """A new process, as a user starts one: ``che-bench`` puts the settings into its
    environment before torch starts, and a sweep's workers inherit them."""
    store = tmp_path / "s.sqlite"
    if command == "run":
        arguments = ["run", "--task", "parity_check", "--preset", "smoke", "--steps", "2",
                     "--test-lengths", "41", "--eval-samples", "2", "--device", "cpu"]
    else:
        suite = tmp_path / "tiny.toml"
        suite.write_text('preset = "smoke"\ntasks = ["parity_check"]\nencodings = ["none"]\n'
                         '[overrides]\nsteps = 2\ntest_lengths = "41"\neval_samples = 2\n')
        arguments = ["sweep", str(suite), "--workers", "1", "--device", "cpu"]
    environment = {k: v for k, v in os.environ.items() if k not in cpu.PORTABLE_ENVIRONMENT}
    finished = subprocess.run(
        [sys.executable, "-m", "che_bench.cli", *arguments, "--portable-cpu", "--no-progress",
         "--store", str(store)],
        env={**environment, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stderr
    (details,) = ResultStore(store).run_details(ResultStore(store).runs()["run_id"]).values()
    versions = json.loads(ResultStore(store).runs()["versions"].item())
    assert details["portable_cpu"] is True and versions["cpu_capability"] == "AVX2"

