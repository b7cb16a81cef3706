"""``che-bench report``: the self-contained HTML page, its run selection and its reproduce
commands, and (with headless Chromium) that the page really displays its table and images.

The stores here hold SYNTHETIC run results (made-up accuracies, as in test_store.py), enough to
render every part of the page; they are not results of any model.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
from pathlib import Path

import pytest
from test_store import reevaluation, synthetic_result

from che_bench.cli import build_parser, main
from che_bench.commands.command_lines import run_command_line
from che_bench.commands.run import overrides_from_args
from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.reports.html import render_report, write_report
from che_bench.store import ResultStore

CHROMIUM = Path("/usr/bin/chromium")
#: Set in CI (.ci/run), where Chromium is installed: there a missing browser fails the test
#: instead of skipping it.
REQUIRE_CHROMIUM = "CHE_BENCH_REQUIRE_CHROMIUM"
HOSTILE_ERROR = '<img src=x onerror="alert(1)"> & "quotes"'
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ResultStore:
    store = ResultStore(tmp_path_factory.mktemp("report") / "s.sqlite")
    for result in (
        synthetic_result("missing_duplicate", "kerple", 3, seed=0, score=0.60),
        synthetic_result("missing_duplicate", "kerple", 3, seed=1, score=0.80),
        synthetic_result("even_pairs", "alibi", None, seed=0, score=0.70),
        synthetic_result("associative_recall", "rope", None, seed=0, score=0.05),
    ):
        store.record(result)
    failed = synthetic_result("even_pairs", "alibi", None, seed=1, status="failed")
    failed.error = HOSTILE_ERROR
    store.record(failed)
    store.mark_started(synthetic_result("even_pairs", "alibi", None, seed=2).config)
    return store


@pytest.fixture(scope="module")
def page(store) -> str:
    return render_report(store, command_line=run_command_line)


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r'<img src="data:image/png;base64,([^"]+)"', page)]


def test_the_page_has_the_table_one_figure_per_task_and_loads_nothing(page):
    table = page[page.index('<table id="che-table">'):page.index("</table>")]
    for cell in ("missing_duplicate_string", "even_pairs", "associative_recall",
                 "80.00 (70.00±14.14, n=2)", "DAPE_k3_Kerple", "99.65 (not comparable"):
        assert cell in table
    images = _images(page)
    assert len(images) == 3 and all(image.startswith(PNG_SIGNATURE) for image in images)
    assert page.count("<img ") == 3
    assert re.findall(r'alt="accuracy against length, (\w+)"', page) == [  # the table's row order
        "even_pairs", "missing_duplicate_string", "associative_recall"]
    # No fetch of any kind: every src/href is a data: URI, no CSS url() or @import.
    references = re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', page)
    assert references and all(reference.startswith("data:image/png;base64,") for reference in references)
    assert "url(" not in page and "@import" not in page and "http" not in page.replace("http-equiv", "")
    assert "default-src 'none'" in page
    assert "@media print" in page


def test_store_strings_are_escaped_and_what_ran_is_listed(page, store):
    assert HOSTILE_ERROR not in page and "<img src=x" not in page
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt; &amp; &quot;quotes&quot;" in page
    what_ran = page[page.index("<h2>What ran</h2>"):page.index("<h2>Reproduce</h2>")]
    assert "4 complete, 1 failed, 1 started" in what_ran
    assert "smoke (6)" in what_ran and "che_bench synthetic" in what_ran
    assert "1 started runs have no result" in what_ran
    failed_id = store.runs().query("status == 'failed'")["run_id"].item()
    assert failed_id in what_ran[what_ran.index('<table id="failures">'):]


def test_reproduce_lists_run_commands_that_recreate_the_runs(page, store):
    reproduce = page[page.index("<h2>Reproduce</h2>"):]
    commands = re.findall(r"che-bench run [^\n<]*", reproduce)
    assert len(commands) == len(store.runs())
    assert (f"che-bench run --task missing_duplicate_string --pe kerple --kernel 3 --preset smoke "
            f"--seed 1 --store {store.path}") in commands
    assert f"che-bench report --store {store.path} --out report.html" in reproduce


@pytest.mark.parametrize("overrides", [
    {},
    {"seed": 3, "data_seed": 5, "lr": 3e-4, "steps": 7},
    {"task": "cycle_navigation", "task_params": {"cycle_length": 7}, "dim": 32},
    {"pe": "random_rope", "pe_options": {"randomize_at_eval": False}, "dropout_at_eval": True},
    {"kernel": 3, "dape_width": 16, "train_max_length": 30, "test_lengths": "41:60,100,200:203"},
    {"score_from_42": True, "eval_samples": 4, "layers": 2, "dropout": 0.0},
    {"causal": True, "length_seed": 4, "pe": "rope"},
    {"task": "mqar", "causal": False, "pe": "rope"},  # against mqar's own default: --no-causal
])
def test_run_command_lines_recreate_the_run_id(overrides):
    arguments = {"task": "even_pairs", "pe": "alibi", "kernel": None, "preset": "smoke", **overrides}
    config = make_config(**arguments)
    argv = run_command_line(config.to_dict(), config.run_id())
    assert argv is not None and argv[0] == "run"
    args = build_parser().parse_args(argv)  # parsed independently of run_command_line's own check
    rebuilt = make_config(args.task, args.pe, args.kernel, args.preset, **overrides_from_args(args))
    assert rebuilt.run_id() == config.run_id()


def test_a_run_without_flags_for_its_settings_has_no_command():
    config = make_config("even_pairs", "alibi", 3, "smoke", dape_tril=True)  # no --dape-tril
    assert run_command_line(config.to_dict(), config.run_id()) is None


def test_suite_task_and_run_selections(store, tmp_path):
    suite = tmp_path / "mine.toml"
    suite.write_text('preset = "smoke"\ntasks = ["missing_duplicate"]\n'
                     'encodings = [{ name = "kerple", kernels = [3] }]\nseeds = [0, 1, 7]\n')
    page = render_report(store, suite=str(suite))
    assert "che-bench report: suite mine" in page
    assert f"che-bench sweep {suite} --store {store.path}" in page
    assert "2 complete, 0 failed, 0 started" in page and "even_pairs" not in page

    by_task = render_report(store, tasks=["even_pairs"])
    assert "che-bench report: task even_pairs" in by_task and "missing_duplicate" not in by_task
    run_id = store.runs().query("task == 'associative_recall'")["run_id"].item()
    by_run = render_report(store, run_ids=[run_id])
    assert len(_images(by_run)) == 1 and f"--run {run_id}" in by_run


def test_several_runs_after_one_flag_and_the_page_names_its_own_file(store, tmp_path, capsys):
    first, second = store.runs().query("status == 'complete'")["run_id"][:2]
    out = tmp_path / "pages" / "mine.html"
    assert main(["report", "--store", str(store.path), "--run", first, second[:6],
                 "--metric", "exact", "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    page = out.read_text(encoding="utf-8")
    assert "che-bench report: runs" in page
    assert (f"che-bench report --run {first} {second} --metric exact --store {store.path} "
            f"--out {out}") in page


def test_a_reevaluation_report_shows_its_scores(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    kept, other = synthetic_result(seed=0, score=0.6), synthetic_result("parity_check", score=0.7)
    store.record(kept)
    store.record(other)
    evaluation = store.record_evaluation(kept.run_id, **reevaluation(kept, accuracy=0.35))
    page = render_report(store, evaluation=evaluation)
    assert f"evaluation {evaluation} (test lengths 41..1000 (2 lengths)" in page
    assert "35.00 (n=1)" in page and "parity_check" not in page[:page.index("<h2>What ran")]
    assert "evaluation devices</b>: synthetic-gpu (1)" in page
    assert f"--evaluation {evaluation}" in page
    with pytest.raises(CheBenchError, match="no complete run of run .* has evaluation"):
        render_report(store, run_ids=[other.run_id], evaluation=evaluation)


def test_bad_selections_and_outputs_are_one_line_errors(store, tmp_path, capsys):
    path = str(store.path)
    empty_suite = tmp_path / "other.toml"
    empty_suite.write_text('preset = "smoke"\ntasks = ["parity_check"]\nencodings = ["none"]\n')
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    bad = [
        (["--run", "nonexistent"], "no run nonexistent"),
        (["--task", "bucket_sort"], "no runs task bucket_sort"),
        (["--suite", str(empty_suite)], "no runs of suite"),
        (["--suite", "no_such_suite"], "no suite file"),
        (["--task", "no_such_task"], "unknown task"),
        (["--evaluation", "0123456789"], "unknown evaluation"),
    ]
    for arguments, message in bad:
        assert main(["report", "--store", path, *arguments, "--out", str(tmp_path / "r.html")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("che-bench: error:") and message in err, err
    assert main(["report", "--store", path, "--out", str(blocker / "r.html")]) == 2
    assert "cannot write report" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # argparse: one line, exit 2
        main(["report", "--store", path, "--task", "even_pairs", "--run", "x", "--out", "r.html"])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(CheBenchError, match="one of --suite, --task or --run"):
        write_report(store, tmp_path / "r.html", tasks=["even_pairs"], run_ids=["x"])
    assert not (tmp_path / "r.html").exists()
    assert main(["report", "--store", path, "--out", str(tmp_path / "ok.html")]) == 0
    assert (tmp_path / "ok.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def _rendered_dom(page: Path, profile: Path) -> str:
    """The DOM of ``page`` after headless Chromium loaded it (file://, no network features)."""
    completed = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
         "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    return completed.stdout


def test_chromium_displays_the_table_and_every_image(page, tmp_path):
    if not CHROMIUM.exists():
        if os.environ.get(REQUIRE_CHROMIUM):
            pytest.fail(f"{CHROMIUM} missing but ${REQUIRE_CHROMIUM} is set")
        pytest.skip("headless Chromium not installed (apt-get install chromium)")
    report = tmp_path / "report.html"
    report.write_text(page, encoding="utf-8")
    dom = _rendered_dom(report, tmp_path / "profile")
    assert 'data-images-loaded="3/3"' in dom  # set by the page's script once every image decoded
    start = dom.index('<table id="che-table">')
    table = dom[start:dom.index("</table>", start)]
    assert table.count("<tr>") == 1 + 3  # header + one row per task

    # The check can fail: a page with one undecodable image reports 2/3.
    broken = tmp_path / "broken.html"
    broken.write_text(page.replace("base64,iVBOR", "base64,AAAAA", 1), encoding="utf-8")
    assert 'data-images-loaded="2/3"' in _rendered_dom(broken, tmp_path / "profile2")


def test_cells_that_did_not_learn_the_training_lengths_are_named(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    learned = synthetic_result("even_pairs", "alibi", None, seed=0, score=0.7)  # 90% in-dist.
    unlearned = synthetic_result("even_pairs", "kerple", None, seed=0, score=0.5)
    unlearned.train_accuracy = 0.55
    unlearned.train_per_length = {n: 0.55 for n in unlearned.train_per_length}
    for result in (learned, unlearned):
        store.record(result)
    verdict = re.search(r'<p id="learning">([^<]*)</p>', render_report(store)).group(1)
    assert "even_pairs / Kerple (55.0%)" in verdict and "ALiBi" not in verdict
    store = ResultStore(tmp_path / "learned.sqlite")
    store.record(learned)
    assert "Every cell learned" in render_report(store)
