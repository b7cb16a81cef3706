"""What a run setting is (``Setting``) and the validators of its values; the settings
themselves are declared in ``che_bench.settings``, which re-exports these names."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from che_bench.errors import CheBenchError

#: Where a setting lives: a field of ``RunConfig``, a key of its ``model_options`` or
#: ``dape_options``, or a runtime option of the execution (recorded with the runs, never in
#: the run id: TF32, threads, ...).
RUN, MODEL, DAPE, RUNTIME = "run", "model", "dape", "runtime"
#: How a setting enters the run id: always, or only while it differs from its default
#: (settings added after results were first stored), or never (runtime options).
IN_ID, IN_ID_UNLESS_DEFAULT, NOT_IN_ID = "always", "unless default", "never"
#: Command-line value kinds beyond ``int`` / ``float`` / ``str``.
SWITCH = "switch"  # a flag without a value: given = True
KEY_VALUES = "key=value"  # repeatable KEY=VALUE items, collected into a dict

#: A setting's validator: ``check(label, value)`` returns the value to use, or raises the one
#: CheBenchError every way of giving the setting (flag, suite, Python API) reports.
Validator = Callable[[str, Any], Any]


def spelt_default(value: Any, default: Any) -> bool:
    """Whether an option's given ``value`` is its ``default`` spelt out: equal, and of the
    default's type (an integer for a float default too; never a number for a switch), so
    that it stays out of the run id. A value of another type goes on to the option's check."""
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return value == default
    return type(value) is type(default) and value == default


def at_least(minimum: int) -> Validator:
    """An integer >= ``minimum`` (numpy integers too; bools are not numbers here)."""

    def check(label: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            raise CheBenchError(f"{label} must be an integer >= {minimum}, got {value!r}")
        return int(value)

    return check


def positive_number(label: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CheBenchError(f"{label} must be a positive number, got {value!r}")
    return float(value)


def _real(value: Any) -> float:
    """``value`` as a float when it is a real number (not a bool), else NaN (no bound holds)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return math.nan
    return float(value)


def non_negative_number(label: str, value: Any) -> float:
    if not 0 <= _real(value) < math.inf:
        raise CheBenchError(f"{label} must be a number >= 0, got {value!r}")
    return float(value)


def fraction(label: str, value: Any) -> float:
    """A number in [0, 1]."""
    if not 0 <= _real(value) <= 1:
        raise CheBenchError(f"{label} must be a number in [0, 1], got {value!r}")
    return float(value)


def one_of(*choices: str) -> Validator:
    """One of ``choices`` (a string)."""

    def check(label: str, value: Any) -> str:
        if value not in choices:
            raise CheBenchError(f"{label} must be one of {', '.join(choices)}, got {value!r}")
        return str(value)

    return check


def true_or_false(label: str, value: Any) -> bool:
    """A bool (a suite's ``causal = true``), not a truthy string."""
    if not isinstance(value, (bool, np.bool_)):
        raise CheBenchError(f"{label} must be true or false, got {value!r}")
    return bool(value)


@dataclass(frozen=True)
class Setting:
    """One run setting. ``presets``: its value per preset (every preset names it); else
    ``default`` holds for all (an ``IN_ID_UNLESS_DEFAULT`` setting with presets has both:
    ``default`` is then the value left out of the run id). ``flag=None``: no command-line
    flag (suite files and the Python API only); ``metavar``: its flag's (KEY=VALUE for
    KEY_VALUES). ``follows``: the setting whose value it takes when not given;
    ``task_default``: the ``Task`` attribute that gives its value when not given (the task is
    defined with it), instead of ``default``. ``check``: its validator (``validate``)."""

    name: str
    kind: Any
    help: str
    where: str = RUN
    in_id: str = IN_ID
    default: Any = None
    presets: dict[str, Any] | None = None
    flag: str | None = ""
    metavar: str | None = None
    follows: str | None = None
    task_default: str | None = None
    check: Validator | None = None

    def __post_init__(self) -> None:
        if self.flag == "":
            object.__setattr__(self, "flag", "--" + self.name.replace("_", "-"))
        if self.kind == KEY_VALUES and self.metavar is None:
            object.__setattr__(self, "metavar", "KEY=VALUE")

    def default_for(self, preset: str) -> Any:
        """The value this setting has under ``preset`` when not overridden."""
        return self.presets[preset] if self.presets is not None else self.default

    @property
    def label(self) -> str:
        """How messages name it: a run setting by its name (a suite key, a ``make_config``
        keyword), a runtime option by its flag (runtime options have no suite key)."""
        return self.flag if self.where == RUNTIME and self.flag else self.name

    def validate(self, value: Any) -> Any:
        """``value`` checked by the setting's validator (None, "not given", passes)."""
        if value is None or self.check is None:
            return value
        return self.check(self.label, value)


def task_default(setting: Setting, task: Any) -> Any:
    """The value ``setting`` takes for ``task`` when not given."""
    return getattr(task, setting.task_default) if setting.task_default else setting.default


def stored_value(config: dict[str, Any], setting: Setting) -> Any:
    """The value of ``setting`` in a stored config dict (``RunConfig.to_dict``); its default
    when the dict leaves it out."""
    if setting.where == MODEL:
        return config["model_options"].get(setting.name, setting.default)
    if setting.where == DAPE:
        return config["dape_options"].get(setting.name, setting.default)
    return config.get(setting.name, setting.default)
