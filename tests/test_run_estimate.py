"""``che-bench run`` says what it expects to take before it trains (issue 44, item 16): a
training step and an evaluation length of the run's own model timed at representative lengths
and scaled to the run (its packs, the steps its checkpoints leave, evaluate's cost model),
without changing a number of the run. No test depends on the machine's speed: the timings are
replaced by fixed ones, or only their form is checked."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from run_helpers import run_interrupted_at

from che_bench.checks import run_estimate, speed
from che_bench.checks.run_estimate import estimate_runs, representative_length
from che_bench.cli import main
from che_bench.config import make_config
from che_bench.eval.reevaluation import evaluation_cost
from che_bench.run import runner
from che_bench.run.runner import execute_run
from che_bench.store import ResultStore

TINY = {"steps": 6, "test_lengths": "41,61", "eval_samples": 2, "eval_batch_size": 2,
        "length_seed": 0}
COMMAND = ["run", "--task", "parity_check", "--preset", "smoke", "--steps", "6", "--log-every",
           "1", "--test-lengths", "41,61", "--eval-samples", "2", "--eval-batch-size", "2",
           "--length-seed", "0"]


def test_the_representative_length_is_the_root_mean_square_of_the_model_inputs():
    tokens = SimpleNamespace(model_length=lambda n: n)
    # Over 1..40 the mean square is 553.5: 24² = 576 is nearest (the mean length, 20.5, is
    # below it: a step's cost grows faster than its tokens).
    assert representative_length(tokens, range(1, 41)) == 24
    doubled = SimpleNamespace(model_length=lambda n: 2 * n + 1)
    assert representative_length(doubled, [1, 1, 1, 10]) == 1
    assert representative_length(doubled, [1, 10, 10]) == 10


def test_the_estimate_scales_the_timed_step_and_length_to_every_pack(tmp_path, monkeypatch):
    """Two packs, one resuming from its checkpoint at step 2: 6 + 4 steps at the timed step,
    and both evaluations at the timed seconds per unit of evaluate's cost."""
    timed = []
    monkeypatch.setattr(run_estimate, "step_seconds", lambda configs, device, repeats, length,
                        mixed_lengths: timed.append(("step", length)) or 0.25)
    monkeypatch.setattr(run_estimate, "_evaluation_unit_seconds", lambda configs, task, device,
                        length: timed.append(("eval", length)) or 1e-3)
    packs = [[make_config("parity_check", preset="smoke", seed=seed, **TINY)] for seed in (0, 1)]
    run_interrupted_at(2, packs[1], tmp_path)  # checkpoints at step 2
    estimate = estimate_runs(packs, torch.device("cpu"), tmp_path)
    assert (estimate.packs, estimate.steps, estimate.train_s) == (2, 10, 2.5)
    assert estimate.eval_s == pytest.approx(2 * 1e-3 * evaluation_cost(packs[0][0]))
    task = packs[0][0].build_task()
    assert timed == [("step", estimate.train_length), ("eval", estimate.eval_length)]
    assert estimate.eval_length == representative_length(task, [1, 11, 21, 30, 40, 41, 61])
    assert 1 <= estimate.train_length <= 40
    assert re.fullmatch(
        r"expected: about \d+ s in 2 packs, one after another at this machine's present speed "
        rf"\(training 2 s: 10 steps at 250 ms, timed at n = {estimate.train_length}; evaluation "
        rf"\d+ s, timed at n = {estimate.eval_length}\)", estimate.line())


def test_a_mixed_length_run_is_timed_on_a_mixed_batch_in_its_precision(monkeypatch):
    """Issue 47's runs: a mixed-length bf16 step computes every sequence to the batch's
    longest, under autocast; timing a one-length float32 step at n = 24 had read 2.5x short."""
    config = make_config("modular_arithmetic", preset="smoke", arch="deltanet", steps=6,
                         batch_size=16, batch_lengths="mixed", train_precision="bfloat16",
                         task_params={"layout": "harness"})
    steps = []
    monkeypatch.setattr(speed, "training_step", lambda *args, **keywords: steps.append(
        (args[2].shape, keywords)))
    monkeypatch.setattr(run_estimate, "_evaluation_unit_seconds", lambda *args: 1e-3)
    estimate = estimate_runs([[config]], torch.device("cpu"), None)
    assert estimate.mixed and len(steps) == 1 + run_estimate.TIMED_STEPS
    (shape, keywords), *_ = steps
    lengths = keywords["lengths"]
    assert shape[:2] == (1, 16) and lengths.shape == (16,) and keywords["autocast"] == torch.bfloat16
    # (lengths: each row's input tokens; layout=harness reads n - 1 of them at an odd n)
    longest = config.build_task().sample(estimate.train_length, 1, np.random.default_rng(0))
    assert 2 <= estimate.train_length <= 40 and int(lengths.min()) < int(lengths.max())
    assert shape[2] == int(lengths.max()) == longest.inputs.shape[1]  # rows padded to it
    assert f"timed on a mixed-length batch up to n = {estimate.train_length};" in estimate.line()


def test_run_prints_its_expected_time_before_training_and_changes_no_number(tmp_path, capsys,
                                                                            monkeypatch):
    events = []
    estimate, train = run_estimate.estimate_runs, runner.train_pack
    monkeypatch.setattr(run_estimate, "estimate_runs", lambda *args: (
        events.append("estimate") or estimate(*args)))
    monkeypatch.setattr(runner, "train_pack", lambda *args, **kwargs: (
        events.append("train") or train(*args, **kwargs)))
    store = tmp_path / "s.sqlite"
    assert main([*COMMAND, "--store", str(store), "--no-progress"]) == 0
    assert events == ["estimate", "train"]
    lines = capsys.readouterr().err.replace("\n  ", " ").splitlines()
    assert lines[0].startswith("run ")
    found = re.fullmatch(r"expected: about (\d+) s at this machine's present speed \(training "
                         r"(\d+) s: 6 steps at ([\d,]+) ms, timed at n = (\d+); evaluation (\d+) "
                         r"s, timed at n = (\d+)\)", lines[1])
    assert found, lines[1]
    total, train_s, step_ms, train_length, eval_s, eval_length = map(
        lambda text: int(text.replace(",", "")), found.groups())
    assert abs(total - train_s - eval_s) <= 1 and 1 <= train_length <= 40
    assert eval_length in {1, 11, 21, 30, 40, 41, 61}
    # The same numbers as the run alone, without the estimate's timing before it.
    alone = execute_run(make_config("parity_check", preset="smoke", **TINY), device="cpu",
                        progress=False, log_every=1)
    stored = ResultStore(store)
    assert stored.history()["loss"].tolist() == [row["loss"] for row in alone.history]
    curve = stored.per_length()
    assert dict(zip(curve[curve["split"] == "test"]["length"],
                    curve[curve["split"] == "test"]["accuracy"], strict=True)) == alone.per_length


def test_a_failed_estimate_is_said_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    def fail(*args):
        raise RuntimeError("no timing here")

    monkeypatch.setattr(run_estimate, "estimate_runs", fail)
    assert main([*COMMAND, "--store", str(tmp_path / "s.sqlite"), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "expected: not estimated (RuntimeError: no timing here)" in captured.err
    assert "complete on cpu" in captured.out
