"""``che-bench tasks`` and ``che-bench sample``."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from che_bench.cli import main
from che_bench.commands.key_values import parse_key_values
from che_bench.tasks import get_task, list_tasks


def test_tasks_lists_all_twenty_with_their_formulas(capsys):
    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    for name in list_tasks():
        assert name in out
    assert len(list_tasks()) == 20
    for formula in ("n+1", "2n", "ceil(n/2)", "0.39%", "n (in place)", "2n (in place)"):
        assert formula in out


@pytest.mark.parametrize("columns", [100, 160])
def test_tasks_lists_the_published_settings_of_a_parametrised_task(columns, capsys, monkeypatch):
    """Each setting named by its parameters as --task-param takes them; a long name wraps
    (indented) at 100 columns rather than splitting the table."""
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["tasks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= columns
    table: list[list[str]] = []
    for line in lines:
        if line.startswith("  ") and table:  # a wrapped task name's continuation
            table[-1][0] += f" {line.strip()}"
        else:
            table.append(re.split(r"\s{2,}", line))
    rows = {cells[0]: cells[1:] for cells in table}
    # level, in size, out size (the group's order), out length, chance, perm-inv, min n
    assert rows["word_problem group=S3"] == [
        "regular", "6", "6", "n (in place)", "16.67%", "no", "1"
    ]
    assert rows["word_problem group=A4_x_Z5"][1:5] == ["60", "60", "n (in place)", "1.67%"]
    assert rows["word_problem group=S5 variant=tokens m=4"][1:3] == ["121", "120"]  # + separator
    assert rows["word_problem group=S5 variant=limit_to m=3"][-1] == "1"
    assert rows["word_problem variant=identity"][1:5] == ["60", "2", "n (in place)", "50.00%"]
    assert rows["flip_flop p_ignore=0.98"] == [
        "regular", "5", "2", "2n (in place)", "50.00%", "no", "2"
    ]


def test_sample_jsonl_matches_the_sampler_and_the_oracle(capsys):
    args = ["sample", "--task", "stack_manipulation", "--length", "9", "--count", "3", "--seed", "4",
            "--format", "jsonl"]
    assert main(args) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == 3
    batch = get_task("stack_manipulation").sample(9, 3, np.random.default_rng(4))
    assert [r["input"] for r in records] == batch.inputs.tolist()
    assert [r["target"] for r in records] == batch.targets.tolist()
    assert [r["mask"] for r in records] == batch.mask.astype(int).tolist()
    assert all(r["task"] == "stack_manipulation" and r["length"] == 9 for r in records)


def test_sample_text_shows_symbols_and_masked_positions(capsys):
    assert main(["sample", "--task", "binary_addition", "--length", "7", "--count", "2"]) == 0
    out = capsys.readouterr().out
    assert "+" in out and "·" in out and "n=7" in out
    assert out.count("->") == 2


def test_sample_text_with_task_parameters(capsys):
    args = ["sample", "--task", "recall", "--length", "8", "--param", "num_keys=8",
            "--param", "value_mode=iid", "--param", "num_values=4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "value_mode='iid'" in out and "k" in out and "v" in out


@pytest.mark.parametrize(
    "args",
    [
        ["sample", "--task", "no_such_task", "--length", "5"],
        ["sample", "--task", "parity_check", "--length", "0"],
        ["sample", "--task", "induction", "--length", "2"],
        ["sample", "--task", "parity_check", "--length", "5", "--count", "0"],
        ["sample", "--task", "parity_check", "--length", "5", "--param", "vocab_size=3"],
        ["sample", "--task", "parity_check", "--length", "5", "--param", "novalue"],
    ],
)
def test_bad_sample_arguments_exit_with_code_two(args, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("che-bench: error:") and err.count("\n") == 1


def test_argparse_errors_exit_with_code_two():
    with pytest.raises(SystemExit) as exc:
        main(["sample", "--task", "parity_check", "--length", "five"])
    assert exc.value.code == 2


def test_key_values_read_json_scalars():
    assert parse_key_values(["a=3", "b=true", "c=False", "d=near", "e=0.5"], "--param") == {
        "a": 3, "b": True, "c": False, "d": "near", "e": 0.5,
    }


@pytest.mark.parametrize("task, params", [
    ("flip_flop", {"p_ignore": 0.98}),
    ("word_problem", {"variant": "identity"}),
    ("word_problem", {"group": "S3", "variant": "tokens", "m": 2}),
])
def test_sample_shows_the_state_tracking_tasks_symbols_and_scored_positions(task, params, capsys):
    """Flip-flop scores the reads, the identity form the last position, the word problem every
    one; the symbols are the task's (w r i 0 1; elements, the separator |)."""
    arguments = [item for key, value in params.items() for item in ("--param", f"{key}={value}")]
    assert main(["sample", "--task", task, "--length", "6", "--count", "3", "--seed", "2",
                 *arguments]) == 0
    lines = capsys.readouterr().out.splitlines()
    lines = lines[lines.index(next(line for line in lines if line.startswith("[0] "))):]
    task_obj = get_task(task, **params)
    batch = task_obj.sample(6, 3, np.random.default_rng(2))
    for row in range(3):
        symbols = " ".join(task_obj.input_symbols[i] for i in batch.inputs[row])
        outputs = " ".join(str(t) if m else "·" for t, m in
                           zip(batch.targets[row], batch.mask[row], strict=True))
        assert lines[2 * row] == f"[{row}] {symbols}" and lines[2 * row + 1] == f"  -> {outputs}"


@pytest.mark.parametrize("columns", [100, 160])
def test_a_long_sample_wraps_between_tokens_to_the_terminal(columns, monkeypatch, capsys):
    """The header of a word problem (126 characters) and the tokens of a long sample were one
    line each; wrapped, every line fits and the tokens read back whole, in order."""
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["sample", "--task", "word_problem", "--param", "group=S5", "--length", "120",
                 "--count", "2", "--seed", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= columns
    header = " ".join(" ".join(lines[: lines.index(next(ln for ln in lines
                                                      if ln.startswith("[0] ")))]).split())
    assert "WordProblem(group='S5'" in header and "output positions=120 (· = not scored)" in header
    text = " ".join(line.strip() for line in lines)
    batch = get_task("word_problem", group="S5").sample(120, 2, np.random.default_rng(3))
    for row in range(2):
        symbols = " ".join(str(token) for token in batch.inputs[row])
        outputs = " ".join(str(token) for token in batch.targets[row])
        assert f"[{row}] {symbols} -> {outputs}" in text


def test_sample_and_check_task_take_task_param_as_run_does(capsys):
    """``run`` spells a task parameter ``--task-param``; ``sample`` and ``check-task`` refused
    it (``unrecognized arguments``) and knew only ``--param``."""
    assert main(["sample", "--task", "word_problem", "--task-param", "group=S3", "--length", "4",
                 "--count", "1"]) == 0
    assert "WordProblem(group='S3'" in capsys.readouterr().out
    assert main(["sample", "--task", "parity_check", "--task-param", "group=S3",
                 "--length", "4"]) == 2
    assert "has no parameter group" in capsys.readouterr().err
    assert main(["check-task", "parity_check", "--task-param", "group=S3"]) == 2
    assert "has no parameter group" in capsys.readouterr().err
