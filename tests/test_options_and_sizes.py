"""Issue 44, item 5: a run's encoding options and its model's parameter count are visible in
the run header, `runs`, `export` and the report's "What ran"; `encodings` says where each
encoding comes from; `evaluate` without a run's plugin names the plugin it recorded."""

from __future__ import annotations

import csv
import io
import json

import pytest
from test_provenance import flat, install, plugin_folder  # noqa: F401 (a fixture)

from che_bench.cli import main
from che_bench.encodings.base import ENCODINGS
from che_bench.model.check import parameter_count
from che_bench.store import ResultStore

pytestmark = pytest.mark.usefixtures("scratch_registries")

SMOKE = ["--preset", "smoke", "--steps", "2", "--test-lengths", "41", "--eval-samples", "8",
         "--no-progress"]


def test_encodings_lists_where_each_encoding_comes_from(plugin_folder, capsys):  # noqa: F811
    install(plugin_folder, "0.1.0")
    assert main(["--plugin", "plugin_plain", "encodings"]) == 0
    rows = {line.split()[0]: line.split()[1:3] for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] in (["test_plain"], ["kerple"])}
    assert rows == {"test_plain": ["plugin", "plugin_plain"], "kerple": ["che-bench", "relative"]}
    assert ENCODINGS.source("test_plain") == "plugin plugin_plain"


def test_options_and_parameters_are_shown_wherever_a_run_is_named(
        plugin_folder, tmp_path, capsys):  # noqa: F811
    source = install(plugin_folder, "0.1.0")
    store = tmp_path / "s.sqlite"
    assert main(["--plugin", "plugin_plain", "run", "--task", "parity_check", "--pe",
                 "test_plain", "--pe-option", "gate_bias_init=-2", *SMOKE,
                 "--store", str(store)]) == 0
    assert main(["run", "--task", "parity_check", "--arch", "lstm", "--arch-option",
                 "hidden_size=4", *SMOKE, "--store", str(store)]) == 0
    header = flat(capsys.readouterr().err)
    reader = ResultStore(store, read_only=True)
    runs = reader.runs().set_index("pe")
    details = reader.run_details(runs["run_id"])
    plain_id = runs.at["test_plain", "run_id"]
    [lstm_id] = [run_id for run_id in runs["run_id"] if run_id != plain_id]
    plain = details[plain_id]["model"]["parameters"]
    lstm = details[lstm_id]["model"]["parameters"]
    config = json.loads(runs.at["test_plain", "config"])
    assert plain == parameter_count("parity_check", {}, "transformer",
                                    _model_arguments(config)) and plain != lstm
    assert (f"run {plain_id}: parity_check / test_plain · gate_bias_init=-2, preset smoke, 2 "
            f"steps, lr 0.001, seed 0, evaluated at ") in header
    assert f"in-distribution 1..40 (5 lengths), {plain:,} parameters" in header
    assert f"run {lstm_id}: parity_check / LSTM · hidden_size=4, preset smoke" in header
    assert f"(5 lengths), {lstm:,} parameters" in header

    assert main(["runs", "--store", str(store)]) == 0
    listing = capsys.readouterr().out
    assert "test_plain · gate_bias_init=-2" in flat(listing)
    # (the first of each run's rows: the table may continue in column groups)
    [plain_row, *_] = [line for line in listing.splitlines() if line.startswith(plain_id)]
    [lstm_row, *_] = [line for line in listing.splitlines() if line.startswith(lstm_id)]
    assert f" {plain:,} " in plain_row and f" {lstm:,} " in lstm_row

    assert main(["export", "--format", "csv", "--store", str(store)]) == 0
    exported = {row["run_id"]: row for row in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    assert exported[plain_id]["encoding_options"] == "gate_bias_init=-2"
    assert (exported[plain_id]["parameters"], exported[lstm_id]["parameters"]) == (
        str(plain), str(lstm))
    provenance = f"plugin_plain 0.1.0 (source {source[:12]})"
    assert (exported[plain_id]["plugins"], exported[lstm_id]["plugins"]) == (provenance, "")

    page_path = tmp_path / "r.html"
    assert main(["report", "--store", str(store), "--out", str(page_path)]) == 0
    page = page_path.read_text()
    assert f"test_plain · gate_bias_init=-2: {plain:,} parameters (1)" in page
    assert f"LSTM · hidden_size=4: {lstm:,} parameters (1)" in page
    [plugins_item] = [line for line in page.split("<li>") if "plugins (version, source" in line]
    assert f"{provenance} (1)" in plugins_item and "no plugin (1)" in plugins_item


def _model_arguments(config: dict) -> dict:
    from che_bench.config import RunConfig

    return RunConfig.from_dict(config).model_arguments()


def test_evaluate_without_the_plugin_names_the_recorded_plugin(
        plugin_folder, tmp_path, capsys):  # noqa: F811
    source = install(plugin_folder, "0.1.0")
    store = tmp_path / "s.sqlite"
    assert main(["--plugin", "plugin_plain", "run", "--task", "parity_check", "--pe",
                 "test_plain", *SMOKE, "--store", str(store)]) == 0
    [run_id] = ResultStore(store).runs()["run_id"]
    del ENCODINGS._entries["test_plain"], ENCODINGS._origins["test_plain"]  # not installed now
    capsys.readouterr()
    before = store.read_bytes()
    assert main(["evaluate", run_id, "--test-lengths", "41,42", "--store", str(store)]) == 2
    assert capsys.readouterr().err == (
        f"che-bench: error: run {run_id} was made with plugin plugin_plain 0.1.0 (source "
        f"{source[:12]}), which is not loaded here: encoding test_plain unknown (a plugin's "
        "names need the plugin installed, or --plugin MODULE)\n")
    assert store.read_bytes() == before


def test_a_sweeps_lines_name_the_encoding_options():
    from che_bench.config import make_config
    from che_bench.run.sweep_views import describe_run

    config = make_config("parity_check", "alibi", 3, "smoke",
                         pe_options={"alibi_mode": "two_slopes"})
    assert describe_run(config) == "parity_check alibi(alibi_mode=two_slopes) k3 lr=0.001 seed=0"
    assert describe_run(make_config("parity_check", "alibi", None, "smoke")) == (
        "parity_check alibi - lr=0.001 seed=0")
