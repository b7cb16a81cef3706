"""Plugins: encodings and tasks from outside che-bench, loaded by entry point, --plugin or
CHE_BENCH_PLUGINS, and handled by run, table, export and report like built-ins."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from importlib import metadata, resources
from pathlib import Path

import pytest

from che_bench import plugins
from che_bench.cli import main
from che_bench.config import make_config
from che_bench.encodings import canonical_encoding_name, list_encodings
from che_bench.encodings.base import ENCODINGS
from che_bench.errors import CheBenchError
from che_bench.model.architectures import ARCHITECTURES
from che_bench.store import ResultStore
from che_bench.tasks import TASKS, get_task, list_tasks

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE = EXAMPLES / "che-bench-loglength"

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
    assert "majority,transformer,log_length_nope,,log_length_nope," in capsys.readouterr().out
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
    assert capsys.readouterr().err == (
        "che-bench: error: plugin no_such_plugin_module failed to import: no module "
        "'no_such_plugin_module' in the current folder or on the Python path (a plugin must be "
        "importable: install it, or add its folder to PYTHONPATH)\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["tasks", "--plugin"])
    assert exit_info.value.code == 2


def test_a_missing_plugin_named_with_the_flag_is_not_said_to_be_in_the_variable(monkeypatch, capsys):
    """A fresh process (plugins not yet configured): the error of a ``--plugin`` module named
    CHE_BENCH_PLUGINS, which the user never set, before the fix."""
    monkeypatch.setattr(plugins, "_configured", False)
    monkeypatch.setattr(metadata, "entry_points", lambda group: [])
    assert main(["--plugin", "no_such_plugin_module", "tasks"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("che-bench: error: plugin no_such_plugin_module failed to import")
    assert plugins.ENVIRONMENT_VARIABLE not in err
    # A module the variable does name is still said to be named there.
    monkeypatch.setattr(plugins, "_configured", False)
    monkeypatch.setenv(plugins.ENVIRONMENT_VARIABLE, "no_such_plugin_module_either")
    assert main(["tasks"]) == 2
    assert f"it is named in {plugins.ENVIRONMENT_VARIABLE}" in capsys.readouterr().err


def test_unknown_names_suggest_close_ones():
    with pytest.raises(CheBenchError, match="did you mean 'kerple'"):
        canonical_encoding_name("kerpel")
    with pytest.raises(CheBenchError, match="did you mean 'reverse_string'.*--plugin MODULE"):
        get_task("revers_string")


def test_the_package_marks_itself_typed_for_plugin_type_checkers():
    # PEP 561: without this marker, mypy and pyright ignore che-bench's annotations.
    assert (resources.files("che_bench") / "py.typed").is_file()


def broken_installed_plugin(tmp_path, monkeypatch) -> None:
    """An installed plugin (entry point) that raises on import, not yet scanned for."""
    write_module(tmp_path, "plugin_broken", "raise RuntimeError('needs a GPU')")
    monkeypatch.syspath_prepend(str(tmp_path))
    point = metadata.EntryPoint("broken", "plugin_broken", plugins.ENTRY_POINT_GROUP)
    monkeypatch.setattr(metadata, "entry_points",
                        lambda group: [point] if group == plugins.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(plugins, "_configured", False)


def test_a_broken_installed_plugin_names_the_switch_that_skips_it(tmp_path, monkeypatch, capsys):
    broken_installed_plugin(tmp_path, monkeypatch)
    assert main(["tasks"]) == 2
    assert capsys.readouterr().err == (
        "che-bench: error: plugin plugin_broken failed to import: RuntimeError: needs a GPU "
        "(--no-plugins or CHE_BENCH_NO_PLUGINS=1 starts che-bench without plugins)\n")
    broken_installed_plugin(tmp_path, monkeypatch)
    monkeypatch.setattr(plugins, "_loaded_modules", set())
    assert main(["tasks", "--no-plugins"]) == 0
    assert "parity_check" in capsys.readouterr().out
    # Child processes (a sweep's workers) inherit the switch.
    assert plugins.disabled() and os.environ[plugins.DISABLE_VARIABLE] == "1"
    with pytest.raises(CheBenchError, match="plugins are switched off: --no-plugins"):
        get_task("majority")


def test_the_environment_switch_skips_installed_plugins(tmp_path, monkeypatch, capsys):
    broken_installed_plugin(tmp_path, monkeypatch)
    monkeypatch.setenv(plugins.DISABLE_VARIABLE, "1")
    assert main(["encodings"]) == 0
    assert main(["--no-plugins", "--plugin", "plugin_broken", "tasks"]) == 2
    assert "contradict each other" in capsys.readouterr().err


def test_a_plugin_in_the_current_folder_loads_as_with_python_m(tmp_path, monkeypatch, capsys):
    write_module(tmp_path, "plugin_here", """
        from che_bench.tasks import TASKS
        TASKS_SEEN = len(TASKS.names())
    """)
    monkeypatch.chdir(tmp_path)
    # As the che-bench script runs: its own folder first, the current folder not searched.
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", ".")])
    assert main(["--plugin", "plugin_here", "tasks"]) == 0
    assert "plugin_here" in plugins.loaded()


def forget_example_plugin() -> None:
    """As if the example plugin were not installed: its names unregistered again."""
    for registry, name in ((TASKS, "majority"), (ENCODINGS, "log_length_nope"),
                           (ARCHITECTURES, "gru")):
        aliases = [alias for alias, target in registry._aliases.items() if target == name]
        for key in aliases:
            del registry._aliases[key]
        del registry._entries[name], registry._origins[name]


def test_a_store_of_plugin_runs_is_readable_without_the_plugin(example_on_path, tmp_path, capsys):
    store = ["--store", str(tmp_path / "s.sqlite")]
    assert main(["--plugin", "che_bench_loglength", "run", "--task", "majority", "--pe",
                 "loglength", "--preset", "smoke", "--test-lengths", "41", "--no-progress",
                 *store]) == 0
    # ... and one still training, with no versions recorded yet
    ResultStore(store[1]).mark_started(make_config("majority", "loglength", None, "smoke", seed=1))
    forget_example_plugin()
    capsys.readouterr()
    assert main(["table", "--task", "majority", *store]) == 0
    table = capsys.readouterr().out
    [row] = [line.split() for line in table.splitlines() if " majority " in line]
    assert row[:3] == ["?", "majority", "?"]  # level and chance unknown, the score shown
    note = ("not registered here (plugin che_bench_loglength not loaded): task majority, "
            "encoding log_length_nope; shown as the store recorded them; level ? and chance "
            "unknown (the task class is needed)")
    assert note in " ".join(table.split())  # (the note wraps to the terminal)
    assert main(["report", *store, "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert note in page and "<img" in page  # the table, its note and the task's panel


def test_runs_of_a_plugin_model_record_and_name_its_plugin(example_on_path, tmp_path, capsys):
    store = ["--store", str(tmp_path / "s.sqlite")]
    assert main(["--plugin", "che_bench_loglength", "run", "--task", "parity_check", "--arch",
                 "gru", "--arch-option", "hidden_size=4", "--preset", "smoke", "--steps", "2",
                 "--test-lengths", "41", "--no-progress", *store]) == 0
    [versions] = [json.loads(text) for text in ResultStore(store[1]).runs()["versions"]]
    assert versions["plugin che_bench_loglength"] == "0.1.0"  # the model's plugin
    forget_example_plugin()
    capsys.readouterr()
    assert main(["table", *store]) == 0
    table = " ".join(capsys.readouterr().out.split())  # (notes are wrapped to the terminal)
    assert ("not registered here (plugin che_bench_loglength not loaded): architecture gru; "
            "shown as the store recorded them") in table


def test_options_a_plugin_refuses_with_a_value_error_are_one_line_errors(tmp_path, monkeypatch, capsys):
    write_module(tmp_path, "plugin_picky", """
        from che_bench.encodings import PositionalEncoding, register
        from che_bench.tasks import Task, register_task

        @register
        class Picky(PositionalEncoding):
            name, kind, description = "test_picky", "none", "takes scale 1 only"

            def __init__(self, *, dim, heads, layers, train_max_tokens, members=1, scale=1):
                super().__init__(dim=dim, heads=heads, layers=layers,
                                 train_max_tokens=train_max_tokens, members=members)
                if scale != 1:
                    raise ValueError(f"scale must be 1, got {scale!r}\\nmore detail")

        @register_task
        class PickyTask(Task):
            name, level, output_length_formula = "test_picky_task", "regular", "1"

            def __init__(self, size=2):
                if size != 2:
                    raise ValueError(f"size must be 2, got {size!r}")

            output_length = _sample = _solve = None  # never sampled here
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check-encoding", "test_picky", "--pe-option", "scale=2.5",
                 "--plugin", "plugin_picky"]) == 2
    assert capsys.readouterr().err == (
        "che-bench: error: positional encoding 'test_picky': scale must be 1, got 2.5\n")
    assert main(["check-task", "test_picky_task", "--param", "size=3"]) == 2
    assert capsys.readouterr().err == "che-bench: error: task 'test_picky_task': size must be 2, got 3\n"


def test_an_encoding_passing_its_shape_on_and_one_naming_it_take_the_same_options():
    """The two constructor forms of docs/plugins.md: the model's shape passed on as ``**shape``
    (only the encoding's own keywords are its options) and the five keywords named."""
    from che_bench.encodings import PositionalEncoding, build_encoding, register

    class PassedOn(PositionalEncoding):
        name, kind, description = "test_passed_on", "none", "shape passed on"

        def __init__(self, *, scale=1.0, **shape):
            super().__init__(**shape)
            self.resolved_options = {"scale": scale}

    class Named(PositionalEncoding):
        name, kind, description = "test_named", "none", "shape named"

        def __init__(self, *, dim, heads, layers, train_max_tokens, members=1, scale=1.0):
            super().__init__(dim=dim, heads=heads, layers=layers,
                             train_max_tokens=train_max_tokens, members=members)
            self.resolved_options = {"scale": scale}

    shape = {"dim": 8, "heads": 2, "layers": 3, "train_max_tokens": 20}
    for cls in (PassedOn, Named):
        register(cls)
        assert cls.option_names() == ["scale"]
        encoding = build_encoding(cls.name, **shape, members=2, scale=2.0)
        assert (encoding.dim, encoding.heads, encoding.head_dim, encoding.layers,
                encoding.train_max_tokens, encoding.members) == (8, 2, 4, 3, 20, 2)
        assert encoding.options() == {"scale": 2.0} and len(encoding.layer_hooks()) == 3
        with pytest.raises(CheBenchError, match=r"take option\(s\) shape; its options: scale"):
            build_encoding(cls.name, **shape, shape=1)


def test_the_documented_one_module_plugin_passes_every_check(monkeypatch, capsys):
    monkeypatch.chdir(EXAMPLES)  # "from this folder", as its docstring says
    assert main(["--plugin", "my_plugin", "check-encoding", "my_pe", "--pe-option", "power=0.5"]) == 0
    assert main(["check-task", "every_other", "--param", "vocab_size=3"]) == 0
    out = capsys.readouterr().out
    assert "encoding my_pe: all 13 checks passed" in out and "task every_other: all 5 checks passed" in out
    assert main(["check-encoding", "my_alias", "--pe-option", "power=true"]) == 2
    assert capsys.readouterr().err == (
        "che-bench: error: encoding 'my_pe': power must be in (0, 2], got True\n")
    assert get_task("every_other").output_length(5) == 3


def test_the_example_gru_is_checked_causal_and_on_the_meta_device(example_on_path, monkeypatch):
    """The example plugin declares its GRU causal: check-model checks it on an in-place task;
    the same model reading the next input fails."""
    from che_bench.checks import model_checks

    plugins.add_modules(["che_bench_loglength"])
    gru = ARCHITECTURES.get("gru").build
    assert gru.causal_outputs
    for check in ("causal", "device"):
        assert model_checks.run_model_check(check, "gru", {"hidden_size": 4}) == []
    member_inputs = gru.member_inputs
    monkeypatch.setattr(gru, "member_inputs", lambda self, inputs: member_inputs(
        self, inputs.roll(-1, dims=-1)))  # position t reads token t + 1
    [failure, _] = model_checks.run_model_check("causal", "gru", {"hidden_size": 4})
    assert failure.startswith("causal outputs (the model declares causal_outputs, mqar n=24): "
                              "expected the logits up to position 9 unchanged with tokens after "
                              "it changed, got others from position 9")


def test_the_documented_content_plugins_pass_every_check(monkeypatch, capsys):
    """One encoding of each kind beyond a data-independent bias (docs/plugins.md): a bias per
    sequence read from x, its own scores of (q, k, x), its own normalisation; bidirectional
    and causal."""
    monkeypatch.chdir(EXAMPLES)
    for pe in ("gated_distance", "query_temperature", "sigmoid_attention"):
        for causal in ([], ["--causal"]):
            code = main(["--plugin", "content_plugin", "check-encoding", pe, *causal])
            out = capsys.readouterr().out
            passed = f"all {14 if causal else 13} checks passed"
            assert code == 0 and passed in out, out
