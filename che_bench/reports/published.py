"""Published state-tracking results beside che-bench's cells (``table --compare NAME``), and
the registry of every comparison but DAPE V2's (``paper``): Grazzi et al.'s (``grazzi``),
PaTH's flip-flop Table 1 (``path``), Liu et al.'s flip-flop results (``flip_flop``), PD-SSM's
Table 3 (``pd_ssm``), SLiCE's Table 2 (``slice``) and DeltaProduct's Figure 1
(``deltaproduct``, read off the figure).

Each of the five is a long table shipped inside the package (a copy of results/reference/,
which the tests keep identical), one published value a row, as the spec
(shared/spec/word_problems.md) gives it (``as_printed``, ``spec_line``): the che-bench
architecture, its options (``arch_options``, JSON, the transformer's ``pe`` too), task and
task parameters a run must be tested under (its own or its evaluation's ``eval_task_params``)
for the value to sit beside its cell (no architecture or no
task: che-bench has no such model or task, and the value is listed in the notes); the
settings of the source's protocol (``protocol``, JSON: che-bench settings, a run's model
options, ``train_task_params`` and ``test_lengths``); and ``not_comparable``, what keeps every
run from following it. A cell is compared (ours minus theirs, our ``ours`` statistic: max or
mean over runs) only where its runs followed every published setting.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from che_bench import protocol
from che_bench.config import TRANSFORMER
from che_bench.reports import grazzi
from che_bench.reports.labels import run_settings
from che_bench.reports.paper import read_published_table
from che_bench.settings import BY_NAME, stored_value
from che_bench.store import ResultStore

#: Published values in another unit than che-bench's accuracy in percent, as that accuracy:
#: a read error e % is accuracy 100 - e (flip-flop's read error is 1 - the pooled accuracy,
#: which is why the flip-flop comparisons need ``--metric pooled``).
AS_ACCURACY = {
    "read error %": lambda value: 100 - value,
    "prefix accuracy (approximate)": lambda value: 100 * value,
}
JSON_COLUMNS = ("arch_options", "task_params", "protocol")


@dataclass(frozen=True)
class PublishedComparison:
    """One published table (``file`` under che_bench/data and results/reference) and what its
    notes say: ``title`` (source, metric, statistic) and ``unstated`` (the protocol's
    settings the source does not give, which a comparable cell may differ in)."""

    name: str
    file: str
    title: str
    unstated: str = ""
    #: The che-bench metric its cells are set beside (``table --metric``).
    metric: str = "token"

    @property
    def reference_file(self) -> Path:
        return Path("results") / "reference" / self.file

    def load_table(self) -> pd.DataFrame:
        """The published rows as printed (text, ``""`` where empty), ``value`` a number and
        the JSON columns parsed (empty: ``{}``)."""
        table = read_published_table(
            ("data", self.file), self.name, dtype=str, keep_default_na=False
        )
        table["value"] = table["value"].astype(float)
        for column in JSON_COLUMNS:
            table[column] = [json.loads(text) if text else {} for text in table[column]]
        return table

    def with_protocol_differences(self, runs: pd.DataFrame) -> pd.DataFrame:
        """Labelled runs whose ``paper_differences`` are those from the protocol of their
        published row (``published_row``: its index, None where no row matches the run)."""
        table = self.load_table()
        matches = [matching_row(table, settings) for settings in runs["settings"]]
        return runs.assign(
            paper_differences=[
                () if row is None else tuple(protocol_differences(table.loc[row], settings))
                for row, settings in zip(matches, runs["settings"], strict=True)
            ],
            # Object: pandas would turn a column of row numbers and None into floats and NaN.
            published_row=pd.Series(matches, index=runs.index, dtype=object),
        )

    def add_published(self, cells: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
        """``cells`` with ``paper`` (the published value as accuracy in percent, NaN where no
        row matches), ``comparable``, ``diff`` (ours minus theirs) and ``differences``."""
        table = self.load_table()
        rows = dict(
            zip(
                zip(runs["task_label"], runs["column"], strict=True),
                runs["published_row"],
                strict=True,
            )
        )
        matched = [rows.get(key) for key in zip(cells["task_label"], cells["column"], strict=True)]
        cells = cells.assign(
            paper=[math.nan if row is None else accuracy(table.loc[row]) for row in matched]
        )
        cells["comparable"] = [
            row is not None and not differences
            for row, differences in zip(matched, cells["paper_differences"], strict=True)
        ]
        ours = [
            cell[table.at[row, "ours"] or "max"] if row is not None else math.nan
            for row, (_, cell) in zip(matched, cells.iterrows(), strict=True)
        ]
        cells["diff"] = (pd.Series(ours, index=cells.index) - cells["paper"]).where(
            cells["comparable"]
        )
        cells["differences"] = cells["paper_differences"]
        return cells

    def notes(self, runs: pd.DataFrame) -> list[str]:
        """The source and its statistic, what it leaves unstated, and every published value
        no cell of ``runs`` (``ResultStore.runs()`` rows) shows."""
        table = self.load_table()
        shown = {
            matching_row(table, run_settings(config, evaluation))
            for config, evaluation in zip(runs["config"], runs["protocol"], strict=True)
        }
        lines = [
            f"{self.title}; in brackets: ours minus theirs where the runs followed its "
            "protocol, otherwise what differs"
        ]
        if self.unstated:
            lines.append(self.unstated)
        listed = table[[row not in shown for row in table.index]]
        if len(listed):
            lines.append(f"published, beside no cell here: {unshown_text(listed)}")
        return lines


def matching_row(table: pd.DataFrame, settings: dict[str, Any]) -> int | None:
    """The first published row whose architecture, options, task and task parameters the run
    (``run_settings``) has, the task parameters those it was evaluated under (its
    ``eval_task_params`` over its own: flip-flop's split); None when there is none."""
    tested = {**settings["task_params"], **settings.get("eval_task_params", {})}
    for index, row in table.iterrows():
        if (
            row["arch"] == settings.get("arch", TRANSFORMER)
            and row["task"] == settings["task"]
            and all(tested.get(k) == v for k, v in row["task_params"].items())
            and all(run_value(settings, k) == v for k, v in row["arch_options"].items())
        ):
            return int(index)
    return None


def run_value(settings: dict[str, Any], key: str) -> Any:
    """A run's value of ``key``: an option of its architecture (with the defaults; the
    transformer's model options), otherwise a setting (its default where not stored)."""
    arch = settings.get("arch", TRANSFORMER)
    if arch != TRANSFORMER:
        from che_bench.model.architectures import ARCHITECTURES, architecture_options

        options = dict(settings.get("arch_options", {}))
        if arch in ARCHITECTURES.names():
            options = architecture_options(arch, options)
        if key in options:
            return options[key]
    if key in BY_NAME:
        return stored_value(settings, BY_NAME[key])
    return settings.get(key)


def protocol_differences(row: pd.Series, settings: dict[str, Any]) -> list[str]:
    """How a run differs from the protocol of a published row: what keeps every run from it
    first, then each published setting the run does not have (ours, then theirs); the
    training distribution (``train_task_params``) is the run's own task parameters, whatever
    its evaluation's ``eval_task_params``."""
    differences = [f"{row['column']}: {row['not_comparable']}"] if row["not_comparable"] else []
    for key, theirs in row["protocol"].items():
        if key == "train_task_params":
            ours = {name: settings["task_params"].get(name) for name in theirs}
            if ours != theirs:
                differences.append(
                    f"trained on {_params_text(ours)} (theirs {_params_text(theirs)})"
                )
        elif key == "test_lengths":
            lengths = tuple(settings["test_lengths"])
            if lengths != protocol.parse_lengths(theirs):
                differences.append(
                    f"test lengths {protocol.format_lengths(lengths)} (theirs {theirs})"
                )
        elif (ours := run_value(settings, key)) != theirs:
            text = f"no option {key}" if ours is None else f"{key} {ours}"
            differences.append(f"{text} (theirs {theirs})")
    return differences


def split_evaluations_note(store: ResultStore, run_ids: Iterable[str]) -> list[str]:
    """A note naming the re-evaluations of ``run_ids`` under other task parameters
    (``eval_task_params``: flip-flop's sparse and dense splits) and how to show them, for a
    table of the runs' original evaluations; none when there are none."""
    evaluations = store.evaluations(list(run_ids))
    found = []
    for evaluation in dict.fromkeys(evaluations.loc[~evaluations["original"], "evaluation"]):
        protocol = json.loads(store.runs(None, evaluation)["protocol"].iloc[0])
        if protocol.get("eval_task_params"):
            found.append(f"{evaluation} ({_params_text(protocol['eval_task_params'])})")
    if not found:
        return []
    return [
        f"these runs were also tested under other task parameters, in evaluation(s) "
        f"{', '.join(found)}: --evaluation ID sets them beside the published values"
    ]


def _params_text(params: dict[str, Any]) -> str:
    return ", ".join(f"{name}={value}" for name, value in params.items())


def accuracy(row: pd.Series) -> float:
    """A published row's value as che-bench's accuracy in percent (``AS_ACCURACY``)."""
    return float(AS_ACCURACY.get(row["metric"], lambda value: value)(row["value"]))


def unshown_text(rows: pd.DataFrame) -> str:
    """Published rows by model: ``model (why not): column value, ...; ...``, values as
    printed, each model's metric once."""
    parts = []
    for model, group in rows.groupby("model", sort=False):
        first = group.iloc[0]
        reason = f", {first['not_comparable']}" if first["not_comparable"] else ""
        values = ", ".join(
            f"{c} {v}" for c, v in zip(group["column"], group["as_printed"], strict=True)
        )
        parts.append(f"{model} ({first['metric']}{reason}): {values}")
    return "; ".join(parts)


PUBLISHED = (
    PublishedComparison(
        "path",
        "path_table1_flip_flop.csv",
        "PaTH (arXiv 2505.16381) Table 1: flip-flop read error % of a 1-layer, 2-head, "
        "width-64 model trained on FFL(0.8), in distribution (ID), on FFL(0.98) (sparse) and "
        "FFL(0.1) (dense), shown as accuracy 100 - error beside our pooled accuracy of "
        "flip_flop tested at that p_ignore",
        "PaTH does not state its sequence length, steps or data source: a comparable cell "
        "assumes T = 512 (n = 256) and may differ in budget; the sparse and dense columns sit "
        "beside a run trained on FFL(0.8) and evaluated with --eval-task-param p_ignore=0.98 "
        "or 0.1 (shown with --evaluation ID)",
        metric="pooled",
    ),
    PublishedComparison(
        "flip_flop",
        "liu2023_flip_flop.csv",
        "Liu et al. 2023 (arXiv 2306.00946v2): flip-flop read error % (every run's; shown as "
        "accuracy 100 - error, set against our mean pooled accuracy) of a 1-layer LSTM, "
        "hidden 128, trained 500 steps x 16 on FFL(0.8) at T = 512, tested on FFL(0.98) and "
        "FFL(0.1): beside a run trained on FFL(0.8) and evaluated with --eval-task-param "
        "p_ignore=0.98 or 0.1 (shown with --evaluation ID)",
        metric="pooled",
    ),
    PublishedComparison(
        "pd_ssm",
        "pd_ssm_table3.csv",
        "PD-SSM (arXiv 2509.22284) Table 3: best validation accuracy % of 3 seeds on A5 and "
        "S5 automata, trained on lengths <= 40, validated on 40..256",
    ),
    PublishedComparison(
        "slice",
        "slice_table2.csv",
        "SLiCE (arXiv 2505.17761) Table 2 (= PD-SSM Table 2): accuracy %, mean of 5 seeds "
        "(set against our mean), 2 layers, trained on 3..40, validated on 40..256 (as the "
        "state_tracking preset translates these lengths)",
        "SLiCE's Table 2 does not state its steps, batch or learning rate in the text read: a "
        "comparable cell may differ in them",
    ),
    PublishedComparison(
        "deltaproduct",
        "deltaproduct_fig1.csv",
        "DeltaProduct (arXiv 2502.10297) Figure 1, read off the image [F], approximate: "
        "prefix accuracy (shown x 100) by sequence length of 1-layer DeltaProduct_n_h on S5, "
        "trained at length 128",
    ),
)

#: Every comparison but ``paper``, by name: each has ``metric``, ``with_protocol_differences``,
#: ``add_published`` and ``notes`` (Grazzi et al.'s: ``reports.grazzi``).
COMPARISONS: dict[str, Any] = {grazzi.COMPARISON: grazzi} | {c.name: c for c in PUBLISHED}
