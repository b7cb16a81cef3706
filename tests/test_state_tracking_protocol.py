"""The xLSTM harness's protocol as a preset, Grazzi et al.'s scaled accuracy, and their
Table 3 beside che-bench's cells (issue 27, items 5 and 6)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib
import pytest
from test_store import synthetic_result

from che_bench.cli import build_parser, main
from che_bench.commands.run import cell_configs
from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.model.architectures import ARCHITECTURES
from che_bench.protocol import parse_lengths
from che_bench.reports import grazzi
from che_bench.reports.export import export_frame
from che_bench.reports.labels import run_settings
from che_bench.reports.plots import plot_accuracy, plot_data
from che_bench.reports.tables import format_table, summarize
from che_bench.run.runner import execute_runs
from che_bench.run.suites import parse_suite
from che_bench.store import ResultStore

matplotlib.use("Agg")
REPOSITORY = Path(__file__).resolve().parent.parent
#: The harness's settings (spec 2.3; NX parity yamls), lengths translated to CHE's n = L - 1.
HARNESS = {"steps": 20_000, "batch_size": 256, "lr": 1e-3, "optimizer": "adamw",
           "weight_decay": 0.1, "grad_clip_norm": 0.0, "lr_schedule": "warmup_cosine",
           "warmup_steps": 2000, "min_lr_ratio": 1e-3, "train_max_length": 39}


@pytest.mark.parametrize("arch", ARCHITECTURES.names())
def test_the_preset_is_the_harness_s_protocol_for_every_architecture(arch):
    config = make_config("parity_check", preset="state_tracking", arch=arch)
    assert {name: getattr(config, name) for name in HARNESS} == HARNESS
    assert config.test_lengths == tuple(range(39, 256))  # the harness's L = 40..256


def test_the_preset_from_the_command_line_and_in_a_suite(tmp_path):
    args = build_parser().parse_args(["run", "--task", "parity_check", "--arch", "lstm",
                                      "--preset", "state_tracking", "--seeds", "0:3"])
    configs = cell_configs(args)
    assert [c.seed for c in configs] == [0, 1, 2]
    assert {c.optimizer for c in configs} == {"adamw"} and len({c.pack_key() for c in configs}) == 1
    suite = parse_suite({"preset": "state_tracking", "tasks": ["parity_check"],
                         "architectures": ["lstm"], "overrides": {"warmup_steps": 10}},
                        tmp_path / "s.toml")
    assert [(c.preset, c.warmup_steps, c.optimizer) for c in suite.configs()] == [
        ("state_tracking", 10, "adamw")]


@pytest.mark.parametrize("arch", ["transformer", "lstm"])
def test_a_run_under_the_preset_trains_and_is_stored(tmp_path, arch):
    config = make_config("parity_check", preset="state_tracking", arch=arch, steps=3,
                         batch_size=4, warmup_steps=1, test_lengths="39,40", eval_samples=2,
                         eval_batch_size=2, **({"dim": 16, "ffn": 32} if arch == "transformer"
                                               else {"arch_options": {"hidden_size": 8}}))
    [result] = execute_runs([config], device="cpu", progress=False, log_every=1)
    assert result.status == "complete"
    assert [row["lr"] for row in result.history][:2] == [0.0, 1e-3]


def record(store, task, score, preset="state_tracking", arch="deltanet", negative=None, **more):
    options = {} if negative is None else {"negative_eigenvalues": negative}
    extra = {"arch": arch, "arch_options": options} if arch != "transformer" else {}
    result = synthetic_result(task, None, None, score=score, preset=preset, **extra, **more)
    store.record(result)
    return result


def test_scaled_accuracy_in_tables_exports_and_plots(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    lengths = {"arch": "lstm", "test_lengths": "39,100,255"}
    record(store, "parity_check", 0.75, **lengths)
    record(store, "modular_arithmetic", 0.6, **lengths)
    record(store, "cycle_navigation", 1 / 7, task_params={"cycle_length": 7}, **lengths)
    cells = summarize(store, metric="scaled").set_index("task")
    assert cells.at["parity_check", "max"] == pytest.approx(50.0)
    assert cells.at["modular_arithmetic", "max"] == pytest.approx(50.0)  # (0.6 - 0.2) / 0.8
    assert cells.filter(like="cycle", axis=0)["max"].iloc[0] == pytest.approx(0.0)
    assert set(cells["chance"]) == {0.0}
    assert summarize(store).set_index("task").at["parity_check", "max"] == pytest.approx(75.0)
    assert "scaled accuracy % = (accuracy - chance) / (1 - chance)" in format_table(
        store, metric="scaled")
    curves = export_frame(store, per_length=True, metric="scaled")
    parity = curves[curves["task"] == "parity_check"]
    assert list(parity["accuracy"][parity["split"] == "test"]) == pytest.approx([0.5] * 3)
    assert export_frame(store, metric="scaled").set_index("task").at[
        "modular_arithmetic", "score"] == pytest.approx(0.5)
    _, plotted = plot_data(store, metric="scaled")
    assert plotted[plotted["task"] == "parity_check"]["accuracy"].tolist() == pytest.approx(
        [0.5] * 3 + [(0.9 - 0.5) / 0.5] * 5)
    assert plot_accuracy(store, tmp_path / "p.png", metric="scaled").stat().st_size > 0


def test_the_packaged_table_is_the_reference_copy_with_the_spec_s_numbers():
    packaged = REPOSITORY / "che_bench" / "data" / "grazzi_iclr2025_table3.csv"
    assert packaged.read_bytes() == (REPOSITORY / grazzi.TABLE_FILE).read_bytes()
    table = grazzi.load_table()
    assert grazzi.published_value(table, "modular_arithmetic", "deltanet", True) == 97.1
    assert grazzi.published_value(table, "parity_check", "mamba", False) == 0.0
    assert grazzi.published_value(table, "modular_arithmetic_brackets", "slstm", False) == 17.8
    assert grazzi.published_value(table, "even_pairs", "deltanet", True) != 0  # NaN: no column
    assert table.set_index("model").at["sLSTM", "quoted_modular_arithmetic"] == 1.00
    assert "0.971" in packaged.read_text() and "1.000" in packaged.read_text()


def test_the_published_value_beside_each_cell_compared_where_the_protocol_was_followed(
    tmp_path, capsys
):
    store = ResultStore(tmp_path / "s.sqlite")
    record(store, "parity_check", 1.0, negative=True)
    record(store, "parity_check", 0.5, negative=False, preset="quick")
    record(store, "modular_arithmetic", 0.5, negative=True, steps=100)
    record(store, "parity_check", 0.51, arch="transformer")
    record(store, "parity_check", 0.9, arch="lstm")
    cells = summarize(store, metric="scaled", compare="grazzi")
    cells = cells.set_index(["task", "column"])
    followed = cells.loc[("parity_check", "DeltaNet · negative_eigenvalues=true [steps=20000]")]
    assert (followed["paper"], followed["comparable"], followed["diff"]) == (100.0, True, 0.0)
    quick = cells.loc[("parity_check", "DeltaNet")]
    assert quick["paper"] == pytest.approx(1.7) and not quick["comparable"]
    assert quick["differences"][:3] == ("preset quick", "1500 steps", "batch 32")
    shorter = cells.loc[("modular_arithmetic", "DeltaNet · negative_eigenvalues=true [steps=100]")]
    assert shorter["paper"] == pytest.approx(97.1) and shorter["differences"] == ("100 steps",)
    assert cells.filter(like="LSTM", axis=0)["paper"].isna().all()
    transformer = cells.filter(like="Transformer", axis=0)
    assert transformer["paper"].tolist() == [pytest.approx(2.2)]
    text = format_table(store, metric="scaled", compare="grazzi")
    assert "100.00 (+0.00)" in text and "not comparable: preset quick" in text
    assert "arXiv 2411.12537" in text and "no published row for: lstm" in text
    assert main(["table", "--store", str(store.path), "--compare", "grazzi"]) == 2
    assert "needs --metric scaled" in capsys.readouterr().err
    with pytest.raises(CheBenchError, match="valid: none, paper, grazzi"):
        summarize(store, compare="other")


def test_runs_laid_out_as_the_harness_go_beside_the_published_column(tmp_path):
    """``--task-param layout=harness`` is the harness's own read-out of the same problem
    (docs/protocol.md): its cells were left without a published value, and without a note."""
    store = ResultStore(tmp_path / "s.sqlite")
    record(store, "parity_check", 1.0, negative=True, task_params={"layout": "harness"})
    record(store, "modular_arithmetic", 0.6, negative=True, task_params={"layout": "harness"})
    record(store, "modular_arithmetic", 0.6, negative=True, task_params={"modulus": 7})
    cells = summarize(store, metric="scaled", compare="grazzi").set_index("task")
    parity = cells.loc["parity_check(layout=harness)"]
    assert (parity["paper"], parity["comparable"], parity["diff"]) == (100.0, True, 0.0)
    assert cells.loc["modular_arithmetic(layout=harness)", "paper"] == pytest.approx(97.1)
    assert math.isnan(cells.loc["modular_arithmetic(modulus=7)", "paper"])  # another problem
    assert "100.00 (+0.00)" in format_table(store, metric="scaled", compare="grazzi")


@pytest.mark.parametrize(
    "task, arch, settings, differences",
    [
        ("parity_check", "deltanet", {"weight_decay": 0.0}, ()),
        ("parity_check", "mamba", {"weight_decay": 0.0}, ()),
        ("parity_check", "mlstm", {"warmup_steps": 0}, ()),
        ("parity_check", "slstm", {"warmup_steps": 0}, ("0 warm-up steps",)),
        ("parity_check", "lstm", {"weight_decay": 0.0}, ("weight decay 0.0",)),
        ("modular_arithmetic", "deltanet", {"steps": 100_000, "warmup_steps": 10_000}, ()),
        ("modular_arithmetic_brackets", "mlstm", {"steps": 100_000, "warmup_steps": 10_000}, ()),
        ("modular_arithmetic", "mamba", {"steps": 100_000}, ("100000 steps",)),
        ("modular_arithmetic", "deltanet", {"weight_decay": 0.0}, ("weight decay 0.0",)),
    ],
)
def test_runs_that_follow_grazzi_et_al_s_own_file_for_their_task_and_model_are_compared(
    task, arch, settings, differences
):
    """Their parity files decay no weights for Mamba and DeltaNet and warm mLSTM up for 0
    steps; their modular arithmetic files train 100,000 steps after 10,000 of warm-up
    (docs/protocol.md): the documented flags beside the preset follow them; a mix of the
    two protocols, or one model's file on another, does not."""
    config = make_config(task, preset="state_tracking", arch=arch, **settings)
    assert config.run_id() != make_config(task, preset="state_tracking", arch=arch).run_id()
    stored = run_settings(json.dumps(config.to_dict()), None)
    assert tuple(grazzi.protocol_differences(stored)) == differences


def test_the_preset_s_lengths_are_the_harness_s_translated():
    """n = L - 1: parity's bits are the harness's, modular arithmetic's expressions (CHE
    drops a token from an even n) the harness's up to its 2-token shift (docs/protocol.md)."""
    config = make_config("parity_check", preset="state_tracking")
    assert (config.train_max_length, min(config.test_lengths), max(config.test_lengths)) == (
        39, 39, 255)
    task = make_config("modular_arithmetic", preset="state_tracking").build_task()
    assert {task.input_length(n) for n in parse_lengths("39:255")} == set(range(39, 256, 2))


@pytest.mark.parametrize("preset, differences", [
    ("state_tracking_harness", ()), ("quick", ("preset quick", "1500 steps", "batch 32"))])
def test_a_run_of_the_harness_preset_follows_grazzi_et_al_s_protocol(preset, differences):
    config = make_config("modular_arithmetic", preset=preset, arch="deltanet",
                         steps=100_000 if preset != "quick" else None, warmup_steps=10_000)
    stored = run_settings(json.dumps(config.to_dict()), None)
    assert tuple(grazzi.protocol_differences(stored))[:3] == differences
    assert grazzi.published_task(stored) == "modular_arithmetic"
