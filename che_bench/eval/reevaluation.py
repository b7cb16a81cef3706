"""Re-evaluation of kept models under another evaluation protocol (longer test lengths, more
sequences, dropout at evaluation, the reference's 42..500 average), and what it costs.

A re-evaluation changes only the fields of ``config.EVALUATION_FIELDS`` (among them the task
parameters of the evaluation, ``eval_task_params``: flip-flop's sparse and dense splits): the
model is the run's own, rebuilt from its kept weights. Runs of one table cell are evaluated as
one pack, on the same test batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from che_bench import protocol
from che_bench.config import RunConfig, group_into_packs
from che_bench.eval.evaluation import Evaluation, evaluate
from che_bench.model.base import BenchModel
from che_bench.model.check import check_evaluation
from che_bench.model.packs import stack_members
from che_bench.settings import BY_NAME


def reevaluation_config(config: RunConfig, **changes: Any) -> RunConfig:
    """``config`` with the given evaluation fields changed (None: keep the run's own);
    ``test_lengths`` is a length spec (see ``protocol.parse_lengths``). Lengths the task or
    the encoding cannot take are refused here, before any work."""
    changes = {
        name: BY_NAME[name].validate(value) for name, value in changes.items() if value is not None
    }
    if "test_lengths" in changes:
        changes["test_lengths"] = protocol.parse_lengths(changes["test_lengths"])
    updated = dataclasses.replace(config, **changes)
    check_evaluation(updated)
    return updated


def evaluation_cost(config: RunConfig) -> float:
    """Relative cost of an evaluation protocol: sequences x (model input tokens)^2 summed
    over its lengths (attention, the dominant term at long lengths, is quadratic)."""
    task = config.build_evaluation_task()
    lengths = set(config.test_lengths) | set(config.train_eval_lengths)
    return float(sum(config.eval_samples * task.model_length(n) ** 2 for n in lengths))


def reevaluate(
    models: Sequence[BenchModel],
    configs: Sequence[RunConfig],
    device: torch.device,
    *,
    progress: bool = True,
) -> list[Evaluation]:
    """Evaluate each one-member ``models[i]`` under ``configs[i]``'s protocol; the models of
    one table cell (same everything but seeds and learning rate) are stacked and evaluated as
    one pack. Results in the order of ``configs``."""
    by_run = {
        config.run_id(): (config, model) for config, model in zip(configs, models, strict=False)
    }
    results: dict[str, Evaluation] = {}
    for cell in group_into_packs(configs, None):
        members = [by_run[config.run_id()][1] for config in cell]
        model = members[0] if len(members) == 1 else stack_members(members)
        evaluations = evaluate(
            model.to(device), cell[0].build_evaluation_task(), cell[0], device, progress=progress
        )
        results.update(
            {config.run_id(): result for config, result in zip(cell, evaluations, strict=False)}
        )
    return [results[config.run_id()] for config in configs]
