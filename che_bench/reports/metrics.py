"""The metrics a table, plot or export shows: which stored columns each reads, what its
notes say, and a runs or per-length frame with a metric's values in the accuracy columns."""

from __future__ import annotations

import pandas as pd

from che_bench.errors import CheBenchError
from che_bench.reports import METRICS
from che_bench.reports.scaled import with_scaled_accuracy

#: The two names of exact match.
SEQUENCE_METRICS = ("exact", "sequence")
#: The stored columns a metric other than token accuracy reads, by the columns it fills.
METRIC_COLUMNS = {
    "exact": {
        "score": "exact_score",
        "train_accuracy": "train_exact_accuracy",
        "accuracy": "exact_accuracy",
    },
    "pooled": {
        "score": "pooled_score",
        "train_accuracy": "train_pooled_accuracy",
        "accuracy": "pooled_accuracy",
    },
}
METRIC_COLUMNS["sequence"] = METRIC_COLUMNS["exact"]
METRIC_NOTES = {
    "token": "accuracy % = correct scored tokens / scored tokens",
    "exact": "exact match % = sequences with every scored token right / sequences",
    "sequence": "sequence accuracy % (exact match) = sequences with every scored token right / "
    "sequences",
    "pooled": "pooled accuracy % = correct / scored tokens of all test sequences together "
    "(100 - it: the pooled error, flip-flop's read error)",
    "scaled": "scaled accuracy % = (accuracy - chance) / (1 - chance), chance = 1 / number of "
    "classes (Grazzi et al.)",
}
#: What the chance column holds, per metric (``reports.chance``).
CHANCE_NOTES = {
    "token": "chance = 1 / number of classes",
    "exact": "chance = exact match of a uniform guesser: (1 / number of classes) to the "
    "power of a sequence's scored positions, averaged over sequences and the "
    "score's test lengths",
    "scaled": "chance = 0 on this scale",
    "pooled": "chance = 1 / number of classes",
}
CHANCE_NOTES["sequence"] = CHANCE_NOTES["exact"]


def check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise CheBenchError(f"unknown metric {metric!r}; valid: {', '.join(METRICS)}")


def with_metric(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    """A ``ResultStore.runs()`` or ``per_length()`` frame whose ``score`` / ``train_accuracy``
    / ``accuracy`` columns hold ``metric``; for exact match and pooled accuracy, rows without
    it are left out."""
    check_metric(metric)
    if metric == "token":
        return frame
    if metric == "scaled":
        return with_scaled_accuracy(frame)
    frame = frame.assign(
        **{
            name: frame[source]
            for name, source in METRIC_COLUMNS[metric].items()
            if source in frame
        }
    )
    key = "score" if "score" in frame else "accuracy"
    return frame[frame[key].notna()].reset_index(drop=True)
