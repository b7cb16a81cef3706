"""Check (d) of the self-test: the paper-size model's training step on the device, alone and
in the widest ``--pack auto`` pack, its peak memory, and estimates (labelled so) of a paper
run's and a table cell's training time."""

from __future__ import annotations

import math
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from che_bench.config import RunConfig, make_config
from che_bench.run.packing import AUTO, resolve_width
from che_bench.run.runner import build_pack_model
from che_bench.settings import BY_NAME
from che_bench.tasks.base import Task
from che_bench.train.batches import mixed_pack_batch
from che_bench.train.optimizer import pack_optimizer
from che_bench.train.progress import duration_text
from che_bench.train.step import (
    micro_batches_for,
    projected_modules,
    training_autocast,
    training_step,
)

PAPER_STEPS = BY_NAME["steps"].default_for("paper")


@dataclass
class Measurement:
    """A figure of (d): ``kind`` is "measured" or "estimate"."""

    name: str
    value: float
    unit: str
    kind: str
    note: str = ""


#: The task every check of the self-test trains and runs.
TASK = "reverse_string"
#: Runs of one table cell in the published protocol: 10 seeds x 3 learning rates.
RUNS_PER_CELL = 30


#: The preset whose model (d) times: the paper's.
SPEED_PRESET = "paper"
#: The preset whose training time ``check-model`` estimates.
ESTIMATE_PRESET = "quick"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU), so that timings are whole."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak tensor memory on a GPU; on a CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``repeats`` calls of ``call`` (warm it up first where the first
    call pays for set-up)."""
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def step_seconds(
    configs: Sequence[RunConfig],
    device: torch.device,
    repeats: int,
    warm_up: int = 1,
    length: int | None = None,
    mixed_lengths: Sequence[int] | None = None,
) -> float:
    """Median seconds of one training step of the pack ``configs``, in its training precision,
    after ``warm_up`` untimed steps: on a batch of ``length`` (default the longest training
    length), or with ``mixed_lengths``, on a mixed-length batch of these lengths."""
    task = configs[0].build_task()
    model = build_pack_model(task, configs).to(device).train()
    optimizer = pack_optimizer(model, configs)
    projected = projected_modules(model)
    length = configs[0].train_max_length if length is None else length
    inputs, targets, lengths = _timed_batch(task, configs, length, mixed_lengths)
    inputs, targets = inputs.to(device), targets.to(device)
    lengths = None if lengths is None else lengths.to(device)
    micro_batches = micro_batches_for(len(configs), device)
    autocast = training_autocast(configs[0])

    def step() -> None:
        training_step(
            model,
            optimizer,
            inputs,
            targets,
            projected,
            micro_batches,
            lengths=lengths,
            autocast=autocast,
        )
        synchronize(device)  # the step's queued work, whole

    synchronize(device)  # the model's and the batches' copies, outside every timing
    for _ in range(warm_up):
        step()
    return median_seconds(step, repeats)


def _timed_batch(
    task: Task, configs: Sequence[RunConfig], length: int, mixed_lengths: Sequence[int] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(inputs, targets, a mixed batch's lengths or None) of each member: ``length`` long, or
    of ``mixed_lengths`` padded as a mixed-length step's (``che_bench.train.batches``)."""
    rngs = [np.random.default_rng(config.data_seed) for config in configs]
    if mixed_lengths is None:
        samples = [task.sample(length, configs[0].batch_size, rng) for rng in rngs]
        inputs = np.stack([sample.inputs for sample in samples])
        targets = np.stack([sample.targets for sample in samples])
        return torch.from_numpy(inputs), torch.from_numpy(targets), None
    inputs, targets, _, lengths = mixed_pack_batch(task, mixed_lengths, rngs)
    return torch.from_numpy(inputs), torch.from_numpy(targets), torch.from_numpy(lengths)


def model_speed_line(arch: str, options: dict[str, Any], device: torch.device, threads: int) -> str:
    """``check-model``'s speed line (``speed_line``) for ``arch`` built with ``options`` (over
    its defaults, as a run builds it)."""
    config = make_config(TASK, preset=ESTIMATE_PRESET, arch=arch, arch_options=options, seed=0)
    return speed_line(config, device, threads)


def encoding_speed_line(
    pe: str, options: dict[str, Any], causal: bool, device: torch.device, threads: int
) -> str:
    """``check-encoding``'s speed line (``speed_line``): the transformer with encoding ``pe``
    (``options``) at the preset's size, causal or not."""
    config = make_config(TASK, pe, None, ESTIMATE_PRESET, seed=0, pe_options=options, causal=causal)
    return speed_line(config, device, threads)


def speed_line(config: RunConfig, device: torch.device, threads: int) -> str:
    """The measured time of one training step of ``config``'s model on ``TASK`` at the quick
    preset's batch size and longest training length, on ``threads`` torch threads (a run's:
    ``--threads``, 1 by default), and the quick preset's training time at that speed (at
    most: shorter lengths are faster; evaluation not included)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = step_seconds([config], device, repeats=3)
    finally:
        torch.set_num_threads(before)
    plural = "s" if threads != 1 else ""
    return (
        f"speed: {1e3 * seconds:.1f} ms per training step ({TASK}, batch {config.batch_size}, "
        f"n = {config.train_max_length}, {device.type}, {threads} thread{plural}); "
        f"the {ESTIMATE_PRESET} preset's {config.steps:,} steps: about "
        f"{duration_text(config.steps * seconds)} of training (at most: shorter lengths are "
        "faster; evaluation not included)"
    )


def measure_speed(device: torch.device, quick: bool) -> list[Measurement]:
    """(d) paper-size step times at n = 40, peak memory, and estimates of a paper run and a
    table cell (training only: 200k steps at the longest length bound it from above)."""
    pe, kernel = ("kerple", None) if quick else ("kerple", 3)
    label = f"{TASK}, {pe}{'' if kernel is None else f' + DAPE k={kernel}'}"
    single = [make_config(TASK, pe, kernel, SPEED_PRESET, seed=0, length_seed=0)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    repeats = 2 if quick else 10
    one = step_seconds(single, device, repeats)
    width = resolve_width(AUTO, single[0], device)
    pack = [
        make_config(TASK, pe, kernel, SPEED_PRESET, seed=seed, length_seed=0)
        for seed in range(width)
    ]
    wide = one if width == 1 else step_seconds(pack, device, repeats)
    packs_per_cell = math.ceil(RUNS_PER_CELL / width)
    return [
        Measurement(
            f"step, one run ({label}, batch {single[0].batch_size}, "
            f"n = {single[0].train_max_length})",
            1e3 * one,
            "ms",
            "measured",
        ),
        Measurement(f"step, --pack auto = {width} runs", 1e3 * wide, "ms", "measured"),
        Measurement(
            "peak memory",
            peak_memory_bytes(device) / 2**30,
            "GiB",
            "measured",
            "tensors on a GPU; on a CPU the process's peak resident set",
        ),
        Measurement(
            "one paper run, training",
            PAPER_STEPS * one / 3600,
            "h",
            "estimate",
            f"{PAPER_STEPS:,} steps x the step at n = 40 (an upper bound); evaluation not included",
        ),
        Measurement(
            f"one table cell ({RUNS_PER_CELL} runs), training",
            packs_per_cell * PAPER_STEPS * wide / 3600,
            "h",
            "estimate",
            f"{packs_per_cell} pack(s) of <= {width} one after another, "
            f"{PAPER_STEPS:,} steps each; evaluation not included",
        ),
    ]
