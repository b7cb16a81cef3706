"""The portable CPU mode's reference run and its check (issue 44, item 15): the committed
reference is the run of the command it names, the check repeats a portable run in a fresh
process, calls a repeat bit for bit only when every recorded bit agrees, and says by how much
each length differs otherwise."""

from __future__ import annotations

import copy
import json
import re
import subprocess

import pytest

from che_bench import cpu
from che_bench.checks import portable_reference
from che_bench.checks.portable_reference import (
    REFERENCE_ARGUMENTS,
    compare,
    load_reference,
    run_portable,
)
from che_bench.cli import build_parser, main
from che_bench.commands.portable_reference import verdict_lines
from che_bench.commands.run import cell_configs
from che_bench.errors import CheBenchError

#: A portable run of seconds: the check's path, not the reference's numbers.
TINY_ARGUMENTS = ["run", "--task", "parity_check", "--preset", "smoke", "--steps", "4",
                  "--log-every", "2", "--test-lengths", "41", "--eval-samples", "2", "--seed",
                  "0", "--length-seed", "0", "--threads", "1", "--portable-cpu"]


@pytest.fixture
def reference():
    return load_reference()


def test_the_cpu_description_tells_cpus_of_one_name_apart(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 1\n"
                       "model name\t: AMD EPYC\nflags\t\t: fpu avx avx2 fma\n\n"
                       "processor\t: 1\ncpu family\t: 99\nflags\t\t: avx512f\n")
    assert cpu.cpu_description(cpuinfo) == "AMD EPYC (family 25, model 1; AVX2)"
    cpuinfo.write_text("model name\t: Intel(R) Xeon(R) Processor\nflags\t: avx2 avx512f\n")
    assert cpu.cpu_description(cpuinfo) == "Intel(R) Xeon(R) Processor (AVX-512)"


def test_the_committed_reference_is_the_run_of_its_command(reference):
    """Its run id is the one the command makes today (a changed preset or setting would make
    the reference another run's), with every length of it, from the mode's AVX2 kernels."""
    (config,) = cell_configs(build_parser().parse_args(list(REFERENCE_ARGUMENTS)))
    assert reference.arguments == list(REFERENCE_ARGUMENTS)
    assert reference.run_id == config.run_id()
    assert sorted(reference.per_length["test"]) == list(config.test_lengths)
    assert sorted(reference.per_length["train"]) == list(config.train_eval_lengths)
    test = reference.per_length["test"].values()
    assert reference.score == pytest.approx(sum(test) / len(test))
    assert reference.versions["cpu_capability"] == cpu.PORTABLE_CAPABILITY
    assert re.fullmatch(r"[0-9a-f]{64}", reference.weights_sha256)
    assert re.search(r"family \d+, model \d+", reference.cpu)
    assert [step for step, _ in reference.losses] == list(range(100, config.steps + 1, 100))


def test_a_repeat_is_bit_for_bit_only_when_every_recorded_bit_agrees(reference):
    assert compare(reference, copy.deepcopy(reference)).identical
    assert "bit for bit" in verdict_lines(compare(reference, copy.deepcopy(reference)))[-1]
    measured = copy.deepcopy(reference)
    measured.per_length["test"][341] += 1 / 64  # one more right answer at n = 341
    measured.per_length["train"][40] = 1e-16 + measured.per_length["train"][40]
    comparison = compare(reference, measured)
    assert not comparison.identical and comparison.weights_equal
    assert [(d.split, d.length) for d in comparison.lengths] == [("test", 341), ("train", 40)]
    measured = copy.deepcopy(reference)
    measured.weights_sha256 = "0" * 64
    assert not compare(reference, measured).identical  # the weights alone
    measured.losses[4] = (500, measured.losses[4][1] + 1e-12)
    measured.versions["torch"] = "2.12.0+cpu"
    comparison = compare(reference, measured)
    assert not comparison.identical and not comparison.weights_equal
    assert comparison.first_loss_step == 500 and not comparison.lengths
    assert comparison.builds == {"torch": (reference.versions["torch"], "2.12.0+cpu")}


def test_a_difference_is_said_per_length_and_a_score_reported_elsewhere_is_named(reference):
    measured = copy.deepcopy(reference)
    measured.per_length["test"][341] += 2 / 64
    measured.score += 2 / 64 / len(measured.per_length["test"])
    measured.weights_sha256 = "0" * 64
    text = "\n".join(verdict_lines(compare(reference, measured)))
    assert "DIFFERS" in text and "final weights differ" in text
    assert "1 of 29 accuracies differ" in text
    assert re.search(r"length\s+341\n.*\nreference %\s+37\.50\nthis CPU %\s+40\.62\n"
                     r"difference\s+\+3\.12", text)
    elsewhere = [other["cpu"] for other in reference.elsewhere]
    measured.score = 835 / 1536  # the 54.36% reported on two AMD EPYCs
    assert compare(reference, measured).matching_elsewhere() == elsewhere
    assert " and ".join(elsewhere) in "\n".join(verdict_lines(compare(reference, measured)))


def test_the_check_runs_the_mode_in_a_fresh_process_and_reads_the_run_back():
    """A new process, as a user starts one: the mode's run read back from its store."""
    run = run_portable(TINY_ARGUMENTS, timeout_s=300)
    assert run.arguments == TINY_ARGUMENTS and run.cpu == cpu.cpu_description()
    assert run.versions["cpu_capability"] == cpu.PORTABLE_CAPABILITY
    assert set(run.per_length["test"]) == {41} and run.per_length["train"]
    assert [step for step, _ in run.losses] == [2, 4]
    assert re.fullmatch(r"[0-9a-f]{64}", run.weights_sha256)


@pytest.mark.slow
def test_a_portable_run_repeats_bit_for_bit_on_this_cpu():
    first, second = (run_portable(TINY_ARGUMENTS, timeout_s=300) for _ in range(2))
    assert compare(first, second).identical


def test_a_failed_portable_run_is_one_line_with_its_last_message(monkeypatch):
    failed = subprocess.CompletedProcess([], 2, "", "a warning\nche-bench: error: unknown task\n")
    monkeypatch.setattr(portable_reference.subprocess, "run", lambda *args, **kwargs: failed)
    with pytest.raises(CheBenchError, match=r"^the portable run failed \(exit 2\): che-bench: "
                                            r"error: unknown task$"):
        run_portable(["run", "--task", "unknown", "--portable-cpu"])


@pytest.mark.parametrize("differs", [False, True])
def test_the_command_says_whether_this_cpu_repeats_it(reference, differs, monkeypatch, tmp_path,
                                                      capsys):
    measured = copy.deepcopy(reference)
    if differs:
        measured.per_length["test"][41] -= 1 / 64
    arguments = []
    monkeypatch.setattr(portable_reference, "run_portable",
                        lambda given: arguments.append(given) or measured)
    written = tmp_path / "this_cpu.json"
    code = main(["selftest", "--portable-reference", "--json", str(written)])
    out = capsys.readouterr().out
    assert arguments == [REFERENCE_ARGUMENTS]
    assert code == (1 if differs else 0)
    assert ("DIFFERS" in out) == differs and ("bit for bit" in out) != differs
    assert load_reference(written) == measured
    assert json.loads(written.read_text())["run_id"] == reference.run_id


@pytest.mark.parametrize("flag", [["--quick"], ["--threads", "2"], ["--device", "cpu"]])
def test_the_check_takes_no_device_options(flag, capsys):
    assert main(["selftest", "--portable-reference", *flag]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"leave out {flag[0]}" in error
