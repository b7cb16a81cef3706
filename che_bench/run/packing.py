"""Which runs train together: grouping a grid into packs, and how wide a pack may be.

Runs pack when they differ only in seed, data seed and learning rate (``RunConfig.pack_key``)
and share a length seed. ``--pack N`` caps a pack at N members; ``--pack auto`` makes packs as
wide as the device allows: on a GPU, as many members as fit in its free memory (measured with
one training step of a pack of ``PROBE_MEMBERS`` at the longest training length, under the
run's numerics); on a CPU, ``CPU_AUTO_WIDTH`` (packing there gains nothing measurable: see
``CPU_AUTO_WIDTH``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from che_bench.config import group_into_packs
from che_bench.device_memory import free_gpu_memory, release_memory
from che_bench.errors import CheBenchError

if TYPE_CHECKING:  # torch is imported where a width is measured: `--pack` is checked first
    import torch

    from che_bench.config import RunConfig

AUTO = "auto"
#: ``--pack auto`` on a CPU. There a step is memory-bound: a pack of 4 measured 0.99-1.07x
#: four single steps on the 2-core reference machine (benchmarks/results/
#: bench_pack_cpu_2core.json), break-even at best, so a CPU packs only when asked to and
#: keeps one run per worker.
CPU_AUTO_WIDTH = 1
#: Share of the free GPU memory a pack's training may fill (the rest: fragmentation, the
#: evaluation's own budget, other processes sharing the GPU).
GPU_MEMORY_SHARE = 0.7
#: Upper bound of ``--pack auto`` (beyond it a step is compute-bound: no further gain).
MAX_AUTO_WIDTH = 64
#: Members of the pack ``--pack auto`` measures: two run the code every wider pack runs, where
#: one member may take another path (a one-member lstm trains with cuDNN's fused kernel on a
#: GPU, a pack with the batched loop, which holds every time step's activations).
PROBE_MEMBERS = 2


def parse_pack_width(text: str) -> int | str:
    """``auto`` or a positive integer, else a CheBenchError."""
    if text == AUTO:
        return AUTO
    try:
        width = int(text)
    except ValueError:
        width = 0
    if width < 1:
        raise CheBenchError(f"--pack takes a positive integer or 'auto', got {text!r}")
    return width


def training_bytes_per_member(config: RunConfig, device: torch.device) -> int:
    """Peak device memory of one training step at the longest training length, per member of
    a pack of ``PROBE_MEMBERS`` (its share of what the pack holds beyond the weights: an upper
    bound on what each member of a wider pack adds); measured on ``device``, a GPU (elsewhere
    only with faked memory queries, in tests)."""
    import numpy as np
    import torch

    from che_bench.model.architectures import build_architecture
    from che_bench.train.metrics import token_loss
    from che_bench.train.step import teacher_targets

    task = config.build_task()
    length = config.train_max_length
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = build_architecture(
            config.arch, task, members=PROBE_MEMBERS, **config.model_arguments()
        ).to(device)
        batch = task.sample(length, config.batch_size, np.random.default_rng(0))
        inputs = torch.from_numpy(batch.inputs.copy())
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        # A model trained with teacher forcing reads the targets, as in its training step.
        teacher = teacher_targets(model, torch.from_numpy(batch.targets.copy()).to(device))
        logits = model(inputs.to(device), **teacher)
        targets = torch.zeros(logits.shape[:-1], dtype=torch.long, device=device)
        token_loss(logits, targets).sum().backward()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - baseline
    del model, logits
    torch.cuda.empty_cache()
    return max(1, peak // PROBE_MEMBERS)


def resolve_width(width: int | str, config: RunConfig, device: torch.device) -> int:
    """The pack width to use on ``device``: ``width`` itself, or for ``auto`` what the device
    allows (see the module docstring)."""
    import torch

    if width != AUTO:
        return int(width)
    if device.type != "cuda":
        return CPU_AUTO_WIDTH
    try:
        per_member: int | None = training_bytes_per_member(config, device)
    except torch.cuda.OutOfMemoryError:
        per_member = None  # not even the probe's pack fits: one member at a time
    if per_member is None:
        release_memory(device)  # past the except block, whose traceback held the probe
        return 1
    usable = int(free_gpu_memory(device) * GPU_MEMORY_SHARE)
    return max(1, min(MAX_AUTO_WIDTH, usable // per_member))


def packs_on(
    configs: Sequence[RunConfig], width: int | str, device: torch.device
) -> list[list[RunConfig]]:
    """``configs`` in the packs they train in on ``device``, one after another: each table
    cell (``group_into_packs``) cut into packs of ``resolve_width(width, ...)`` members."""
    packs = []
    for cell in group_into_packs(configs, None):
        members = resolve_width(width, cell[0], device)
        packs += [cell[start : start + members] for start in range(0, len(cell), members)]
    return packs
