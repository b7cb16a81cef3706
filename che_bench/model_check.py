"""Building a run's model once before it runs, so that bad model, encoding or DAPE options
fail before any training (``config.check_evaluation``), and what the model can take."""

from __future__ import annotations

import functools
import json

import torch

from che_bench.config import RunConfig
from che_bench.model.encoder import build_model
from che_bench.tasks import get_task


def max_input_tokens(config: RunConfig) -> int | None:
    """The longest input ``config``'s encoding takes (None: no limit), from its model built
    once (cached: the seeds and learning rates of a grid share one build)."""
    return _build_model_once(json.dumps(
        [config.task, config.task_params, config.pe, config.kernel, config.model_kwargs()],
        sort_keys=True,
    ))


@functools.lru_cache(maxsize=1024)
def _build_model_once(arguments_json: str) -> int | None:
    task, task_params, pe, kernel, kwargs = json.loads(arguments_json)
    with torch.random.fork_rng(devices=[]):  # leave the global torch RNG untouched
        model = build_model(get_task(task, **task_params), pe=pe, kernel=kernel, **kwargs)
    return model.encoding.max_tokens()
