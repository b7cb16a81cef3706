"""Issue 44 items 7 and 18: what a sweep prints. Its workers' messages reach the terminal
through the sweep (above its bar, wrapped at spaces), a Ctrl-C is announced once, a sweep
whose standard error is not a terminal prints a progress line every interval, and the dry run
shows the suite's overrides."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import signal
import textwrap
import threading
import time

import pytest
from rich.console import Console

from che_bench.cli import main
from che_bench.config import make_config
from che_bench.run.local_backend import LinesToSweep, LocalBackend, WorkerLines
from che_bench.run.sweep import checkpoint_dir_for, run_sweep
from che_bench.run.sweep_views import GridView
from che_bench.store import ResultStore
from che_bench.train.progress import say


def test_worker_lines_reach_the_sweeps_stderr_whole_and_in_order(monkeypatch):
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    relay = WorkerLines(multiprocessing.get_context("spawn"))
    worker_stderr = LinesToSweep(relay.queue)
    worker_stderr.write("che-bench: run a: resuming from step 5/8\nche-bench: run b: ")
    worker_stderr.write("checkpoint saved\n")
    relay.stop()  # prints what is queued, then stops
    assert stderr.getvalue() == (
        "che-bench: run a: resuming from step 5/8\nche-bench: run b: checkpoint saved\n"
    )


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_written_during_the_live_bar_go_above_it_wrapped_at_spaces(monkeypatch):
    """As a single run's messages: a worker's line said while the bar is shown (standard
    error on the terminal too) is printed by the bar's console, at spaces, never cut inside a
    word at the terminal's edge."""
    monkeypatch.setattr("sys.stderr", Terminal())
    out = io.StringIO()
    console = Console(file=out, width=40, force_terminal=True, color_system=None)
    view = GridView(console, live=True)
    view.start([], [make_config("even_pairs", "none", None, "smoke")])
    message = "che-bench: runs 0123456789ab, 0123456789cd: resuming from step 300/1000"
    with view:
        say(message + "\n")
    # (each line as the terminal shows it: what follows the last carriage return)
    printed = [
        line.split("\r")[-1].replace("\x1b[2K", "").rstrip()
        for line in out.getvalue().split("\n")
    ]
    wrapped = textwrap.wrap(message, 40, break_long_words=False)
    assert wrapped == printed[:3] and len(wrapped) == 3


class Recorded(io.StringIO):
    """Standard error that is not a terminal, telling when a line arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.wrote = threading.Event()

    def write(self, text: str) -> int:
        self.wrote.set()
        return super().write(text)


def test_a_sweep_with_stderr_not_a_terminal_prints_a_progress_line_every_interval(monkeypatch):
    """``sweep ... 2> file`` with the bar on the terminal: the lines go to the file."""
    stderr = Recorded()
    monkeypatch.setattr("sys.stderr", stderr)
    terminal = Console(file=io.StringIO(), force_terminal=True)
    view = GridView(terminal, live=True, interval=0.01)
    view.start([], [make_config("even_pairs", "none", None, "smoke")] * 4)
    with view:
        view.update(running=2, left=2)
        assert stderr.wrote.wait(timeout=60)
    assert stderr.getvalue().startswith(
        "che-bench: sweep: runs done 0/4 (0%), 2 running, 0 failed, ")


def test_no_progress_lines_without_live_progress(monkeypatch):
    stderr = Recorded()
    monkeypatch.setattr("sys.stderr", stderr)
    view = GridView(Console(file=io.StringIO()), live=False, interval=0.0)
    assert not view.prints_lines


def test_the_dry_run_shows_the_suites_overrides(tmp_path, capsys):
    suite = tmp_path / "short.toml"
    suite.write_text(textwrap.dedent("""
        preset = "quick"
        tasks = ["even_pairs"]
        encodings = ["none"]
        seeds = [0]
        [overrides]
        steps = 400
        curriculum = "uniform"
    """))
    assert main(["sweep", str(suite), "--dry-run", "--store", str(tmp_path / "s.sqlite")]) == 0
    assert 'preset quick with steps = 400, curriculum = "uniform"' in capsys.readouterr().out


def test_ctrl_c_in_a_local_sweep_is_announced_once_and_each_run_checkpoints(
    tmp_path, capsys
):
    """Two workers, each training a run: one "stopping" line (the sweep's), and each run's
    "checkpoint saved" line, relayed from its worker."""
    store = ResultStore(tmp_path / "store.sqlite")
    configs = [make_config("even_pairs", "none", None, "smoke", steps=100_000, seed=seed)
               for seed in (0, 1)]
    checkpoints = checkpoint_dir_for(store)
    options_dir = {"checkpoint_dir": checkpoints}

    def press_ctrl_c_once_both_train() -> None:
        paths = [checkpoints / f"{config.run_id()}.pt" for config in configs]
        while not all(path.exists() for path in paths):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    from che_bench.run.options import RuntimeOptions

    options = RuntimeOptions(device="cpu", checkpoint_every=5, **options_dir)
    started_with = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=press_ctrl_c_once_both_train, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_sweep(configs, store, lambda: LocalBackend(2, options), live=False)
    finally:
        signal.signal(signal.SIGINT, started_with)
    err = capsys.readouterr().err
    assert err.count("stopping") == 1
    for config in configs:
        assert f"run {config.run_id()}: checkpoint saved at step " in err


def test_the_tables_note_names_what_runs_changed_from_their_preset():
    """``steps = 400`` read "preset(s): quick"; seeds and learning rates, which a cell's
    max is over, are not changes."""
    from che_bench.reports.preset_changes import preset_changes

    configs = [
        make_config("even_pairs", "none", None, "quick", steps=400, seed=seed, lr=lr,
                    length_seed=0, test_lengths="41,60").to_dict()
        for seed in (0, 1) for lr in (1e-3, 3e-3)
    ]
    texts = [json.dumps(config) for config in configs]
    assert preset_changes(texts) == (
        " with steps = 400, test_lengths = 41..60 (2 lengths), length_seed = 0")
    assert preset_changes([json.dumps(make_config("even_pairs", preset="quick").to_dict())]) == ""


def test_preset_changes_of_another_architecture_and_the_run_header_name_them(capsys, tmp_path):
    """A state-tracking run's changes are named too (the rebuild at its preset once passed
    the transformer's empty encoding options to it, which refused them, and named none)."""
    from che_bench.cli import main
    from che_bench.reports.preset_changes import preset_changes

    config = make_config("parity_check", arch="deltanet", preset="smoke", batch_lengths="mixed")
    assert preset_changes([json.dumps(config.to_dict())]) == ' with batch_lengths = "mixed"'
    argv = ["run", "--task", "parity_check", "--arch", "deltanet", "--arch-option", "layers=1",
            "--arch-option", "width=16", "--preset", "smoke", "--steps", "2", "--test-lengths",
            "41", "--train-precision", "bfloat16", "--store", str(tmp_path / "s.sqlite"),
            "--no-progress"]
    assert main(argv) == 0
    assert 'preset smoke with train_precision = "bfloat16", 2 steps' in " ".join(
        capsys.readouterr().err.split())
