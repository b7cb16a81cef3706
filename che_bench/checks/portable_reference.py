"""``che-bench selftest --portable-reference``: does this CPU repeat the portable CPU mode's
reference run bit for bit?

The reference (``REFERENCE_PATH``) is one quick-preset run made with ``--portable-cpu``
(``REFERENCE_ARGUMENTS``): its final weights (a digest), its logged training losses and its
per-length accuracies, with the CPU it ran on, its software and its seconds, and the scores
others reported for the same command on other CPUs (score only). The check makes the same run
in a fresh process, as a user starts one (the mode's settings must be in place before torch
starts), into a temporary store, and compares: the same bits, or by how much each length
differs. A repeat means something only with the same torch, numpy and Python builds: a
difference in them is named.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from che_bench.cpu import cpu_description
from che_bench.errors import CheBenchError

#: The committed reference run.
REFERENCE_PATH = Path(__file__).resolve().parent.parent / "data" / "portable_reference.json"
#: The reference's command, after ``che-bench`` (the check adds a store and ``--no-progress``).
REFERENCE_ARGUMENTS = (
    "run",
    "--task",
    "missing_duplicate_string",
    "--pe",
    "kerple",
    "--preset",
    "quick",
    "--seed",
    "0",
    "--length-seed",
    "0",
    "--threads",
    "1",
    "--portable-cpu",
)
#: The builds a bit-for-bit repeat needs to share (keys of a run's recorded versions).
BUILDS = ("torch", "numpy", "python")
SPLITS = ("test", "train")


@dataclass
class PortableRun:
    """One run of the portable mode, as the reference records it."""

    arguments: list[str]
    run_id: str
    cpu: str
    versions: dict[str, str]
    score: float
    #: Accuracy by split ("test", "train") and length.
    per_length: dict[str, dict[int, float]]
    #: The logged training losses, as (step, loss).
    losses: list[tuple[int, float]]
    weights_sha256: str
    seconds: dict[str, float]
    measured_on: str
    #: Scores reported for the same command on other CPUs: {"cpu", "score_percent", "source"}.
    elsewhere: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        content = asdict(self)
        content["per_length"] = {
            split: {str(n): accuracy for n, accuracy in lengths.items()}
            for split, lengths in self.per_length.items()
        }
        content["losses"] = [list(row) for row in self.losses]
        return content

    @classmethod
    def from_json(cls, content: dict[str, Any]) -> PortableRun:
        content = dict(content)
        content["per_length"] = {
            split: {int(n): float(accuracy) for n, accuracy in lengths.items()}
            for split, lengths in content["per_length"].items()
        }
        content["losses"] = [(int(step), float(loss)) for step, loss in content["losses"]]
        return cls(**content)


def load_reference(path: Path = REFERENCE_PATH) -> PortableRun:
    """The reference run stored at ``path``."""
    try:
        return PortableRun.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheBenchError(f"cannot read the portable reference {path}: {exc}") from None


def weights_digest(path: Path) -> str:
    """SHA-256 of a kept model's (or checkpoint's) ``state`` tensors, by name."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)["state"]
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def run_portable(arguments: Sequence[str], timeout_s: float | None = None) -> PortableRun:
    """``che-bench ARGUMENTS`` (one ``run`` in the portable mode) in a fresh process, into a
    temporary store, read back as a ``PortableRun``."""
    with tempfile.TemporaryDirectory(prefix="che-bench-portable-") as folder:
        store_path = Path(folder) / "che-bench.sqlite"
        command = [sys.executable, "-m", "che_bench.cli", *arguments, "--no-progress"]
        finished = subprocess.run(
            [*command, "--store", str(store_path)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if finished.returncode != 0:
            last = (finished.stderr.strip().splitlines() or ["no message"])[-1]
            raise CheBenchError(f"the portable run failed (exit {finished.returncode}): {last}")
        return _read_run(store_path, list(arguments))


def _read_run(store_path: Path, arguments: list[str]) -> PortableRun:
    """The one run of the store at ``store_path``, with its kept weights' digest."""
    from che_bench.run.kept_models import model_path, models_dir_for
    from che_bench.store import ResultStore

    store = ResultStore(store_path)
    (row,) = store.runs().itertuples()
    curves = store.per_length([row.run_id])
    timings = json.loads(row.timings)
    return PortableRun(
        arguments=arguments,
        run_id=row.run_id,
        cpu=cpu_description(),
        versions=json.loads(row.versions),
        score=float(row.score),
        per_length={
            split: {int(n): float(a) for n, a in zip(rows["length"], rows["accuracy"], strict=True)}
            for split, rows in curves.groupby("split")
        },
        losses=[
            (int(step), float(loss))
            for step, loss in store.history([row.run_id])[["step", "loss"]].itertuples(index=False)
        ],
        weights_sha256=weights_digest(model_path(models_dir_for(store_path), row.run_id)),
        seconds={name: round(float(timings[name]), 1) for name in ("train_s", "eval_s")},
        measured_on=time.strftime("%Y-%m-%d", time.gmtime()),
    )


@dataclass
class LengthDifference:
    split: str
    length: int
    reference: float
    measured: float


@dataclass
class Comparison:
    """A run of this CPU against the reference."""

    reference: PortableRun
    measured: PortableRun
    weights_equal: bool
    #: The first logged step whose loss differs (None: every logged loss is equal).
    first_loss_step: int | None
    #: The per-length accuracies that differ (lengths one run has and the other lacks: NaN).
    lengths: list[LengthDifference]
    #: The builds that differ: name -> (reference's, this CPU's).
    builds: dict[str, tuple[str, str]]

    @property
    def identical(self) -> bool:
        return self.weights_equal and self.first_loss_step is None and not self.lengths

    @property
    def lengths_compared(self) -> int:
        return sum(len(lengths) for lengths in self.reference.per_length.values())

    def matching_elsewhere(self) -> list[str]:
        """The other CPUs whose reported score (rounded as reported) this run's equals."""
        measured = round(100 * self.measured.score, 2)
        return [
            other["cpu"]
            for other in self.reference.elsewhere
            if math.isclose(float(other["score_percent"]), measured)
        ]


def compare(reference: PortableRun, measured: PortableRun) -> Comparison:
    """``measured`` against ``reference``, bit for bit."""
    expected_losses, losses = dict(reference.losses), dict(measured.losses)
    first_loss_step = next(
        (
            step
            for step in sorted(set(expected_losses) | set(losses))
            if not _same_bits(expected_losses.get(step), losses.get(step))
        ),
        None,
    )
    differences = []
    for split in SPLITS:
        expected = reference.per_length.get(split, {})
        got = measured.per_length.get(split, {})
        for n in sorted(set(expected) | set(got)):
            if not _same_bits(expected.get(n), got.get(n)):
                differences.append(
                    LengthDifference(split, n, expected.get(n, math.nan), got.get(n, math.nan))
                )
    builds = {
        name: (reference.versions.get(name, "?"), measured.versions.get(name, "?"))
        for name in BUILDS
        if reference.versions.get(name) != measured.versions.get(name)
    }
    return Comparison(
        reference,
        measured,
        weights_equal=reference.weights_sha256 == measured.weights_sha256,
        first_loss_step=first_loss_step,
        lengths=differences,
        builds=builds,
    )


def _same_bits(first: float | None, second: float | None) -> bool:
    """Whether two recorded numbers are the same double (NaN equal to NaN); None: absent."""
    return repr(first) == repr(second)
