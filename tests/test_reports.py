"""Tables, exports and plots of the store, on SYNTHETIC run results (made-up accuracies that
only exercise the aggregation; not results of any model)."""

from __future__ import annotations

import dataclasses
import io
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_store import reevaluation, store_files, synthetic_result, v1_results, v1_store

from che_bench.cli import main
from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.reports import paper
from che_bench.reports.chance import EXACT_CHANCE_SEQUENCES, exact_match_chance, run_exact_chance
from che_bench.reports.export import export_frame
from che_bench.reports.labels import run_encoding_label
from che_bench.reports.plots import plot_accuracy
from che_bench.reports.tables import format_table, summarize
from che_bench.run.kept_models import model_path, models_dir_for
from che_bench.store import ResultStore, resolve_run_ids
from che_bench.tasks import get_task, list_tasks

REPOSITORY = Path(__file__).resolve().parent.parent


@pytest.fixture
def store(tmp_path) -> ResultStore:
    store = ResultStore(tmp_path / "s.sqlite")
    for result in (
        synthetic_result("missing_duplicate", "kerple", 3, seed=0, score=0.60),
        synthetic_result("missing_duplicate", "kerple", 3, seed=1, score=0.80),
        synthetic_result("missing_duplicate", "kerple", None, seed=0, score=0.55),
        synthetic_result("even_pairs", "kerple", None, seed=0, score=0.70),
        synthetic_result("even_pairs", "kerple", None, seed=1, score=0.90, status="failed"),
    ):
        store.record(result)
    store.mark_started(synthetic_result("even_pairs", "kerple", None, seed=2).config)  # crashed
    return store


def test_encoding_labels_follow_the_paper():
    def label(pe, kernel, **config):
        return run_encoding_label({"pe": pe, "kernel": kernel, **config})

    assert label("kerple", None) == "Kerple"
    assert label("alibi", 1) == "DAPE_k1_ALiBi"
    assert label("fire", 3) == "DAPE_k3_FIRE"
    assert label("sin_cos", None) == "sin_cos"
    assert label("kerple", 3, causal=True) == run_encoding_label('{"pe": "kerple", "kernel": 3, '
                                                                 '"causal": true}') == "DAPE_k3_Kerple (causal)"


def test_cells_are_max_and_mean_over_complete_runs(store):
    cells = summarize(store, compare="paper").set_index(["task", "column"])
    k3 = cells.loc[("missing_duplicate_string", "DAPE_k3_Kerple")]
    assert k3["max"] == pytest.approx(80.0)
    assert k3["mean"] == pytest.approx(70.0)
    assert k3["std"] == pytest.approx(14.1421, abs=1e-3)
    assert k3["n"] == 2
    assert k3["paper"] == pytest.approx(99.65)
    # smoke runs: the published value is shown, no difference
    assert not k3["comparable"] and math.isnan(k3["diff"])
    assert k3["differences"][:3] == ("preset smoke", "20 steps", "1 layer")
    # the failed (90%) and the crashed run do not count
    even = cells.loc[("even_pairs", "Kerple")]
    assert (even["max"], even["n"], even["paper"]) == (pytest.approx(70.0), 1, pytest.approx(57.50))
    # rows grouped by level: R (even_pairs) before CS (missing_duplicate_string)
    assert list(dict.fromkeys(summarize(store)["task"])) == ["even_pairs", "missing_duplicate_string"]


def test_csv_table_is_a_numeric_pivot(store):
    table = pd.read_csv(io.StringIO(format_table(store, fmt="csv", compare="paper")))
    assert table["task"].tolist() == ["even_pairs", "missing_duplicate_string"]
    assert table["level"].tolist() == ["R", "CS"]
    row = table.set_index("task").loc["missing_duplicate_string"]
    assert row["DAPE_k3_Kerple max"] == pytest.approx(80.0)
    assert row["Kerple max"] == pytest.approx(55.0)
    assert row["Kerple paper"] == pytest.approx(79.06)


@pytest.mark.parametrize("fmt, marker", [("text", "DAPE_k3_Kerple"), ("markdown", "| level |"),
                                         ("latex", r"\begin{tabular}")])
def test_other_formats_render(store, fmt, marker):
    text = format_table(store, fmt=fmt, compare="paper")
    assert marker in text
    assert "80.00 (70.00±14.14, n=2)" in text.replace(r"$\pm$", "±")
    assert "99.65" in text


def test_table_filters_by_task_and_run(store):
    only = format_table(store, tasks=["missing_duplicate"], fmt="csv")
    assert "even_pairs" not in only and "missing_duplicate_string" in only
    assert format_table(store, run_ids=["nonexistent"]) == "(no complete runs)\n"
    with pytest.raises(CheBenchError):
        format_table(store, fmt="html")


def test_runs_differing_in_other_settings_get_separate_columns(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    store.record(synthetic_result("even_pairs", "alibi", score=0.6))
    store.record(synthetic_result("even_pairs", "alibi", score=0.7, steps=7))
    columns = summarize(store)["column"].tolist()
    assert columns == ["ALiBi [steps=7]", "ALiBi [steps=20]"] or columns == ["ALiBi [steps=20]", "ALiBi [steps=7]"]


def test_table_suite_filter_shows_the_suites_runs_only(store, tmp_path, capsys):
    """Issue 44, item 8: ``table --suite`` as ``report --suite``."""
    suite = tmp_path / "mine.toml"
    suite.write_text('preset = "smoke"\ntasks = ["missing_duplicate"]\n'
                     'encodings = [{ name = "kerple", kernels = [3] }]\nseeds = [0, 1, 7]\n')
    assert main(["table", "--store", str(store.path), "--suite", str(suite)]) == 0
    text = capsys.readouterr().out
    assert "DAPE_k3_Kerple" in text and "n=2" in text
    assert "even_pairs" not in text and "Kerple " not in text.replace("DAPE_k3_Kerple", "")
    other = tmp_path / "other.toml"
    other.write_text('preset = "smoke"\ntasks = ["parity_check"]\nencodings = ["none"]\n')
    assert main(["table", "--store", str(store.path), "--suite", str(other)]) == 2
    assert "no runs of suite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["table", "--store", str(store.path), "--suite", str(suite), "--task", "even_pairs"])


def test_columns_of_several_presets_name_the_preset_and_what_differs_from_it(tmp_path):
    """Issue 44, item 8: not every setting in which the presets differ."""
    store = ResultStore(tmp_path / "s.sqlite")
    store.record(synthetic_result("even_pairs", "kerple", preset="smoke"))
    store.record(synthetic_result("even_pairs", "kerple", preset="quick"))
    store.record(synthetic_result("even_pairs", "kerple", preset="quick", steps=7))
    store.record(synthetic_result("even_pairs", "kerple", preset="quick", steps=12))
    columns = summarize(store)["column"].tolist()
    # (numbers in order: steps=7 before steps=12)
    assert columns == ["Kerple [quick, steps=7]", "Kerple [quick, steps=12]", "Kerple [quick]",
                       "Kerple [smoke]"]


def test_one_seed_and_several_seeds_share_a_column(tmp_path):
    """Issue 44, item 8: ``--seeds 0,1`` sets a length seed where ``--seed 2`` does not (run
    ids unchanged); the length seed is a seed of the cell, not a setting of a column."""
    store = ResultStore(tmp_path / "s.sqlite")
    store.record(synthetic_result("even_pairs", "kerple", seed=0, length_seed=0, score=0.6))
    store.record(synthetic_result("even_pairs", "kerple", seed=1, length_seed=0, score=0.7))
    store.record(synthetic_result("even_pairs", "kerple", seed=2, score=0.8))
    cells = summarize(store)
    assert cells["column"].tolist() == ["Kerple"] and cells["n"].tolist() == [3]


def test_runs_differing_in_encoding_options_name_the_options_not_a_dict(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    store.record(synthetic_result("even_pairs", "alibi", score=0.6))
    store.record(synthetic_result("even_pairs", "alibi", score=0.7, pe_options={"alibi_mode": "two_slopes"}))
    columns = sorted(summarize(store)["column"].tolist())
    assert columns == ["ALiBi [alibi_mode=two_slopes]", "ALiBi [pe_options=default]"]


def test_the_paper_notes_name_its_tables_only_beside_their_tasks(tmp_path):
    """``che-bench run --task flip_flop`` printed DAPE V2's Table 6 note (and for the LSTM,
    that CHE's table could not be read) under a table with no task of theirs."""
    store = ResultStore(tmp_path / "s.sqlite")
    store.record(synthetic_result("word_problem", "none", task_params={"group": "S3"}))
    store.record(synthetic_result("flip_flop", None, arch="lstm"))
    text = format_table(store, compare="paper")
    assert "2410.04798" not in text and "2207.02098" not in text
    store.record(synthetic_result("parity_check", "kerple"))
    store.record(synthetic_result("parity_check", None, arch="lstm"))
    text = format_table(store, compare="paper")
    assert "paper: DAPE V2 (arXiv 2410.04798)" in text and "LSTM: no published reference" in text


def test_runs_differing_in_one_model_option_name_that_option_only(tmp_path):
    """``--layers 2`` beside the preset's 1 layer: the columns read ``[layers=1]`` and
    ``[layers=2]``, not every model option (``layers=1, dim=16, heads=2, ffn=32, ...``)."""
    store = ResultStore(tmp_path / "s.sqlite")
    store.record(synthetic_result("even_pairs", "alibi", score=0.6))
    store.record(synthetic_result("even_pairs", "alibi", score=0.7, layers=2))
    store.record(synthetic_result("even_pairs", "kerple", score=0.7, layers=2, dim=32))
    store.record(synthetic_result("even_pairs", "kerple", score=0.7, layers=3, dim=32))
    store.record(synthetic_result("even_pairs", "rope", score=0.7, pe_options={"rope_base": 100}))
    store.record(synthetic_result("even_pairs", "rope", score=0.7,
                                  pe_options={"rope_base": 100, "rope_pairing": "half"}))
    columns = sorted(summarize(store)["column"].tolist())
    assert columns == ["ALiBi [layers=1]", "ALiBi [layers=2]", "Kerple [layers=2]",
                       "Kerple [layers=3]", "RoPE [rope_pairing=default]", "RoPE [rope_pairing=half]"]


def test_export_keeps_every_run_and_per_length_rows(store):
    runs = export_frame(store)
    assert sorted(runs["status"]) == ["complete"] * 4 + ["failed", "started"]
    assert {"task", "pe", "kernel", "seed", "lr", "steps", "preset", "score", "run_id"} <= set(runs.columns)
    curves = export_frame(store, per_length=True)
    assert set(curves["run_id"]) == set(runs.loc[runs["status"] == "complete", "run_id"])
    assert set(curves["split"]) == {"test", "train"}


def test_plot_writes_a_png(store, tmp_path):
    out = plot_accuracy(store, tmp_path / "plots" / "acc.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(CheBenchError):
        plot_accuracy(store, tmp_path / "x.png", tasks=["bucket_sort"])


def test_a_line_hidden_under_another_says_so_in_the_legend(tmp_path):
    """Issue 44, item 8: two configurations with the same curve draw one visible line."""
    from matplotlib.figure import Figure

    from che_bench.reports.plots import _draw_panel, plot_data

    store = ResultStore(tmp_path / "s.sqlite")
    store.record(synthetic_result("even_pairs", "kerple", score=1.0))
    store.record(synthetic_result("even_pairs", "alibi", score=1.0))
    store.record(synthetic_result("even_pairs", "rope", score=0.5))
    runs, curves = plot_data(store)
    ax = Figure().subplots()
    _draw_panel(ax, runs, curves, "even_pairs")
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    # (whichever of the two is drawn first lies under the other)
    assert {"Kerple (n=1; under ALiBi)", "ALiBi (n=1)"} <= set(labels) \
        or {"ALiBi (n=1; under Kerple)", "Kerple (n=1)"} <= set(labels)
    assert "RoPE (n=1)" in labels


def test_paper_difference_only_where_the_published_protocol_was_followed(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    store.record(synthetic_result("missing_duplicate", "kerple", 3, score=0.90, preset="paper"))
    store.record(synthetic_result("missing_duplicate", "kerple", None, score=0.85, preset="paper",
                                  steps=1000))
    store.record(synthetic_result("even_pairs", "alibi", None, score=0.60, preset="quick"))
    cells = summarize(store, compare="paper").set_index(["task", "column"])
    paper_run = cells.loc[("missing_duplicate_string", "DAPE_k3_Kerple")]
    assert paper_run["comparable"] and paper_run["diff"] == pytest.approx(90.0 - 99.65)
    assert paper_run["differences"] == ()
    short = cells.loc[("missing_duplicate_string", "Kerple")]
    assert not short["comparable"] and short["differences"] == ("1000 steps",)
    quick = cells.loc[("even_pairs", "ALiBi")]
    assert quick["differences"][:3] == ("preset quick", "1500 steps", "2 layers")

    text = format_table(store, compare="paper", fmt="markdown")  # (cells unwrapped)
    assert "99.65 (-9.65)" in text
    assert "79.06 (not comparable: 1000 steps)" in text
    assert "73.52 (not comparable: preset quick, 1500 steps, 2 layers, +4 more)" in text
    assert "-13.52" not in text  # 60.00 - 73.52 is not shown for the quick run
    assert "reference code keeps dropout on" in text

    csv = pd.read_csv(io.StringIO(format_table(store, compare="paper", fmt="csv"))).set_index("task")
    row = csv.loc["missing_duplicate_string"]
    assert row["DAPE_k3_Kerple diff"] == pytest.approx(90.0 - 99.65)
    assert bool(row["DAPE_k3_Kerple comparable"]) and not bool(row["Kerple comparable"])
    assert math.isnan(row["Kerple diff"]) and row["Kerple paper"] == pytest.approx(79.06)
    assert math.isnan(csv.loc["even_pairs", "ALiBi diff"])


def test_dropout_at_eval_runs_compare_without_the_dropout_note(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    store.record(synthetic_result("even_pairs", "alibi", score=0.8, preset="paper", dropout_at_eval=True))
    text = format_table(store, compare="paper")
    assert "73.52 (+6.48)" in text
    assert "keeps dropout on" not in text


def test_chance_is_that_of_the_run_s_own_task_parameters(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    store.record(synthetic_result("cycle_navigation", "alibi", task_params={"cycle_length": 7}))
    store.record(synthetic_result("cycle_navigation", "alibi"))
    chances = dict(zip(summarize(store)["task"], summarize(store)["chance"]))
    assert chances == {"cycle_navigation(cycle_length=7)": pytest.approx(100 / 7),
                       "cycle_navigation": pytest.approx(20.0)}
    assert "14.3" in format_table(store)


def test_chance_is_one_over_the_classes_as_the_protocol_page_says():
    # The list of docs/protocol.md: 20% for these, 33.3% for these, 50% for every other CHE task
    # (the recall probes and the group word problems have more classes).
    readme = " ".join((REPOSITORY / "docs" / "protocol.md").read_text().split())
    stated = {20.0: ["modular-arithmetic", "cycle navigation", "solve equation", "bucket sort"],
              33.3: ["stack manipulation", "binary addition", "binary multiplication"]}
    for words in stated.values():
        for word in words:
            assert word in readme
    for name in list_tasks():
        task = get_task(name)
        if task.level == "recall" or name == "word_problem":
            continue
        expected = next((c for c, words in stated.items()
                         if any(w.replace("-", "_").replace(" ", "_") in name for w in words)), 50.0)
        assert round(100 * task.chance, 1) == expected, name


def test_the_packaged_paper_table_is_the_reference_copy(monkeypatch, tmp_path):
    packaged = REPOSITORY / "che_bench" / "data" / "dape_v2_table6.csv"
    assert packaged.read_bytes() == (REPOSITORY / paper.PAPER_TABLE_FILE).read_bytes()
    assert paper.load_paper_table().at["even_pairs", "Kerple"] == pytest.approx(57.50)
    monkeypatch.setattr(paper, "PAPER_TABLE_RESOURCE", ("data", "missing.csv"))
    store = ResultStore(tmp_path / "s.sqlite")
    store.record(synthetic_result())
    with pytest.raises(CheBenchError, match="missing from this installation"):
        format_table(store, compare="paper")
    assert "Kerple" in format_table(store)  # without --compare, no published table needed


def test_tables_exports_and_plots_of_a_reevaluation(store, tmp_path):
    best = store.runs().set_index("score").loc[0.80]
    result = synthetic_result("missing_duplicate", "kerple", 3, seed=1, score=0.80)
    assert result.run_id == best["run_id"]
    evaluation = store.record_evaluation(result.run_id, **reevaluation(result, accuracy=0.30,
                                                                       dropout_at_eval=True))
    cells = summarize(store, evaluation=evaluation)
    assert cells[["task", "column", "max", "n"]].values.tolist() == [
        ["missing_duplicate_string", "DAPE_k3_Kerple", pytest.approx(30.0), 1]]
    text = format_table(store, evaluation=evaluation)
    assert f"scores of evaluation {evaluation} (test lengths 41..1000 (2 lengths)" in text
    assert "dropout at eval" in text
    assert "scores of evaluation" not in format_table(store)

    runs = export_frame(store, evaluation=evaluation)
    assert runs[["run_id", "evaluation", "score", "test_lengths", "eval_device"]].values.tolist() == [
        [result.run_id, evaluation, 0.30, "[41, 1000]", "synthetic-gpu"]]
    assert export_frame(store)["evaluation"].notna().sum() == 4  # the complete runs' originals
    curves = export_frame(store, per_length=True, evaluation=evaluation)
    assert set(curves["evaluation"]) == {evaluation}
    assert sorted(curves.loc[curves["split"] == "test", "length"]) == [41, 1000]
    assert plot_accuracy(store, tmp_path / "re.png", evaluation=evaluation).is_file()
    with pytest.raises(CheBenchError, match="unknown evaluation"):
        plot_accuracy(store, tmp_path / "x.png", evaluation="0123456789")


def test_cli_evaluation_flag_export_to_stdout_and_listings(store, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = str(store.path)
    result = synthetic_result("missing_duplicate", "kerple", 3, seed=1, score=0.80)
    evaluation = store.record_evaluation(result.run_id, **reevaluation(result))

    assert main(["export", "--store", path, "--out", "-", "--evaluation", evaluation]) == 0
    exported = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert exported["evaluation"].tolist() == [evaluation]
    assert not (tmp_path / "-").exists()
    assert main(["export", "--store", path, "--out", "runs.csv"]) == 0
    assert capsys.readouterr().out == f"wrote runs.csv ({len(store.runs())} rows)\n"
    assert len(pd.read_csv(tmp_path / "runs.csv")) == len(store.runs())

    assert main(["table", "--store", path, "--evaluation", evaluation]) == 0
    assert f"scores of evaluation {evaluation}" in capsys.readouterr().out
    assert main(["table", "--store", path, "--evaluation", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown evaluation 'nope'" in err and evaluation in err

    assert main(["evaluations", "--store", path, "--run", result.run_id]) == 0
    listing = capsys.readouterr().out
    assert evaluation in listing and "re-evaluation" in listing and "original" in listing
    assert "test lengths 41..1000" in listing
    assert main(["evaluations", "--store", path, "--run", "nonexistent"]) == 2
    assert "no run nonexistent" in capsys.readouterr().err

    kept = model_path(models_dir_for(store.path), result.run_id)
    kept.parent.mkdir()
    kept.write_bytes(b"a kept model (stand-in)")
    assert main(["runs", "--store", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "model" in next(line for line in lines if "run id" in line)
    # (each column group of the listing starts its rows with the run id)
    kept = {line.split()[0] for line in lines if line.split() and "kept" in line.split()
            and line.split()[0] in set(store.runs()["run_id"])}
    assert kept == {result.run_id}


READER_COMMANDS = [["runs"], ["evaluations"], ["table"], ["table", "--compare", "paper"],
                   ["export"], ["export", "--per-length"], ["export", "--curves"],
                   ["plot", "--out", "{out}/a.png"], ["report", "--out", "{out}/r.html"],
                   ["curves", "{run}", "--out", "{out}/c.png"]]


@pytest.mark.parametrize("schema", [1, 2, 3])
def test_readers_change_no_byte_of_a_store_of_any_schema(schema, store, tmp_path, capsys):
    if schema == 1:
        path = v1_store(tmp_path / "old.sqlite", v1_results())
    elif schema == 2:  # the committed laptop store is of version 2
        path = tmp_path / "laptop.sqlite"
        shutil.copyfile(REPOSITORY / "results" / "laptop" / "laptop.sqlite", path)
    else:
        path = store.path
    before = store_files(path)
    run_id = ResultStore(path, read_only=True).runs()["run_id"].iloc[0]
    out = tmp_path / "out"
    for command in READER_COMMANDS:
        arguments = [argument.format(out=out, run=run_id) for argument in command]
        status = main([*arguments, "--store", str(path)])
        # (the stores here have no training history to draw)
        assert status == (2 if command[0] == "curves" else 0), (command, capsys.readouterr().err)
        assert store_files(path) == before, command


def _store_with_run_ids(path, run_ids: list[str], histories: list[list[float]]) -> ResultStore:
    """SYNTHETIC runs recorded under the given ids (to have ids that share prefixes), each with
    a training history of the given training accuracies (none when empty)."""
    store = ResultStore(path)
    for seed, (run_id, accuracies) in enumerate(zip(run_ids, histories)):
        result = dataclasses.replace(synthetic_result("parity_check", "kerple", seed=seed),
                                     run_id=run_id)
        result.history = [{"step": 10 * (i + 1), "loss": 0.7, "accuracy": accuracy, "grad_norm": 1.0,
                           "lr": 1e-3, "elapsed_s": float(i)} for i, accuracy in enumerate(accuracies)]
        store.record(result)
    return store


def test_the_runs_listing_names_task_parameters_and_what_changed_from_the_preset(
        tmp_path, monkeypatch, capsys):
    store = ResultStore(tmp_path / "s.sqlite")
    arch = {"arch": "deltanet", "arch_options": {"negative_eigenvalues": True}}
    at_preset = make_config("modular_arithmetic", None, None, "state_tracking", **arch)
    changed = make_config("modular_arithmetic", None, None, "state_tracking", steps=12000,
                          batch_lengths="mixed", train_precision="bfloat16",
                          task_params={"layout": "harness"}, **arch)
    for config in (at_preset, changed):
        store.mark_started(config)
    monkeypatch.setenv("COLUMNS", "400")  # every column on one line
    assert main(["runs", "--store", str(store.path)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert "modular_arithmetic(layout=harness)" in rows[changed.run_id()]
    assert 'batch_lengths="mixed", train_precision="bfloat16"' in rows[changed.run_id()]
    assert "12000" in rows[changed.run_id()] and "steps=" not in rows[changed.run_id()]
    assert all(text not in rows[at_preset.run_id()] for text in ("(layout", "batch_", "precision"))


def test_listings_show_whole_ids_whether_runs_learned_and_count_in_the_singular(
        tmp_path, monkeypatch, capsys):
    ids = ["aaaa0000learned", "aaaa1111stuck", "bbbb2222nohistory"]
    store = _store_with_run_ids(tmp_path / "s.sqlite", ids, [[0.5, 0.99], [0.5, 0.5], []])
    monkeypatch.setenv("COLUMNS", "100")  # a narrow terminal
    assert main(["runs", "--store", str(store.path)]) == 0
    rows = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert set(ids) <= rows  # whole ids, not cut short
    monkeypatch.setenv("COLUMNS", "240")  # wide enough for every column
    assert main(["runs", "--store", str(store.path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    learned = next(line for line in lines if "run id" in line).index("learned")
    cells = {line.split()[0]: line[learned:].split()[0] for line in lines
             if line.split() and line.split()[0] in ids}
    assert [cells[run_id] for run_id in ids] == ["yes", "stuck", "-"]

    assert main(["evaluations", "--store", str(store.path), "--run", "bbbb"]) == 0
    listing = capsys.readouterr().out
    assert "bbbb2222nohistory" in listing
    assert "1 evaluation of 1 run: 0 re-evaluations under 0 protocols" in listing


def test_run_ids_are_taken_as_unique_prefixes_everywhere(tmp_path, capsys):
    ids = ["aaaa0000", "aaaa1111", "bbbb2222"]
    store = _store_with_run_ids(tmp_path / "s.sqlite", ids, [[0.5, 0.99]] * 3)
    path = str(store.path)
    assert resolve_run_ids(store, ["bb", "aaaa1", "bbbb2222", "b"]) == ["bbbb2222", "aaaa1111"]
    assert main(["evaluations", "--store", path, "--run", "aaaa0", "bb"]) == 0
    assert main(["curves", "aaaa1", "bb", "--store", path, "--out", str(tmp_path / "c.png")]) == 0
    assert main(["report", "--store", path, "--run", "aaaa0", "--out", str(tmp_path / "r.html")]) == 0
    assert "--run aaaa0000 " in (tmp_path / "r.html").read_text()  # the whole id
    capsys.readouterr()
    for command in (["evaluations", "--run", "aaaa"], ["curves", "aaaa"],
                    ["report", "--run", "a", "--out", str(tmp_path / "x.html")],
                    ["evaluate", "aa", "--device", "cpu"], ["attention", "aaa", "--length", "41",
                                                            "--out", str(tmp_path / "a.png")]):
        assert main([*command, "--store", path]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 5 and all("ambiguous" in line and "aaaa0000, aaaa1111" in line
                                 for line in err)
    assert main(["curves", "cc", "--store", path]) == 2
    assert "no run cc in" in capsys.readouterr().err


def with_exact_match(result, exact: float):
    """A SYNTHETIC result with exact match ``exact`` at every length."""
    config = result.config
    return dataclasses.replace(
        result, exact_score=exact, train_exact_accuracy=exact,
        exact_per_length={n: exact for n in config.test_lengths},
        train_exact_per_length={n: exact for n in config.train_eval_lengths})


def test_exact_match_chance_is_per_sequence(tmp_path):
    """A uniform guesser gets a sequence of L scored positions right with chance c^L: c for
    one output (parity), (1/32)^4 for mqar's 4 queries, c^n for reverse_string; averaged over
    the sequences where L varies (binary_addition) and over the score's test lengths."""
    mqar = {"vocab_size": 64, "num_pairs": 4, "random_non_queries": False}
    assert exact_match_chance(get_task("parity_check"), 41) == 0.5
    assert exact_match_chance(get_task("mqar", **mqar), 100) == pytest.approx(32.0 ** -4)
    assert exact_match_chance(get_task("reverse_string"), 20) == pytest.approx(0.5 ** 20)
    addition = get_task("binary_addition")
    scored = addition.sample(12, EXACT_CHANCE_SEQUENCES, np.random.default_rng(0)).mask.sum(1)
    assert len(set(scored)) > 1
    assert exact_match_chance(addition, 12) == pytest.approx(np.mean((1 / 3) ** scored))
    settings = {"task": "reverse_string", "task_params": {}, "test_lengths": [2, 3, 50],
                "train_max_length": 1, "score_from_42": True}
    assert run_exact_chance(settings) == pytest.approx(0.5 ** 50 / 2 + 0.5 ** 3 / 2)

    store = ResultStore(tmp_path / "s.sqlite")
    store.record(with_exact_match(synthetic_result("parity_check", "none"), 0.5))
    store.record(with_exact_match(synthetic_result("mqar", "none", task_params=mqar,
                                                   train_max_length=16, test_lengths="41,50"), 0.01))
    table = format_table(store, metric="exact")
    assert "chance = exact match of a uniform guesser" in " ".join(table.split())  # (wrapped)
    chances = {line.split()[1]: line.split()[2] for line in table.splitlines()[2:4]}
    assert chances == {"parity_check": "50.0", "mqar": "1e-04"}  # (1/32)^4 = 0.0001 %
    assert " 50.0 " in format_table(store, metric="token") and " 3.1 " in format_table(store)


@pytest.mark.parametrize("extra, below", [(0, False), (1, True)])
def test_a_panel_of_many_configurations_puts_its_legend_below_the_axes(extra, below):
    """Seven architectures' curves fill every spot inside a panel; past LEGEND_INSIDE_MAX the
    legend goes below the axes, off the curves."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from che_bench.reports.plots import LEGEND_INSIDE_MAX, _place_legend

    configurations = LEGEND_INSIDE_MAX + extra
    figure = Figure()
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    for level in range(configurations):
        ax.plot([0, 500], [level, level], label=f"configuration {level}")
    _place_legend(ax, configurations)
    figure.canvas.draw()
    legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert (legend.y1 <= axes.y0) == below
