"""Experiment trackers (optional extras): TensorBoard event files and Weights & Biases runs.

Each run gets its own tracker run, named by its run id: TensorBoard writes to ``DIR/<run id>/``,
W&B logs to project ``PROJECT`` (W&B's own settings apply: ``WANDB_MODE=offline`` keeps
everything on disk, and is passed on as the run's mode). During training they log the
history rows (``che_bench.train.history``: ``train/loss``, ``train/accuracy``, ``train/grad_norm``,
``train/lr``, ``train/elapsed_s`` at each row's step); at the end of a completed run, the
scores and the per-length accuracy curve (token and exact match). A resumed run logs only its
new rows, under the same name. A missing extra is a one-line error naming the pip command.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from che_bench.config import RunConfig
from che_bench.errors import CheBenchError

#: History fields logged as ``train/<field>`` scalars.
LOGGED_FIELDS = ("loss", "accuracy", "grad_norm", "lr", "elapsed_s")


@dataclass(frozen=True)
class TrackerOptions:
    """Where to log (picklable, so it travels to sweep workers): a TensorBoard directory
    and/or a W&B project."""

    tensorboard: str | None = None
    wandb: str | None = None

    def check(self) -> None:
        """Import the extras asked for, or raise the one-line error naming the pip command."""
        if self.tensorboard is not None:
            _tensorboard_writer_class()
        if self.wandb is not None:
            _wandb()


def _missing(extra: str, package: str) -> CheBenchError:
    return CheBenchError(f'--{extra} needs the {package} package: pip install "che-bench[{extra}]"')


def _tensorboard_writer_class():
    try:
        importlib.import_module("tensorboard")
        return importlib.import_module("torch.utils.tensorboard").SummaryWriter
    except ImportError:
        raise _missing("tensorboard", "tensorboard") from None


def _wandb():
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise _missing("wandb", "wandb") from None


class _TensorBoardRun:
    def __init__(self, directory: str, config: RunConfig) -> None:
        self.writer = _tensorboard_writer_class()(log_dir=str(Path(directory) / config.run_id()))

    def log_row(self, row: dict[str, Any]) -> None:
        for name in LOGGED_FIELDS:
            self.writer.add_scalar(f"train/{name}", row[name], global_step=row["step"])

    def log_evaluation(self, evaluation: Any, step: int) -> None:
        for name in ("score", "train_accuracy", "exact_score", "train_exact_accuracy"):
            self.writer.add_scalar(f"eval/{name}", getattr(evaluation, name), global_step=step)
        for length, accuracy in evaluation.per_length.items():
            self.writer.add_scalar("eval/accuracy_by_length", accuracy, global_step=length)
            self.writer.add_scalar(
                "eval/exact_match_by_length",
                evaluation.exact_per_length[length],
                global_step=length,
            )

    def close(self) -> None:
        self.writer.close()


class _WandbRun:
    def __init__(self, project: str, config: RunConfig) -> None:
        wandb = _wandb()
        mode = {"mode": os.environ["WANDB_MODE"]} if os.environ.get("WANDB_MODE") else {}
        self.table = wandb.Table
        self.run = wandb.init(
            project=project,
            name=config.run_id(),
            id=config.run_id(),
            resume="allow",
            config=config.to_dict(),
            reinit="create_new",
            **mode,
        )

    def log_row(self, row: dict[str, Any]) -> None:
        self.run.log({f"train/{name}": row[name] for name in LOGGED_FIELDS}, step=row["step"])

    def log_evaluation(self, evaluation: Any, step: int) -> None:
        for name in ("score", "train_accuracy", "exact_score", "train_exact_accuracy"):
            self.run.summary[f"eval/{name}"] = getattr(evaluation, name)
        curve = self.table(
            columns=["length", "accuracy", "exact_match"],
            data=[[n, a, evaluation.exact_per_length[n]] for n, a in evaluation.per_length.items()],
        )
        self.run.log({"eval/accuracy_by_length": curve}, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The tracker runs of a pack's members (none without options)."""

    def __init__(self, options: TrackerOptions | None, configs: Sequence[RunConfig]) -> None:
        self.members: list[list[Any]] = [[] for _ in configs]
        self.steps = [config.steps for config in configs]
        if options is None:
            return
        for runs, config in zip(self.members, configs, strict=True):
            if options.tensorboard is not None:
                runs.append(_TensorBoardRun(options.tensorboard, config))
            if options.wandb is not None:
                runs.append(_WandbRun(options.wandb, config))

    def log_row(self, member: int, row: dict[str, Any]) -> None:
        for run in self.members[member]:
            run.log_row(row)

    def log_evaluation(self, member: int, evaluation: Any) -> None:
        """A completed run's ``evaluation.Evaluation``, logged at its last step."""
        for run in self.members[member]:
            run.log_evaluation(evaluation, self.steps[member])

    def close(self) -> None:
        for runs in self.members:
            for run in runs:
                run.close()
        self.members = [[] for _ in self.members]
