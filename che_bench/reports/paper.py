"""The published reference table (DAPE V2, Table 6) and how a run's protocol differs from
the paper's."""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

import pandas as pd

from che_bench import protocol
from che_bench.errors import CheBenchError
from che_bench.settings import BY_NAME, stored_value

#: The published table, shipped inside the package (a copy of results/reference/, which the
#: tests keep identical) so that installed wheels compare too.
PAPER_TABLE_RESOURCE = ("data", "dape_v2_table6.csv")


PAPER_TABLE_FILE = Path("results") / "reference" / "dape_v2_table6.csv"


PAPER_NOTE = (
    "paper: DAPE V2 (arXiv 2410.04798) Table 6: 200k steps, trained on lengths 1..40, "
    "score = mean accuracy over 41..500, max over runs"
)


#: The optimizer's settings besides Adam's betas, eps and clipping (CHE's at their defaults).
SCHEDULE_SETTINGS = ("optimizer", "weight_decay", "lr_schedule", "warmup_steps", "min_lr_ratio")


#: How many differences from the published protocol a table cell names.
SHOWN_DIFFERENCES = 3


#: Words for the model options that differ from the published model: counted ones read
#: "2 layers", the others "width 32".
_MODEL_OPTION_WORDS = {
    "layers": "layer",
    "dim": "width",
    "heads": "head",
    "ffn": "FFN",
    "dropout": "dropout",
}


_COUNTED_MODEL_OPTIONS = ("layers", "heads")


def paper_protocol_differences(settings: dict[str, Any]) -> list[str]:
    """How a run's settings (``run_settings``) differ from the published protocol, most telling
    first, e.g. ``["preset quick", "1500 steps", "2 layers", ...]``; empty when the run followed
    it: preset paper with its steps, batch, optimiser, model, uniform lengths 1..40, and the
    score over every test length 41..500 from 512 sequences each. Seeds, learning rates and
    dropout at evaluation may differ (the reference code keeps dropout on at evaluation)."""
    paper = protocol.preset_settings("paper")
    differences = [] if settings["preset"] == "paper" else [f"preset {settings['preset']}"]
    if settings["steps"] != paper["steps"]:
        differences.append(f"{settings['steps']} steps")
    model = settings["model_options"]
    differences += [
        _model_option_text(name, model.get(name))
        for name in _MODEL_OPTION_WORDS
        if settings.get("arch", "transformer") == "transformer" and model.get(name) != paper[name]
    ]
    if settings["batch_size"] != paper["batch_size"]:
        differences.append(f"batch {settings['batch_size']}")
    if settings["train_max_length"] != paper["train_max_length"]:
        differences.append(f"training lengths up to {settings['train_max_length']}")
    curriculum = stored_value(settings, BY_NAME["curriculum"])
    if curriculum != BY_NAME["curriculum"].default:
        differences.append(f"curriculum {curriculum}")
    if tuple(settings["test_lengths"]) != protocol.parse_lengths(paper["test_lengths"]):
        differences.append(f"test lengths {protocol.format_lengths(settings['test_lengths'])}")
    if settings["score_from_42"]:
        differences.append("score from 42")
    if settings["eval_samples"] != paper["eval_samples"]:
        differences.append(f"{settings['eval_samples']} samples")
    if settings["eval_batch_size"] != paper["eval_batch_size"]:
        differences.append(f"eval batch {settings['eval_batch_size']}")
    optimiser = (tuple(settings["adam_betas"]), settings["adam_eps"], settings["grad_clip_norm"])
    if optimiser != (protocol.ADAM_BETAS, protocol.ADAM_EPS, protocol.GRAD_CLIP_NORM) or any(
        stored_value(settings, BY_NAME[name]) != BY_NAME[name].default for name in SCHEDULE_SETTINGS
    ):
        differences.append("optimiser settings")
    return differences


def _model_option_text(name: str, value: Any) -> str:
    word = _MODEL_OPTION_WORDS[name]
    if name in _COUNTED_MODEL_OPTIONS:
        return f"{value} {word}" + ("" if value == 1 else "s")
    return f"{word} {value}"


def paper_protocol_text() -> str:
    paper = protocol.preset_settings("paper")
    return (
        f"preset paper: {paper['steps']} steps, batch {paper['batch_size']}, training lengths up "
        f"to {paper['train_max_length']}, score over test lengths "
        f"{protocol.format_lengths(protocol.parse_lengths(paper['test_lengths']))} from "
        f"{paper['eval_samples']} sequences each, model {paper['layers']} layers x "
        f"{paper['dim']} wide x {paper['heads']} heads"
    )


def read_published_table(
    resource_path: tuple[str, ...], comparison: str, **read_options: Any
) -> pd.DataFrame:
    """A published table shipped inside the package at ``che_bench/<resource_path>`` (read
    by ``pd.read_csv`` with ``read_options``); missing (a broken installation) is a one-line
    CheBenchError naming ``--compare comparison``."""
    resource = importlib.resources.files("che_bench")
    for part in resource_path:
        resource = resource.joinpath(part)
    try:
        with resource.open("rb") as handle:
            return pd.read_csv(handle, **read_options)
    except OSError:
        raise CheBenchError(
            f"the published table che_bench/{'/'.join(resource_path)} is missing from this "
            f"installation (needed for --compare {comparison}); reinstall che-bench"
        ) from None


def load_paper_table() -> pd.DataFrame:
    """The published table (shipped with the package), indexed by task id, values in percent."""
    return read_published_table(PAPER_TABLE_RESOURCE, "paper").set_index("task_id")


def paper_table_or_none() -> pd.DataFrame | None:
    """The published table, or None when its file is not available."""
    try:
        return load_paper_table()
    except CheBenchError:
        return None
