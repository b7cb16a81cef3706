"""Issue 26, items 6 and 9: what a run is called everywhere. A model's options that differ from
its defaults are in its label (table columns, run headers, sweep lines, ``runs``); the sweep
gives scores in percent as ``run`` does; exports leave ``pe`` blank for an architecture
without an encoding; the note on the CHE paper's table names CHE's baselines only; and
``models`` credits a plugin with its own models only.

The stored runs are SYNTHETIC (made-up scores)."""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
from rich.console import Console
from test_store import synthetic_result

from che_bench.commands.run import RunView
from che_bench.config import make_config
from che_bench.reports.export import export_frame
from che_bench.reports.labels import run_encoding_label
from che_bench.reports.tables import format_table, summarize
from che_bench.run.sweep_views import GridView, describe_run
from che_bench.store import ResultStore

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "che-bench-loglength"


def lstm(hidden_size: int | None = None, **changes):
    options = {} if hidden_size is None else {"hidden_size": hidden_size}
    return synthetic_result("parity_check", None, None, arch="lstm", arch_options=options,
                            **changes)


def unloaded_plugin_run(options: dict, score: float):
    """A run of a model whose plugin is not loaded here (an LSTM's config, renamed)."""
    result = lstm(score=score)
    config = dataclasses.replace(result.config, arch="my_ssm", arch_options=options)
    return dataclasses.replace(result, config=config, run_id=config.run_id())


def test_a_models_label_names_the_options_that_differ_from_its_defaults():
    assert run_encoding_label({"arch": "lstm"}) == "LSTM"
    assert run_encoding_label({"arch": "lstm", "arch_options": {"hidden_size": 256}}) == "LSTM"
    assert run_encoding_label({"arch": "lstm", "arch_options": {"hidden_size": 8}}) \
        == "LSTM · hidden_size=8"
    # a model whose plugin is not loaded: every recorded option (its defaults are unknown)
    assert run_encoding_label({"arch": "my_ssm", "arch_options": {"neg_eigen": True}}) \
        == "my_ssm · neg_eigen=true"


def test_table_columns_read_the_options_not_a_settings_dump(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    for result in (lstm(), lstm(256, seed=1), lstm(8), unloaded_plugin_run({}, 0.5),
                   unloaded_plugin_run({"neg_eigen": True}, 0.6)):
        store.record(result)
    columns = set(summarize(store)["column"])
    assert columns == {"LSTM", "LSTM · hidden_size=8", "my_ssm", "my_ssm · neg_eigen=true"}
    text = format_table(store, compare="paper")
    assert "arch_options" not in text and "None" not in text
    # the note on the CHE paper's unreadable table is about CHE's baselines only
    [note] = [line for line in text.split("\n\n")[-1].split("\n") if "2207.02098" in line]
    assert note.startswith("LSTM: no published reference")
    store = ResultStore(tmp_path / "plugin_only.sqlite")
    store.record(unloaded_plugin_run({"neg_eigen": True}, 0.6))
    assert "2207.02098" not in format_table(store, compare="paper")


def test_run_header_sweep_lines_and_dry_run_show_the_options(tmp_path, capsys):
    config = make_config("parity_check", preset="smoke", arch="lstm",
                         arch_options={"hidden_size": 8})
    RunView(tmp_path / "s.sqlite", config).start([], [config])
    assert "parity_check / LSTM · hidden_size=8" in capsys.readouterr().err
    assert describe_run(config) == "parity_check lstm(hidden_size=8) lr=0.001 seed=0"
    default = make_config("parity_check", preset="smoke", arch="lstm",
                          arch_options={"hidden_size": 256})
    assert describe_run(default) == "parity_check lstm lr=0.001 seed=0"


def test_the_sweep_gives_scores_in_percent_as_run_does():
    output = io.StringIO()
    view = GridView(Console(file=output, width=200), live=False)
    result = lstm(8, score=0.51239)
    view.start([], [result.config])
    view.finished(result, running=0, left=0)
    assert "score 51.24%" in output.getvalue()


def test_exports_leave_pe_blank_for_a_model_without_an_encoding(tmp_path):
    store = ResultStore(tmp_path / "s.sqlite")
    store.record(lstm(8))
    store.record(synthetic_result("parity_check", "none", None))  # NoPE: a transformer's pe
    runs = export_frame(store).set_index("architecture")
    assert pd.isna(runs.loc["lstm", "pe"]) and runs.loc["transformer", "pe"] == "none"
    per_length = export_frame(store, per_length=True)
    assert per_length[per_length["architecture"] == "lstm"]["pe"].isna().all()
    assert (per_length[per_length["architecture"] == "transformer"]["pe"] == "none").all()


def test_models_credits_a_plugin_with_its_own_models_only():
    """A plugin that imports che_bench.model first ran the built-ins' registration during its
    own import, and every built-in was credited to it."""
    environment = dict(os.environ, CHE_BENCH_PLUGINS="che_bench_loglength", COLUMNS="200",
                       PYTHONPATH=os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")]))
    environment.pop("CHE_BENCH_NO_PLUGINS", None)
    script = "from che_bench.cli import main; raise SystemExit(main(['models']))"
    listing = subprocess.run([sys.executable, "-c", script], env=environment,
                             capture_output=True, text=True, check=True).stdout
    origins = {line.split()[0]: line for line in listing.splitlines()
               if line.split() and line.split()[0] in ("transformer", "lstm", "gru")}
    assert "plugin che_bench_loglength" in origins["gru"]
    assert "che-bench" in origins["transformer"] and "plugin" not in origins["transformer"]
    assert "plugin" not in origins["lstm"]


def test_a_name_defined_in_che_bench_is_che_benchs_whichever_import_registers_it(monkeypatch):
    from che_bench import plugins
    from che_bench.registry import Registry

    own, theirs = type("Own", (), {}), type("Theirs", (), {})
    own.__module__, theirs.__module__ = "che_bench.model.mine", "my_plugin.models"
    registry = Registry("thing")
    monkeypatch.setattr(plugins, "_loading", ["my_plugin"])  # while a plugin imports
    registry.add("own", own)
    registry.add("theirs", theirs)
    registry.add("built", object(), module="che_bench.model.architectures")
    assert registry._origins == {"own": None, "theirs": "my_plugin", "built": None}
