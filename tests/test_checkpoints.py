"""A member's checkpoint resumes in a pack of any width (issue 19, item 1): after an
out-of-memory split, in a sweep resumed with ``--pack auto`` at another width; a checkpoint of
another model is still refused, and one written before (its fingerprint bound to its pack's
width) still resumes. An interrupted recurrent baseline resumes to the uninterrupted run's
numbers, bit for bit."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.model.encoder import build_model
from che_bench.run import runner
from che_bench.run.runner import execute_pack, execute_runs
from che_bench.train.optimizer import PackOptimizer
from tests.run_helpers import run_interrupted_at

TINY = {"steps": 6, "dropout": 0.0, "test_lengths": "41", "eval_samples": 4,
        "eval_batch_size": 4, "length_seed": 0}


def cell(members=4, pe="none", **changes):
    return [make_config("reverse_string", pe, None, "smoke", seed=seed, **{**TINY, **changes})
            for seed in range(members)]


def curves(results):
    """Each run's training curve: (step, loss, accuracy) of every history row."""
    return [[(row["step"], row["loss"], row["accuracy"]) for row in result.history]
            for result in results]


def assert_same_curves(got, expected):
    assert [r.status for r in got] == ["complete"] * len(expected)
    for got_curve, expected_curve in zip(curves(got), curves(expected)):
        assert [row[0] for row in got_curve] == [row[0] for row in expected_curve]
        # Another width sums a step's micro-batches in another order: equal up to rounding.
        np.testing.assert_allclose([row[1:] for row in got_curve],
                                   [row[1:] for row in expected_curve], rtol=1e-4, atol=1e-6)
    for got_result, expected_result in zip(got, expected):
        assert got_result.per_length == pytest.approx(expected_result.per_length, abs=1e-9)


def test_a_pack_out_of_memory_after_a_checkpoint_goes_on_as_two_narrower_packs(
        monkeypatch, tmp_path):
    configs = cell()
    reference = execute_pack(configs, device="cpu", progress=False, log_every=1)
    real_train_pack, widths = runner.train_pack, []

    def out_of_memory_at_step_3_when_wide(model, task, pack, *args, **options):
        widths.append(len(pack))

        def fail(step, losses):
            if step == 3 and len(pack) == 4:  # after the checkpoint of step 2
                raise torch.cuda.OutOfMemoryError("simulated")

        return real_train_pack(model, task, pack, *args, **{**options, "on_step": fail})

    monkeypatch.setattr(runner, "train_pack", out_of_memory_at_step_3_when_wide)
    split = execute_pack(configs, device="cpu", progress=False, log_every=1,
                         checkpoint_dir=tmp_path, checkpoint_every=2)
    assert widths == [4, 2, 2]
    assert_same_curves(split, reference)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("width", [1, 2, "auto"])  # auto: one member on a CPU
def test_a_sweep_resumed_at_another_width_gives_the_same_curves(tmp_path, width):
    configs = cell(pe="random_alibi")
    reference = execute_runs(configs, pack=4, device="cpu", progress=False, log_every=1)
    run_interrupted_at(3, configs, tmp_path, pack=4, log_every=1)
    assert len(list(tmp_path.iterdir())) == 4
    resumed = execute_runs(configs, pack=width, device="cpu", progress=False, log_every=1,
                           checkpoint_dir=tmp_path)
    assert all(result.timings["resumed_from_step"] == 3 for result in resumed)
    assert_same_curves(resumed, reference)


def optimizer_of(members, **sizes):
    task = make_config("even_pairs", preset="smoke").build_task()
    model = build_model(task, "none", members=members, layers=1, heads=2, **sizes)
    return PackOptimizer(model, [1e-3] * members, (0.9, 0.999), 1e-8, 1.0)


def test_a_members_state_loads_into_a_pack_of_any_width_but_not_another_model():
    state = optimizer_of(3, dim=8, ffn=8).member_state(2)
    for members in (1, 2, 5):
        optimizer = optimizer_of(members, dim=8, ffn=8)
        optimizer.load_member_state(members - 1, state)
        assert torch.equal(optimizer.flat[members - 1], state["flat"])
    with pytest.raises(CheBenchError, match="another model layout"):
        optimizer_of(3, dim=8, ffn=16).load_member_state(0, state)
    with pytest.raises(CheBenchError, match="another model layout"):
        swapped = optimizer_of(3, dim=8, ffn=8)
        swapped.member_shapes = swapped.member_shapes[::-1]  # same size, another layout
        swapped.load_member_state(0, state)


def test_a_checkpoint_fingerprinted_with_its_packs_width_still_resumes_at_any_width():
    writer = optimizer_of(4, dim=8, ffn=8)
    full_shapes = [tuple(p.shape) for p in writer.parameters]  # how version 2 fingerprinted
    state = {**writer.member_state(1), "format": 2,
             "layout": hashlib.sha256(repr(full_shapes).encode()).hexdigest()[:16]}
    optimizer_of(1, dim=8, ffn=8).load_member_state(0, state)
    with pytest.raises(CheBenchError, match="another model layout"):
        optimizer_of(1, dim=8, ffn=16).load_member_state(0, state)


@pytest.mark.parametrize("arch", ["lstm", "tape_rnn"])
def test_an_interrupted_baseline_resumes_to_the_uninterrupted_runs_numbers(tmp_path, arch):
    settings = {key: value for key, value in TINY.items() if key != "dropout"}  # transformer's
    configs = [make_config("parity_check", preset="smoke", arch=arch, seed=seed,
                           arch_options={"hidden_size": 16}, **{**settings, "steps": 8})
               for seed in range(2)]
    reference = execute_runs(configs, device="cpu", progress=False, log_every=1)
    run_interrupted_at(5, configs, tmp_path, log_every=1)
    resumed = execute_runs(configs, device="cpu", progress=False, log_every=1,
                           checkpoint_dir=tmp_path)
    assert [result.timings["resumed_from_step"] for result in resumed] == [5, 0]
    assert curves(resumed) == curves(reference)  # the same width: bit for bit
    assert [r.per_length for r in resumed] == [r.per_length for r in reference]


def test_a_resumed_runs_total_time_counts_every_session_as_its_training_time_does(tmp_path):
    """Issue 26, item 13: train_s counts the training of every session (the checkpoint's
    seconds plus this session's); total_s did count the last session only, so that
    train_s + eval_s exceeded it."""
    [config] = cell(members=1)
    run_interrupted_at(3, [config], tmp_path)
    path = runner.checkpoint_path(tmp_path, config.run_id())
    state = torch.load(path, weights_only=True)
    state["train_seconds"] = 1000.0  # an earlier session that trained for 1000 s
    torch.save(state, path)
    [result] = execute_runs([config], device="cpu", progress=False, checkpoint_dir=tmp_path)
    timings = result.timings
    assert result.status == "complete" and timings["resumed_from_step"] == 3
    assert timings["train_s"] >= 1000.0
    assert timings["total_s"] >= timings["train_s"] + timings["eval_s"]
