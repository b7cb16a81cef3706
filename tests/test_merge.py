"""Issue 44, item 19: ``che-bench merge OUT IN...`` brings the runs of stores written by separate
jobs into one, with their kept models and checkpoints, keeps a duplicate run once, names
conflicting ones, and never writes to its inputs. The runs are SYNTHETIC (made-up scores)."""

from __future__ import annotations

import dataclasses
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from test_store import reevaluation, store_files, synthetic_result, v1_results, v1_store

from che_bench.cli import main
from che_bench.store import ResultStore


def plant(directory, kind: str, run_id: str, content: bytes):
    """A stand-in kept model or checkpoint file of ``run_id`` in ``directory/kind``."""
    (directory / kind).mkdir(parents=True, exist_ok=True)
    (directory / kind / f"{run_id}.pt").write_bytes(content)


def test_merge_keeps_each_run_once_brings_its_files_and_names_conflicts(tmp_path, capsys):
    one, two = tmp_path / "cluster1", tmp_path / "cluster2"
    same = synthetic_result("even_pairs", score=0.6)
    elsewhere = dataclasses.replace(same, device="other-gpu", timings={"train_s": 9.0})
    resumed = synthetic_result("even_pairs", seed=1, score=0.7)
    ours, theirs = (synthetic_result("parity_check", score=score) for score in (0.5, 0.9))
    broken = synthetic_result("even_pairs", seed=3, status="failed")
    first, second = ResultStore(one / "a.sqlite"), ResultStore(two / "b.sqlite")
    for result in (same, ours):
        first.record(result)
    first.mark_started(resumed.config)
    for result in (elsewhere, resumed, theirs, broken):
        second.record(result)
    second.record_evaluation(same.run_id, **reevaluation(same))  # made on the second cluster
    plant(one, "a.models", same.run_id, b"model of a")
    plant(one, "a.models", ours.run_id, b"our model")
    plant(two, "models", resumed.run_id, b"model of b")  # an older store's shared folder
    plant(two, "b.checkpoints", broken.run_id, b"checkpoint of b")
    before = {path: store_files(path) for path in (first.path, second.path)}

    out = tmp_path / "merged" / "all.sqlite"
    assert main(["merge", str(out), str(first.path), str(second.path)]) == 1
    printed = " ".join(capsys.readouterr().out.split())
    assert "4 runs added, 1 already there with the same results, 1 started or failed runs " \
           "replaced by complete ones" in printed and "1 conflicts" in printed
    assert (f"conflict: run {ours.run_id}: complete in {first.path} (score 50.00%) and in "
            f"{second.path} (score 90.00%) with other results (runs.score") in printed
    runs = ResultStore(out).runs().set_index("run_id")
    assert runs["status"].to_dict() == {same.run_id: "complete", ours.run_id: "complete",
                                        resumed.run_id: "complete", broken.run_id: "failed"}
    assert runs.loc[ours.run_id, "score"] == 0.5 and runs.loc[same.run_id, "device"] == "synthetic"
    assert len(ResultStore(out).evaluations([same.run_id])) == 2  # the re-evaluation came along
    assert ResultStore(out).per_length([resumed.run_id]).equals(second.per_length([resumed.run_id]))
    files = {path.relative_to(out.parent).as_posix(): path.read_bytes()
             for path in out.parent.rglob("*.pt")}
    assert files == {f"all.models/{same.run_id}.pt": b"model of a",
                     f"all.models/{ours.run_id}.pt": b"our model",
                     f"all.models/{resumed.run_id}.pt": b"model of b",
                     f"all.checkpoints/{broken.run_id}.pt": b"checkpoint of b"}
    assert {path: store_files(path) for path in (first.path, second.path)} == before

    # merged again: nothing new, the conflict named again
    assert main(["merge", str(out), str(first.path), str(second.path)]) == 1
    again = " ".join(capsys.readouterr().out.split())
    assert "0 runs added, 4 already there with the same results" in again
    assert "2 started or failed copies left out" in again and "0 kept models and" in again
    assert len(ResultStore(out).runs()) == 4


def test_merge_copies_tables_and_columns_it_does_not_know(tmp_path):
    """Another schema's additions travel: the merge copies every column of every table of a
    run, whatever they are (here a column and a table added by hand to both stores)."""
    result = synthetic_result()
    source, out = ResultStore(tmp_path / "in.sqlite"), ResultStore(tmp_path / "out.sqlite")
    source.record(result)
    for path in (source.path, out.path):
        with closing(sqlite3.connect(path, isolation_level=None)) as connection:
            connection.execute("ALTER TABLE runs ADD COLUMN provenance TEXT")
            connection.execute("CREATE TABLE plugins (run_id TEXT, name TEXT, version TEXT)")
    with closing(sqlite3.connect(source.path, isolation_level=None)) as connection:
        connection.execute("UPDATE runs SET provenance = 'my-plugin 1.2'")
        connection.execute("INSERT INTO plugins VALUES (?, 'my-plugin', '1.2')", (result.run_id,))
    assert main(["merge", str(out.path), str(source.path)]) == 0
    with closing(sqlite3.connect(out.path)) as connection:
        assert connection.execute("SELECT provenance FROM runs").fetchall() == [("my-plugin 1.2",)]
        assert connection.execute("SELECT * FROM plugins").fetchall() \
            == [(result.run_id, "my-plugin", "1.2")]


def test_merge_reads_older_stores_as_they_are_and_refuses_bad_arguments(tmp_path, capsys):
    results = v1_results()
    old = v1_store(tmp_path / "v1.sqlite", results)
    before = store_files(old)
    out = tmp_path / "out.sqlite"
    assert main(["merge", str(out), str(old)]) == 0
    assert store_files(old) == before  # read from an upgraded copy in memory
    assert sorted(ResultStore(out).runs()["run_id"]) == sorted(r.run_id for r in results)
    capsys.readouterr()
    for arguments, message in (
        ([str(out), str(out)], "is among the stores to merge"),
        ([str(out), str(tmp_path / "missing.sqlite")], "no result store at"),
        ([str(tmp_path), str(old)], "is a directory"),
    ):
        assert main(["merge", *arguments]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_shards_deal_out_whole_cells_and_cover_the_grid_once(tmp_path, capsys):
    """``sweep --shard K/N``: the parts of a SLURM array's grid, merged afterwards."""
    from che_bench.run.shards import shard
    from che_bench.run.suites import load_suite

    suite = tmp_path / "grid.toml"
    suite.write_text('preset = "smoke"\ntasks = ["even_pairs", "parity_check"]\n'
                     'encodings = ["none", "alibi", "kerple"]\nseeds = [0, 1]\n'
                     'learning_rates = [1e-3, 3e-3]\n[overrides]\nlength_seed = 0\n')
    configs = load_suite(str(suite)).configs()
    parts = [shard(configs, index, 4) for index in range(4)]
    assert sorted(c.run_id() for part in parts for c in part) == sorted(c.run_id() for c in configs)
    cells = [{config.pack_key() for config in part} for part in parts]
    assert [len(part) for part in parts] == [8, 8, 4, 4] and [len(c) for c in cells] == [2, 2, 1, 1]
    assert not set.intersection(*cells[:2])  # a cell's runs (2 seeds x 2 lrs) in one part
    capsys.readouterr()
    assert main(["sweep", str(suite), "--shard", "3/4", "--dry-run",
                 "--store", str(tmp_path / "s.sqlite")]) == 0
    assert capsys.readouterr().out.startswith(f"suite grid ({suite}): 4 runs")
    for bad in ("4/4", "1", "a/b", "2/1"):
        assert main(["sweep", str(suite), "--shard", bad, "--dry-run"]) == 2
        assert "--shard takes K/N" in capsys.readouterr().err


def test_the_cluster_launch_files_parse_and_keep_run_files_off_the_upload():
    """Every Ray cluster file (one per provider) is YAML the launcher reads, and none ships a
    local store's models or checkpoints to the cluster."""
    yaml = pytest.importorskip("yaml")
    runners = Path(__file__).resolve().parent.parent / "runners"
    providers = {}
    for path in sorted(runners.glob("ray-cluster*.yaml")):
        config = yaml.safe_load(path.read_text())
        providers[path.name] = config["provider"]["type"]
        assert {"results/*.checkpoints", "results/*.models"} <= set(config["rsync_exclude"])
        assert "che-bench sweep" in path.read_text() and "docs/sweeps.md" in path.read_text()
    assert sorted(providers.values()) == ["aws", "azure", "gcp", "local"]
