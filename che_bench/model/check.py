"""Building a run's model once before it runs, so that bad model, encoding or DAPE options
fail before any training (``config.check_evaluation``), and what the model can take."""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from che_bench.model.encoder import build_model
from che_bench.tasks import get_task


def max_input_tokens(
    task: str,
    task_params: dict[str, Any],
    pe: str,
    kernel: int | None,
    model_kwargs: dict[str, Any],
) -> int | None:
    """The longest input the encoding of a model built with these arguments takes (None: no
    limit), from that model built once (cached: the seeds and learning rates of a grid share
    one build)."""
    return _build_model_once(
        json.dumps([task, task_params, pe, kernel, model_kwargs], sort_keys=True)
    )


@functools.lru_cache(maxsize=1024)
def _build_model_once(arguments_json: str) -> int | None:
    task, task_params, pe, kernel, kwargs = json.loads(arguments_json)
    with torch.random.fork_rng(devices=[]):  # leave the global torch RNG untouched
        model = build_model(get_task(task, **task_params), pe=pe, kernel=kernel, **kwargs)
    return model.encoding.max_tokens()
