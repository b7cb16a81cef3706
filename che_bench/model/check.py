"""The check of a run's configuration before it runs (``check_evaluation``): its evaluation
protocol and task parameters, and its model built once, so that bad model, encoding or DAPE
options fail before any training; what the model can take and how many parameters it has
(shown in the run header)."""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from che_bench import settings
from che_bench.errors import CheBenchError
from che_bench.model.architectures import build_architecture
from che_bench.model.option_text import options_text
from che_bench.tasks import get_task
from che_bench.tasks.base import Task


def max_input_tokens(
    task: str, task_params: dict[str, Any], arch: str, arguments: dict[str, Any]
) -> int | None:
    """The longest input a model built with these arguments takes (None: no limit), from
    that model built once (cached: the seeds and learning rates of a grid share one
    build)."""
    return _build_model_once(json.dumps([task, task_params, arch, arguments], sort_keys=True))[0]


def reads_lengths(
    task: str, task_params: dict[str, Any], arch: str, arguments: dict[str, Any]
) -> bool:
    """Whether a model built with these arguments trains on mixed-length batches
    (``BenchModel.reads_lengths``), from the same cached build as ``max_input_tokens``."""
    return _build_model_once(json.dumps([task, task_params, arch, arguments], sort_keys=True))[2]


def parameter_count(
    task: str, task_params: dict[str, Any], arch: str, arguments: dict[str, Any]
) -> int:
    """The parameters of one model built with these arguments (one member), from the same
    cached build as ``max_input_tokens``."""
    return _build_model_once(json.dumps([task, task_params, arch, arguments], sort_keys=True))[1]


@functools.lru_cache(maxsize=1024)
def _build_model_once(arguments_json: str) -> tuple[int | None, int, bool]:
    task, task_params, arch, arguments = json.loads(arguments_json)
    with torch.random.fork_rng(devices=[]):  # leave the global torch RNG untouched
        model = build_architecture(arch, get_task(task, **task_params), **arguments)
    parameters = sum(p.numel() for p in model.parameters()) // model.members
    return model.max_input_tokens(), parameters, model.reads_lengths


def check_evaluation(config: Any) -> None:
    """Refuse, before anything runs, an evaluation protocol the run (a ``RunConfig``, read by
    its attributes: this layer is below the config's) cannot have: sizes below 1, lengths
    below the task's minimum or beyond what the task can produce (the recall probes have a
    longest length) or the model can take (learned and randomized positions end at their
    table / range), no length to average with score_from_42, task parameters of the
    evaluation the model cannot read (``_checked_evaluation_task``), test lengths a sample set
    trains on (``_check_sample_set``). Builds the model once,
    so bad model options fail here too."""
    for name in ("eval_samples", "eval_batch_size"):
        settings.BY_NAME[name].validate(getattr(config, name))
    _check_sample_set(config)
    task = _checked_evaluation_task(config)
    for label, lengths in (
        ("test", config.test_lengths),
        ("in-distribution", config.train_eval_lengths),
    ):
        if lengths[0] < task.min_length:
            raise CheBenchError(
                f"{label} length {lengths[0]} is below the minimum length {task.min_length} "
                f"of task {task.name!r}"
            )
    if not config.score_lengths:
        raise CheBenchError(
            f"no test length above {config.train_max_length + 1} to average with score_from_42"
        )
    lengths = config.test_lengths
    task.check_length(max(lengths))
    max_tokens = max_input_tokens(
        config.task, config.task_params, config.arch, config.model_arguments()
    )
    if config.batch_lengths == settings.MIXED and not reads_lengths(
        config.task, config.task_params, config.arch, config.model_arguments()
    ):
        raise CheBenchError(
            f"architecture {config.arch!r} cannot train on mixed-length batches (batch_lengths "
            "mixed): only a causal model that reads each sequence's length can (the "
            "state-tracking models: mamba, deltanet, gated_deltanet, deltaproduct, mlstm, "
            "slstm); --batch-lengths one trains it on one length per step"
        )
    longest = max(task.model_length(n) for n in lengths)
    if max_tokens is not None and longest > max_tokens:
        raise CheBenchError(
            f"test length {max(lengths)} needs {longest} model input tokens but encoding "
            f"{config.pe!r} takes at most {max_tokens} (raise max_positions / noise_max_length "
            "with --pe-option)"
        )


def _check_sample_set(config: Any) -> None:
    """A run with a sample set is tested on its held-out part (``tasks.sample_sets``): at no
    length below the split, where the evaluation would draw sequences it may have trained on,
    and under the trained task parameters only."""
    if config.sample_set is None:
        return
    if config.eval_task_params:
        raise CheBenchError(
            "sample_set holds out sequences of the trained task: leave out eval_task_params"
        )
    shortest = min(config.test_lengths)
    if shortest < config.train_max_length:
        raise CheBenchError(
            f"sample_set: test length {shortest} is below train_max_length "
            f"{config.train_max_length}, whose sequences are all training data (test at "
            f"{config.train_max_length}, on its held-out ones, or beyond)"
        )


def _checked_evaluation_task(config: Any) -> Task:
    """The run's evaluation task (``build_evaluation_task``); its parameters must change the
    run's own and keep the model's inputs and outputs (the trained model reads them)."""
    task = config.build_evaluation_task()
    if not config.eval_task_params:
        return task
    trained = config.build_task()
    own = trained.params()
    given = config.eval_task_params
    same = {key: value for key, value in given.items() if own.get(key) == value}
    if same:
        raise CheBenchError(
            f"--eval-task-param {options_text(same, ' ')}: the run's own value (leave it out)"
        )
    shape = ("input_size", "output_size", "output_layout")
    if any(getattr(task, name) != getattr(trained, name) for name in shape):
        raise CheBenchError(
            f"--eval-task-param {options_text(given, ' ')} changes the inputs or outputs of task "
            f"{config.task!r} (to {_shape_text(task, trained)}): the run's model, trained with "
            f"{options_text({key: own.get(key) for key in given}, ' ')}, reads "
            f"{_shape_text(trained, task)}; an evaluation may change only task parameters "
            "that keep them"
        )
    return task


def _shape_text(task: Task, other: Task) -> str:
    """What a model reads and writes for ``task``: its input and output classes, and where
    its outputs go when that differs from ``other``."""
    text = f"{task.input_size} input and {task.output_size} output classes"
    if task.output_layout != other.output_layout:
        text += f", outputs {task.output_layout.replace('_', ' ')}"
    return text
