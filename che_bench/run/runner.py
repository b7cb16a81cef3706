"""Benchmark runs: their execution (train, then evaluate) on a device, one pack at a time.

``execute_pack`` trains and evaluates runs that differ only in seeds and learning rate side by
side, ``execute_run`` one run (a pack of one); neither touches the result store, so they can
run in any worker process; the caller records the returned ``RunResult``s (see
``che_bench.store.result_store``).
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from che_bench import plugins
from che_bench.config import RunConfig
from che_bench.device_memory import release_memory
from che_bench.errors import CheBenchError
from che_bench.eval.evaluation import Evaluation, evaluate
from che_bench.model.architectures import build_members
from che_bench.model.base import BenchModel
from che_bench.model.packs import member_state_dict
from che_bench.outcomes import RunResult
from che_bench.run.device import (
    check_portable_device,
    configure_numerics,
    describe_device,
    numerics_details,
    prepare_deterministic_cublas,
    resolve_device,
)
from che_bench.run.kept_models import save_model
from che_bench.run.options import RuntimeOptions, runtime_options
from che_bench.run.packing import packs_on
from che_bench.run.provenance import plugin_origins, software_versions
from che_bench.run.trackers import Trackers
from che_bench.tasks.base import Task
from che_bench.train.checkpoints import checkpoint_step
from che_bench.train.loop import PackTraining, train_pack
from che_bench.train.readings import Diverged


def checkpoint_path(checkpoint_dir: str | Path, run_id: str) -> Path:
    return Path(checkpoint_dir) / f"{run_id}.pt"


def check_pack(configs: Sequence[RunConfig]) -> None:
    """Refuse, before any training, runs that cannot train as one pack: members must agree on
    everything but seed, data seed and learning rate, be distinct, and share a length seed."""
    if not configs:
        raise CheBenchError("a pack needs at least one run")
    keys = [json.loads(config.pack_key()) for config in configs]
    differing = sorted(
        {name for key in keys[1:] for name in key if key[name] != keys[0].get(name)}
        | {name for key in keys[1:] for name in set(keys[0]) ^ set(key)}
    )
    if differing:
        raise CheBenchError(
            f"these runs cannot train as one pack: they differ in {', '.join(differing)} "
            "(members may differ only in seed, data seed and learning rate)"
        )
    run_ids = [config.run_id() for config in configs]
    if len(set(run_ids)) != len(run_ids):
        raise CheBenchError("a pack holds the same run twice")
    if len(configs) > 1 and configs[0].length_seed is None:
        raise CheBenchError(
            "packed runs must share a length schedule: give them a length_seed "
            "(--length-seed, or length_seed in a suite's [overrides])"
        )


def execute_pack(
    configs: Sequence[RunConfig],
    options: RuntimeOptions | None = None,
    *,
    on_step: Callable[[int, list[float]], None] | None = None,
    **changes: Any,
) -> list[RunResult]:
    """Train and evaluate a pack of runs side by side (``check_pack``) as ``options`` say
    (``RuntimeOptions``; keyword ``changes`` to its fields, e.g. ``device="cpu"``, build one
    for a Python call); never touches the result store. Returns one RunResult per config, in
    order.

    With a ``checkpoint_dir``, each member's training state is saved there every
    ``checkpoint_every`` steps and on Ctrl-C, and members with a checkpoint resume from it
    (exactly the result of an uninterrupted run for an unchanged pack); members whose
    checkpoints are at different steps train as separate packs. A checkpoint is removed once
    its run has finished. With a ``models_dir``, every completed run's final weights are kept
    there (``che_bench.run.kept_models``). ``tf32`` lets a GPU use TF32, ``deterministic`` selects
    deterministic algorithms (``configure_numerics``); both are recorded with the runs.
    ``on_step(step, losses)`` is called after every optimizer step with each member's loss
    (progress hooks, tests). Each result carries its training history, a row every
    ``log_every`` steps (``che_bench.train.history``); ``trackers`` also log it, and each completed
    run's evaluation, to TensorBoard / W&B. A diverged member or a crashed pack gives
    ``status="failed"`` results; a pack that runs out of GPU memory is split in two;
    KeyboardInterrupt propagates after the checkpoints are saved.
    """
    options = runtime_options(options, changes)
    check_pack(configs)
    torch_device = resolve_device(options.device)
    check_portable_device(torch_device, options.portable_cpu)
    configure_numerics(options.tf32, options.deterministic, options.portable_cpu)
    results = [
        RunResult(
            run_id=config.run_id(),
            config=config,
            status="failed",
            versions=software_versions(config, torch_device),
            plugins=plugins.provenance_of(*plugin_origins(config)),
            device=describe_device(torch_device),
            details=numerics_details(
                torch_device, options.tf32, options.deterministic, options.portable_cpu
            ),
        )
        for config in configs
    ]
    checkpoints = (
        None
        if options.checkpoint_dir is None
        else [checkpoint_path(options.checkpoint_dir, config.run_id()) for config in configs]
    )
    for members in _members_by_checkpoint_step(configs, results, checkpoints):
        _execute_group(
            [configs[i] for i in members],
            [results[i] for i in members],
            torch_device,
            checkpoints=None if checkpoints is None else [checkpoints[i] for i in members],
            options=options,
            on_step=on_step,
        )
    return results


def _members_by_checkpoint_step(
    configs: Sequence[RunConfig],
    results: list[RunResult],
    checkpoints: list[Path] | None,
) -> list[list[int]]:
    """The pack's members grouped by the step their checkpoints resume from (0: none); a
    member whose checkpoint cannot resume gets the error in its result and no group."""
    groups: dict[int, list[int]] = {}
    for index, config in enumerate(configs):
        try:
            step = 0 if checkpoints is None else checkpoint_step(checkpoints[index], config)
        except CheBenchError as exc:  # this member cannot resume; the others go on
            results[index].error = str(exc)
            continue
        groups.setdefault(step, []).append(index)
    return list(groups.values())


def _execute_group(
    configs: list[RunConfig],
    results: list[RunResult],
    device: torch.device,
    *,
    checkpoints: list[Path] | None,
    options: RuntimeOptions,
    on_step: Callable[[int, list[float]], None] | None,
) -> None:
    """Train and evaluate members that resume from the same step as one pack; fills
    ``results`` in place. A pack out of GPU memory goes on as two narrower packs, from the
    members' checkpoints."""
    started = time.perf_counter()
    tracking = Trackers(options.trackers, configs)
    history: list[list[dict[str, Any]]] = [[] for _ in configs]
    out_of_memory = False
    try:
        model, training, evaluations = _train_and_evaluate(
            configs,
            results,
            device,
            checkpoints,
            progress=options.progress,
            checkpoint_every=options.checkpoint_every,
            on_step=on_step,
            log_every=options.log_every,
            on_history=tracking.log_row,
        )
    except KeyboardInterrupt:
        tracking.close()
        raise
    except Diverged as exc:  # deterministic: a resumed run would diverge again
        history = exc.history
        for result in results:
            result.error = str(exc)
        finished = [True] * len(configs)
    except Exception as exc:  # recorded as failed runs; the traceback is kept in details
        out_of_memory = isinstance(exc, torch.cuda.OutOfMemoryError) and len(configs) > 1
        if not out_of_memory:  # (a pack out of memory splits, below)
            for result in results:
                result.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                result.details["traceback"] = traceback.format_exc()
        finished = [False] * len(configs)  # keep the checkpoints: a re-run after a fix resumes
    else:
        finished = [True] * len(configs)
        history = training.history
        _record_outcome(
            configs, results, model, training, evaluations, options.models_dir, tracking
        )
    tracking.close()
    if out_of_memory:
        # Here, past the except block, nothing holds the failed pack's weights, Adam state
        # and activations any more: freed before the halves start.
        release_memory(device)
        _execute_halves(configs, results, device, checkpoints, options, on_step)
        return
    _finish(results, history, checkpoints, finished, time.perf_counter() - started)


def _execute_halves(
    configs: list[RunConfig],
    results: list[RunResult],
    device: torch.device,
    checkpoints: list[Path] | None,
    options: RuntimeOptions,
    on_step: Callable[[int, list[float]], None] | None,
) -> None:
    """A pack that ran out of GPU memory goes on as two narrower packs, each from its
    members' checkpoints."""
    half = len(configs) // 2
    for part in (slice(0, half), slice(half, None)):
        _execute_group(
            configs[part],
            results[part],
            device,
            checkpoints=None if checkpoints is None else checkpoints[part],
            options=options,
            on_step=on_step,
        )


def _finish(
    results: list[RunResult],
    history: list[list[dict[str, Any]]],
    checkpoints: list[Path] | None,
    finished: list[bool],
    total_seconds: float,
) -> None:
    """Each member's history and total time; the checkpoints of finished members go. Like
    ``train_s``, the total counts every session of a resumed run: this session's seconds plus
    the training seconds of the earlier ones (what their checkpoint recorded)."""
    for member, result in enumerate(results):
        result.history = history[member]
        result.timings["total_s"] = total_seconds + result.timings.get("resumed_train_s", 0.0)
        if checkpoints is not None and finished[member]:
            checkpoints[member].unlink(missing_ok=True)


def _train_and_evaluate(
    configs: list[RunConfig],
    results: list[RunResult],
    device: torch.device,
    checkpoints: list[Path] | None,
    **training_options: Any,
) -> tuple[BenchModel, PackTraining, list[Evaluation]]:
    """The pack's model, its training (``training_options``: ``train_pack``'s keywords) and
    its members' evaluations; notes the model (and the pack) in ``results``."""
    task = configs[0].build_task()
    model = build_pack_model(task, configs)
    description = model.describe()
    pack = {"members": len(configs), "run_ids": [config.run_id() for config in configs]}
    for result in results:
        result.details["model"] = description
        if len(configs) > 1:
            result.details["pack"] = pack
    model.to(device)
    training = train_pack(model, task, configs, device, checkpoints=checkpoints, **training_options)
    return (
        model,
        training,
        evaluate(
            model,
            configs[0].build_evaluation_task(),
            configs[0],
            device,
            progress=training_options["progress"],
        ),
    )


def _record_outcome(
    configs: list[RunConfig],
    results: list[RunResult],
    model: BenchModel,
    training: PackTraining,
    evaluations: list[Evaluation],
    models_dir: str | Path | None,
    tracking: Trackers,
) -> None:
    """Fill the results of a pack that trained and evaluated, log the evaluations to the
    trackers and keep completed runs' weights."""
    for member, (config, result, evaluation) in enumerate(
        zip(configs, results, evaluations, strict=False)
    ):
        result.timings.update(training.timings)
        result.timings["eval_s"] = evaluation.seconds
        diverged_at = training.diverged_at[member]
        if diverged_at is not None:
            result.error = f"diverged at step {diverged_at}: loss is not finite (lr {config.lr:g})"
            continue
        result.status = "complete"
        result.take_scores(evaluation)
        tracking.log_evaluation(member, evaluation)
        if models_dir is not None:
            save_model(models_dir, config, member_state_dict(model, member))


def build_pack_model(task: Task, configs: Sequence[RunConfig]) -> BenchModel:
    """The model of a pack (on the CPU): member m initialised exactly as run m alone would be,
    from ``torch.manual_seed(configs[m].seed)``; the global RNG is left after the last one."""
    first = configs[0]
    return build_members(
        first.arch, task, [config.seed for config in configs], **first.model_arguments()
    )


def execute_runs(
    configs: Sequence[RunConfig],
    options: RuntimeOptions | None = None,
    *,
    pack: int | str = 1,
    on_step: Callable[[int, list[float]], None] | None = None,
    **changes: Any,
) -> list[RunResult]:
    """Train and evaluate ``configs`` in packs of at most ``pack`` members (``"auto"``: as wide
    as the device allows, see ``che_bench.run.packing``), one pack after another, each with
    ``execute_pack``, ``options`` (keyword ``changes`` as there) and ``on_step``. Results
    come back in the order of ``configs``."""
    options = runtime_options(options, changes)
    if options.deterministic:
        prepare_deterministic_cublas()
    torch_device = resolve_device(options.device)
    # Before ``--pack auto``'s probe, which measures the step the runs take (TF32 and
    # deterministic algorithms change the kernels and their workspaces).
    check_portable_device(torch_device, options.portable_cpu)
    configure_numerics(options.tf32, options.deterministic, options.portable_cpu)
    hooks = {} if on_step is None else {"on_step": on_step}
    results: dict[str, RunResult] = {}
    for members in packs_on(configs, pack, torch_device):
        for result in execute_pack(members, options, **hooks):
            results[result.run_id] = result
    return [results[config.run_id()] for config in configs]


def execute_run(
    config: RunConfig,
    options: RuntimeOptions | None = None,
    *,
    on_step: Callable[[int, float], None] | None = None,
    **changes: Any,
) -> RunResult:
    """Train and evaluate one configuration (a pack of one; ``options`` and ``changes`` as in
    ``execute_pack``); never touches the result store. ``on_step(step, loss)`` is called
    after every optimizer step."""
    on_member_step = None if on_step is None else (lambda step, losses: on_step(step, losses[0]))
    return execute_pack([config], options, on_step=on_member_step, **changes)[0]
