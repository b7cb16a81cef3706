"""Issue 26, item 11: every listing and table of the command line fits ``$COLUMNS`` without
losing a value (``che_bench.reports.text_tables``, the one layout helper they share).

The store here holds SYNTHETIC runs (made-up scores that only exercise the layout)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from test_store import reevaluation, synthetic_result

from che_bench.cli import main
from che_bench.reports.tables import summarize
from che_bench.reports.text_tables import Column, fit_table, output_width, wrap
from che_bench.store import ResultStore

LONG_ERROR = ("RuntimeError: a made-up failure whose message is long enough to need several "
              "lines in a terminal of one hundred columns, " * 2).strip()


@pytest.fixture
def store(tmp_path) -> ResultStore:
    store = ResultStore(tmp_path / "s.sqlite")
    results = [
        synthetic_result("missing_duplicate", "kerple", 3, seed=0, score=0.6123),
        synthetic_result("missing_duplicate", "kerple", 3, seed=1, score=0.8045),
        synthetic_result("missing_duplicate", "kerple", None, seed=0, score=0.5511),
        synthetic_result("cycle_navigation", "alibi", 5, task_params={"cycle_length": 7},
                         score=0.3377),
        synthetic_result("parity_check", None, None, arch="lstm",
                         arch_options={"hidden_size": 8}, score=0.9912),
        synthetic_result("parity_check", None, None, arch="tape_rnn", score=0.7531),
        synthetic_result("even_pairs", "kerple", None, seed=5, status="failed"),
    ]
    results[-1] = dataclasses.replace(results[-1], error=LONG_ERROR)
    for result in results:
        store.record(result)
    store.mark_started(synthetic_result("even_pairs", "kerple", None, seed=6).config)
    store.record_evaluation(results[0].run_id, **reevaluation(results[0], accuracy=0.4321))
    return store


SUITE = """
preset = "smoke"
tasks = ["parity_check", { name = "cycle_navigation", params = { cycle_length = 7 } }]
encodings = [{ name = "kerple", kernels = ["none", 3] }]
architectures = [{ name = "lstm", options = { hidden_size = 8 } }, "tape_rnn", "transformer"]
"""

COMMANDS = [["runs"], ["evaluations"], ["tasks"], ["encodings"], ["models"], ["table"],
            ["table", "--compare", "paper"], ["sweep", "{suite}", "--dry-run"]]


def output_of(command: list[str], store: ResultStore, capsys) -> str:
    suite = store.path.parent / "grid.toml"
    suite.write_text(SUITE)
    arguments = [argument.format(suite=suite) for argument in command]
    if command[0] not in ("tasks", "encodings", "models"):
        arguments += ["--store", str(store.path)]
    capsys.readouterr()
    assert main(arguments) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def words(text: str) -> set[str]:
    return set(re.split(r"[\s│|]+", text))


@pytest.mark.parametrize("columns", [100, 132])
@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_listing_fits_the_terminal(command, columns, store, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(columns))
    text = output_of(command, store, capsys)
    too_wide = [line for line in text.splitlines() if len(line) > columns]
    assert not too_wide, "\n".join(too_wide)


def test_no_id_score_or_note_is_cut(store, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "100")
    runs = store.runs()
    run_ids = set(runs["run_id"])
    listing = words(output_of(["runs"], store, capsys))
    assert run_ids <= listing  # every id whole, on one line
    assert {f"{100 * score:.2f}" for score in runs["score"].dropna()} <= listing
    assert "…" not in " ".join(listing)
    # a long error wraps at spaces: every one of its words is there
    assert set(LONG_ERROR.split()) <= listing

    evaluations = store.evaluations()
    listing = words(output_of(["evaluations"], store, capsys))
    assert set(evaluations["evaluation"]) | set(evaluations["run_id"]) <= listing
    assert {f"{100 * score:.2f}" for score in evaluations["score"].dropna()} <= listing

    table = output_of(["table", "--compare", "paper"], store, capsys)
    cells = summarize(store, compare="paper")
    assert {f"{value:.2f}" for value in cells["max"]} | {"cycle_navigation(cycle_length=7)"} \
        <= words(table)
    paper = "99.65 (not comparable: preset smoke, 20 steps, 1 layer, +7 more)"
    assert set(paper.split()) <= words(table)

    assert {"hidden_size=256", "memory_budget_bytes=1073741824"} <= {
        word.strip(",") for word in words(output_of(["models"], store, capsys))}

    dry_run = output_of(["sweep", "{suite}", "--dry-run"], store, capsys)
    assert len(re.findall(r"\b[0-9a-f]{12}\b", dry_run)) == 2 * (2 + 2)  # whole ids, each row
    assert "lstm(hidden_size=8)" in dry_run


def test_a_wide_table_repeats_its_key_columns_in_each_group():
    columns = [Column("id", key=True), Column("a"), Column("b"), Column("note", wrap=True)]
    rows = [("0123456789ab", "x" * 30, "y" * 30, "many short words " * 6)]
    lines = fit_table(columns, rows, width=60)
    assert max(len(line) for line in lines) <= 60
    headers = [line for line in lines if line.startswith("id")]
    assert len(headers) >= 2  # split into groups, each with the id
    assert sum(line.startswith("0123456789ab") for line in lines) == len(headers)
    assert "x" * 30 in "\n".join(lines) and "y" * 30 in "\n".join(lines)
    # a word longer than the width keeps its line rather than being broken
    assert wrap("short " + "z" * 20, width=10) == ["short", "z" * 20]


def test_the_width_is_columns_else_the_terminal_else_100(monkeypatch):
    monkeypatch.setenv("COLUMNS", "123")
    assert output_width() == 123
    monkeypatch.delenv("COLUMNS")
    assert output_width() == 100  # (pytest's captured output is no terminal)
