"""Progress of a run whose standard error is not a terminal: a line at a steady interval of
wall time (a fake clock here), and check-model's measured step time and quick-preset estimate
(a fake measurement): nothing here depends on how fast this machine is."""

from __future__ import annotations

import pytest

from che_bench.checks import speed
from che_bench.cli import main
from che_bench.train import progress
from che_bench.train.progress import ProgressLines, duration_text


def test_durations_read_as_a_person_writes_them():
    assert [duration_text(s) for s in (0.4, 42, 185, 7620)] == ["0 s", "42 s", "3 min 05 s",
                                                                 "2 h 07 min"]
    assert duration_text(float("inf")) == "?"


def test_a_line_comes_once_per_interval_of_the_clock(capsys):
    now = [100.0]
    lines = ProgressLines("run abc", 1000, 0, interval=60, clock=lambda: now[0])
    for at, step in ((130, 10), (160, 20), (170, 25), (215, 30), (219, 31), (275, 40)):
        now[0] = at
        lines.update(step, 0.5, 0.75)
    assert capsys.readouterr().err.splitlines() == [
        "che-bench: run abc: step 20/1,000 (2%), loss 0.5000, acc 75.0%, 1 min 00 s elapsed, "
        "about 49 min 00 s left",
        "che-bench: run abc: step 40/1,000 (4%), loss 0.5000, acc 75.0%, 2 min 55 s elapsed, "
        "about 1 h 10 min left",
    ]  # at 160 s and at 275 s: 215 s is within 60 s of the line at 160


def test_a_resumed_run_estimates_from_its_own_steps(capsys):
    now = [0.0]
    lines = ProgressLines("run abc", 100, 50, interval=10, clock=lambda: now[0])
    now[0] = 10
    lines.update(60, 0.1, 0.9)
    assert "step 60/100 (60%)" in capsys.readouterr().err  # 10 steps in 10 s: 40 s left
    now[0] = 20
    lines.update(60, 0.1, 0.9)
    assert "about 1 min 20 s left" in capsys.readouterr().err


@pytest.mark.parametrize("shown", [True, False])
def test_a_run_with_redirected_output_prints_progress_lines(tmp_path, monkeypatch, capsys, shown):
    monkeypatch.setattr(progress, "LINE_INTERVAL_S", 0.0)  # a line at every reading
    flags = [] if shown else ["--no-progress"]
    assert main(["run", "--task", "parity_check", "--arch", "rnn", "--arch-option",
                 "hidden_size=4", "--preset", "smoke", "--steps", "3", "--test-lengths", "41,42",
                 "--train-eval-lengths", "5", "--eval-samples", "4",
                 "--store", str(tmp_path / "s.sqlite"), *flags]) == 0
    err = capsys.readouterr().err.splitlines()
    lines = [line for line in err if ": step " in line]
    evaluation = [line for line in err if line.startswith("che-bench: evaluate: length ")]
    if not shown:
        assert lines == [] and evaluation == []
        return
    assert [line.split(": step ")[1].split(",")[0] for line in lines] == [
        "1/3 (33%)", "2/3 (67%)", "3/3 (100%)"]
    assert lines[0].startswith("che-bench: run ")
    # The evaluation too: one line per length (in-distribution first), with the length done.
    assert [line.split(": length ")[1].split(", ")[:2] for line in evaluation] == [
        ["1/3 (33%)", "n=5 done"], ["2/3 (67%)", "n=41 done"], ["3/3 (100%)", "n=42 done"]]


def test_check_model_prints_the_step_time_and_the_quick_preset_estimate(monkeypatch, capsys):
    measured = []

    def fake_step_seconds(configs, device, repeats, warm_up=1):
        measured.append(configs[0])
        return 0.25

    monkeypatch.setattr(speed, "step_seconds", fake_step_seconds)
    assert main(["check-model", "rnn"]) == 0
    [config] = measured
    assert config.arch == "rnn" and config.arch_options == {}  # a run's options, not tiny ones
    out = capsys.readouterr().out
    line = " ".join(out[out.index("speed: "):].split())  # wrapped to the terminal
    assert line.startswith(
        f"speed: 250.0 ms per training step (reverse_string, batch {config.batch_size}, n = 40, "
    )
    assert f"the quick preset's {config.steps:,} steps: about " in line
    assert duration_text(0.25 * config.steps) in line


def test_the_evaluation_eta_holds_when_one_length_takes_over_30_seconds():
    """Issue 44 item 18: rich's own column averaged the last 30 s only and read -:--:-- from
    n = 641 to the end; the bar's column averages since the start."""
    from rich.progress import Progress, TimeRemainingColumn

    now = [0.0]
    bar = Progress(get_time=lambda: now[0])
    task = bar.add_task("eval", total=10)
    for at in (100.0, 200.0):  # 100 s a unit of work
        now[0] = at
        bar.advance(task, 1)
    shown = bar.tasks[0]
    assert TimeRemainingColumn().render(shown).plain == "-:--:--"
    assert progress.AverageTimeRemaining().render(shown).plain == "0:13:20"  # 8 x 100 s


def test_progress_lines_estimate_the_time_left_from_the_share_of_work_done(capsys):
    """An evaluation's lengths cost more as they grow: its lines estimate from the work."""
    now = [0.0]
    lines = ProgressLines("evaluate", 4, 0, interval=0, clock=lambda: now[0], unit="length")
    now[0] = 60.0
    lines.report(2, "n=41 done", done_share=0.25)  # half the lengths, a quarter of the work
    assert capsys.readouterr().err == (
        "che-bench: evaluate: length 2/4 (50%), n=41 done, 1 min 00 s elapsed, "
        "about 3 min 00 s left\n"
    )


def test_evaluate_weighs_its_lengths_by_their_cost_and_says_how_to_see_its_result(
    tmp_path, monkeypatch, capsys
):
    """The run's header counts the lengths its evaluation goes through (in-distribution ones
    too); a re-evaluation's progress is weighed by each length's work, and its last line is
    the command that shows it."""
    store = tmp_path / "s.sqlite"
    assert main(["run", "--task", "even_pairs", "--preset", "smoke", "--steps", "4",
                 "--test-lengths", "41,50", "--device", "cpu", "--no-progress",
                 "--store", str(store)]) == 0
    header = " ".join(capsys.readouterr().err.split())
    assert ("evaluated at 7 lengths: test 41..50 (2 lengths), in-distribution 1..40 (5 lengths)"
            in header)
    reports = []
    monkeypatch.setattr(ProgressLines, "report", lambda self, step, detail, done_share=None:
                        reports.append((step, done_share)))
    from che_bench.store import ResultStore

    run_id = ResultStore(store).runs()["run_id"].iloc[0]
    assert main(["evaluate", run_id, "--test-lengths", "100,200", "--store", str(store)]) == 0
    shares = [share for _, share in reports]
    assert [step for step, _ in reports] == [1, 2, 3, 4, 5, 6, 7] and shares[-1] == 1
    assert shares[5] < 0.5  # n = 200 (a transformer: its input squared) is most of the work
    evaluation = ResultStore(store).evaluations()["evaluation"].iloc[-1]
    last = capsys.readouterr().out.splitlines()[-2:]
    assert last == [f"see evaluation {evaluation} with (export, plot and report take "
                    "--evaluation too):", f"  che-bench table --evaluation {evaluation} "
                    f"--store {store}"]
