"""Per-sample predictions of kept models: what a model answers, position by position, at each
test length.

At each test length of a run's protocol, the first ``count`` sequences of the evaluation's
first sub-batch (drawn as the evaluation draws them, ``evaluation.seed_for_length``: the very
sequences it scored; with dropout off, as by default, the very answers it scored) go through
the model. Each becomes one JSON line: ``run_id``,
``length``, ``index``, ``input`` / ``target`` / ``prediction`` (token ids), ``mask`` (0/1),
``correct`` (per output position: true / false, null where the mask drops it), ``exact`` (every
masked position right), and the texts ``che-bench sample`` prints: ``input_text`` (the task's
input symbols), ``target_text`` and ``prediction_text`` (ids, ``·`` where not scored).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from che_bench.config import RunConfig
from che_bench.errors import CheBenchError
from che_bench.eval.evaluation import seed_for_length
from che_bench.model.base import BenchModel
from che_bench.tasks.base import MASKED

DEFAULT_SAMPLES_PER_LENGTH = 8


def sample_predictions(
    model: BenchModel,
    config: RunConfig,
    run_id: str,
    device: torch.device,
    count: int = DEFAULT_SAMPLES_PER_LENGTH,
) -> Iterator[dict[str, Any]]:
    """The records (see the module docstring) of a one-member ``model``, the kept model of
    stored run ``run_id``, under ``config``'s evaluation protocol (the run's own, or a
    re-evaluation's), length by length."""
    task = config.build_evaluation_task()
    model.to(device).train(config.dropout_at_eval)
    sub_batch = min(config.eval_batch_size, config.eval_samples)
    shown = min(count, sub_batch)
    for length in config.test_lengths:
        data_rng, seed = seed_for_length(model, config, length)
        batch = task.sample(length, sub_batch, data_rng)
        inputs = torch.from_numpy(batch.inputs[:shown].copy()).to(device)
        with (
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
            torch.inference_mode(),
        ):
            torch.manual_seed(seed)  # dropout at evaluation, as the evaluation seeds it
            draws = model.sample_draws(inputs.shape[-1], evaluating=True)
            predictions = model(inputs, draws, evaluating=True)[0].argmax(-1).cpu().numpy()
        for index in range(shown):
            yield _record(
                task,
                run_id,
                length,
                index,
                batch.inputs[index],
                batch.targets[index],
                batch.mask[index],
                predictions[index],
            )


def _record(
    task, run_id: str, length: int, index: int, inputs, targets, mask, prediction
) -> dict[str, Any]:
    mask = mask.astype(bool).tolist()
    target, predicted = targets.tolist(), prediction.tolist()
    correct = [
        t == p if keep else None for t, p, keep in zip(target, predicted, mask, strict=False)
    ]
    return {
        "run_id": run_id,
        "task": task.name,
        "length": length,
        "index": index,
        "input": inputs.tolist(),
        "target": target,
        "prediction": predicted,
        "mask": [int(keep) for keep in mask],
        "correct": correct,
        "exact": all(c for c in correct if c is not None),
        "input_text": " ".join(task.input_symbols[t] for t in inputs.tolist()),
        "target_text": _shown(target, mask),
        "prediction_text": _shown(predicted, mask),
    }


def _shown(tokens: list[int], mask: list[bool]) -> str:
    return " ".join(str(t) if keep else MASKED for t, keep in zip(tokens, mask, strict=False))


def check_samples_per_length(count: int) -> None:
    if count < 1:
        raise CheBenchError(f"--samples-per-length must be at least 1, got {count}")


def write_samples(
    out: str | Path,
    run_ids: Sequence[str],
    models: Sequence[BenchModel],
    configs: Sequence[RunConfig],
    device: torch.device,
    count: int = DEFAULT_SAMPLES_PER_LENGTH,
) -> int:
    """Write the records of every (run id, model, config) to JSON-lines file ``out``; returns
    how many."""
    check_samples_per_length(count)
    written = 0
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", encoding="utf-8") as handle:
            for run_id, model, config in zip(run_ids, models, configs, strict=False):
                for record in sample_predictions(model, config, run_id, device, count):
                    handle.write(json.dumps(record) + "\n")
                    written += 1
    except OSError as exc:
        raise CheBenchError(f"cannot write samples {out}: {exc.strerror or exc}") from None
    return written
