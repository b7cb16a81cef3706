"""Issue 29, item 4: the Tape-RNN as the CHE paper swept it. Computation tokens (CHE's
``computation_steps_mult``) and several tapes (``n_tapes``) as options, checked against a
plain step-by-step reference of CHE's models/tape_rnn.py; tables whose cells are the best
over those options (``--best-over``, a suite's ``best_over``); the suite of the six
configurations. The stored runs of the table tests are SYNTHETIC (made-up scores)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from test_store import synthetic_result

from che_bench.checks.model_checks import run_model_check
from che_bench.cli import main
from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.model.recurrent import build_recurrent
from che_bench.model.recurrent.base import unroll
from che_bench.reports.tables import format_table, summarize
from che_bench.run.runner import execute_runs
from che_bench.run.suites import load_suite
from che_bench.store import ResultStore
from che_bench.tasks import get_task
from tests.run_helpers import run_interrupted_at

REPO = Path(__file__).resolve().parents[1]
TINY = {"hidden_size": 8, "memory_cell_size": 3, "memory_size": 6, "mlp_layers_size": (5,)}
SWEPT = ("computation_steps_mult", "n_tapes")


def tape_model(members: int = 1, task: str = "reverse_string", seed: int = 0, **options):
    torch.manual_seed(seed)
    model = build_recurrent("tape_rnn", get_task(task), members=members, **TINY, **options)
    with torch.no_grad():  # zero biases at initialisation would hide a misplaced one
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_()
    return model.eval()


def inputs_of(task: str, n: int, batch: int, seed: int = 0) -> torch.Tensor:
    sample = get_task(task).sample(n, batch, np.random.default_rng(seed))
    return torch.from_numpy(sample.inputs.copy())


def linear(layer, member: int, x: torch.Tensor) -> torch.Tensor:
    return layer.weight[member] @ x + layer.bias[member]


def reference_logits(model, member: int, tokens: list[int], n: int, read: int) -> torch.Tensor:
    """CHE's TapeRNNCore step by step for one sequence of token ids: read every tape's head,
    hk.VanillaRNN (relu) on [one-hot, heads], an MLP writes n_tapes cells, one softmax of
    five moves per tape, each tape moved as sum_a p_a * roll(written, shift_a)."""
    cell, memory = model.cell, model.memory
    tapes = [torch.zeros(memory.size, memory.cell_size) for _ in range(memory.tapes)]
    h = torch.zeros(cell.hidden_size)
    outputs = []
    for token in tokens:
        one_hot = torch.nn.functional.one_hot(torch.tensor(token), cell.tokens).float()
        x = torch.cat([one_hot, *[tape[0] for tape in tapes]])
        h = torch.relu(
            linear(cell.input_to_hidden, member, x) + linear(cell.hidden_to_hidden, member, h)
        )
        value = h
        for index, layer in enumerate(memory.write_mlp):
            value = linear(layer, member, value if index == 0 else torch.relu(value))
        logits = linear(memory.actions, member, h)
        for t, tape in enumerate(tapes):
            written = tape.clone()
            written[0] = value[t * memory.cell_size : (t + 1) * memory.cell_size]
            moves = torch.softmax(logits[5 * t : 5 * t + 5], dim=0)
            rolled = [torch.roll(written, shift, dims=0) for shift in (0, -1, 1, -n, n)]
            tapes[t] = sum(p * tape for p, tape in zip(moves, rolled, strict=True))
        outputs.append(linear(model.head, member, torch.relu(h)))
    return torch.stack(outputs[len(outputs) - read :])


def test_computation_tokens_follow_the_input_and_the_outputs_are_read_after_them():
    task = get_task("reverse_string")  # input_size 2, output_length(n) = n
    inputs = inputs_of("reverse_string", 5, 3)
    plain, doubled = tape_model(), tape_model(computation_steps_mult=2)
    tokens, read = doubled.with_output_tokens(inputs.expand(1, -1, -1))
    # CHE's make_model_with_empty_targets: n inputs, 2n computation tokens (class
    # input_size), n empty output tokens (class input_size + 1), one more one-hot class.
    assert tokens.shape == (1, 3, 5 + 10 + 5) and read == 5
    assert torch.equal(tokens[0, :, :5], inputs)
    assert (tokens[0, :, 5:15] == task.input_size).all()
    assert (tokens[0, :, 15:] == task.input_size + 1).all()
    assert (doubled.cell.tokens, plain.cell.tokens) == (task.input_size + 2, task.input_size + 1)
    assert plain.with_output_tokens(inputs.expand(1, -1, -1))[0].shape[-1] == 10
    with torch.no_grad():
        logits = doubled(inputs)
        every_step = unroll(doubled.cell, doubled.memory, tokens, 5, tokens.shape[-1])
        assert torch.allclose(logits, doubled.head(torch.relu(every_step))[:, :, -5:])
        for row in range(3):
            expected = reference_logits(doubled, 0, tokens[0, row].tolist(), 5, 5)
            assert torch.allclose(logits[0, row], expected, atol=1e-5)


def test_four_tapes_match_the_reference_in_a_pack():
    model = tape_model(members=2, n_tapes=4, computation_steps_mult=1)
    assert model.memory.width == 12 and model.memory.actions.fan_out == 20
    inputs = inputs_of("reverse_string", 7, 2)
    tokens, read = model.with_output_tokens(inputs.expand(2, -1, -1))
    with torch.no_grad():
        logits = model(inputs)
    for member in range(2):
        for row in range(2):
            expected = reference_logits(model, member, tokens[member, row].tolist(), 7, read)
            assert torch.allclose(logits[member, row], expected, atol=1e-5)


def test_four_tapes_move_apart_and_copies_of_one_tape_stay_together():
    one, four = tape_model(), tape_model(n_tapes=4)
    h = torch.randn(1, 3, TINY["hidden_size"])
    plan = four.memory.plan(5)
    tapes = four.memory.write(four.memory.initial(1, 3, h), h, plan)
    tapes = four.memory.write(tapes, h, plan).reshape(3, 4, 6, 3)
    assert not torch.allclose(tapes[:, 0], tapes[:, 1])  # each tape its own write and moves
    with torch.no_grad():  # four copies of the one tape's maps: four copies of its tape
        last = four.memory.write_mlp[-1]
        last.weight.copy_(one.memory.write_mlp[-1].weight.repeat(1, 4, 1))
        last.bias.copy_(one.memory.write_mlp[-1].bias.repeat(1, 4))
        four.memory.write_mlp[0].load_state_dict(one.memory.write_mlp[0].state_dict())
        four.memory.actions.weight.copy_(one.memory.actions.weight.repeat(1, 4, 1))
        four.memory.actions.bias.copy_(one.memory.actions.bias.repeat(1, 4))
    single = one.memory.write(one.memory.initial(1, 3, h), h, one.memory.plan(5))
    single = one.memory.write(single, h, one.memory.plan(5))
    copies = four.memory.write(four.memory.initial(1, 3, h), h, four.memory.plan(5))
    copies = four.memory.write(copies, h, four.memory.plan(5)).reshape(3, 4, 6, 3)
    for t in range(4):
        assert torch.allclose(copies[:, t], single[0], atol=1e-6)


def test_the_defaults_are_the_configuration_che_bench_always_had():
    # Computed before the options existed (the tree they were added to): the default
    # Tape-RNN's run id.
    config = make_config("parity_check", preset="paper", arch="tape_rnn", seed=3, lr=3e-4,
                         length_seed=0)
    assert config.run_id() == PINNED_TAPE_RUN_ID
    inputs = inputs_of("reverse_string", 6, 2)
    given = tape_model(computation_steps_mult=0, n_tapes=1)
    with torch.no_grad():
        assert torch.equal(tape_model()(inputs), given(inputs))


PINNED_TAPE_RUN_ID = "972c6b0e91b7"


@pytest.mark.parametrize(
    "options, message",
    [({"n_tapes": 0}, "n_tapes must be a positive integer"),
     ({"computation_steps_mult": -1}, "computation_steps_mult must be a non-negative integer"),
     ({"computation_steps_mult": 1.5}, "computation_steps_mult must be a non-negative integer")],
)
def test_bad_values_are_one_line_errors(options, message):
    with pytest.raises(CheBenchError, match=message):
        build_recurrent("tape_rnn", get_task("parity_check"), **options)


def test_computation_tokens_refuse_an_in_place_task():
    with pytest.raises(CheBenchError, match="reads its outputs at its inputs"):
        build_recurrent("tape_rnn", get_task("mqar"), computation_steps_mult=1)


@pytest.mark.parametrize("check", ["pack", "option_effects"])
def test_packs_of_the_swept_configuration_equal_their_members(check):
    assert run_model_check(check, "tape_rnn", {"n_tapes": 4, "computation_steps_mult": 2}) == []


def test_check_model_passes_for_a_swept_configuration(capsys):
    code = main(["check-model", "tape_rnn", "--arch-option", "n_tapes=4",
                 "--arch-option", "computation_steps_mult=1"])
    assert code == 0, capsys.readouterr().out


def tape_run(task: str, seed: int, score: float, **options):
    return synthetic_result(task, None, None, seed=seed, score=score, arch="tape_rnn",
                            arch_options=options)


@pytest.fixture
def store(tmp_path) -> ResultStore:
    store = ResultStore(tmp_path / "s.sqlite")
    for result in (
        tape_run("parity_check", 0, 0.60),
        tape_run("parity_check", 1, 0.62),
        tape_run("parity_check", 0, 0.90, computation_steps_mult=2, n_tapes=4),
        tape_run("parity_check", 0, 0.50, computation_steps_mult=1),
        tape_run("even_pairs", 0, 0.70),
        tape_run("even_pairs", 0, 0.80, n_tapes=4),
        synthetic_result("parity_check", None, None, seed=0, score=0.55, arch="lstm"),
    ):
        store.record(result)
    return store


def test_a_best_of_cell_is_the_max_over_the_configurations_and_names_the_winner(store):
    separate = set(summarize(store)["column"])
    assert "Tape-RNN · computation_steps_mult=2, n_tapes=4" in separate and len(separate) == 5
    cells = summarize(store, best_over=SWEPT).set_index(["task", "column"])
    assert sorted(set(cells.index.get_level_values("column"))) == ["LSTM", "Tape-RNN (best of 4)"]
    parity = cells.loc[("parity_check", "Tape-RNN (best of 4)")]
    assert (parity["max"], parity["n"]) == (pytest.approx(90.0), 4)
    assert parity["mean"] == pytest.approx(65.5)
    assert parity["best"] == "computation_steps_mult=2, n_tapes=4"
    assert cells.loc[("even_pairs", "Tape-RNN (best of 4)"), "best"] == (
        "computation_steps_mult=0, n_tapes=4")
    assert cells.loc[("parity_check", "LSTM"), "best"] == ""  # one configuration: no sweep
    text = format_table(store, best_over=SWEPT)
    assert "90.00 (65.50±17.16, n=4) [computation_steps_mult=2, n_tapes=4]" in text
    assert "(best of K)" in text
    csv = format_table(store, best_over=SWEPT, fmt="csv")
    assert "Tape-RNN (best of 4) best" in csv.splitlines()[0]


def test_the_table_command_takes_best_over(store, capsys):
    assert main(["table", "--best-over", "computation_steps_mult,n_tapes",
                 "--store", str(store.path)]) == 0
    assert "Tape-RNN (best of 4)" in capsys.readouterr().out
    assert main(["table", "--best-over", "tapes", "--store", str(store.path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no architecture takes option 'tapes'" in err and "\n" not in err


def test_the_suite_runs_six_configurations_per_task_and_its_table_takes_their_best():
    suite = load_suite(REPO / "tasks" / "che_tape_rnn.toml")
    assert suite.best_over == SWEPT and suite.preset == "paper"
    configs = suite.configs()
    assert len(configs) == 15 * 6 * 10 * 3
    per_task = {}
    for config in configs:
        options = tuple(sorted(config.arch_options.items()))
        per_task.setdefault(config.task, set()).add(options)
    assert len(per_task) == 15 and all(len(found) == 6 for found in per_task.values())
    # The default configuration is che_baselines.toml's Tape-RNN: the same runs.
    plain = next(c for c in configs if not c.arch_options)
    assert plain.run_id() == make_config(plain.task, preset="paper", arch="tape_rnn",
                                         seed=plain.seed, lr=plain.lr, length_seed=0).run_id()


def test_a_suite_refuses_a_bad_best_over(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('tasks = "parity_check"\narchitectures = "tape_rnn"\nbest_over = [1]\n')
    with pytest.raises(CheBenchError, match="'best_over' must be a list"):
        load_suite(path)


def test_a_suites_closing_table_and_report_take_its_best(tmp_path, capsys):
    path = tmp_path / "tapes.toml"
    path.write_text('preset = "smoke"\ntasks = "parity_check"\nbest_over = "n_tapes"\n'
                    'architectures = ["tape_rnn", { name = "tape_rnn", '
                    'options = { n_tapes = 4 } }]\n')
    store = ResultStore(tmp_path / "s.sqlite")
    for config, score in zip(load_suite(path).configs(), (0.6, 0.7), strict=True):
        made_up = synthetic_result("parity_check", None, None, score=score, arch="tape_rnn")
        store.record(dataclasses.replace(made_up, config=config, run_id=config.run_id()))
    assert main(["sweep", str(path), "--store", str(store.path)]) == 0  # nothing left to run
    assert "70.00 (65.00±7.07, n=2) [n_tapes=4]" in capsys.readouterr().out
    from che_bench.reports.html import render_report

    page = render_report(store, suite=str(path), out=tmp_path / "r.html")
    assert "Tape-RNN (best of 2)" in page and "[n_tapes=4]" in page


def test_a_swept_configuration_resumes_exactly_and_its_kept_model_re_evaluates(tmp_path, capsys):
    options = {**TINY, "n_tapes": 2, "computation_steps_mult": 1}
    configs = [make_config("parity_check", preset="smoke", arch="tape_rnn", seed=seed, steps=8,
                           arch_options=options, test_lengths="41", eval_samples=4,
                           eval_batch_size=4, length_seed=0) for seed in range(2)]
    reference = execute_runs(configs, device="cpu", progress=False, log_every=1)
    run_interrupted_at(5, configs, tmp_path / "checkpoints", log_every=1)
    resumed = execute_runs(configs, device="cpu", progress=False, log_every=1,
                           checkpoint_dir=tmp_path / "checkpoints")
    assert [result.timings["resumed_from_step"] for result in resumed] == [5, 0]
    def curves(results):  # (step, loss, accuracy): elapsed seconds differ
        return [[(row["step"], row["loss"], row["accuracy"]) for row in r.history]
                for r in results]

    assert curves(resumed) == curves(reference)  # bit for bit
    assert [r.per_length for r in resumed] == [r.per_length for r in reference]
    store = tmp_path / "s.sqlite"
    assert main(["run", "--task", "parity_check", "--arch", "tape_rnn", "--preset", "smoke",
                 "--steps", "4", "--test-lengths", "41", "--eval-samples", "4",
                 "--eval-batch-size", "4", "--no-progress", "--device", "cpu",
                 "--arch-option", "n_tapes=2", "--arch-option", "computation_steps_mult=2",
                 "--arch-option", "hidden_size=8", "--store", str(store)]) == 0
    [run_id] = ResultStore(store).runs()["run_id"]
    assert main(["evaluate", run_id, "--store", str(store), "--no-progress"]) == 0
    assert "reproduces the stored curve exactly" in " ".join(capsys.readouterr().out.split())
