"""Issue 26, item 15: what a new user meets first says what che-bench does. The README's example
output is what ``run`` prints, its commands work as written and leave nothing untracked, the
docs' home page lists the pages the README lists, ``run --help`` names the preset's default,
the evaluation's progress bar labels its countdown, the MQAR plot's legend keeps off its axis
label, and the API page renders no reST literal marker."""

from __future__ import annotations

import ast
import fnmatch
import io
import re
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from che_bench.cli import build_parser
from che_bench.config import make_config
from che_bench.eval import evaluation
from che_bench.store import ResultStore
from che_bench.train import progress

REPOSITORY = Path(__file__).resolve().parents[1]
README = (REPOSITORY / "README.md").read_text()


def block_after(heading: str, fence: str) -> str:
    section = README[README.index(heading):]
    return section.split(f"```{fence}\n", 1)[1].split("```", 1)[0]


def test_the_readme_shows_both_lines_run_prints_for_its_own_run():
    shown = block_after("## The main job", "text")
    run_id = make_config("missing_duplicate", "kerple", 3, "smoke").run_id()
    assert f"run {run_id}: missing_duplicate_string / DAPE_k3_Kerple, preset smoke" in shown
    assert f"run {run_id} complete on cpu" in shown
    assert all(len(line) <= 100 for line in shown.splitlines())  # as in a 100-column terminal


def test_the_readmes_next_commands_run_as_written_and_leave_nothing_untracked():
    commands = block_after("## Next commands", "bash")
    assert "my_pe" not in commands
    assert re.search(r"check-encoding NAME +# NAME: .*placeholder", commands)
    ignored = [line.strip() for line in (REPOSITORY / ".gitignore").read_text().splitlines()
               if line.strip() and not line.startswith(("#", "!"))]
    outputs = re.findall(r"--out (\S+)", commands)
    assert outputs
    for out in outputs:
        assert out.startswith("results/"), out
        assert any(fnmatch.fnmatch(out, pattern) for pattern in ignored), out


def page_rows(text: str, prefix: str) -> list[tuple[str, str, str]]:
    return re.findall(rf"^\| \[([^]]+)\]\({prefix}([\w-]+\.md)\) \| (.+) \|$", text, re.M)


def test_the_docs_home_page_lists_the_pages_the_readme_lists():
    index = (REPOSITORY / "docs" / "index.md").read_text()
    assert page_rows(index, "") == page_rows(README, "docs/")
    assert len(page_rows(README, "docs/")) >= 12


def test_run_help_names_the_presets_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    assert "(default: quick)" in " ".join(capsys.readouterr().out.split())


def test_the_evaluation_progress_bar_labels_its_countdown(monkeypatch):
    output = io.StringIO()
    monkeypatch.setattr(progress, "Console", lambda stderr: Console(
        file=output, force_terminal=True, width=100, color_system=None))
    with evaluation._progress_bar(True, 24, 24.0) as bar:
        bar.refresh()
    shown = output.getvalue()
    assert re.search(r"0/24 lengths · ETA -:--:--", shown), shown


def test_the_mqar_legend_sits_below_the_axis_label(tmp_path):
    from matplotlib.figure import Figure

    from che_bench.reports.plots import PANEL_SIZE, _draw_panel, plot_data

    path = tmp_path / "arch.sqlite"  # the committed store of seven architectures
    shutil.copyfile(REPOSITORY / "results" / "laptop" / "arch" / "arch.sqlite", path)
    runs, curves = plot_data(ResultStore(path, read_only=True), tasks=["mqar"])
    figure = Figure(figsize=PANEL_SIZE)
    ax = figure.subplots()
    _draw_panel(ax, runs, curves, "mqar")
    figure.tight_layout()
    figure.draw_without_rendering()
    legend, label = ax.get_legend().get_window_extent(), ax.xaxis.label.get_window_extent()
    assert legend.y1 < label.y0  # below it, not over it


@pytest.mark.parametrize("module", ["encodings/base.py", "tasks/base.py", "model/base.py",
                                    "members.py", "plugins.py"])
def test_api_docstrings_hold_no_rest_literal_marker(module):
    """mkdocstrings renders docstrings as Markdown, where ``text::`` stays as it is."""
    tree = ast.parse((REPOSITORY / "che_bench" / module).read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
            docstring = ast.get_docstring(node) or ""
            assert not re.search(r"\w::$", docstring, re.M), (module, docstring[:80])
