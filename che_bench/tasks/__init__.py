"""The task registry: the 15 CHE tasks plus the recall probes.

Adding a task = one ``Task`` subclass in the module of its level + one entry in ``TASKS``.
"""

from __future__ import annotations

import inspect
import re

from che_bench.errors import CheBenchError
from che_bench.tasks.base import LEVELS, Batch, Task
from che_bench.tasks.cs import (
    BinaryAddition,
    BinaryMultiplication,
    BucketSort,
    ComputeSqrt,
    DuplicateString,
    MissingDuplicateString,
    OddsFirst,
)
from che_bench.tasks.dcf import ModularArithmeticBrackets, ReverseString, SolveEquation, StackManipulation
from che_bench.tasks.mqar import MultiQueryAssociativeRecall
from che_bench.tasks.recall import AssociativeRecall, Induction
from che_bench.tasks.regular import CycleNavigation, EvenPairs, ModularArithmetic, ParityCheck

__all__ = ["LEVELS", "TASKS", "Batch", "Task", "canonical_task_name", "get_task", "list_tasks"]

#: Canonical name -> class, in the order of the CHE tables, then the recall probes.
TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (
        EvenPairs, ModularArithmetic, ParityCheck, CycleNavigation,
        StackManipulation, ReverseString, ModularArithmeticBrackets, SolveEquation,
        DuplicateString, MissingDuplicateString, OddsFirst, BinaryAddition,
        BinaryMultiplication, ComputeSqrt, BucketSort,
        AssociativeRecall, Induction, MultiQueryAssociativeRecall,
    )
}

#: Other spellings (already normalised: lower case, words joined by "_") -> canonical name.
#: The paper label "MODULAR ARITHMETIC" (without "(SIMPLE)") names the *bracket* task in
#: the papers' tables but normalises to the canonical ``modular_arithmetic`` (the simple
#: one), so it is deliberately not an alias; use the task ids of the tables instead.
ALIASES: dict[str, str] = {
    "modular_arithmetic_simple": "modular_arithmetic",
    "missing_duplicate": "missing_duplicate_string",
    "compute_square_root": "compute_sqrt",
    "recall": "associative_recall",
    "recall_single": "associative_recall",
    "induction_trigger": "induction",
    "multi_query_associative_recall": "mqar",
    "multiquery_ar": "mqar",
}


def _normalise(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.strip().lower()).strip("_")


def canonical_task_name(name: str) -> str:
    """The registry name for ``name``, accepting aliases and the paper labels
    case- and space-insensitively ("MISSING DUPLICATE", "Modular Arithmetic (Simple)")."""
    key = _normalise(str(name))
    key = ALIASES.get(key, key)
    if key not in TASKS:
        raise CheBenchError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    return key


def list_tasks() -> list[str]:
    """Canonical task names, in table order."""
    return list(TASKS)


def get_task(name: str, **params: object) -> Task:
    """A task instance; ``params`` override its reference parameters (CheBenchError if unknown)."""
    cls = TASKS[canonical_task_name(name)]
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = [
        p.name for p in inspect.signature(cls.__init__).parameters.values()
        if p.kind in named and p.name != "self"
    ]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        valid = ", ".join(accepted) or "none"
        raise CheBenchError(f"task {cls.name!r} has no parameter {', '.join(unknown)} (valid: {valid})")
    return cls(**params)
