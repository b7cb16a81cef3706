"""Tables, exports and plots of the store, on SYNTHETIC run results (made-up accuracies that
only exercise the aggregation; not results of any model)."""

from __future__ import annotations

import io

import pandas as pd
import pytest
from test_store import synthetic_result

from che_bench.errors import CheBenchError
from che_bench.plotting import plot_accuracy
from che_bench.reports import encoding_label, export_frame, format_table, summarize
from che_bench.store import ResultStore


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
    assert encoding_label("kerple", None) == "Kerple"
    assert encoding_label("alibi", 1) == "DAPE_k1_ALiBi"
    assert encoding_label("fire", 3) == "DAPE_k3_FIRE"
    assert encoding_label("sin_cos", None) == "sin_cos"


def test_cells_are_max_and_mean_over_complete_runs(store):
    cells = summarize(store, compare="paper").set_index(["task", "column"])
    k3 = cells.loc[("missing_duplicate_string", "DAPE_k3_Kerple")]
    assert k3["max"] == pytest.approx(80.0)
    assert k3["mean"] == pytest.approx(70.0)
    assert k3["std"] == pytest.approx(14.1421, abs=1e-3)
    assert k3["n"] == 2
    assert k3["paper"] == pytest.approx(99.65)
    assert k3["diff"] == pytest.approx(80.0 - 99.65)
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
