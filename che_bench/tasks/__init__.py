"""The task registry: the 15 CHE tasks, the recall probes, the state-tracking tasks (group word
problems, flip-flop) and the tasks of plugins.

Adding a task = one ``Task`` subclass in the module of its level + one entry in the list
below (a plugin decorates its class with ``@register_task`` instead).
"""

from __future__ import annotations

import inspect

from che_bench.errors import CheBenchError, accepted_text
from che_bench.tasks.base import LEVELS, TASKS, Batch, Task, register_task, single_class
from che_bench.tasks.cs import (
    BinaryAddition,
    BinaryMultiplication,
    BucketSort,
    ComputeSqrt,
    DuplicateString,
    MissingDuplicateString,
    OddsFirst,
)
from che_bench.tasks.dcf import (
    ModularArithmeticBrackets,
    ReverseString,
    SolveEquation,
    StackManipulation,
)
from che_bench.tasks.flip_flop import FlipFlop
from che_bench.tasks.mqar import MultiQueryAssociativeRecall
from che_bench.tasks.recall import AssociativeRecall, Induction
from che_bench.tasks.regular import CycleNavigation, EvenPairs, ModularArithmetic, ParityCheck
from che_bench.tasks.word_problems import WordProblem

__all__ = [
    "LEVELS",
    "TASKS",
    "Batch",
    "Task",
    "canonical_task_name",
    "get_task",
    "list_tasks",
    "listed_task_params",
    "register_task",
    "single_class",
    "task_parameters",
]

# The CHE tasks in the order of the CHE tables, then the recall probes, then the state-tracking
# tasks (regular languages, after CHE's regular rows in the tables). Other spellings are
# aliases (compared normalised: lower case, words joined by "_"). The paper label "MODULAR
# ARITHMETIC" (without "(SIMPLE)") names the *bracket* task in the papers' tables but
# normalises to the canonical ``modular_arithmetic`` (the simple one), so it is deliberately
# not an alias; use the task ids of the tables instead.
for _task, _aliases in (
    (EvenPairs, ()),
    (ModularArithmetic, ("modular_arithmetic_simple",)),
    (ParityCheck, ()),
    (CycleNavigation, ()),
    (StackManipulation, ()),
    (ReverseString, ()),
    (ModularArithmeticBrackets, ()),
    (SolveEquation, ()),
    (DuplicateString, ()),
    (MissingDuplicateString, ("missing_duplicate",)),
    (OddsFirst, ()),
    (BinaryAddition, ()),
    (BinaryMultiplication, ()),
    (ComputeSqrt, ("compute_square_root",)),
    (BucketSort, ()),
    (AssociativeRecall, ("recall", "recall_single")),
    (Induction, ("induction_trigger",)),
    (MultiQueryAssociativeRecall, ("multi_query_associative_recall", "multiquery_ar")),
    (WordProblem, ("word_problems", "group_word_problem")),
    (FlipFlop, ("flipflop", "flip_flop_language_modeling", "ffl")),
):
    register_task(*_aliases)(_task)


def canonical_task_name(name: str) -> str:
    """The registry name for ``name``, accepting aliases and the paper labels
    case- and space-insensitively ("MISSING DUPLICATE", "Modular Arithmetic (Simple)")."""
    return TASKS.canonical(name)


def list_tasks() -> list[str]:
    """Registered task names: the built-ins in table order, then the plugins'."""
    return TASKS.names()


def get_task(name: str, **params: object) -> Task:
    """A task instance; ``params`` override its reference parameters (CheBenchError if unknown,
    or refused with a CheBenchError or a ValueError)."""
    cls = TASKS.get(name)
    accepted = list(task_parameters(name))
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise CheBenchError(
            f"task {cls.name!r} has no parameter {', '.join(unknown)} "
            f"({accepted_text(accepted, 'parameters', 'has')})"
        )
    return TASKS.instantiate(cls, **params)


def task_parameters(name: str) -> dict[str, object]:
    """Task ``name``'s parameters, each with its reference value (its constructor's default)."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {
        p.name: p.default
        for p in inspect.signature(TASKS.get(name).__init__).parameters.values()
        if p.kind in named and p.name != "self"
    }


def listed_task_params(name: str, params: dict[str, object]) -> dict[str, object]:
    """The items of ``params`` that task ``name`` lists among its published settings
    (``Task.listed_params``): where a protocol preset's task parameters apply (the xLSTM
    harness's ``layout=harness`` to parity and modular arithmetic only)."""
    listed = TASKS.get(name).listed_params
    return {
        key: value
        for key, value in params.items()
        if any(key in entry and entry[key] == value for entry in listed)
    }
