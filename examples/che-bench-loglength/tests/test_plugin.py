"""The example plugin, installed: che-bench finds it through its entry point, its encoding,
task and model pass che-bench's conformance checks, and runs with them complete."""

from __future__ import annotations

import json

import numpy as np

from che_bench.checks import conformance, model_checks
from che_bench.cli import main
from che_bench.encodings.base import ENCODINGS
from che_bench.model.architectures import ARCHITECTURES
from che_bench.store import ResultStore
from che_bench.tasks import TASKS, get_task


def test_the_entry_point_registers_all_three():
    assert TASKS.origin("majority") == ENCODINGS.origin("log_length_nope") == "che-bench-loglength"
    assert ARCHITECTURES.origin("gru") == "che-bench-loglength"
    assert ARCHITECTURES.get("gru").label == "GRU"


def test_the_docstring_examples():
    task = get_task("majority")
    targets, _ = task.solve(np.array([[0, 1, 1, 0, 1], [1, 0, 0, 0, 1]]))
    assert targets[:, 0].tolist() == [1, 0]
    assert task.solve(np.array([[0, 1, 1, 0]]))[0].tolist() == [[2]]


def test_the_conformance_checks_pass():
    for check in conformance.TASK_CHECKS:
        assert conformance.run_task_check(check, get_task("majority")) == []
    for check in ("pack", "chunks", "options", "option_effects", "dtypes", "draws"):
        assert conformance.run_encoding_check(check, "log_length_nope", {"normalise": True}) == []


def test_a_run_records_the_plugin(tmp_path, capsys):
    store = tmp_path / "s.sqlite"
    assert main(["run", "--task", "majority", "--pe", "log_length_nope", "--kernel", "3",
                 "--preset", "smoke", "--test-lengths", "41", "--no-progress",
                 "--store", str(store)]) == 0
    [versions] = [json.loads(text) for text in ResultStore(store).runs()["versions"]]
    assert versions["plugin che-bench-loglength"] == "0.1.0"
    assert "DAPE_k3_log_length_nope" in capsys.readouterr().out


def test_the_model_passes_check_model(capsys):
    assert main(["check-model", "gru"]) == 0
    assert "architecture gru: all 11 checks passed" in capsys.readouterr().out
    assert model_checks.run_model_check("shapes", "gru", {"hidden_size": 8}) == []


def test_the_model_refuses_bad_inputs_in_one_line():
    import pytest
    import torch

    from che_bench.errors import CheBenchError
    from che_bench.model.architectures import build_architecture

    model = build_architecture("gru", get_task("parity_check"), members=2, hidden_size=4)
    with pytest.raises(CheBenchError, match="input ids"):
        model(torch.tensor([[0, 2]]))
    with pytest.raises(CheBenchError, match="inputs must be"):
        model(torch.zeros(3, 1, 4, dtype=torch.long))
    assert model(torch.zeros(2, 1, 4, dtype=torch.long)).shape == (2, 1, 1, 2)


def test_a_run_with_the_model(tmp_path, capsys):
    store = tmp_path / "s.sqlite"
    assert main(["run", "--task", "parity_check", "--arch", "gru", "--arch-option",
                 "hidden_size=16", "--preset", "smoke", "--steps", "20", "--test-lengths", "41",
                 "--no-progress", "--store", str(store)]) == 0
    assert "GRU" in capsys.readouterr().out
    assert len(ResultStore(store).runs()) == 1
