"""Plugins: encodings and tasks from outside che-bench, loaded by entry point, --plugin or
CHE_BENCH_PLUGINS, and handled by run, table, export and report like built-ins."""

from __future__ import annotations

import json
import textwrap
from importlib import metadata, resources
from pathlib import Path

import pytest

from che_bench import plugins
from che_bench.cli import main
from che_bench.encodings import canonical_encoding_name, list_encodings
from che_bench.encodings.base import ENCODINGS
from che_bench.errors import CheBenchError
from che_bench.store import ResultStore
from che_bench.tasks import TASKS, get_task, list_tasks

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "che-bench-loglength"

pytestmark = pytest.mark.usefixtures("scratch_registries")


@pytest.fixture
def example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))


def write_module(directory: Path, name: str, source: str) -> None:
    (directory / f"{name}.py").write_text(textwrap.dedent(source))


def test_a_plugin_named_on_the_command_line_runs_like_a_built_in(example_on_path, tmp_path, capsys):
    store = tmp_path / "s.sqlite"
    common = ["--store", str(store)]
    run = ["run", "--task", "majority", "--pe", "loglength", "--preset", "smoke",
           "--test-lengths", "41,60", "--no-progress", *common]
    assert main(["--plugin", "che_bench_loglength", *run]) == 0  # before the command
    assert "majority" in list_tasks() and canonical_encoding_name("log_n_scaled") == "log_length_nope"
    assert TASKS.origin("majority") == ENCODINGS.origin("log_length_nope") == "che_bench_loglength"
    [versions] = [json.loads(text) for text in ResultStore(store).runs()["versions"]]
    assert versions["plugin che_bench_loglength"] == "0.1.0"
    capsys.readouterr()
    assert main(["table", *common, "--plugin", "che_bench_loglength"]) == 0  # after it
    table = capsys.readouterr().out
    assert "majority" in table and "log_length_nope" in table
    assert main(["export", "--format", "csv", *common]) == 0
    assert "majority,log_length_nope,,log_length_nope," in capsys.readouterr().out
    assert main(["report", *common, "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "plugin che_bench_loglength 0.1.0" in page
    assert "che-bench run --task majority --pe log_length_nope --preset smoke" in page


def test_plugins_named_in_the_environment_load_before_the_first_look_up(example_on_path, monkeypatch):
    monkeypatch.setattr(plugins, "_configured", False)
    monkeypatch.setattr(metadata, "entry_points", lambda group: [])
    monkeypatch.setenv(plugins.ENVIRONMENT_VARIABLE, " che_bench_loglength ,")
    assert get_task("majority_vote").name == "majority"
    assert plugins.loaded() == {"che_bench_loglength": "0.1.0"}


def test_entry_points_of_the_group_are_loaded(tmp_path, monkeypatch):
    write_module(tmp_path, "plugin_entry", """
        from che_bench.encodings import PositionalEncoding, register

        @register
        class Entry(PositionalEncoding):
            name = "test_entry"
            description = "registered through an entry point"
            kind = "none"
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    point = metadata.EntryPoint("entry", "plugin_entry", plugins.ENTRY_POINT_GROUP)
    monkeypatch.setattr(metadata, "entry_points",
                        lambda group: [point] if group == plugins.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(plugins, "_configured", False)
    assert "test_entry" in [cls.name for cls in list_encodings()]


@pytest.mark.parametrize("source, message", [
    ("raise RuntimeError('needs a GPU\\nand more')",
     "plugin plugin_bad failed to import: RuntimeError: needs a GPU"),
    ("""
     from che_bench.encodings import PositionalEncoding, register

     @register
     class Again(PositionalEncoding):
         name = "ALiBi"
         description = "a second alibi"
         kind = "relative"
     """, "plugin plugin_bad: positional encoding name 'alibi' is already registered by che-bench"),
    ("""
     from che_bench.tasks import Task, register_task

     @register_task("parity")
     class Parity(Task):
         name = "my_parity"
         level = "regular"
     """, "plugin plugin_bad: task class Parity does not set output_length_formula"),
])
def test_a_broken_plugin_is_a_one_line_error_naming_it(tmp_path, monkeypatch, capsys, source, message):
    write_module(tmp_path, "plugin_bad", source)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["tasks", "--plugin", "plugin_bad"]) == 2
    err = capsys.readouterr().err
    assert err == f"che-bench: error: {message}\n"


def test_a_missing_plugin_and_a_missing_module_argument(capsys):
    assert main(["--plugin=no_such_plugin_module", "tasks"]) == 2
    assert "plugin no_such_plugin_module failed to import: ModuleNotFoundError" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["tasks", "--plugin"])
    assert exit_info.value.code == 2


def test_unknown_names_suggest_close_ones():
    with pytest.raises(CheBenchError, match="did you mean 'kerple'"):
        canonical_encoding_name("kerpel")
    with pytest.raises(CheBenchError, match="did you mean 'reverse_string'.*--plugin MODULE"):
        get_task("revers_string")


def test_the_package_marks_itself_typed_for_plugin_type_checkers():
    # PEP 561: without this marker, mypy and pyright ignore che-bench's annotations.
    assert (resources.files("che_bench") / "py.typed").is_file()
