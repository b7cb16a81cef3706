"""TensorBoard and W&B trackers: what they log, read back (TensorBoard event files) or seen by
a fake ``wandb`` module (nothing leaves the machine), and the one-line error of a missing extra."""

from __future__ import annotations

import builtins
import importlib.util
import os
import sys
import types

import pytest

from che_bench.cli import main
from che_bench.config import make_config
from che_bench.run.runner import execute_run
from che_bench.run.trackers import TrackerOptions

TINY = ["--task", "even_pairs", "--pe", "none", "--preset", "smoke", "--steps", "6",
        "--test-lengths", "41,50", "--eval-samples", "4", "--eval-batch-size", "4",
        "--log-every", "3", "--device", "cpu", "--no-progress"]


def tiny_config(seed: int = 0):
    return make_config("even_pairs", "none", None, "smoke", steps=6, test_lengths="41,50",
                       eval_samples=4, eval_batch_size=4, seed=seed)


#: Set (as CI does): a missing tensorboard extra fails the TensorBoard test instead of skipping it.
REQUIRE_TENSORBOARD = "CHE_BENCH_REQUIRE_TENSORBOARD"


def test_tensorboard_event_files_hold_the_history_and_the_evaluation(tmp_path):
    if importlib.util.find_spec("tensorboard") is None:
        if os.environ.get(REQUIRE_TENSORBOARD):
            pytest.fail(f"{REQUIRE_TENSORBOARD} is set but tensorboard is not installed")
        pytest.skip('the [tensorboard] extra is not installed: pip install -e ".[tensorboard]"')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = tmp_path / "tb"
    assert main(["run", *TINY, "--tensorboard", str(logs),
                 "--store", str(tmp_path / "s.sqlite")]) == 0
    run_id = tiny_config().run_id()
    events = EventAccumulator(str(logs / run_id))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/accuracy", "train/grad_norm", "train/lr", "eval/score",
            "eval/exact_score", "eval/accuracy_by_length"} <= set(tags)

    from che_bench.store import ResultStore

    store = ResultStore(tmp_path / "s.sqlite")
    history = store.history([run_id])
    logged = events.Scalars("train/loss")
    assert [event.step for event in logged] == [3, 6]
    assert [event.value for event in logged] == pytest.approx(list(history["loss"]), rel=1e-6)
    curve = {event.step: event.value for event in events.Scalars("eval/accuracy_by_length")}
    stored = store.per_length([run_id])
    stored = stored[stored["split"] == "test"]
    assert curve == pytest.approx(dict(zip(stored["length"], stored["accuracy"])), rel=1e-6)
    assert events.Scalars("eval/score")[0].value == pytest.approx(store.runs()["score"].iloc[0])


class FakeWandbRun:
    def __init__(self, **settings):
        self.settings = settings
        self.logged: list[tuple[dict, int]] = []
        self.summary: dict = {}
        self.finished = False

    def log(self, values: dict, step: int) -> None:
        self.logged.append((values, step))

    def finish(self) -> None:
        self.finished = True


def fake_wandb() -> types.ModuleType:
    """A stand-in for the wandb package: records what che-bench asks of it, sends nothing."""
    module = types.ModuleType("wandb")
    module.runs = []

    def init(**settings):
        run = FakeWandbRun(**settings)
        module.runs.append(run)
        return run

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    module.init, module.Table = init, Table
    return module


def test_wandb_runs_get_the_history_and_the_evaluation_and_honour_offline_mode(monkeypatch):
    wandb = fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setenv("WANDB_MODE", "offline")
    configs = [tiny_config(0), tiny_config(1)]
    from che_bench.run.runner import execute_runs

    results = execute_runs([c for c in configs], device="cpu", progress=False, log_every=3,
                           trackers=TrackerOptions(wandb="che-test"))
    assert [run.settings["name"] for run in wandb.runs] == [c.run_id() for c in configs]
    for run, result in zip(wandb.runs, results):
        assert run.settings["project"] == "che-test" and run.settings["mode"] == "offline"
        assert run.settings["config"]["seed"] == result.config.seed
        training = [(values, step) for values, step in run.logged if "train/loss" in values]
        assert [step for _, step in training] == [3, 6]
        assert [values["train/loss"] for values, _ in training] == pytest.approx(
            [row["loss"] for row in result.history])
        table = next(values["eval/accuracy_by_length"] for values, _ in run.logged
                     if "eval/accuracy_by_length" in values)
        assert {row[0]: row[1] for row in table.data} == result.per_length
        assert run.summary["eval/score"] == result.score
        assert run.finished


def test_a_missing_extra_is_a_one_line_error_naming_pip(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_trackers(name, *args, **kwargs):
        if name.split(".")[0] in ("tensorboard", "wandb"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_trackers)
    for module in ("wandb", "tensorboard"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    store = tmp_path / "s.sqlite"
    for flag, extra in (("--tensorboard", "tensorboard"), ("--wandb", "wandb")):
        assert main(["run", *TINY, flag, str(tmp_path / "x"), "--store", str(store)]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f'pip install "che-bench[{extra}]"' in error
    assert not store.exists()  # refused before anything was written


def test_without_trackers_nothing_is_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import would fail
    assert execute_run(tiny_config(), device="cpu", progress=False).status == "complete"
