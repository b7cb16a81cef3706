"""Plugin provenance: each run records the version and source hash of the plugins behind its
task, encoding and model; a run whose plugin changed since is named by `run` / `sweep`, kept,
and rerun with --rerun-stale; readers never write; old stores upgrade."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import sys
import textwrap
from pathlib import Path

import pytest

from che_bench import plugins
from che_bench.cli import main
from che_bench.encodings.base import ENCODINGS
from che_bench.store import ResultStore
from che_bench.store.schema import SCHEMA_VERSION, _migrate_2_to_3

pytestmark = pytest.mark.usefixtures("scratch_registries")

V2_STORE = Path(__file__).parent / "data" / "store_v2.sqlite"
PLUGIN = """
    from che_bench.encodings import PositionalEncoding, register

    __version__ = "{version}"

    @register
    class Plain(PositionalEncoding):
        name = "test_plain"
        description = "no positions ({comment})"
        kind = "none"

        def __init__(self, *, dim, heads, layers, train_max_tokens, members=1, gate_bias_init=0.0):
            super().__init__(dim=dim, heads=heads, layers=layers,
                             train_max_tokens=train_max_tokens, members=members)
            self.gate_bias_init = gate_bias_init
"""
RUN = ["run", "--task", "parity_check", "--pe", "test_plain", "--preset", "smoke", "--steps", "2",
       "--test-lengths", "41", "--eval-samples", "8", "--no-progress"]


@pytest.fixture
def plugin_folder(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "plugins"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # (a rewrite within a second)
    return folder


def install(folder: Path, version: str, comment: str = "first") -> str:
    """(Re)write plugin_plain as if reinstalled: a fresh process would import it anew. Returns
    the SHA-256 of its source."""
    source = textwrap.dedent(PLUGIN.format(version=version, comment=comment))
    (folder / "plugin_plain.py").write_text(source)
    for registry_key in [key for key in ENCODINGS._entries if key == "test_plain"]:
        del ENCODINGS._entries[registry_key], ENCODINGS._origins[registry_key]
    sys.modules.pop("plugin_plain", None)
    plugins._loaded_modules.discard("plugin_plain")
    return hashlib.sha256(b"plugin_plain.py\0" + source.encode() + b"\0").hexdigest()


def flat(text: str) -> str:
    """Wrapped output as one line."""
    return " ".join(text.split())


def run(store: Path, *extra: str) -> int:
    return main(["--plugin", "plugin_plain", *RUN, "--store", str(store), *extra])


def stored_run(store: Path) -> tuple:
    with sqlite3.connect(store) as connection:
        return connection.execute(
            "SELECT run_id, score, finished_at, plugins, versions FROM runs").fetchone()


def test_a_run_records_its_plugins_version_and_source_hash(plugin_folder, tmp_path):
    source = install(plugin_folder, "0.1.0")
    store = tmp_path / "s.sqlite"
    assert run(store) == 0
    _, _, _, recorded, versions = stored_run(store)
    assert json.loads(recorded) == {"plugin_plain": {"version": "0.1.0", "source": source}}
    assert json.loads(versions)["plugin plugin_plain"] == "0.1.0"
    # A built-in run records that it used no plugin ({}, not NULL: "not recorded").
    assert main([*RUN[:4], "none", *RUN[5:], "--store", str(store)]) == 0
    reader = ResultStore(store, read_only=True)
    assert sorted(map(json.dumps, reader.run_plugins(reader.runs()["run_id"]).values())) == [
        json.dumps(json.loads(recorded)), "{}"]


@pytest.mark.parametrize("version, comment", [("0.2.0", "first"), ("0.1.0", "fixed")])
def test_a_changed_plugin_is_named_and_its_run_kept_until_rerun_stale(
        plugin_folder, tmp_path, capsys, version, comment):
    old_source = install(plugin_folder, "0.1.0")
    store = tmp_path / "s.sqlite"
    assert run(store) == 0
    before = stored_run(store)
    run_id = before[0]
    assert run(store) == 0  # unchanged: complete, nothing said about staleness
    assert "stale" not in capsys.readouterr().err

    new_source = install(plugin_folder, version, comment)  # fixed and reinstalled
    assert run(store) == 0
    captured = capsys.readouterr()
    notice = flat(captured.err)
    assert (f"che-bench: run {run_id} is stale: plugin plugin_plain recorded 0.1.0 (source "
            f"{old_source[:12]}), installed {version} (source {new_source[:12]}); kept, not "
            "rerun: --rerun-stale reruns it (its stored result is replaced)") in notice
    assert stored_run(store) == before  # kept as it was, same run id

    # The listing marks it, and never writes.
    stamp = store.stat().st_mtime_ns, store.read_bytes()
    capsys.readouterr()
    assert main(["--plugin", "plugin_plain", "runs", "--store", str(store)]) == 0
    listing = capsys.readouterr().out
    # (its first line in whichever column group holds the status)
    assert any("complete, stale" in line for line in listing.splitlines() if line.startswith(run_id))
    assert "1 stale: made with another version or source of their plugin" in flat(listing)
    assert (store.stat().st_mtime_ns, store.read_bytes()) == stamp

    # Its kept model evaluated again: said to be rebuilt with the installed plugin.
    assert main(["--plugin", "plugin_plain", "evaluate", run_id, "--test-lengths", "41,42",
                 "--eval-samples", "8", "--store", str(store)]) == 0
    assert (f"che-bench: run {run_id} is stale: plugin plugin_plain recorded 0.1.0"
            in flat(capsys.readouterr().err))
    assert len(ResultStore(store).evaluations()) == 2

    install(plugin_folder, version, comment)
    assert run(store, "--rerun-stale") == 0
    assert "rerunning it (--rerun-stale)" in flat(capsys.readouterr().err)
    after = stored_run(store)
    assert after[0] == run_id and after[2] >= before[2]
    assert json.loads(after[3]) == {"plugin_plain": {"version": version, "source": new_source}}
    assert len(ResultStore(store).evaluations()) == 1  # the old model's re-evaluation dropped
    install(plugin_folder, version, comment)
    assert run(store) == 0  # up to date again
    assert "stale" not in capsys.readouterr().err


def test_sweep_dry_run_marks_stale_runs(plugin_folder, tmp_path, capsys):
    install(plugin_folder, "0.1.0")
    store = tmp_path / "s.sqlite"
    assert run(store) == 0
    suite = tmp_path / "plain.toml"
    suite.write_text(textwrap.dedent("""
        preset = "smoke"
        tasks = ["parity_check"]
        encodings = ["test_plain"]
        seeds = [0]
        [overrides]
        steps = 2
        test_lengths = "41"
        eval_samples = 8
    """))
    install(plugin_folder, "0.2.0")
    capsys.readouterr()
    assert main(["--plugin", "plugin_plain", "sweep", str(suite), "--dry-run",
                 "--store", str(store)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "complete, stale (plugin changed)" in out
    assert "1 runs: 1 complete in the store, 0 to run" in out


def test_a_rerun_with_other_plugins_drops_the_re_evaluations(tmp_path):
    from che_bench.eval.reevaluation import reevaluation_config
    from che_bench.outcomes import Scores
    from che_bench.config import make_config
    from che_bench.run.runner import execute_run

    store = ResultStore(tmp_path / "s.sqlite")
    config = make_config("parity_check", "none", None, "smoke", steps=2, test_lengths=[41],
                         eval_samples=8)
    result = execute_run(config, device="cpu", progress=False)
    store.record(result)
    longer = reevaluation_config(result.config, test_lengths=[41, 42])
    scores = Scores(score=0.5, train_accuracy=0.5, per_length={41: 0.5, 42: 0.5},
                    train_per_length=dict(result.train_per_length))
    store.record_evaluation(result.run_id, longer.evaluation_protocol(), scores, device="cpu",
                            versions={}, timings={})
    assert len(store.evaluations()) == 2
    store.record(result)  # recorded again with the same plugins: its re-evaluation stays
    assert len(store.evaluations()) == 2
    result.plugins = {"plugin_plain": {"version": "0.2.0", "source": "ab" * 32}}
    store.record(result)  # rerun (--rerun-stale): the re-evaluation was of the old model
    assert list(store.evaluations()["original"]) == [True]


def v3_store_with_a_plugin_run(tmp_path: Path) -> Path:
    """store_v2.sqlite brought to schema 3, one of its runs naming a plugin in its versions."""
    path = Path(shutil.copy(V2_STORE, tmp_path / "v3.sqlite"))
    with sqlite3.connect(path) as connection:
        _migrate_2_to_3(connection)
        connection.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
        run_id, versions = connection.execute(
            "SELECT run_id, versions FROM runs ORDER BY run_id").fetchone()
        versions = {**json.loads(versions), "plugin che-bench-fox": "0.3.0",
                    "plugin my_module": "(module)"}
        connection.execute("UPDATE runs SET versions = ? WHERE run_id = ?",
                           (json.dumps(versions), run_id))
    return path


def test_old_stores_upgrade_with_the_plugins_their_runs_named(tmp_path):
    path = v3_store_with_a_plugin_run(tmp_path)
    before = path.read_bytes()
    read = ResultStore(path, read_only=True)  # read as upgraded, nothing written
    recorded = read.run_plugins(read.runs()["run_id"])
    assert path.read_bytes() == before
    named = {run_id: used for run_id, used in recorded.items() if used is not None}
    assert list(named.values()) == [{"che-bench-fox": {"version": "0.3.0", "source": None},
                                     "my_module": {"version": None, "source": None}}]
    ResultStore(path)  # for writing: upgraded in place
    with sqlite3.connect(path) as connection:
        assert connection.execute(
            "SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
            str(SCHEMA_VERSION),)
    assert ResultStore(path).run_plugins(list(recorded)) == recorded
    v2 = Path(shutil.copy(V2_STORE, tmp_path / "v2.sqlite"))
    assert set(map(str, ResultStore(v2).run_plugins(ResultStore(v2).runs()["run_id"]).values())) \
        == {"None"}  # nothing recorded: never judged stale


def test_provenance_changes_compare_versions_and_hashes_where_both_were_recorded():
    recorded = {"fox": {"version": "0.1.0", "source": None}}
    assert plugins.provenance_changes(recorded, {"fox": {"version": "0.1.0", "source": "ab"}}) == []
    assert plugins.provenance_changes(
        {"fox": {"version": "0.1.0", "source": "a" * 64}},
        {"fox": {"version": "0.1.0", "source": "b" * 64}}) == [
        f"plugin fox recorded 0.1.0 (source {'a' * 12}), installed 0.1.0 (source {'b' * 12})"]
    assert plugins.provenance_changes(recorded, {}) == [
        "plugin fox recorded 0.1.0, installed none"]


def test_a_sweep_names_a_stale_run_and_keeps_it(plugin_folder, tmp_path):
    import io

    from rich.console import Console

    from che_bench.config import make_config
    from che_bench.run.sweep import run_sweep

    install(plugin_folder, "0.1.0")
    store = tmp_path / "s.sqlite"
    assert run(store) == 0
    install(plugin_folder, "0.2.0")
    plugins.add_modules(["plugin_plain"])
    config = make_config("parity_check", "test_plain", None, "smoke", steps=2,
                         test_lengths=[41], eval_samples=8)
    shown = io.StringIO()

    def no_backend():
        raise AssertionError("a stale run is kept without --rerun-stale")

    outcome = run_sweep([config], ResultStore(store), no_backend,
                        console=Console(file=shown, width=100), live=False)
    assert list(outcome.stale) == [config.run_id()] and outcome.already_complete == 1
    assert f"run {config.run_id()} is stale: plugin plugin_plain recorded 0.1.0" in flat(
        shown.getvalue())
