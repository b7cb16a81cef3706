"""``che-bench sweep`` with the local backend: dry run, parallel runs, failures, resume after kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import che_bench.run.sweep
from che_bench.cli import main
from che_bench.errors import CheBenchError
from che_bench.run.suites import load_suite
from che_bench.run.sweep import LocalBackend, run_sweep
from che_bench.store import ResultStore

TINY = """
    preset = "smoke"
    tasks = ["even_pairs", "parity_check"]
    encodings = ["none"]
    kernels = ["none", 3]
    seeds = [0]
    [overrides]
    steps = {steps}
    test_lengths = "41"
    eval_samples = 8
"""

CELLS = """
    preset = "smoke"
    tasks = ["even_pairs", "parity_check"]
    encodings = ["none"]
    seeds = [0, 1]
    learning_rates = [1e-3, 3e-3]
    [overrides]
    steps = {steps}
    test_lengths = "41"
    eval_samples = 8
    length_seed = 0
"""


def write_suite(tmp_path: Path, steps: int = 5, grid: str = TINY) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(textwrap.dedent(grid.format(steps=steps)))
    return path


def test_dry_run_lists_the_grid_and_runs_nothing(tmp_path, capsys):
    suite = write_suite(tmp_path)
    store = tmp_path / "store.sqlite"
    assert main(["sweep", str(suite), "--dry-run", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    ids = [c.run_id() for c in load_suite(suite).configs()]
    assert "4 runs" in out and all(run_id in out for run_id in ids)
    assert not store.exists()  # a dry run creates no store


def test_bad_suite_is_rejected_before_anything_runs(tmp_path, capsys):
    suite = tmp_path / "bad.toml"
    suite.write_text('preset = "smoke"\ntasks = ["even_pairs", "nonesuch"]\nencodings = "none"\n')
    store = tmp_path / "store.sqlite"
    assert main(["sweep", str(suite), "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert "nonesuch" in err and err.count("\n") == 1
    assert not store.exists()


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--max-runs", "0", "a positive integer"), ("--max-runs", "2.5", "a positive integer"),
    ("--num-cpus", "-1", "a number >= 0"), ("--num-gpus", "x", "a number >= 0"),
])
def test_bad_numbers_of_the_sweep_flags_are_refused(tmp_path, capsys, flag, value, expected):
    suite = write_suite(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", str(suite), "--dry-run", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: expected {expected}, got '{value}'" in capsys.readouterr().err


def test_sweep_runs_the_grid_in_parallel_and_skips_completed_runs(tmp_path, capsys):
    suite = write_suite(tmp_path)
    store_path = tmp_path / "store.sqlite"
    args = ["sweep", str(suite), "--workers", "2", "--store", str(store_path), "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    ids = {c.run_id() for c in load_suite(suite).configs()}
    store = ResultStore(store_path)
    runs = store.runs()
    assert set(runs["run_id"]) == ids and set(runs["status"]) == {"complete"}
    assert "4 completed now" in out and "even_pairs" in out  # progress lines and the table
    # Every run executed in a worker process, not in the sweep process.
    assert all("cpu" in device for device in runs["device"])

    finished = dict(zip(runs["run_id"], runs["finished_at"]))
    assert main(args) == 0
    assert "4 already complete, 0 completed now" in capsys.readouterr().out
    again = store.runs()
    assert dict(zip(again["run_id"], again["finished_at"])) == finished
    assert set(again["attempts"]) == {1}


def test_packed_sweep_trains_each_cell_as_one_pack(tmp_path, capsys):
    suite = write_suite(tmp_path, grid=CELLS)
    store_path = tmp_path / "store.sqlite"
    assert main(["sweep", str(suite), "--pack", "4", "--store", str(store_path),
                 "--no-progress"]) == 0
    runs = ResultStore(store_path).runs()
    assert len(runs) == 8 and set(runs["status"]) == {"complete"}
    assert {json.loads(t)["pack_members"] for t in runs["timings"]} == {4.0}
    out = capsys.readouterr().out
    assert "n=4" in out  # each cell of the table: the max over its 4 runs
    # Without a length seed runs cannot share a schedule: they train alone, and it is said.
    unseeded = write_suite(tmp_path, grid=CELLS.replace("length_seed = 0", ""))
    assert main(["sweep", str(unseeded), "--pack", "4", "--store", str(tmp_path / "other.sqlite"),
                 "--no-progress", "--max-runs", "1"]) == 0
    assert "8 runs have no length_seed and train alone" in capsys.readouterr().out


def _raise_in_worker() -> None:
    raise RuntimeError("injected failure")


def _die_in_worker() -> None:
    os._exit(3)  # the worker process vanishes, as if killed for memory


class FlakyBackend(LocalBackend):
    """The real process pool, but two chosen runs fail: one raises, one kills its worker."""

    raise_for: str = ""
    die_for: str = ""

    def submit(self, configs, width):
        run_id = configs[0].run_id()  # unpacked: one run per submission
        if run_id == self.raise_for:
            return self._executor().submit(_raise_in_worker)
        if run_id == self.die_for:
            return self._executor().submit(_die_in_worker)
        return super().submit(configs, width)


def test_failed_runs_are_recorded_and_the_others_complete(tmp_path, monkeypatch, capsys):
    suite = write_suite(tmp_path)
    configs = load_suite(suite).configs()
    FlakyBackend.raise_for, FlakyBackend.die_for = configs[0].run_id(), configs[1].run_id()
    monkeypatch.setattr(che_bench.run.sweep, "LocalBackend", FlakyBackend)
    store_path = tmp_path / "store.sqlite"
    # One worker: the dying worker takes only its own run down; the pool is rebuilt after it.
    code = main(["sweep", str(suite), "--workers", "1", "--store", str(store_path), "--no-progress"])
    assert code == 1
    runs = ResultStore(store_path).runs().set_index("run_id")
    assert runs.loc[configs[0].run_id(), "status"] == "failed"
    assert "injected failure" in runs.loc[configs[0].run_id(), "error"]
    assert runs.loc[configs[1].run_id(), "status"] == "failed"
    assert "worker process died" in runs.loc[configs[1].run_id(), "error"]
    assert set(runs.loc[[c.run_id() for c in configs[2:]], "status"]) == {"complete"}
    assert "2 failed" in capsys.readouterr().out

    # A plain re-run retries the failed runs only.
    monkeypatch.setattr(che_bench.run.sweep, "LocalBackend", LocalBackend)
    assert main(["sweep", str(suite), "--store", str(store_path), "--no-progress"]) == 0
    runs = ResultStore(store_path).runs().set_index("run_id")
    assert set(runs["status"]) == {"complete"}
    assert runs.loc[configs[0].run_id(), "attempts"] == 2
    assert set(runs.loc[[c.run_id() for c in configs[2:]], "attempts"]) == {1}


def test_max_runs_limits_the_runs_started(tmp_path):
    configs = load_suite(write_suite(tmp_path)).configs()
    store = ResultStore(tmp_path / "store.sqlite")
    outcome = run_sweep(configs, store, lambda: LocalBackend(1), max_runs=1, live=False)
    assert len(outcome.results) == 1 and outcome.not_started == 3
    assert store.completed_run_ids() == {configs[0].run_id()}
    # One torch thread a worker, as `che-bench run`, whatever the machine's cores.
    assert set(store.runs()["device"]) == {"cpu (1 thread)"}


def test_nothing_to_do_starts_no_backend(tmp_path):
    def no_backend():
        raise AssertionError("backend started although every run is complete")

    outcome = run_sweep([], ResultStore(tmp_path / "store.sqlite"), no_backend, live=False)
    assert outcome.total == 0 and outcome.results == []


def test_ray_only_flags_are_refused_with_the_local_backend(tmp_path, capsys):
    assert main(["sweep", str(write_suite(tmp_path)), "--num-gpus", "0.5"]) == 2
    assert "--backend ray" in capsys.readouterr().err


def test_missing_ray_is_a_clear_error(monkeypatch):
    from che_bench.run.ray_backend import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` fail
    with pytest.raises(CheBenchError, match=r"pip install \"che-bench\[ray\]\""):
        import_ray()


#: Bound of a wait for an event that a hung process would never bring (not a speed bound:
#: a loaded 2-core machine reaches the event in minutes at most).
HANG_GUARD_S = 1800


def _children(pid: int) -> set[int]:
    """Live child processes of ``pid`` (Linux /proc)."""
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.add(int(stat.parent.name))
    return children


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.add(pid)
        except ProcessLookupError:
            pass
    return alive


@pytest.mark.parametrize("grid, pack", [(TINY, "1"), (CELLS, "2")])
def test_sweep_killed_with_sigkill_resumes_without_losing_or_repeating_runs(tmp_path, grid, pack):
    # Runs of about a second each, so that runs are left when the first ones land.
    suite = write_suite(tmp_path, steps=400, grid=grid)
    configs = load_suite(suite).configs()
    store_path = tmp_path / "store.sqlite"
    command = [sys.executable, "-m", "che_bench.cli", "sweep", str(suite), "--workers", "1",
               "--store", str(store_path), "--no-progress", "--pack", pack]
    sweep = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: set[int] = set()
    try:
        # Events, not deadlines: however slow a loaded machine is, wait for the first
        # completed run (or the sweep's end); HANG_GUARD_S only stops a hung test.
        hang_guard = time.monotonic() + HANG_GUARD_S
        while sweep.poll() is None and time.monotonic() < hang_guard:
            workers |= _children(sweep.pid)
            if store_path.exists() and ResultStore(store_path).completed_run_ids():
                break
            time.sleep(0.05)
        assert sweep.poll() is None, "the sweep finished before it could be killed"
        workers |= _children(sweep.pid)
        assert workers, "no worker process seen"
        os.kill(sweep.pid, signal.SIGKILL)  # the sweep process only: its workers are orphaned
        sweep.wait()
        # Orphaned workers notice and exit by themselves (no process of the sweep lingers).
        hang_guard = time.monotonic() + HANG_GUARD_S
        while _alive(workers) and time.monotonic() < hang_guard:
            time.sleep(0.2)
        assert not _alive(workers), "worker processes outlived the killed sweep"
    finally:
        for pid in _alive(workers):
            os.kill(pid, signal.SIGKILL)

    before = ResultStore(store_path).runs().set_index("run_id")
    done_before = set(before.index[before["status"] == "complete"])
    assert 1 <= len(done_before) < len(configs)

    assert main(["sweep", str(suite), "--workers", "1", "--store", str(store_path),
                 "--no-progress", "--pack", pack]) == 0
    after = ResultStore(store_path).runs().set_index("run_id")
    assert sorted(after.index) == sorted(c.run_id() for c in configs)  # complete, no duplicates
    assert set(after["status"]) == {"complete"}
    for run_id in done_before:  # completed before the kill: untouched, never re-executed
        assert after.loc[run_id, "finished_at"] == before.loc[run_id, "finished_at"]
        assert after.loc[run_id, "attempts"] == 1
