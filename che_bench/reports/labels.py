"""How a stored run is labelled everywhere (table columns, curves, exports, the report): its
encoding (with DAPE and '(causal)'), its task's level and chance, its settings."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

import pandas as pd

from che_bench.config import OMITTED_AT_DEFAULT, TRANSFORMER
from che_bench.errors import CheBenchError
from che_bench.model.option_text import options_text
from che_bench.reports import unregistered
from che_bench.reports.paper import paper_protocol_differences
from che_bench.reports.unregistered import UNKNOWN_LEVEL, recorded_task_label

#: Config fields that identify a cell's row and column, or vary within a cell (seeds, lrs).
#: ``length_seed`` seeds the draw of training lengths as ``seed`` and ``data_seed`` seed the
#: rest: ``--seeds 0,1`` sets it to 0 (so that the runs pack) where ``--seed 0`` leaves it
#: unset, and both are runs of one cell.
CELL_FIELDS = {
    "arch",
    "task",
    "task_params",
    "pe",
    "kernel",
    "seed",
    "data_seed",
    "length_seed",
    "lr",
    "train_eval_lengths",
}

LEVEL_LABELS = {"regular": "R", "dcf": "DCF", "cs": "CS", "recall": "recall"}

#: The CHE paper's own baselines (arXiv 2207.02098), whose published table could not be read.
CHE_BASELINES = ("rnn", "lstm", "stack_rnn", "stack_lstm", "ndstack_rnn", "tape_rnn")


#: Display names of the encodings in the published table (others keep their canonical name).
PAPER_ENCODING_LABELS = {
    "rope": "RoPE",
    "relative": "Relative",
    "alibi": "ALiBi",
    "kerple": "Kerple",
    "fire": "FIRE",
}


def run_encoding_label(config: str | Mapping[str, Any]) -> str:
    """The column name of a run, from its config (a dict or its stored JSON): a transformer's
    encoding as in the paper, ``Kerple``, ``DAPE_k1_Kerple``, ``DAPE_k3_Kerple``, and
    ``Kerple (causal)`` for decoder-style attention (no published column); another
    architecture's label and the options it was given that differ from its defaults, e.g.
    ``LSTM`` or ``LSTM · hidden_size=128``. Every label of a run comes from here."""
    from che_bench.model.option_text import changed_options, options_text

    fields: Mapping[str, Any] = json.loads(config) if isinstance(config, str) else config
    arch = run_architecture(fields)
    if arch != TRANSFORMER:
        options = options_text(changed_options(arch, fields.get("arch_options")))
        return architecture_label(arch) + (f" · {options}" if options else "")
    base = PAPER_ENCODING_LABELS.get(fields["pe"], fields["pe"])
    label = base if fields["kernel"] is None else f"DAPE_k{fields['kernel']}_{base}"
    return f"{label} (causal)" if fields.get("causal", False) else label


def run_model_label(config: str | Mapping[str, Any]) -> str:
    """``run_encoding_label`` plus the encoding options the run was given (those not at their
    defaults), e.g. ``fox · gate_bias_init=-2``: how listings, the run header and the
    report's "What ran" name a run's model."""
    fields: Mapping[str, Any] = json.loads(config) if isinstance(config, str) else config
    options = options_text(fields.get("pe_options") or {})
    label = run_encoding_label(fields)
    return f"{label} · {options}" if options else label


def run_task_label(config: str | Mapping[str, Any]) -> str:
    """A run's task as tables name it: with the parameters that differ from the task's
    defaults, e.g. ``modular_arithmetic(layout=harness)``."""
    fields: Mapping[str, Any] = json.loads(config) if isinstance(config, str) else config
    params = json.dumps(fields.get("task_params") or {}, sort_keys=True)
    _, _, label = _task_facts(fields["task"], params)
    return label


def run_parameters(details: Mapping[str, Any]) -> int | None:
    """A run's parameter count (one member) from its recorded details (``model.describe()``);
    None where none was recorded (a run that never built its model)."""
    model = details.get("model")
    return model.get("parameters") if isinstance(model, dict) else None


def run_architecture(config: Mapping[str, Any]) -> str:
    """A stored config's architecture (configs stored before architectures: the transformer)."""
    return str(config.get("arch", TRANSFORMER))


@cache
def architecture_label(name: str) -> str:
    """How tables name an architecture (``Transformer``, ``LSTM``, ``Stack-RNN``); its name
    when the plugin that registered it is not loaded."""
    from che_bench.model.architectures import ARCHITECTURES

    return ARCHITECTURES.get(name).label if name in ARCHITECTURES.names() else name


def architecture_order(name: str) -> int:
    """Where an architecture's columns go: the transformer's first, then in registration
    order (CHE's baselines, then plugins'), unknown ones last."""
    from che_bench.model.architectures import ARCHITECTURES

    names = ARCHITECTURES.names()
    return names.index(name) if name in names else len(names)


def architecture_summary(configs: Iterable[str]) -> str:
    """Runs per architecture, the transformer's with their columns, from stored configs
    (JSON), e.g. ``Transformer: 6 (Kerple, DAPE_k3_Kerple); LSTM: 3``."""
    columns: dict[str, list[str]] = {}
    for config in map(json.loads, configs):
        columns.setdefault(run_architecture(config), []).append(run_encoding_label(config))
    parts = []
    for arch in sorted(columns, key=architecture_order):
        labels = columns[arch]
        named = f" ({', '.join(dict.fromkeys(labels))})" if arch == TRANSFORMER else ""
        parts.append(f"{architecture_label(arch)}: {len(labels)}{named}")
    return "; ".join(parts)


def runs_of_architectures(runs: pd.DataFrame, archs: Iterable[str]) -> list[str]:
    """The run ids among ``runs`` (a ``ResultStore.runs()`` frame) of the architectures
    ``archs`` (names or aliases; an unknown one is a CheBenchError unless some stored run
    has it, as for a plugin not loaded)."""
    from che_bench.model.architectures import canonical_architecture

    stored = {run_architecture(json.loads(config)) for config in runs["config"]}
    wanted = {arch if arch in stored else canonical_architecture(arch) for arch in archs}
    return [
        run_id
        for run_id, config in zip(runs["run_id"], runs["config"], strict=True)
        if run_architecture(json.loads(config)) in wanted
    ]


def _task_facts(name: str, params_json: str) -> tuple[str, float, str]:
    """(level label, chance, table label) of a task with the given parameters (JSON): the
    chance of the task the run trained on, e.g. 1/7 for cycle_navigation(cycle_length=7). The
    label names the parameters that differ from the task's defaults. A task whose plugin is
    not loaded has an unknown level and chance, and its label names every parameter."""
    if not unregistered.task_known(name):
        return UNKNOWN_LEVEL, math.nan, recorded_task_label(name, json.loads(params_json))
    return _registered_task_facts(name, params_json)


@cache
def _registered_task_facts(name: str, params_json: str) -> tuple[str, float, str]:
    from che_bench.tasks import get_task

    task = get_task(name, **json.loads(params_json))
    default = get_task(name).params()
    changed = {key: value for key, value in task.params().items() if default.get(key) != value}
    label = (
        name
        if not changed
        else (f"{name}({', '.join(f'{k}={v}' for k, v in sorted(changed.items()))})")
    )
    return LEVEL_LABELS.get(task.level, task.level), task.chance, label


def tested_label(label: str, eval_task_params: dict[str, Any] | None) -> str:
    """A task's table label, naming the task parameters it was evaluated under where they
    are not the trained ones (``eval_task_params``), e.g. ``flip_flop, tested at
    p_ignore=0.98``."""
    if not eval_task_params:
        return label
    return f"{label}, tested at {', '.join(f'{k}={v}' for k, v in eval_task_params.items())}"


def run_settings(config_json: str, protocol_json: str | None) -> dict[str, Any]:
    """A run's config with the fields of the evaluation shown (its protocol JSON, None for a
    run without an evaluation) in place of the original ones."""
    config = json.loads(config_json)
    if isinstance(protocol_json, str):
        config.update(json.loads(protocol_json))
    return config


def labelled_runs(frame: pd.DataFrame) -> pd.DataFrame:
    """Add ``settings`` (``run_settings``: a dict), ``level``, ``chance``, ``task_label``,
    ``encoding`` (paper-style label), ``column`` and ``paper_differences`` to a
    ``ResultStore.runs()`` frame. ``column`` is the encoding label (after ``Transformer · ``
    when other architectures are in the frame) plus, when runs of that encoding differ in
    other settings (preset, steps, options...), those settings (``_telling_settings``: where
    the presets differ, the preset and what differs from it), so that different protocols
    never share a cell. ``paper_differences`` is
    ``paper_protocol_differences`` of each run."""
    frame = frame.copy()
    configs = [run_settings(c, p) for c, p in zip(frame["config"], frame["protocol"], strict=False)]
    frame["settings"] = configs
    facts = [_task_facts(c["task"], json.dumps(c["task_params"], sort_keys=True)) for c in configs]
    frame["level"] = [level for level, _, _ in facts]
    frame["chance"] = [chance for _, chance, _ in facts]
    frame["task_label"] = [
        tested_label(label, config.get("eval_task_params"))
        for (_, _, label), config in zip(facts, configs, strict=True)
    ]
    frame["encoding"] = [run_encoding_label(config) for config in configs]
    frame["architecture"] = [run_architecture(config) for config in configs]
    frame["paper_differences"] = [tuple(paper_protocol_differences(c)) for c in configs]
    variants = [_setting_values(config) for config in configs]
    varying: dict[str, list[str]] = {}
    varying_items: dict[str, dict[str, set[str]]] = {}
    for encoding in set(frame["encoding"]):
        group = [v for v, e in zip(variants, frame["encoding"], strict=False) if e == encoding]
        keys = set().union(*group)
        varying[encoding] = sorted(k for k in keys if len({v.get(k) for v in group}) > 1)
        varying_items[encoding] = _varying_items(
            [c for c, e in zip(configs, frame["encoding"], strict=False) if e == encoding],
            varying[encoding],
        )
    mixed = frame["architecture"].nunique() > 1
    frame["column"] = [
        _architecture_prefix(arch, mixed)
        + encoding
        + _settings_suffix(
            config, _telling_settings(config, variant, varying[encoding]), varying_items[encoding]
        )
        for arch, encoding, config, variant in zip(
            frame["architecture"], frame["encoding"], configs, variants, strict=True
        )
    ]
    return frame


def _varying_items(group: list[dict[str, Any]], keys: list[str]) -> dict[str, set[str]]:
    """For each setting of ``keys`` that is a table of items in every config of ``group``
    (``model_options``, ``pe_options``), the items whose values differ among them (an item
    a config lacks differs from one it has)."""
    found: dict[str, set[str]] = {}
    for key in keys:
        values = [{**OMITTED_AT_DEFAULT, **config}.get(key) for config in group]
        tables = [value for value in values if isinstance(value, dict)]
        if len(tables) == len(values):
            names: set[str] = set().union(*tables)
            found[key] = {
                name
                for name in names
                if len({json.dumps(table.get(name), sort_keys=True) for table in tables}) > 1
            }
    return found


def _setting_values(config: Mapping[str, Any]) -> dict[str, str]:
    """The settings (JSON) of a stored config that may tell columns apart: all but the cell's
    fields and an architecture's options (in its label already, those that differ from the
    defaults); settings stored only when not at their default count as the default where
    absent."""
    return {
        key: json.dumps(value, sort_keys=True)
        for key, value in {**OMITTED_AT_DEFAULT, **config}.items()
        if key not in CELL_FIELDS and key != "arch_options"
    }


def _telling_settings(
    config: Mapping[str, Any], values: dict[str, str], varying: list[str]
) -> list[str]:
    """The settings a run's column names, of those that vary among its encoding's runs
    (``varying``): all of them; or, where the runs follow different presets, the preset and
    the settings in which the run differs from its preset (a preset unknown here: all)."""
    preset_values = _preset_values(config) if "preset" in varying else None
    if preset_values is None:
        return varying
    return ["preset"] + [
        key for key in varying if key != "preset" and values.get(key) != preset_values.get(key)
    ]


def _preset_values(config: Mapping[str, Any]) -> dict[str, str] | None:
    """``_setting_values`` of the run its preset makes for its task, encoding and
    architecture with nothing overridden; None where the preset, the task or the
    architecture is not known here."""
    arch = run_architecture(config)
    pe = config["pe"] if arch == TRANSFORMER else None
    return _preset_run_values(
        json.dumps(
            [config["task"], config.get("task_params", {}), pe, config.get("kernel"), arch],
            sort_keys=True,
        ),
        str(config["preset"]),
    )


@cache
def _preset_run_values(run_json: str, preset: str) -> dict[str, str] | None:
    from che_bench.config import make_config

    task, task_params, pe, kernel, arch = json.loads(run_json)
    try:
        made = make_config(task, pe, kernel, preset, arch=arch, task_params=task_params)
    except CheBenchError:
        return None
    return _setting_values(made.to_dict())


def _architecture_prefix(arch: str, mixed: bool) -> str:
    """``Transformer · `` before an encoding's column where other architectures share the
    table (``Transformer · Kerple`` beside ``LSTM``); nothing in a transformers-only table,
    whose columns stay the published table's names."""
    return f"{architecture_label(TRANSFORMER)} · " if mixed and arch == TRANSFORMER else ""


def _settings_suffix(
    config: dict[str, Any], keys: list[str], varying_items: dict[str, set[str]] | None = None
) -> str:
    """`` [key=value, ...]`` of the settings that tell the encoding's runs apart (the preset
    by its name alone: `` [paper, steps=400]``); a table of items (the encoding's
    ``pe_options``, the model's ``model_options``) shows its own ``key=value`` items, those
    that tell the runs apart where ``varying_items`` names them (``layers=2``, not every
    model option), an item it lacks as ``name=default``, or ``pe_options=default`` when
    empty, never a dict."""
    if not keys:
        return ""
    values = {**OMITTED_AT_DEFAULT, **config}
    items = []
    for key in keys:
        value = values.get(key)
        if key == "preset":
            items.append(str(value))
        elif isinstance(value, dict):
            items.append(_items_text(key, value, (varying_items or {}).get(key)))
        else:
            items.append(f"{key}={short_value(value)}")
    return " [" + ", ".join(items) + "]"


def _items_text(key: str, table: dict[str, Any], varying: set[str] | None) -> str:
    """A table setting's items as a column label names them (``_settings_suffix``)."""
    if not table:
        return f"{key}=default"
    if not varying:
        return options_text(table)
    shown = options_text({name: value for name, value in table.items() if name in varying})
    lacking = [f"{name}=default" for name in sorted(varying) if name not in table]
    return ", ".join(part for part in (shown, *lacking) if part)


def short_value(value: Any) -> str:
    """A setting's value as labels show it: lengths as ranges, strings bare, None as
    ``none``, anything else as JSON (``true``, ``[0.9, 0.98]``)."""
    if isinstance(value, list) and len(value) > 3 and all(isinstance(v, int) for v in value):
        from che_bench.protocol import format_lengths

        return format_lengths(value)
    if value is None:
        return "none"
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
