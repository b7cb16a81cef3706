"""The options that make a state-tracking run follow the xLSTM harness (issue 47):
``layout=harness`` for parity and modular arithmetic, bf16 training, and their use from suites
and the command line (mixed-length batches: ``tests/test_mixed_lengths.py``)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from che_bench.cli import main
from che_bench.commands.command_lines import run_command_line
from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.model.architectures import build_architecture
from che_bench.run.suites import load_suite
from che_bench.tasks import get_task
from che_bench.train.optimizer import pack_optimizer
from che_bench.train.step import training_step


def test_harness_parity_reads_the_answer_at_the_last_bit():
    task = get_task("parity_check", layout="harness")
    batch = task.sample(7, 16, np.random.default_rng(0))
    assert batch.inputs.shape == batch.targets.shape == (16, 7)
    assert batch.mask[:, -1].all() and not batch.mask[:, :-1].any()
    assert (batch.targets[:, -1] == batch.inputs.sum(1) % 2).all()
    assert task.output_size == 3 and task.chance == 0.5 and task.min_length == 2
    targets, mask = task.solve(batch.inputs)
    assert (targets == batch.targets).all() and (mask == batch.mask).all()


def test_harness_modular_arithmetic_puts_equals_after_the_expression():
    task = get_task("modular_arithmetic", layout="harness")
    assert [task.input_length(n) for n in (2, 3, 6, 7, 39, 256)] == [2, 2, 6, 6, 38, 256]
    batch = task.sample(7, 32, np.random.default_rng(0))
    assert batch.inputs.shape == (32, 6) and (batch.inputs[:, -1] == 8).all()  # `=` is id m+3
    che = get_task("modular_arithmetic")
    assert (che.solve(batch.inputs[:, :-1])[0][:, 0] == batch.targets[:, -1]).all()
    assert task.output_size == 10 and task.chance == pytest.approx(0.2)
    assert task.input_symbols[8] == "=" and che.input_symbols[8] == "_"
    # The spec's worked example: 3 + 4 + 0 = 2 (mod 5), read at `=`.
    targets, mask = task.solve(np.array([[3, 5, 4, 5, 0, 8]]))
    assert targets[0, -1] == 2 and mask[0].tolist() == [False] * 5 + [True]


def test_the_harness_layout_enters_the_run_id_only_when_set():
    che = make_config("modular_arithmetic", arch="deltanet", preset="smoke")
    harness = make_config(
        "modular_arithmetic",
        arch="deltanet",
        preset="smoke",
        task_params={"layout": "harness"},
    )
    assert che.task_params == {"modulus": 5}
    assert harness.task_params == {"modulus": 5, "layout": "harness"}
    assert harness.run_id() != che.run_id()
    assert harness.train_eval_lengths[0] == 2  # training from the harness's shortest, n = 2


def test_an_unknown_layout_is_refused():
    with pytest.raises(CheBenchError, match="layout"):
        get_task("parity_check", layout="appended")


def tiny_training_step(autocast, **options):
    """One training step of a tiny DeltaNet (seed 0) on modular arithmetic at n = 9:
    (model, losses, logits), ``autocast`` None (float32) or a dtype."""
    task = get_task("modular_arithmetic")
    batch = task.sample(9, 8, np.random.default_rng(0))
    inputs, targets = torch.from_numpy(batch.inputs), torch.from_numpy(batch.targets)[None]
    config = make_config("modular_arithmetic", arch="deltanet", preset="smoke")
    torch.manual_seed(0)
    model = build_architecture("deltanet", task, layers=1, width=16, heads=2, **options)
    optimizer = pack_optimizer(model, [config])
    return model, *training_step(model, optimizer, inputs, targets, [], autocast=autocast)


def test_bf16_training_runs_the_forward_under_autocast_with_float32_weights():
    logits = {}
    for dtype in (None, torch.bfloat16):
        model, losses, logits[dtype] = tiny_training_step(dtype)
        assert torch.isfinite(losses).all() and logits[dtype].dtype == torch.float32
        assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not torch.equal(logits[None], logits[torch.bfloat16])  # bf16 rounds otherwise


def test_the_options_work_in_a_suite(tmp_path):
    path = tmp_path / "harness.toml"
    path.write_text(
        textwrap.dedent(
            """
            preset = "smoke"
            tasks = [{ name = "parity_check", params = { layout = "harness" } }]
            architectures = ["deltanet"]
            [overrides]
            batch_lengths = "mixed"
            train_precision = "bfloat16"
            """
        )
    )
    (config,) = load_suite(path).configs()
    assert (config.batch_lengths, config.train_precision) == ("mixed", "bfloat16")
    assert config.task_params == {"layout": "harness"}


def test_a_harness_run_from_the_command_line(tmp_path, capsys):
    store = tmp_path / "runs.sqlite"
    argv = [
        "run", "--task", "parity_check", "--task-param", "layout=harness", "--arch", "deltanet",
        "--arch-option", "layers=1", "--arch-option", "width=16", "--arch-option", "heads=2",
        "--preset", "smoke", "--steps", "3", "--batch-lengths", "mixed",
        "--train-precision", "bfloat16", "--test-lengths", "41", "--store", str(store),
        "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    assert "parity_check(layout=harness)" in capsys.readouterr().out


def test_fla_roundings_change_bf16_training_only_and_enter_the_run_id_only_when_set():
    logits = {}
    for dtype in (None, torch.bfloat16):
        for roundings in (False, True):
            _, losses, logits[dtype, roundings] = tiny_training_step(dtype, fla_roundings=roundings)
            assert torch.isfinite(losses).all()
    assert torch.equal(logits[None, False], logits[None, True])  # float32: nothing rounded
    assert not torch.equal(logits[torch.bfloat16, False], logits[torch.bfloat16, True])
    config = make_config("modular_arithmetic", arch="deltanet", preset="smoke")
    rounded = make_config(
        "modular_arithmetic", arch="deltanet", preset="smoke", arch_options={"fla_roundings": True}
    )
    spelt = make_config(
        "modular_arithmetic", arch="deltanet", preset="smoke", arch_options={"fla_roundings": False}
    )
    assert spelt.run_id() == config.run_id() != rounded.run_id()
    with pytest.raises(CheBenchError, match="fla_roundings"):
        make_config("parity_check", arch="gated_deltanet", arch_options={"fla_roundings": True})


HARNESS_TASKS = ("parity_check", "modular_arithmetic")


@pytest.mark.parametrize("task", [*HARNESS_TASKS, "even_pairs", "cycle_navigation"])
def test_the_harness_preset_is_state_tracking_with_the_three_options(task):
    """``state_tracking_harness`` trains as ``state_tracking`` with the harness's batches,
    precision and, where the task has it, read-out: the same config but for the preset's name."""
    by_preset = make_config(task, arch="deltanet", preset="state_tracking_harness")
    layout = {"layout": "harness"} if task in HARNESS_TASKS else {}
    by_flags = make_config(task, arch="deltanet", preset="state_tracking", task_params=layout,
                           batch_lengths="mixed", train_precision="bfloat16")
    assert by_preset.to_dict() == {**by_flags.to_dict(), "preset": "state_tracking_harness"}
    assert by_preset.run_id() != by_flags.run_id()  # reports name the preset


def test_the_harness_preset_s_read_out_gives_way_to_a_run_s_task_params():
    che = make_config("modular_arithmetic", arch="mamba", preset="state_tracking_harness",
                      task_params={"layout": "che", "modulus": 7})
    assert che.task_params == {"modulus": 7}
    other = make_config("modular_arithmetic", arch="mamba", preset="state_tracking_harness",
                        task_params={"modulus": 7})
    assert other.task_params == {"modulus": 7, "layout": "harness"}
    spelt = make_config("modular_arithmetic", arch="mamba", preset="state_tracking_harness",
                        task_params={"layout": "harness"})
    assert spelt.task_params == {"modulus": 5, "layout": "harness"}
    for config in (che, other):  # the report's command gives the run back
        argv = run_command_line(config.to_dict(), config.run_id())
        assert argv is not None and ("layout=che" in argv) == (config is che)


def test_the_harness_preset_refuses_a_model_that_cannot_read_mixed_batches():
    with pytest.raises(CheBenchError, match="--batch-lengths one trains it"):
        make_config("parity_check", preset="state_tracking_harness")
    lstm = make_config("parity_check", arch="lstm", preset="state_tracking_harness",
                       batch_lengths="one")
    assert lstm.train_precision == "bfloat16" and lstm.task_params == {"layout": "harness"}


def test_the_harness_preset_from_a_suite_and_the_command_line(tmp_path, capsys):
    path = tmp_path / "harness.toml"
    path.write_text('preset = "state_tracking_harness"\ntasks = ["parity_check", "even_pairs"]\n'
                    'architectures = ["deltanet"]\n')
    parity, even_pairs = load_suite(path).configs()
    assert parity.task_params == {"layout": "harness"} and even_pairs.task_params == {}
    assert {parity.batch_lengths, even_pairs.train_precision} == {"mixed", "bfloat16"}
    argv = [
        "run", "--task", "parity_check", "--arch", "deltanet", "--arch-option", "layers=1",
        "--arch-option", "width=16", "--arch-option", "heads=2",
        "--preset", "state_tracking_harness", "--steps", "2", "--batch-size", "4",
        "--test-lengths", "41", "--eval-samples", "4", "--store", str(tmp_path / "s.sqlite"),
        "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    assert "parity_check(layout=harness)" in capsys.readouterr().out


def test_the_shipped_harness_suite_is_the_affected_cells_under_the_preset():
    """tasks/laptop_state_tracking_harness.toml: DeltaNet in both ranges, 3 seeds; its runs
    are those of the `che-bench run` lines docs/results.md gives (the same run ids)."""
    suite = Path(__file__).resolve().parents[1] / "tasks" / "laptop_state_tracking_harness.toml"
    configs = load_suite(suite).configs()
    assert len(configs) == 6 and {c.preset for c in configs} == {"state_tracking_harness"}
    assert {(bool(c.arch_options), c.seed) for c in configs} == {
        (negative, seed) for negative in (True, False) for seed in range(3)}
    single = make_config("modular_arithmetic", arch="deltanet", preset="state_tracking_harness",
                         steps=12000, test_lengths="42:242:20,256", seed=2,
                         arch_options={"negative_eigenvalues": True})
    assert single.run_id() in {c.run_id() for c in configs}
