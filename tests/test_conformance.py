"""The conformance checks over every built-in encoding and task (the copy `check-encoding` and
`check-task` run), and their verdicts on broken ones."""

from __future__ import annotations

import pytest
import torch

from che_bench import conformance
from che_bench.cli import main
from che_bench.encodings import AttentionHook, PositionalEncoding, list_encodings, register
from che_bench.encodings.base import ENCODINGS
from che_bench.tasks import TASKS, Task, get_task, list_tasks, register_task
from che_bench.tasks.base import single_class

ENCODINGS_BUILT_IN = [cls.name for cls in list_encodings() if ENCODINGS.origin(cls.name) is None]
TASKS_BUILT_IN = [name for name in list_tasks() if TASKS.origin(name) is None]


@pytest.mark.parametrize("check", list(conformance.ENCODING_CHECKS))
@pytest.mark.parametrize("name", ENCODINGS_BUILT_IN)
def test_every_built_in_encoding_conforms(name, check):
    assert conformance.run_encoding_check(check, name) == []


@pytest.mark.parametrize("check", list(conformance.TASK_CHECKS))
@pytest.mark.parametrize("name", TASKS_BUILT_IN)
def test_every_built_in_task_conforms(name, check):
    assert conformance.run_task_check(check, get_task(name)) == []


class WholeMapHook(AttentionHook):
    """Broken on purpose: its bias covers every query row, whatever rows it is asked for."""

    carries_bias = True

    def bias(self, rows, length, ctx):
        offsets = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        return -offsets.abs().float()[None, None, None].expand(1, 1, 4, length, length)


def test_a_broken_encoding_fails_with_one_line_per_fault(scratch_registries, capsys):
    @register
    class Forgetful(PositionalEncoding):
        name = "test_forgetful"
        description = "ignores its rows and forgets its option"
        kind = "relative"
        carries_bias = True

        def __init__(self, *, dim, heads, layers, train_max_tokens, members=1, scale=1.0):
            super().__init__(dim=dim, heads=heads, layers=layers,
                             train_max_tokens=train_max_tokens, members=members)
            self.hooks = torch.nn.ModuleList(WholeMapHook() for _ in range(self.layers))

    assert main(["check-encoding", "test_forgetful"]) == 1
    out = capsys.readouterr().out
    assert "FAIL chunks" in out and "FAIL options" in out and "FAIL memory" in out
    assert "ok   draws" in out
    assert "options recorded: expected every option in options(), missing scale" in out


def test_a_correct_encoding_passes(capsys):
    assert main(["check-encoding", "alibi", "--pe-option", "alibi_mode=symmetric"]) == 0
    assert "encoding alibi: all 8 checks passed" in capsys.readouterr().out


def test_a_task_whose_oracle_disagrees_is_named_with_its_length(scratch_registries, capsys):
    @register_task
    class OffByOne(Task):
        """Broken on purpose: the oracle counts ones, the sampler counts them from n = 30 on
        plus one."""

        name = "test_off_by_one"
        level = "regular"
        output_length_formula = "1"
        input_size, output_size = 2, 2

        def output_length(self, n):
            return 1

        def _sample(self, n, batch_size, rng):
            from che_bench.tasks import Batch

            inputs = rng.integers(0, 2, size=(batch_size, n))
            targets, mask = single_class((inputs.sum(1) + (n >= 30)) % 2)
            return Batch(inputs, targets, mask)

        def _solve(self, inputs):
            return single_class(inputs.sum(1) % 2)

    assert main(["check-task", "test_off_by_one"]) == 1
    out = capsys.readouterr().out
    assert "sampler and oracle agree (n=30): expected the sampled targets" in out
    assert "(n=29)" not in out and "ok   ids" in out


def test_unknown_names_are_usage_errors(capsys):
    assert main(["check-encoding", "alibo"]) == 2
    assert "did you mean 'alibi'" in capsys.readouterr().err
    assert main(["check-task", "parity_check", "--param", "modulus=3"]) == 2


def test_a_check_that_crashes_is_one_failure_line():
    task = get_task("parity_check")
    task.sample = lambda n, batch_size, rng: (_ for _ in ()).throw(RuntimeError("boom\nmore"))
    assert conformance.run_task_check("seed", task) == ["seed: expected to run, got RuntimeError: boom"]
