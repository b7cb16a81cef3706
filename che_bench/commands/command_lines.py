"""``che-bench run`` command lines that recreate stored runs: built from the settings'
declarations and checked by parsing them with the command line's own parser (the report
prints them, ``che_bench.reports.html``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from che_bench import protocol, settings
from che_bench.errors import CheBenchError


def run_command_line(config: dict[str, Any], run_id: str) -> list[str] | None:
    """``che-bench run`` arguments that recreate the run with this stored config, or None when
    no such command exists (settings without a flag). Checked: the arguments are parsed by the
    CLI's own parser and must give back ``run_id``."""
    from che_bench.cli import build_parser
    from che_bench.commands.run import overrides_from_args
    from che_bench.config import make_config

    try:
        argv = ["run", "--task", config["task"]]
        if config.get("arch", "transformer") == "transformer":
            argv += ["--pe", config["pe"]]
        if config["kernel"] is not None:
            argv += ["--kernel", str(config["kernel"])]
        argv += ["--preset", config["preset"]]
        lengths = ("test_lengths", "train_eval_lengths")
        for setting in settings.run_settings():
            if setting.flag is not None and setting.name not in lengths:
                argv += _setting_arguments(setting, config)
        # Lengths last: the preset's "auto" in-distribution lengths follow the other settings
        # (the test lengths first, which a sample set checks against the training length).
        preset_tests = _preset_value(settings.BY_NAME["test_lengths"], config)
        argv += _lengths_arguments("test_lengths", protocol.parse_lengths(preset_tests), config)
        args = build_parser().parse_args(argv)
        resolved = make_config(
            args.task, args.pe, args.kernel, args.preset, **overrides_from_args(args)
        )
        argv += _lengths_arguments("train_eval_lengths", resolved.train_eval_lengths, config)
        args = build_parser().parse_args(argv)
        rebuilt = make_config(
            args.task, args.pe, args.kernel, args.preset, **overrides_from_args(args)
        )
    except (CheBenchError, KeyError, TypeError, SystemExit):
        return None  # an old or hand-edited config that today's CLI cannot express
    return argv if rebuilt.run_id() == run_id else None


def _setting_arguments(setting: settings.Setting, config: dict[str, Any]) -> list[str]:
    """The flag (and value) that gives ``setting`` its stored value, or nothing when the
    preset (or the setting it follows) already gives it."""
    from che_bench.config import TRANSFORMER_ONLY
    from che_bench.tasks import get_task

    flag = setting.flag
    if flag is None:
        return []  # set in suites and Python only
    if config.get("arch", "transformer") != "transformer" and setting.name in TRANSFORMER_ONLY:
        return []
    value = settings.stored_value(config, setting)
    if setting.kind == settings.KEY_VALUES:
        defaults: dict[str, Any] = {}
        if setting.name == "task_params":
            defaults = _preset_task_params(config)
            value = _with_reference_values(config["task"], value, defaults)
        return [
            item
            for key, item_value in sorted(value.items())
            if defaults.get(key) != item_value
            for item in (flag, f"{key}={_flag_value(item_value)}")
        ]
    if setting.follows is not None:
        default = config[setting.follows]
    elif setting.task_default is not None:
        default = settings.task_default(setting, get_task(config["task"], **config["task_params"]))
    else:
        default = _preset_value(setting, config)
    if setting.where == settings.DAPE and setting.name not in config["dape_options"]:
        return []  # no kernel, no DAPE options
    if value == default:
        return []
    if setting.kind == settings.SWITCH:
        return [flag if value else "--no-" + flag[2:]]
    return [flag, str(value)]


def _preset_task_params(config: dict[str, Any]) -> dict[str, Any]:
    """The task's parameters under the run's preset alone (its read-out where it sets one)."""
    from che_bench.tasks import get_task, listed_task_params

    at_preset = _preset_value(settings.BY_NAME["task_params"], config)
    return get_task(config["task"], **listed_task_params(config["task"], at_preset)).params()


def _with_reference_values(
    task: str, stored: dict[str, Any], at_preset: dict[str, Any]
) -> dict[str, Any]:
    """``stored`` with the reference value of each parameter the preset sets and the run's
    record leaves out (a parameter recorded only away from it: CHE's ``layout``)."""
    from che_bench.tasks import task_parameters

    reference = task_parameters(task)
    return {**{key: reference[key] for key in at_preset if key not in stored}, **stored}


def _preset_value(setting: settings.Setting, config: dict[str, Any]) -> Any:
    """The value the run's preset gives ``setting`` for the run's architecture."""
    from che_bench.model.architectures import get_architecture

    presets = get_architecture(config.get("arch", "transformer")).presets
    return protocol.preset_settings(config["preset"], presets).get(setting.name, setting.default)


def _flag_value(value: Any) -> str:
    """A ``KEY=VALUE`` value as ``parse_key_values`` reads it back (strings stay bare)."""
    return value if isinstance(value, str) else json.dumps(value)


def _lengths_arguments(name: str, resolved: Sequence[int], config: dict[str, Any]) -> list[str]:
    """The flag and value of the lengths setting ``name`` where the config's differ from
    ``resolved`` (what the command gives without them)."""
    if list(resolved) == config[name]:
        return []
    return [str(settings.BY_NAME[name].flag), _lengths_spec(config[name])]


def _lengths_spec(lengths: list[int]) -> str:
    """``--test-lengths`` text of a length list: runs of consecutive lengths as START:END."""
    parts, start = [], 0
    for index in range(1, len(lengths) + 1):
        if index == len(lengths) or lengths[index] != lengths[index - 1] + 1:
            first, last = lengths[start], lengths[index - 1]
            parts.append(str(first) if first == last else f"{first}:{last}")
            start = index
    return ",".join(parts)
