"""Checkpoints of a pack's members: one file per run, resumable by a pack of any width.

A member's file holds its weights and Adam state (its row of ``PackOptimizer``'s flat
buffers), its data and draw generators, its history, the pack's shared RNG states and the
step. The weights are fingerprinted by the shapes of one member's parameters, so a member
checkpointed in a pack of 8 resumes alone, in a pack of 2 (an out-of-memory split) or in a
pack of 30 (``--pack auto`` on a GPU with more free memory) -- and bit for bit in a pack of
the same members. A checkpoint of another model is still refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from che_bench.atomic import save_atomically
from che_bench.config import RunConfig
from che_bench.errors import CheBenchError
from che_bench.model.architectures import build_architecture
from che_bench.model.base import BenchModel
from che_bench.train.batches import BatchStream
from che_bench.train.history import TrainingHistory
from che_bench.train.layout import WIDTH_BOUND_FORMAT
from che_bench.train.optimizer import PackOptimizer, pack_optimizer

#: Checkpoint layout version. 3: the layout fingerprint (``che_bench.train.layout``) leaves
#: out the member axis; version 2 (``WIDTH_BOUND_FORMAT``) is still read.
CHECKPOINT_FORMAT = 3


def checkpoint_step(path: Path, config: RunConfig) -> int:
    """The step a member's checkpoint was written at (0 when there is none)."""
    if not path.exists():
        return 0
    return int(read_checkpoint(path, config)["step"])


def read_checkpoint(path: Path, config: RunConfig) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheBenchError(
            f"unreadable checkpoint {path} ({exc}); delete it to start over"
        ) from None
    if state.get("format") not in (CHECKPOINT_FORMAT, WIDTH_BOUND_FORMAT):
        raise CheBenchError(
            f"checkpoint {path} was written by another che-bench version; delete it to start over"
        )
    if state.get("run_id") != config.run_id():
        raise CheBenchError(f"checkpoint {path} belongs to another run; delete it to start over")
    return state


def checkpoint_model(path: Path, config: RunConfig) -> tuple[int, BenchModel]:
    """The step a run's checkpoint was written at, and the model with the weights it holds
    (one member, on the CPU, eval mode): the run as it stood then, for evaluation."""
    if not path.exists():
        raise CheBenchError(
            f"run {config.run_id()} has no checkpoint ({path} is missing: the run completed, "
            "ran without checkpoints, or the file was removed)"
        )
    state = read_checkpoint(path, config)
    model = build_architecture(config.arch, config.build_task(), **config.model_arguments())
    pack_optimizer(model, [config]).load_member_state(0, state)
    return int(state["step"]), model.eval()


def save_checkpoints(
    paths: Sequence[Path],
    configs: Sequence[RunConfig],
    optimizer: PackOptimizer,
    rng_states: dict[str, Any],
    step: int,
    train_seconds: float,
    history: TrainingHistory,
    device: torch.device,
) -> None:
    """One file per member, each written atomically (temp file + rename), so a kill never
    leaves a torn checkpoint. ``rng_states``: the generators' after the last batch trained on
    (``BatchStream.states``). The dropout RNG is the pack's: a member resumed in a pack of
    other members continues statistically, not bit for bit. On a GPU only the training
    device's RNG state is kept, so a machine with fewer GPUs can resume."""
    shared = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "train_seconds": train_seconds,
        "length_rng": rng_states["length"],
        "torch_rng": torch.get_rng_state(),
        "device_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }
    for member, (path, config) in enumerate(zip(paths, configs, strict=True)):
        state = {
            **shared,
            "run_id": config.run_id(),
            "data_rng": rng_states["data"][member],
            "draw_rng": rng_states["draw"][member],
            "history": history.state(member),
            **optimizer.member_state(member),
        }
        save_atomically(state, path, "checkpoint")


def load_checkpoints(
    paths: Sequence[Path],
    configs: Sequence[RunConfig],
    optimizer: PackOptimizer,
    stream: BatchStream,
    history: TrainingHistory,
    device: torch.device,
) -> tuple[int, float]:
    """Restore every member from its file (all at one step); returns (step, training
    seconds before)."""
    states = [read_checkpoint(path, config) for path, config in zip(paths, configs, strict=True)]
    steps = {int(state["step"]) for state in states}
    if len(steps) != 1:
        raise CheBenchError("the members of a pack must resume from the same step")
    for member, state in enumerate(states):
        optimizer.load_member_state(member, state)
        history.restore(member, state.get("history"))
    step = steps.pop()
    stream.restore(
        {
            "step": step,
            "length": states[0]["length_rng"],
            "data": [s["data_rng"] for s in states],
            "draw": [state["draw_rng"] for state in states],
        }
    )
    torch.set_rng_state(states[0]["torch_rng"])
    # (Absent from checkpoints written before: those saved every visible GPU's state.)
    if device.type == "cuda" and states[0].get("device_rng") is not None:
        torch.cuda.set_rng_state(states[0]["device_rng"], device)
    return step, float(states[0]["train_seconds"])
