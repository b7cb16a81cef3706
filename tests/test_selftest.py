"""``che-bench selftest`` on the CPU: its checks pass, a device that computes differently is
caught (exit 1), the JSON report holds every check, and estimates are labelled as such."""

from __future__ import annotations

import json

import pytest
import torch

from che_bench.checks import architecture_check, selftest, speed
from che_bench.cli import main
from che_bench.encodings import get_encoding_class
from che_bench.model.architectures import ARCHITECTURES, get_architecture
from che_bench.model.dape import DapeProcessor
from che_bench.model.encoder import build_model
from che_bench.tasks import get_task


@pytest.fixture
def two_encodings(monkeypatch):
    """Checks (a) and (b) over two encodings only (one with a per-member bias), to stay fast."""
    chosen = [get_encoding_class("none"), get_encoding_class("kerple")]
    monkeypatch.setattr(selftest, "list_encodings", lambda: chosen)


def perturbed_dape(model, device):
    """A device that computes differently: one weight off by 1e-2 after the copy."""
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-2


def test_device_dape_on_a_cpu_is_the_gpus_convolution_in_every_layer():
    model = build_model(get_task("parity_check"), "kerple", 3, layers=2, dim=16, heads=2, ffn=32)
    selftest.use_device_dape(model, torch.device("cpu"))
    processors = [module for module in model.modules() if isinstance(module, DapeProcessor)]
    assert len(processors) == 2
    assert {processor.implementation for processor in processors} == {"convolution"}


def test_agreement_passes_on_cpu_and_catches_a_different_device(two_encodings, monkeypatch):
    cases = selftest.check_agreement(torch.device("cpu"), quick=True)
    assert len(cases) == 2 * 3 * 2 and all(case.passed for case in cases)
    # The GPU's DAPE implementation runs in the "device" copy: not bit-identical, close.
    assert any(case.measured > 0 for case in cases if case.subject.endswith("k=3"))
    monkeypatch.setattr(selftest, "use_device_dape", perturbed_dape)
    cases = selftest.check_agreement(torch.device("cpu"), quick=True)
    assert not any(case.passed for case in cases if case.quantity == "logits")


def test_selftest_command_writes_every_check_and_labels_estimates(two_encodings, tmp_path, capsys,
                                                                  monkeypatch):
    monkeypatch.setattr(speed, "SPEED_PRESET", "smoke")  # (d) times a tiny model here
    report_path = tmp_path / "selftest.json"
    assert main(["selftest", "--device", "cpu", "--quick", "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["passed"] and report["device"].startswith("cpu")
    assert {case["check"] for case in report["cases"]} == {"a", "b", "c", "e", "f"}
    kinds = {figure["name"]: figure["kind"] for figure in report["measurements"]}
    assert kinds["one paper run, training"] == "estimate"
    assert all(kind == "measured" for name, kind in kinds.items() if name.startswith("step"))
    assert all(figure["value"] > 0 for figure in report["measurements"])
    assert "ESTIMATE" in capsys.readouterr().out


def test_selftest_command_exits_1_on_a_disagreement(two_encodings, tmp_path, monkeypatch):
    monkeypatch.setattr(selftest, "use_device_dape", perturbed_dape)
    monkeypatch.setattr(selftest, "measure_speed", lambda device, quick: [])
    report_path = tmp_path / "selftest.json"
    assert main(["selftest", "--device", "cpu", "--quick", "--json", str(report_path)]) == 1
    report = json.loads(report_path.read_text())
    assert not report["passed"]
    assert any(not case["passed"] and case["check"] == "a" for case in report["cases"])


def test_selftest_bad_input_is_one_line_exit_2(tmp_path, capsys):
    assert main(["selftest", "--device", "tpu"]) == 2
    assert main(["selftest", "--device", "cpu", "--json", str(tmp_path / "no" / "x.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 2


@pytest.mark.slow
def test_the_whole_quick_selftest_passes_on_cpu(tmp_path):
    assert main(["selftest", "--device", "cpu", "--quick", "--json", str(tmp_path / "r.json")]) == 0


def test_selftest_says_when_auto_found_no_gpu(two_encodings, monkeypatch, capsys):
    """Issue 19, item 10: ``--device auto`` on a machine without a GPU says in its first line
    that it runs the CPU self-test."""
    monkeypatch.setattr(selftest, "CHECKS", ())
    monkeypatch.setattr(selftest, "measure_speed", lambda device, quick: [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["selftest", "--device", "auto", "--quick"]) == 0
    first_line = capsys.readouterr().out.strip().splitlines()[0]
    assert first_line.startswith("no GPU found (--device auto): this is the CPU self-test")


def test_every_built_in_architecture_trains_on_the_devices_path(monkeypatch):
    """Issue 26, item 1: check (f) trains every built-in architecture (plugins' left out),
    and the LSTM's CPU copy trains through the GPU's fused call, in training mode."""
    flags, lstm = [], torch.lstm
    monkeypatch.setattr(torch, "lstm", lambda *args: flags.append(args[6]) or lstm(*args))
    cases = architecture_check.check_architectures(torch.device("cpu"), quick=True)
    built_in = [name for name in ARCHITECTURES.names() if ARCHITECTURES.origin(name) is None]
    assert {"transformer", "lstm", "tape_rnn"} <= set(built_in)
    assert [case.subject.split(",")[0] for case in cases[::2]] == [
        get_architecture(name).label for name in built_in]
    assert all(case.passed for case in cases), [case for case in cases if not case.passed]
    assert flags == [True] * 3  # the LSTM's device copy, one call a step (the CPU's: loop)
    lstm_cases = [case for case in cases if case.subject.startswith("LSTM")]
    assert any(case.measured > 0 for case in lstm_cases)  # the fused kernel's own rounding
    monkeypatch.setattr(ARCHITECTURES, "origin", lambda name: "a-plugin" if name == "rnn" else None)
    assert "rnn" not in architecture_check.built_in_architectures()


def test_a_device_path_that_fails_fails_its_architecture(monkeypatch):
    """A device whose kernel refuses the backward (cuDNN after an inference-mode forward)
    fails that architecture's cases with the error's line, and only those."""

    def refusing(model, device):
        def hook(module, inputs, output):
            output.register_hook(lambda grad: (_ for _ in ()).throw(
                RuntimeError("cudnn RNN backward can only be called in training mode")))
        if model.name == "lstm" or getattr(model, "architecture", "") == "lstm":
            model.register_forward_hook(hook)

    monkeypatch.setattr(architecture_check, "use_device_path", refusing)
    monkeypatch.setattr(architecture_check, "built_in_architectures", lambda: ["rnn", "lstm"])
    cases = architecture_check.check_architectures(torch.device("cpu"), quick=True)
    assert [case.passed for case in cases] == [True, True, False, False]
    assert cases[2].error == "cudnn RNN backward can only be called in training mode"
