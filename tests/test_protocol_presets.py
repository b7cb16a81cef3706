"""Issue 45, item 3 (b), (c): evaluation under other task parameters (flip-flop's splits),
the presets of the published state-tracking protocols and Merrill et al.'s minimum-depth
table."""

from __future__ import annotations

import pytest

from che_bench.cli import main
from che_bench.commands.command_lines import run_command_line
from che_bench.config import RunConfig, make_config, protocol_id
from che_bench.errors import CheBenchError
from che_bench.outcomes import RunResult
from che_bench.protocol import PRESETS, PROTOCOL_PRESETS, preset_settings
from che_bench.reports.min_depth import format_min_depth, min_depth_cells
from che_bench.store import ResultStore


def test_eval_task_params_enter_the_run_id_and_the_protocol_only_when_set():
    plain = make_config("flip_flop", preset="smoke")
    sparse = make_config("flip_flop", preset="smoke", eval_task_params={"p_ignore": 0.98})
    assert "eval_task_params" not in plain.to_dict()
    assert "eval_task_params" not in plain.evaluation_protocol()
    assert sparse.run_id() != plain.run_id()
    assert sparse.evaluation_protocol() == {
        **plain.evaluation_protocol(), "eval_task_params": {"p_ignore": 0.98}}
    assert protocol_id(sparse.evaluation_protocol()) != protocol_id(plain.evaluation_protocol())
    assert sparse.build_evaluation_task().p_ignore == 0.98 and sparse.build_task().p_ignore == 0.8
    assert RunConfig.from_dict(sparse.to_dict()) == sparse


def test_eval_task_params_that_change_nothing_or_the_model_s_inputs_are_refused():
    with pytest.raises(CheBenchError, match="run's own value"):
        make_config("flip_flop", preset="smoke", eval_task_params={"p_ignore": 0.8})
    with pytest.raises(CheBenchError, match="changes the inputs or outputs"):
        make_config("word_problem", preset="smoke", task_params={"group": "Z3"},
                    eval_task_params={"group": "Z5"})
    with pytest.raises(CheBenchError, match="p_ignore"):
        make_config("flip_flop", preset="smoke", eval_task_params={"p_ignore": 2})


def test_an_eval_task_param_changing_the_model_s_inputs_is_named_with_what_it_reads():
    """The error named the parameters as Python dicts, the run's own with None in them."""
    with pytest.raises(CheBenchError) as refused:
        make_config("word_problem", preset="smoke", task_params={"group": "S3"},
                    eval_task_params={"group": "S5"})
    assert str(refused.value) == (
        "--eval-task-param group=S5 changes the inputs or outputs of task 'word_problem' (to 120 "
        "input and 120 output classes): the run's model, trained with group=S3, reads 6 input "
        "and 6 output classes; an evaluation may change only task parameters that keep them"
    )
    with pytest.raises(CheBenchError, match=r"^--eval-task-param p_ignore=0.8: the run's own"):
        make_config("flip_flop", preset="smoke", eval_task_params={"p_ignore": 0.8})


def test_a_run_is_evaluated_on_flip_flop_s_sparse_and_dense_splits_end_to_end(tmp_path, capsys):
    store = str(tmp_path / "s.sqlite")
    common = ["--store", store, "--no-progress"]
    assert main(["run", "--task", "flip_flop", "--preset", "smoke", "--steps", "2",
                 "--test-lengths", "41", *common]) == 0
    run_id = ResultStore(store).runs()["run_id"].iloc[0]
    for p_ignore in ("0.98", "0.1"):
        assert main(["evaluate", run_id, "--eval-task-param", f"p_ignore={p_ignore}",
                     "--device", "cpu", *common]) == 0
    out = capsys.readouterr().out
    assert "task p_ignore=0.98" in out and "pooled error" in out
    evaluations = ResultStore(store).evaluations()
    assert len(evaluations) == 3 and evaluations["original"].sum() == 1
    reads = {}
    for evaluation in evaluations["evaluation"]:
        curves = ResultStore(store).per_length(evaluation=evaluation)
        reads[evaluation] = int(curves[curves["split"] == "test"]["scored"].sum())
    sparse, dense = (evaluations[evaluations["protocol"].str.contains(f"p_ignore={p}")]
                     ["evaluation"].iloc[0] for p in ("0.98", "0.1"))
    original = evaluations[evaluations["original"]]["evaluation"].iloc[0]
    # reads per 41-instruction sequence: ~1.4 sparse, ~9 FFL(0.8), ~19 dense
    assert reads[sparse] < reads[original] < reads[dense]
    assert main(["table", "--metric", "pooled", "--evaluation", sparse, "--store", store]) == 0
    assert "flip_flop, tested at p_ignore=0.98" in capsys.readouterr().out


def test_the_deltaproduct_preset_is_its_readme_protocol():
    config = make_config("word_problem", preset="deltaproduct", task_params={"group": "S3"})
    assert (config.train_max_length, config.test_lengths, config.train_eval_lengths) == (
        128, (512,), (128,))
    assert config.curriculum == "fixed" and config.curriculum_options == {"sequence_length": 128}
    assert (config.steps, config.batch_size, config.lr) == (4_900, 2048, 1e-3)
    assert (config.optimizer, config.weight_decay, config.lr_schedule) == (
        "adamw", 1e-6, "warmup_cosine")
    assert (config.warmup_steps, config.min_lr_ratio, config.eval_samples) == (0, 0.0, 1000)
    assert config.model_options["layers"] == 1 and config.model_options["heads"] == 8
    product = make_config("word_problem", preset="deltaproduct", arch="deltaproduct",
                          arch_options={"layers": 1, "negative_eigenvalues": True})
    assert product.steps == 4_900 and product.arch_options["layers"] == 1


def test_the_flip_flop_presets_are_the_splits_protocol_and_its_length_variant():
    splits = make_config("flip_flop", preset="flip_flop")
    assert splits.task_params == {"p_ignore": 0.8}
    assert 2 * splits.train_max_length == 512 and splits.test_lengths == (256,)
    assert splits.curriculum == "fixed"
    assert (splits.steps, splits.batch_size, splits.lr, splits.weight_decay) == (
        10_000, 16, 3e-4, 0.1)
    assert splits.warmup_steps == 50 and splits.model_options["layers"] == 6
    lengths = make_config("flip_flop", preset="flip_flop_length")
    assert 2 * lengths.train_max_length == 64 and 2 * max(lengths.test_lengths) == 512
    assert (lengths.steps, lengths.batch_size, lengths.lr) == (16_000, 32, 3e-3)
    assert lengths.weight_decay == 0.1  # the flip_flop preset's, under it


def test_the_merrill_preset_trains_up_to_k_and_tests_at_k():
    config = make_config("word_problem", preset="merrill", task_params={"group": "A5"})
    assert config.train_max_length == 20 and config.test_lengths == (20,)
    assert config.curriculum == "uniform" and config.model_options["layers"] == 1
    assert (config.lr, config.batch_size, config.lr_schedule) == (1e-4, 32, "constant")
    shorter = make_config("word_problem", preset="merrill", train_max_length=8, test_lengths="8")
    assert shorter.test_lengths == (8,)


@pytest.mark.parametrize("preset", sorted(PROTOCOL_PRESETS))
def test_a_protocol_preset_s_runs_keep_che_s_framing_and_reproduce_from_their_command(preset):
    assert set(PRESETS[preset]) >= set(PRESETS["quick"])  # a complete set of settings
    task = "flip_flop" if preset.startswith("flip_flop") else "word_problem"
    # (mixed-length batches: the state-tracking models only)
    archs = ("mamba", "deltanet") if preset == "state_tracking_harness" else ("transformer", "lstm")
    che = make_config(task, preset=preset, arch=archs[0], train_max_length=40,
                      test_lengths="41:500:100", curriculum="uniform")
    assert che.test_lengths == (41, 141, 241, 341, 441)
    for config in (che, make_config(task, preset=preset, arch=archs[1])):
        argv = run_command_line(config.to_dict(), config.run_id())
        assert argv is not None and argv[argv.index("--preset") + 1] == preset


def test_an_architecture_s_own_preset_settings_lie_between_base_and_protocol():
    paper = {"paper": {"steps": 7, "lr": 0.5}}
    assert preset_settings("paper", paper)["steps"] == 7
    assert preset_settings("deltaproduct", {"state_tracking": {"steps": 7, "lr": 0.5}})[
        "steps"] == 4_900
    assert preset_settings("deltaproduct", {"state_tracking": {"eval_seed": 3}})["eval_seed"] == 3
    with pytest.raises(CheBenchError, match="unknown preset"):
        preset_settings("nope")


def depth_result(layers: int, k: int, sequence_accuracy: float, seed: int = 0) -> RunResult:
    config = make_config("word_problem", preset="smoke", task_params={"group": "Z3"},
                         layers=layers, train_max_length=k, test_lengths=str(k), seed=seed)
    return RunResult(run_id=config.run_id(), config=config, status="complete", score=1.0,
                     train_accuracy=1.0, per_length={k: 1.0},
                     train_per_length={n: 1.0 for n in config.train_eval_lengths},
                     exact_score=sequence_accuracy, train_exact_accuracy=1.0,
                     exact_per_length={k: sequence_accuracy},
                     train_exact_per_length={n: 1.0 for n in config.train_eval_lengths})


def test_the_minimum_depth_is_the_fewest_layers_whose_best_run_reaches_90_percent(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    for result in (
        depth_result(1, 5, 0.95),  # k = 5: one layer suffices
        depth_result(2, 5, 0.99),
        depth_result(1, 10, 0.2),  # k = 10: one layer fails, two reach it in one seed of two
        depth_result(2, 10, 0.5),
        depth_result(2, 10, 0.9, seed=1),
        depth_result(3, 10, 1.0),
        depth_result(1, 20, 0.89),  # k = 20: none of 1..2 does
        depth_result(2, 20, 0.3),
    ):
        store.record(result)
    cells = min_depth_cells(store).set_index("k")
    assert cells.loc[5, "min_depth"] == 1 and cells.loc[10, "min_depth"] == 2
    assert cells.loc[20, "min_depth"] is None and cells.loc[10, "depths"] == [1, 2, 3]
    assert cells["column"].nunique() == 1  # depth and lengths set aside
    text = format_min_depth(store)
    assert "k=5" in text and "k=20" in text and ">2" in text
    assert main(["table", "--min-depth", "--store", str(store.path)]) == 0
    assert main(["table", "--min-depth", "--metric", "pooled", "--store", str(store.path)]) == 2
