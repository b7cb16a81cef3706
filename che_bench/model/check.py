"""Building a run's model once before it runs, so that bad model, encoding or DAPE options
fail before any training (``config.check_evaluation``), what the model can take and how many
parameters it has (shown in the run header)."""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from che_bench.model.architectures import build_architecture
from che_bench.tasks import get_task


def max_input_tokens(
    task: str, task_params: dict[str, Any], arch: str, arguments: dict[str, Any]
) -> int | None:
    """The longest input a model built with these arguments takes (None: no limit), from
    that model built once (cached: the seeds and learning rates of a grid share one
    build)."""
    return _build_model_once(json.dumps([task, task_params, arch, arguments], sort_keys=True))[0]


def parameter_count(
    task: str, task_params: dict[str, Any], arch: str, arguments: dict[str, Any]
) -> int:
    """The parameters of one model built with these arguments (one member), from the same
    cached build as ``max_input_tokens``."""
    return _build_model_once(json.dumps([task, task_params, arch, arguments], sort_keys=True))[1]


@functools.lru_cache(maxsize=1024)
def _build_model_once(arguments_json: str) -> tuple[int | None, int]:
    task, task_params, arch, arguments = json.loads(arguments_json)
    with torch.random.fork_rng(devices=[]):  # leave the global torch RNG untouched
        model = build_architecture(arch, get_task(task, **task_params), **arguments)
    return model.max_input_tokens(), sum(p.numel() for p in model.parameters()) // model.members
