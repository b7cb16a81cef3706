"""Kept models: written when a run completes, re-evaluated at other lengths, inspected."""

from __future__ import annotations

import pytest
import torch

from che_bench.cli import main
from che_bench.run.kept_models import load_model
from che_bench.store import ResultStore

TINY = ["--preset", "smoke", "--steps", "6", "--test-lengths", "41,60", "--eval-samples", "8",
        "--eval-batch-size", "4", "--no-progress", "--device", "cpu"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A store with two complete runs (Kerple, Kerple + DAPE V2 k3) and their kept models."""
    store = tmp_path_factory.mktemp("kept") / "store.sqlite"
    for kernel in ([], ["--kernel", "3"]):
        assert main(["run", "--task", "missing_duplicate", "--pe", "kerple", *kernel, *TINY,
                     "--store", str(store)]) == 0
    runs = ResultStore(store).runs()
    # Plain Kerple first, then Kerple + DAPE V2.
    return store, [runs.loc[runs["kernel"].isna(), "run_id"].iloc[0],
                   runs.loc[runs["kernel"] == 3, "run_id"].iloc[0]]


def test_a_complete_run_keeps_its_weights_and_they_rebuild_the_model(trained, tmp_path):
    store, run_ids = trained
    for run_id in run_ids:
        config, model = load_model(store, run_id)
        assert config.run_id() == run_id and not model.training
    other = tmp_path / "other.sqlite"
    assert main(["run", "--task", "even_pairs", *TINY, "--store", str(other), "--no-keep-model"]) == 0
    assert not (tmp_path / "other.models").exists()


def test_evaluate_under_the_original_protocol_reproduces_the_stored_curve(trained, capsys):
    store, run_ids = trained
    before = ResultStore(store).evaluations()
    assert main(["evaluate", *run_ids, "--store", str(store), "--no-progress"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # (wrapped lines)
    assert out.count("reproduces the stored curve exactly") == 2
    assert len(ResultStore(store).evaluations()) == len(before)  # nothing recorded


def test_longer_lengths_are_recorded_as_another_evaluation_and_selected_by_id(
    trained, capsys, monkeypatch
):
    store, run_ids = trained
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["evaluate", *run_ids, "--store", str(store), "--no-progress",
                 "--test-lengths", "41,100,300", "--dropout-at-eval"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100  # a 100-column terminal
    evaluation = out.split("evaluation ")[1].split()[0]
    results = ResultStore(store)
    curves = results.per_length(evaluation=evaluation)
    assert sorted(set(curves.loc[curves["split"] == "test", "length"])) == [41, 100, 300]
    original = results.per_length()
    assert sorted(set(original.loc[original["split"] == "test", "length"])) == [41, 60]
    assert main(["table", "--store", str(store), "--evaluation", evaluation]) == 0
    table = capsys.readouterr().out
    assert "dropout at eval" in table and "41..300" in table
    assert main(["export", "--store", str(store), "--per-length", "--evaluation", evaluation,
                 "--out", "-"]) == 0
    assert ",300," in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--test-lengths", "41:100000"], "pass --yes"),  # Kerple has no length limit: only cost
    (["--test-lengths", "50:41"], "bad length range"),
    (["--eval-samples", "0"], "eval_samples must be an integer >= 1"),
])
def test_impossible_or_far_costlier_evaluations_are_refused_up_front(trained, capsys, flags, message):
    store, run_ids = trained
    code = main(["evaluate", run_ids[0], "--store", str(store), "--no-progress", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


def test_lengths_beyond_a_recall_probe_are_refused_before_anything_runs(tmp_path, capsys):
    store = tmp_path / "store.sqlite"
    assert main(["run", "--task", "associative_recall", *TINY, "--store", str(store)]) == 0
    run_id = ResultStore(store).runs()["run_id"][0]
    capsys.readouterr()
    assert main(["evaluate", run_id, "--store", str(store), "--test-lengths", "41:1000"]) == 2
    assert "supports lengths up to 514" in capsys.readouterr().err


def test_damaged_model_and_unknown_run_are_one_line_errors(trained, tmp_path, capsys):
    store, run_ids = trained
    copy = tmp_path / "store.sqlite"
    copy.write_bytes(store.read_bytes())
    (tmp_path / "store.models").mkdir()
    (tmp_path / "store.models" / f"{run_ids[0]}.pt").write_bytes(b"not a model")
    before = copy.read_bytes()
    assert main(["evaluate", run_ids[0], "--store", str(copy)]) == 2
    assert main(["evaluate", run_ids[1], "--store", str(copy)]) == 2  # no model file at all
    assert main(["evaluate", "0123456789ab", "--store", str(store)]) == 2
    assert main(["attention", "0123456789ab", "--length", "50", "--store", str(store),
                 "--out", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(line.startswith("che-bench: error:") for line in err)
    assert "damaged" in err[0] and "no kept model" in err[1] and "no run" in err[2]
    assert copy.read_bytes() == before  # the store is untouched


def test_attention_draws_both_runs_side_by_side(trained, tmp_path, capsys):
    store, run_ids = trained
    out = tmp_path / "attention.png"
    assert main(["attention", run_ids[1], "--compare", run_ids[0], "--length", "50",
                 "--layer", "-1", "--heads", "0,1", "--store", str(store), "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    for flags in (["--layer", "7"], ["--sample", "4"], ["--heads", "0,9"]):
        assert main(["attention", run_ids[1], "--length", "50", "--store", str(store),
                     "--out", str(out), *flags]) == 2
    assert capsys.readouterr().err.count("che-bench: error:") == 3


def test_attention_maps_are_the_evaluated_forward_pass(trained):
    from che_bench.eval.attention_maps import attention_maps

    store, run_ids = trained
    config, model = load_model(store, run_ids[1])  # with DAPE
    maps = attention_maps(model, config, "k3", length=50, sample=1, layer=0)
    assert maps.logits is not None and maps.scores.shape == (2, 51, 51)
    torch.testing.assert_close(torch.from_numpy(maps.probabilities).sum(-1), torch.ones(2, 51))
    torch.testing.assert_close(torch.from_numpy(maps.probabilities),
                               torch.softmax(torch.from_numpy(maps.logits), -1))


def test_two_stores_in_one_folder_keep_their_models_apart_and_old_ones_are_found(
        trained, tmp_path, capsys):
    """Issue 44, item 8: ``NAME.models/`` per store, so the same run in two stores of one
    folder keeps both models; a store whose models are in the ``models/`` that older stores
    shared still finds them."""
    store, run_ids = trained
    other = store.parent / "other.sqlite"
    assert main(["run", "--task", "missing_duplicate", "--pe", "kerple", *TINY, "--steps", "7",
                 "--store", str(other)]) == 0
    assert sorted(path.name for path in (store.parent / "store.models").iterdir()) \
        == sorted(f"{run_id}.pt" for run_id in run_ids)
    assert len(list((store.parent / "other.models").iterdir())) == 1
    assert not (store.parent / "models").exists()

    old = tmp_path / "old.sqlite"
    old.write_bytes(store.read_bytes())
    (tmp_path / "models").mkdir()
    for run_id in run_ids:
        (tmp_path / "models" / f"{run_id}.pt").write_bytes(
            (store.parent / "store.models" / f"{run_id}.pt").read_bytes())
    config, model = load_model(old, run_ids[1])
    assert config.run_id() == run_ids[1]
    capsys.readouterr()
    assert main(["runs", "--store", str(old)]) == 0
    lines = capsys.readouterr().out.splitlines()
    for run_id in run_ids:  # (its row in whichever column group holds "kept model")
        assert any(line.startswith(run_id) and " kept" in line for line in lines)


def test_the_attention_maps_of_stick_breaking_are_its_weights(tmp_path):
    """An encoding with its own normalisation: the maps are the weights it multiplies the
    values with (rows summing to 1 with the remainder on the diagonal), titled as such."""
    from che_bench.eval.attention_maps import attention_maps

    store = tmp_path / "store.sqlite"
    assert main(["run", "--task", "missing_duplicate", "--pe", "stick_breaking", *TINY,
                 "--store", str(store)]) == 0
    config, model = load_model(store, ResultStore(store).runs()["run_id"].iloc[0])
    maps = attention_maps(model, config, "sb", length=50, sample=1, layer=0)
    assert maps.logits is None and maps.weights == "stick_breaking weights"
    weights = torch.from_numpy(maps.probabilities)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 51))
    assert weights[0].triu(1).eq(0).all() and weights[1].tril(-1).eq(0).all()  # left, right
    assert main(["attention", ResultStore(store).runs()["run_id"].iloc[0], "--length", "50",
                 "--store", str(store), "--out", str(tmp_path / "sb.png")]) == 0
