"""`che-bench evaluate --checkpoint`: a run stopped part-way is evaluated as it stood at its
checkpoint, with the numbers a complete run of that many steps gets, and nothing is recorded."""

from __future__ import annotations

import json
import re

import pytest

import che_bench.run.runner as runner
from che_bench.cli import main
from che_bench.store import ResultStore

TINY = ["--task", "reverse_string", "--pe", "kerple", "--preset", "smoke", "--test-lengths",
        "41,50", "--eval-samples", "4", "--eval-batch-size", "4", "--no-progress", "--device",
        "cpu"]


def stop_at(step, monkeypatch):
    """`che-bench run` stopped by Ctrl-C after training step ``step``."""
    real_execute_pack = runner.execute_pack

    def stop(at, losses):
        if at == step:
            raise KeyboardInterrupt

    monkeypatch.setattr(runner, "execute_pack",
                        lambda *a, **k: real_execute_pack(*a, **k, on_step=stop))


def test_a_stopped_runs_checkpoint_scores_as_the_complete_run_of_that_many_steps(
        tmp_path, monkeypatch, capsys):
    store = tmp_path / "store.sqlite"
    assert main(["run", *TINY, "--steps", "5", "--store", str(store)]) == 0
    short = ResultStore(store).runs().iloc[0]
    stop_at(5, monkeypatch)
    assert main(["run", *TINY, "--steps", "8", "--store", str(store)]) == 130
    stopped = ResultStore(store).runs().query("status == 'started'")["run_id"].item()
    capsys.readouterr()
    assert main(["runs", "--store", str(store)]) == 0
    assert "started (checkpoint at step 5)" in capsys.readouterr().out

    assert main(["evaluate", stopped[:6], "--checkpoint", "--store", str(store)]) == 0
    printed = capsys.readouterr().out
    curves = ResultStore(store).per_length([short["run_id"]])
    test = curves[curves["split"] == "test"]
    assert f"run {stopped} at step 5 of 8 (its checkpoint; nothing recorded)" in printed
    assert f"score {short['score']:.2%}" in " ".join(printed.split())
    assert table_row(printed, "length") == ["41", "50"]
    assert table_row(printed, "accuracy %") == [f"{100 * a:.1f}" for a in test["accuracy"]]
    assert len(ResultStore(store).per_length([stopped])) == 0  # nothing recorded

    samples = tmp_path / "samples.jsonl"
    assert main(["evaluate", stopped, "--checkpoint", "--test-lengths", "60", "--samples",
                 str(samples), "--samples-per-length", "2", "--store", str(store)]) == 0
    assert table_row(capsys.readouterr().out, "length") == ["60"]
    assert [json.loads(line)["length"] for line in samples.read_text().splitlines()] == [60, 60]


def test_a_costlier_evaluation_of_a_checkpoint_states_its_cost(tmp_path, monkeypatch, capsys):
    """A started run has no recorded evaluation time: the cost is stated as a ratio alone (it
    crashed on the missing timings, NaN beside a complete run's in pandas' string column),
    and one beyond the confirmation ratio needs --yes."""
    store = tmp_path / "store.sqlite"
    assert main(["run", *TINY, "--steps", "2", "--store", str(store)]) == 0
    stop_at(3, monkeypatch)
    assert main(["run", *TINY, "--steps", "8", "--store", str(store)]) == 130
    stopped = ResultStore(store).runs().query("status == 'started'")["run_id"].item()
    capsys.readouterr()
    assert main(["evaluate", stopped, "--checkpoint", "--test-lengths", "41:50",
                 "--store", str(store)]) == 0
    stated = " ".join(capsys.readouterr().err.split())
    assert re.fullmatch(r"che-bench: estimated cost: [\d.]+x the runs' own evaluation per run, "
                        r"1 run\(s\)", stated)
    assert main(["evaluate", stopped, "--checkpoint", "--test-lengths", "41:200",
                 "--store", str(store)]) == 2
    assert "pass --yes to start it" in capsys.readouterr().err


def table_row(printed, name):
    """The values of the printed per-length table's row ``name``."""
    (line,) = [line for line in printed.splitlines() if line.startswith(name)]
    return line[len(name):].split()


@pytest.mark.parametrize("flags", [[], ["--test-lengths", "0"]])
def test_a_missing_checkpoint_or_a_bad_length_is_a_one_line_error(tmp_path, capsys, flags):
    store = tmp_path / "store.sqlite"
    assert main(["run", *TINY, "--steps", "2", "--store", str(store)]) == 0
    run_id = ResultStore(store).runs()["run_id"].item()
    capsys.readouterr()
    assert main(["evaluate", run_id, "--checkpoint", *flags, "--store", str(store)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert ("has no checkpoint" in error) if not flags else ("length" in error)


def test_runs_lists_a_started_runs_checkpoint_or_its_absence(tmp_path, monkeypatch, capsys):
    store = tmp_path / "store.sqlite"
    stop_at(3, monkeypatch)
    assert main(["run", *TINY, "--steps", "8", "--store", str(store)]) == 130
    (checkpoint,) = (tmp_path / "store.checkpoints").iterdir()
    monkeypatch.setenv("COLUMNS", "300")  # the status cell on one line
    for damage, status in ((b"not a checkpoint", "checkpoint unreadable"), (None, "incomplete")):
        if damage is None:
            checkpoint.unlink()
        else:
            checkpoint.write_bytes(damage)
        capsys.readouterr()
        assert main(["runs", "--store", str(store)]) == 0
        assert f"started ({status})" in " ".join(capsys.readouterr().out.split())


def test_two_stores_in_one_folder_keep_their_checkpoints_apart_and_old_ones_resume(
        tmp_path, monkeypatch, capsys):
    """Issue 44, item 8: ``NAME.checkpoints/`` per store; a checkpoint in the ``checkpoints/``
    that older stores shared is still listed, evaluated, and resumed (moved into the store's
    own folder first)."""
    first, second = tmp_path / "first.sqlite", tmp_path / "second.sqlite"
    stop_at(3, monkeypatch)
    assert main(["run", *TINY, "--steps", "8", "--store", str(first)]) == 130
    monkeypatch.undo()
    stop_at(5, monkeypatch)
    assert main(["run", *TINY, "--steps", "8", "--store", str(second)]) == 130
    (checkpoint,) = (tmp_path / "first.checkpoints").iterdir()
    assert [path.name for path in (tmp_path / "second.checkpoints").iterdir()] == [checkpoint.name]
    assert not (tmp_path / "checkpoints").exists()
    capsys.readouterr()
    for store, step in ((first, 3), (second, 5)):  # each its own, at its own step
        assert main(["runs", "--store", str(store)]) == 0
        assert f"started (checkpoint at step {step})" in capsys.readouterr().out

    # the layout of an older che-bench: the folder's stores shared checkpoints/
    (tmp_path / "checkpoints").mkdir()
    checkpoint.rename(tmp_path / "checkpoints" / checkpoint.name)
    assert main(["runs", "--store", str(first)]) == 0
    assert "started (checkpoint at step 3)" in capsys.readouterr().out
    assert main(["evaluate", checkpoint.stem, "--checkpoint", "--store", str(first)]) == 0
    assert "at step 3 of 8" in capsys.readouterr().out
    monkeypatch.undo()
    assert main(["run", *TINY, "--steps", "8", "--store", str(first)]) == 0
    assert "resuming from step 3/8" in capsys.readouterr().err
    assert not list((tmp_path / "checkpoints").iterdir())  # adopted, then done with
