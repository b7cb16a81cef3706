"""Table cells that are the best over some architecture options (``che-bench table
--best-over``, a suite's ``best_over``).

The CHE paper scores its Tape-RNN as the best of six configurations (0, n or 2n computation
tokens x 1 or 4 tapes; arXiv 2207.02098, Section 4 and Appendix A.4). Given option names,
runs that differ only in those options share a column, labelled with how many
configurations it holds (``Tape-RNN (best of 6)``); its cell is the maximum over all of
them, as over seeds and learning rates, and names the configuration of its best run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd

from che_bench.errors import CheBenchError
from che_bench.model.option_text import options_text
from che_bench.reports.labels import labelled_runs, run_architecture

#: The column of a summary holding each cell's winning configuration.
BEST = "best"


def parse_best_over(values: Iterable[str] | None) -> tuple[str, ...]:
    """Option names from ``--best-over`` values (each one name or several, comma separated)."""
    names = [name.strip() for value in values or () for name in value.split(",")]
    if any(not name for name in names):
        raise CheBenchError("--best-over takes option names separated by commas, e.g. n_tapes")
    return tuple(dict.fromkeys(names))


def labelled(runs: pd.DataFrame, best_over: Sequence[str]) -> pd.DataFrame:
    """``labelled_runs(runs)`` with the runs that differ only in the ``best_over`` options in
    one column (``"<label> (best of K)"`` where it holds K > 1 configurations) and a
    ``configuration`` column: those options' values, e.g. ``computation_steps_mult=1,
    n_tapes=4`` ("" outside such a column)."""
    if not best_over:
        return labelled_runs(runs)
    _check_names(best_over, runs)
    configurations, configs = [], []
    for config_json in runs["config"]:
        config = json.loads(config_json)
        options = dict(config.get("arch_options") or {})
        configurations.append(_configuration(run_architecture(config), options, best_over))
        config["arch_options"] = {k: v for k, v in options.items() if k not in best_over}
        configs.append(json.dumps(config))
    frame = labelled_runs(runs.assign(config=configs))
    frame["configuration"] = configurations
    counts = frame.groupby("column")["configuration"].nunique()
    swept = [counts[column] > 1 for column in frame["column"]]
    frame["configuration"] = frame["configuration"].where(swept, "")
    frame["column"] = [
        f"{column} (best of {counts[column]})" if many else column
        for column, many in zip(frame["column"], swept, strict=True)
    ]
    return frame


def winners(cells: pd.DataFrame, runs: pd.DataFrame, keys: list[str]) -> list[str]:
    """The ``configuration`` of the best run (highest ``score_pct``, the first on a tie) of
    each cell of ``cells`` (grouped from ``runs`` by ``keys``)."""
    top = runs.loc[runs.groupby(keys, sort=False)["score_pct"].idxmax()]
    best = {tuple(row[keys]): row["configuration"] for _, row in top.iterrows()}
    return [best[tuple(row[keys])] for _, row in cells.iterrows()]


def notes(best_over: Sequence[str]) -> list[str]:
    """The table's note on its ``best of`` columns."""
    if not best_over:
        return []
    return [
        f"(best of K): runs that differ in {', '.join(best_over)} share the column; a cell is "
        "the maximum over its K configurations too (mean±std and n over all of them), [in "
        "brackets] the configuration of its best run"
    ]


def _configuration(arch: str, options: dict[str, Any], best_over: Sequence[str]) -> str:
    """The values of the ``best_over`` options ``arch`` takes (its default where not given)."""
    from che_bench.model.architectures import ARCHITECTURES

    registered = arch in ARCHITECTURES.names()
    defaults = ARCHITECTURES.get(arch).defaults if registered else {}
    values = {key: options.get(key, defaults.get(key)) for key in best_over}
    return options_text(
        {key: value for key, value in values.items() if key in options or key in defaults}
    )


def _check_names(best_over: Sequence[str], runs: pd.DataFrame) -> None:
    """Each name is an option of a registered architecture or of a stored run."""
    from che_bench.model.architectures import ARCHITECTURES

    known = {key for name in ARCHITECTURES.names() for key in ARCHITECTURES.get(name).defaults}
    for config_json in runs["config"]:
        known.update(json.loads(config_json).get("arch_options") or {})
    unknown = [name for name in best_over if name not in known]
    if unknown:
        raise CheBenchError(
            f"--best-over: no architecture takes option {', '.join(map(repr, unknown))}"
        )
