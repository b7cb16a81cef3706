"""Issue 44 item 7: output whose reader is gone. A command piped into ``head`` stops quietly;
a run or a sweep piped through ``tee`` and stopped with Ctrl-C (which stops ``tee`` too)
still saves its checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from che_bench.cli import CLOSED_OUTPUT_EXIT
from che_bench.config import make_config
from che_bench.run.runner import execute_run
from che_bench.run.sweep import run_sweep
from che_bench.store import ResultStore


def test_a_command_whose_output_is_closed_exits_quietly():
    """``che-bench tasks | head -1``: the reader is gone before the listing is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        completed = subprocess.run(
            [sys.executable, "-c", "from che_bench.cli import main; raise SystemExit(main())",
             "tasks"],
            stdout=write_end, stderr=subprocess.PIPE, text=True, check=False,
            env={**os.environ, "CHE_BENCH_NO_PLUGINS": "1"},
        )
    finally:
        os.close(write_end)
    assert (completed.returncode, completed.stderr) == (CLOSED_OUTPUT_EXIT, "")


class ClosedPipe:
    """Standard error after ``tee`` was stopped: every write fails."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def isatty(self) -> bool:
        return False


def test_ctrl_c_with_a_closed_stderr_still_saves_the_checkpoint(tmp_path, monkeypatch):
    config = make_config("even_pairs", "alibi", None, "smoke", steps=8)

    def press_ctrl_c(step: int, loss: float) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    started_with = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        # "stopping after this step", then "checkpoint saved", go to the closed stream.
        monkeypatch.setattr(sys, "stderr", ClosedPipe())
        with pytest.raises(KeyboardInterrupt):
            execute_run(config, device="cpu", checkpoint_dir=tmp_path, progress=True,
                        on_step=press_ctrl_c)
    finally:
        signal.signal(signal.SIGINT, started_with)
    assert torch.load(tmp_path / f"{config.run_id()}.pt", weights_only=True)["step"] == 3


class StoppedBackend:
    """A backend whose wait is interrupted by Ctrl-C; it records being told to stop."""

    on_gpu = False

    def __init__(self) -> None:
        self.calls: list[str] = []

    def capacity(self) -> int:
        return 1

    def submit(self, configs, width):
        return 0

    def wait(self, handles):
        raise KeyboardInterrupt

    def interrupt(self) -> None:
        self.calls.append("interrupt")

    def close(self) -> None:
        self.calls.append("close")


class ViewOnClosedOutput:
    """A sweep view whose last write (clearing its bar) fails: the output's reader is gone."""

    def stale(self, notices) -> None:
        pass

    def start(self, already_complete, todo) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def update(self, *, running: int, left: int) -> None:
        pass


def test_a_sweep_whose_output_fails_on_ctrl_c_still_stops_its_runs(tmp_path):
    """The runs in flight are told to stop (and checkpoint) although the error that leaves
    the sweep is the closed output's, not the KeyboardInterrupt."""
    backend = StoppedBackend()
    store = ResultStore(tmp_path / "store.sqlite")
    configs = [make_config("even_pairs", "none", None, "smoke", steps=8)]
    with pytest.raises(BrokenPipeError):
        run_sweep(configs, store, lambda: backend, view=ViewOnClosedOutput())
    assert backend.calls == ["interrupt", "close"]
