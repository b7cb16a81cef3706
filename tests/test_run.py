"""`che-bench run` end to end (smoke preset, tiny budgets) and the runner's contracts."""

from __future__ import annotations

import io
import os
import signal
import sqlite3

import pandas as pd
import pytest
import torch

import che_bench.run.runner as runner
import che_bench.train.step as train_step
from che_bench.cli import main
from che_bench.config import RunConfig, make_config
from che_bench.outcomes import RunResult
from che_bench.errors import CheBenchError
from che_bench.protocol import parse_lengths
from che_bench.run.runner import execute_run
from che_bench.store import ResultStore

TINY = ["--preset", "smoke", "--steps", "8", "--test-lengths", "41,50", "--eval-samples", "4",
        "--eval-batch-size", "4", "--no-progress", "--device", "cpu"]


def run_cli(store, *args: str) -> int:
    return main(["run", "--task", "reverse_string", "--pe", "kerple", "--kernel", "3",
                 *TINY, "--store", str(store), *args])


def test_parse_lengths():
    assert parse_lengths("41:45") == (41, 42, 43, 44, 45)
    assert parse_lengths("41:500:20,500")[-3:] == (461, 481, 500)
    assert parse_lengths("100,41, 60") == (41, 60, 100)
    assert parse_lengths([50, 41]) == (41, 50)
    for bad in ("500:41", "41:", "a:b", "41:500:0", "0:3", "", [41, float("inf")], [2.5]):
        with pytest.raises(CheBenchError):
            parse_lengths(bad)


def test_config_is_resolved_validated_and_identified():
    config = make_config("missing_duplicate", "kerple", 3, "paper")
    assert config.task == "missing_duplicate_string"
    assert (config.steps, config.batch_size, config.lr) == (200_000, 128, 1e-4)
    assert config.test_lengths == tuple(range(41, 501))
    assert (config.eval_samples, config.eval_batch_size) == (512, 64)
    assert RunConfig.from_dict(config.to_dict()) == config
    assert config.run_id() == make_config("missing_duplicate_string", "kerple", 3, "paper").run_id()
    assert config.run_id() != make_config("missing_duplicate", "kerple", 3, "paper", seed=1).run_id()
    assert make_config("even_pairs", preset="smoke", dim=32).model_options["ffn"] == 128
    assert make_config("even_pairs", preset="paper", score_from_42=True).score_lengths[0] == 42
    for bad in (dict(kernel=2), dict(kernel=0), dict(dape_width=8), dict(test_lengths="50:41"),
                dict(unknown_setting=1), dict(pe="no_such_pe"), dict(task="no_such_task"),
                dict(lr=-1.0), dict(pe_options={"no_such_option": 1})):
        arguments = {"task": "even_pairs", "pe": "alibi", "preset": "smoke", **bad}
        with pytest.raises(CheBenchError):
            make_config(**arguments)


def test_result_round_trips():
    config = make_config("even_pairs", preset="smoke")
    result = RunResult(run_id=config.run_id(), config=config, status="complete", score=0.5,
                       per_length={41: 0.5}, train_per_length={5: 1.0})
    assert RunResult.from_dict(result.to_dict()) == result


def test_run_then_table_export_plot(tmp_path, capsys):
    store = tmp_path / "store.sqlite"
    assert run_cli(store) == 0
    out = capsys.readouterr().out
    assert "complete" in out and "DAPE_k3_Kerple" in out and "81.84" in out  # paper's cell

    runs = ResultStore(store).runs()
    assert runs["status"].tolist() == ["complete"]
    assert 0.0 <= runs["score"].iloc[0] <= 1.0

    assert run_cli(store) == 0  # already complete: nothing re-run
    assert "already complete" in capsys.readouterr().out
    assert ResultStore(store).runs()["attempts"].tolist() == [1]

    assert main(["table", "--store", str(store), "--format", "csv", "--compare", "paper"]) == 0
    table = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert table["DAPE_k3_Kerple paper"].tolist() == [81.84]
    assert main(["export", "--store", str(store), "--per-length", "--out", str(tmp_path / "c.csv")]) == 0
    curves = pd.read_csv(tmp_path / "c.csv")
    assert sorted(curves.loc[curves["split"] == "test", "length"]) == [41, 50]
    assert main(["plot", "--store", str(store), "--out", str(tmp_path / "a.png")]) == 0
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["runs", "--store", str(store)]) == 0


def test_interrupted_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch, capsys):
    config = make_config("reverse_string", "kerple", 3, "smoke", steps=8, test_lengths="41,50",
                         eval_samples=4, eval_batch_size=4)
    reference_losses: list[float] = []
    reference = execute_run(config, device="cpu", progress=False,
                            on_step=lambda step, loss: reference_losses.append(loss))

    losses: list[float] = []

    def stop_at_step_5(step: int, pack_losses: list[float]) -> None:
        losses.append(pack_losses[0])
        if step == 5:
            raise KeyboardInterrupt

    real_execute_pack = runner.execute_pack
    monkeypatch.setattr(runner, "execute_pack",
                        lambda *a, **k: real_execute_pack(*a, **k, on_step=stop_at_step_5))
    store = tmp_path / "store.sqlite"
    assert run_cli(store) == 130
    assert "checkpoint saved at step 5" in capsys.readouterr().err
    assert ResultStore(store).runs()["status"].tolist() == ["started"]
    assert main(["export", "--store", str(store)]) == 0  # an incomplete run does not break exports
    assert "started" in capsys.readouterr().out

    monkeypatch.setattr(runner, "execute_pack", lambda *a, **k: real_execute_pack(
        *a, **k, on_step=lambda step, pack_losses: losses.append(pack_losses[0])))
    assert run_cli(store) == 0
    assert f"{config.run_id()}: resuming from step 5/8" in capsys.readouterr().err
    assert losses == reference_losses  # steps 6..8 continue exactly
    runs = ResultStore(store).runs()
    assert runs["status"].tolist() == ["complete"]
    assert runs["score"].iloc[0] == reference.score
    curves = ResultStore(store).per_length()
    assert dict(zip(curves.loc[curves["split"] == "test", "length"],
                    curves.loc[curves["split"] == "test", "accuracy"])) == reference.per_length
    assert not list((tmp_path / "store.checkpoints").iterdir())  # cleaned up once complete


def test_ctrl_c_finishes_the_step_and_checkpoints_it(tmp_path):
    config = make_config("even_pairs", "alibi", None, "smoke", steps=8)

    def press_ctrl_c(step: int, loss: float) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # delivered as a flag, acted on after the step

    # Python's own handler, whatever pytest was started with (a background job starts with
    # SIGINT ignored).
    started_with = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            execute_run(config, device="cpu", checkpoint_dir=tmp_path, progress=False,
                        on_step=press_ctrl_c)
        state = torch.load(tmp_path / f"{config.run_id()}.pt", weights_only=True)
        assert state["step"] == 3
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    finally:
        signal.signal(signal.SIGINT, started_with)


def test_diverged_run_is_recorded_as_failed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train_step, "token_loss",
                        lambda logits, targets, mask=None: logits.sum((1, 2, 3)) * torch.tensor(float("nan")))
    store = tmp_path / "store.sqlite"
    assert run_cli(store) == 1
    assert "diverged at step 1" in capsys.readouterr().err
    runs = ResultStore(store).runs()
    assert runs["status"].tolist() == ["failed"]
    assert runs["error"].iloc[0].startswith("diverged at step 1")


@pytest.mark.parametrize("args", [
    ["--task", "no_such_task"],
    ["--task", "even_pairs", "--pe", "no_such_pe"],
    ["--task", "even_pairs", "--kernel", "2"],
    ["--task", "even_pairs", "--test-lengths", "500:41"],
    ["--task", "even_pairs", "--pe-option", "novalue"],
    ["--task", "even_pairs", "--device", "cuda:99" if torch.cuda.is_available() else "cuda"],
    ["--task", "associative_recall", "--test-lengths", "41:1000"],  # the probe ends at 514
    ["--task", "duplicate_string", "--pe", "learned", "--test-lengths", "700"],  # T 2100 > 2048
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args):
    store = tmp_path / "store.sqlite"
    assert main(["run", *args, "--preset", "smoke", "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("che-bench: error:") and err.count("\n") == 1
    assert not store.exists()  # nothing was created or run


def test_foreign_store_is_refused_and_kept(tmp_path, capsys):
    store = tmp_path / "precious.sqlite"
    with sqlite3.connect(store) as connection:
        connection.execute("CREATE TABLE thesis (chapter TEXT)")
        connection.execute("INSERT INTO thesis VALUES ('one')")
    before = store.read_bytes()
    assert main(["run", "--task", "even_pairs", "--preset", "smoke", "--store", str(store)]) == 2
    assert main(["table", "--store", str(store)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all("not a che-bench result store" in line for line in err)
    assert store.read_bytes() == before


def test_unwritable_outputs_are_one_line_errors(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert main(["run", "--task", "even_pairs", "--preset", "smoke",
                 "--store", str(blocker / "store.sqlite")]) == 2
    store = tmp_path / "store.sqlite"
    assert main(["run", "--task", "even_pairs", "--preset", "smoke", "--store", str(store),
                 "--checkpoint-dir", str(blocker / "ckpt")]) == 2
    ResultStore(store).record(_synthetic_complete_run())
    assert main(["plot", "--store", str(store), "--out", str(blocker / "x.png")]) == 2
    assert main(["export", "--store", str(store), "--out", str(blocker / "x.csv")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(line.startswith("che-bench: error:") for line in err)


def _synthetic_complete_run() -> RunResult:
    """A made-up result (not from a model), only to have something to plot/export."""
    config = make_config("even_pairs", preset="smoke")
    return RunResult(run_id=config.run_id(), config=config, status="complete", score=0.5,
                     train_accuracy=0.5, per_length={n: 0.5 for n in config.test_lengths},
                     train_per_length={n: 0.5 for n in config.train_eval_lengths})
