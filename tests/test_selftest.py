"""``che-bench selftest`` on the CPU: its checks pass, a device that computes differently is
caught (exit 1), the JSON report holds every check, and estimates are labelled as such."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from che_bench.checks import (
    architecture_check,
    evaluation_checks,
    pack_checks,
    selftest,
    speed,
    task_cases,
    training_checks,
)
from che_bench.cli import main
from che_bench.encodings import get_encoding_class
from che_bench.model.architectures import ARCHITECTURES, get_architecture
from che_bench.model.dape import DapeProcessor, processor
from che_bench.model.encoder import build_model
from che_bench.model.state_tracking import delta_rule
from che_bench.tasks import get_task
from che_bench.tasks.base import Batch
from che_bench.train.optimizer import PackOptimizer


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as the selftest command's default: its tiny models ran several
    times slower with two on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def two_encodings(monkeypatch):
    """Checks (a) and (b) over two encodings only (one with a per-member bias), to stay fast."""
    chosen = [get_encoding_class("none"), get_encoding_class("kerple")]
    for module in (selftest, pack_checks):
        monkeypatch.setattr(module, "list_encodings", lambda: chosen)


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
    # Two encodings x DAPE none/1/3, and DAPE V2 k = 5, 7 and causal k = 3: two cases each.
    assert len(cases) == (2 * 3 + 3) * 2 and all(case.passed for case in cases)
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
    assert {case["check"] for case in report["cases"]} == {"a", "b", "c", "e", "f", "g", "h", "i"}
    kinds = {figure["name"]: figure["kind"] for figure in report["measurements"]}
    assert kinds["one paper run, training"] == "estimate"
    assert all(kind == "measured" for name, kind in kinds.items() if name.startswith("step"))
    assert all(figure["value"] > 0 for figure in report["measurements"])
    assert "ESTIMATE" in capsys.readouterr().out


def test_selftest_command_exits_1_on_a_disagreement(two_encodings, tmp_path, monkeypatch):
    monkeypatch.setattr(selftest, "CHECKS", selftest.CHECKS[:1])  # (a) alone, to stay fast
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


CPU = torch.device("cpu")


def test_wide_and_causal_dape_kernels_are_compared(two_encodings, monkeypatch):
    """Issue 44, item 13: (a) compares DAPE V2 k = 5 and 7 and causal k = 3 too; a GPU
    convolution that reverses the taps of kernels wider than 3 (a planted bug only they show)
    fails those cases and only those."""
    real = processor._filter_by_convolution

    def reversed_wide_taps(content, bias, weight1, bias1, weight2):
        if weight1.shape[-1] >= 5:
            weight1, weight2 = weight1.flip(-1), weight2.flip(-1)
        return real(content, bias, weight1, bias1, weight2)

    subjects = {case.subject for case in selftest.check_agreement(CPU, quick=True)}
    assert {"kerple k=5", "kerple k=7", "kerple k=3 causal"} <= subjects
    monkeypatch.setattr(processor, "_filter_by_convolution", reversed_wide_taps)
    cases = selftest.check_agreement(CPU, quick=True)
    assert {case.subject for case in cases if not case.passed} == {"kerple k=5", "kerple k=7"}


def test_every_architecture_s_pack_is_compared_and_a_mixed_pack_fails(two_encodings, monkeypatch):
    """Issue 44, item 13: (b) packs every built-in architecture, not the transformer alone; a
    pack whose members are not the models alone (planted: stacked in reverse) fails."""
    cases = pack_checks.check_packs(CPU, quick=True)
    assert all(case.passed for case in cases), [case for case in cases if not case.passed]
    others = [get_architecture(name).label for name in architecture_check.built_in_architectures()
              if name != "transformer"]
    assert [case.subject for case in cases[-2 * len(others)::2]] == others
    real = pack_checks.stack_members
    monkeypatch.setattr(pack_checks, "stack_members", lambda models: real(models[::-1]))
    assert not any(case.passed for case in pack_checks.check_packs(CPU, quick=True))


def test_evaluation_on_the_device_is_compared_for_every_architecture():
    """Issue 44, item 13: (g) evaluates the transformer in row chunks with every DAPE setting
    and every other built-in architecture past the state-tracking forms' chunks."""
    cases = evaluation_checks.check_evaluation(CPU, quick=True)
    assert all(case.passed for case in cases), [case for case in cases if not case.passed]
    labels = [get_architecture(name).label for name in architecture_check.built_in_architectures()]
    assert [case.subject for case in cases[6:]] == labels[1:]
    assert cases[5].subject == "transformer kerple k=3 causal, 4 row chunks"
    # n = 40 of reverse_string: 80 model tokens, past the 64-token chunks of the GPU's forms.
    assert get_task("reverse_string").model_length(evaluation_checks.QUICK_LENGTH) > 64


def test_evaluation_catches_a_causal_mask_that_loses_its_row_chunk_s_offset(monkeypatch):
    """A planted bug of the GPU's path: DAPE's key mask of every row chunk starts at row 0."""
    real = DapeProcessor.forward

    def offset_lost(self, scores, bias=None, rows=None):
        return real(self, scores, bias, None if rows is None else slice(0, rows.stop - rows.start))

    monkeypatch.setattr(DapeProcessor, "forward", offset_lost)
    cases = evaluation_checks.check_evaluation(CPU, quick=True)
    assert [case.subject for case in cases if not case.passed] == [
        "transformer kerple k=3 causal, 4 row chunks"]


def test_evaluation_catches_a_chunkwise_delta_rule_that_drops_its_carry(monkeypatch):
    """A planted bug of the GPU's path (issue 44, item 1d's kind): the chunkwise delta rule
    starts every chunk from a zero state. On a CPU only the gated rule and the product take
    that form for the device (DeltaNet's CPU path is chunkwise too: it agrees with itself)."""

    def carry_dropped(q, k, v, beta, gate):
        scores, _, u = (x.unbind(1) for x in delta_rule._in_chunk(q, k, v, beta, gate)[:3])
        return torch.stack([chunk @ fresh for chunk, fresh in zip(scores, u, strict=True)], dim=1)

    monkeypatch.setattr(delta_rule, "_chunkwise", carry_dropped)
    cases = evaluation_checks.check_evaluation(CPU, quick=True)
    assert [case.subject for case in cases if not case.passed] == ["Gated DeltaNet", "DeltaProduct"]


def test_a_resumed_pack_is_compared_bit_for_bit_and_a_lost_adam_state_fails(monkeypatch):
    """Issue 44, item 13: (h) stops a pack after a checkpoint and resumes it on the device;
    a resume that loses the optimizer's state (planted) fails."""
    cases = training_checks.check_resume(CPU, quick=True)
    assert [case.passed for case in cases] == [True, True]
    monkeypatch.setattr(PackOptimizer, "load_member_state", lambda self, member, state: None)
    cases = training_checks.check_resume(CPU, quick=True)
    assert not cases[0].passed and cases[0].measured > 0


def test_only_the_chosen_checks_run(monkeypatch):
    report = selftest.run_selftest(CPU, quick=True, only={"h"})
    assert {case.check for case in report.cases} == {"h"} and not report.measurements


def test_word_problems_and_flip_flop_train_and_score_on_the_device_as_on_the_cpu():
    """Issue 45, item 7: (i) compares losses, scored positions and scores of every case."""
    cases = task_cases.check_task_cases(CPU, quick=True)
    assert all(case.passed for case in cases), [case for case in cases if not case.passed]
    assert list(dict.fromkeys(case.subject for case in cases)) == [
        "word_problem group=S3", "word_problem group=A4_x_Z5",
        "word_problem group=S5 variant=tokens m=4", "word_problem variant=identity",
        "flip_flop", "flip_flop p_ignore=0.98"]
    assert [case.quantity for case in cases[:3]] == ["losses", "scored", "scores"]


class EveryPositionScored:
    """A planted device bug: the evaluation's mask lost, every position scored."""

    def __init__(self, task):
        self.task = task

    def sample(self, n, batch_size, rng):
        batch = self.task._sample(n, batch_size, rng)
        return Batch(batch.inputs, batch.targets, batch.mask | True)


def test_a_device_that_loses_the_mask_or_computes_other_logits_fails_its_cases(monkeypatch):
    """Planted device bugs: an evaluation that scores every position fails the masked tasks'
    scored positions and scores; other weights fail every case's losses (a model at chance
    scores alike with any weights: the scores case is there for miscounts)."""
    copies = []
    real_copy, real_scores = task_cases.device_copy, task_cases.length_scores
    monkeypatch.setattr(task_cases, "device_copy",
                        lambda model, device: copies.append(real_copy(model, device)) or copies[-1])

    def mask_lost(model, task, config, length, device):
        if model is copies[-1]:
            task = copy.copy(task).draw_from(EveryPositionScored(task))
        return real_scores(model, task, config, length, device)

    monkeypatch.setattr(task_cases, "length_scores", mask_lost)
    cases = task_cases.check_task_cases(CPU, quick=True)
    failed = {(case.subject, case.quantity) for case in cases if not case.passed}
    # The word problems score every position anyway; flip-flop and the identity form do not.
    masked = {"word_problem variant=identity", "flip_flop", "flip_flop p_ignore=0.98"}
    assert failed == {(subject, what) for subject in masked for what in ("scored", "scores")}

    def other_weights(model, device):
        copied = real_copy(model, device)
        torch.manual_seed(1)
        for parameter in copied.parameters():
            torch.nn.init.normal_(parameter.data)
        return copied

    monkeypatch.setattr(task_cases, "device_copy", other_weights)
    monkeypatch.setattr(task_cases, "length_scores", real_scores)
    cases = task_cases.check_task_cases(CPU, quick=True)
    compared = [case for case in cases if case.quantity != "scores"]
    assert all(case.passed == (case.quantity == "scored") for case in compared)
