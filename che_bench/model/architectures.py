"""Every architecture che-bench trains, by name: ``transformer`` (the encoder, with a
positional encoding and DAPE), CHE's recurrent baselines, and the models plugins register.

A plugin's model is a ``che_bench.model.base.BenchModel`` subclass decorated with
``@register_model`` (see that module for what a model receives and returns); it is built as
``cls(task, members=M, **options)`` with every option of its ``defaults`` resolved (the
given ones over the defaults). ``build_architecture`` builds any of them,
``build_members`` a pack whose member m is initialised as run m alone would be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from che_bench.encodings import canonical_encoding_name, given_options
from che_bench.errors import CheBenchError, accepted_text, one_line
from che_bench.members import load_member_states
from che_bench.model.autoregressive import AutoregressiveTransformer
from che_bench.model.base import BenchModel
from che_bench.model.dape.processor import describe_filter
from che_bench.model.encoder import Encoder, build_model
from che_bench.model.recurrent import (
    ARCHITECTURES as RECURRENT,
)
from che_bench.model.recurrent import (
    LABELS as RECURRENT_LABELS,
)
from che_bench.model.recurrent import (
    PRESETS as RECURRENT_PRESETS,
)
from che_bench.model.recurrent import (
    build_recurrent,
    recurrent_defaults,
)
from che_bench.model.state_tracking import MODELS as STATE_TRACKING_MODELS
from che_bench.model.state_tracking import delta_rule_native
from che_bench.model.state_tracking.deltanet import DeltaRuleModel
from che_bench.registry import Registry
from che_bench.setting_types import spelt_default
from che_bench.tasks.base import Task

#: The default architecture: the only one with a positional encoding and DAPE.
TRANSFORMER = "transformer"


@dataclass(frozen=True)
class Architecture:
    """A registered architecture: ``build(task, members=M, **options)`` (None for the
    transformer, built with its encoding by ``build_model``), its ``defaults`` (every option
    and its value when not given), its ``label`` in tables and the run settings it trains
    with under each preset where they differ from the transformer's (``presets``)."""

    name: str
    label: str
    build: Callable[..., BenchModel] | None
    defaults: dict[str, Any] = field(default_factory=dict)
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    description: str = ""


ARCHITECTURES: Registry[Architecture] = Registry("architecture")


def register_model(*aliases: Any):
    """Class decorator: make a ``BenchModel`` subclass available as an architecture under
    its ``name`` and ``aliases`` (``@register_model`` or ``@register_model("alias")``); a
    name already taken, or a class that is not a named BenchModel, is a CheBenchError.

    Runs build it as ``cls(task, members=M, **options)`` with every option of its
    ``defaults`` (the ones given over the defaults; an option not in ``defaults`` is refused
    before the class is called), a pack through ``build_members``. The first paragraph of
    the class docstring is what ``che-bench models`` says of it; the plugin whose import
    registers it is recorded with every run of it."""

    def decorate(cls: type[BenchModel]) -> type[BenchModel]:
        if not (isinstance(cls, type) and issubclass(cls, BenchModel)):
            raise CheBenchError(
                f"register_model: {cls!r} is not a che_bench.model.BenchModel subclass"
            )
        if not cls.name:
            raise CheBenchError(f"model class {cls.__name__} does not set name")
        entry = Architecture(
            cls.name,
            cls.label or cls.name,
            cls,
            dict(cls.defaults),
            {preset: dict(values) for preset, values in cls.presets.items()},
            (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " "),
        )
        ARCHITECTURES.add(cls.name, entry, aliases, module=cls.__module__)
        return cls

    if len(aliases) == 1 and isinstance(aliases[0], type):  # bare @register_model
        return decorate(aliases[0])
    return decorate


def canonical_architecture(name: str) -> str:
    return ARCHITECTURES.canonical(name)


def get_architecture(name: str) -> Architecture:
    return ARCHITECTURES.get(name)


def native_kernels(
    arch: str, options: dict[str, Any], dape_kernel: int | None, device: torch.device
) -> dict[str, str]:
    """How the kernels that ``arch`` with ``options`` (and DAPE with key kernel
    ``dape_kernel``, None: no DAPE) may compile run on ``device`` in this process, for the
    run's record: ``dape_filter`` for DAPE (``describe_filter``); ``delta_rule`` for a
    delta-rule model with a forget gate or Householder products (Gated DeltaNet,
    DeltaProduct). Nothing is compiled for another device than a CPU."""
    dape = {} if dape_kernel is None else {"dape_filter": describe_filter(device)}
    model = get_architecture(arch).build
    if not (isinstance(model, type) and issubclass(model, DeltaRuleModel)):
        return dape
    if not model.has_native_rule(architecture_options(arch, options)):
        return dape
    return {**dape, "delta_rule": delta_rule_native.describe(device)}


def architecture_options(arch: str, options: dict[str, Any]) -> dict[str, Any]:
    """Every option of ``arch`` (not the transformer): ``options`` over its defaults; an
    option it does not take is a CheBenchError naming those it does (or the model class's
    reason, ``refused_options``, for one it refuses on purpose)."""
    entry = get_architecture(arch)
    unknown = sorted(set(options) - set(entry.defaults))
    refused: dict[str, str] = getattr(entry.build, "refused_options", {})
    for key in (key for key in unknown if key in refused):
        raise CheBenchError(f"{entry.name} takes no option {key}: {refused[key]}")
    if unknown:
        raise CheBenchError(
            f"{entry.name} takes no option {', '.join(unknown)} ({accepted_text(entry.defaults)})"
        )
    return {**entry.defaults, **options}


def architecture_overrides(
    overrides: dict[str, Any], pe: str | None
) -> tuple[dict[str, Any], str | None]:
    """A run's ``overrides`` without None values, ``arch`` canonical (default: the
    transformer), its ``arch_options`` and the encoding's ``pe_options`` without those spelt
    out at their default (``spelt_default``: such a run's id is the id without them), and
    (overrides, pe) with ``--pe`` and ``--pe-option`` made the options ``pe`` (canonical,
    left out at its default) and ``pe_options`` of an architecture other than the
    transformer that takes them (CHE's autoregressive transformer)."""
    overrides = {key: value for key, value in overrides.items() if value is not None}
    arch = overrides["arch"] = canonical_architecture(overrides.get("arch", TRANSFORMER))
    defaults = get_architecture(arch).defaults
    if "arch_options" in overrides:
        overrides["arch_options"] = {
            key: value
            for key, value in overrides["arch_options"].items()
            if key not in defaults or not spelt_default(value, defaults[key])
        }
    if arch == TRANSFORMER or "pe" not in defaults:
        if isinstance(overrides.get("pe_options"), dict) and arch == TRANSFORMER:
            overrides["pe_options"] = given_options(pe or "none", overrides["pe_options"])
        return overrides, pe
    options = dict(overrides.get("arch_options", {}))
    options.update({} if pe in (None, "none") else {"pe": pe})  # the CLI's --pe is "none"
    if "pe" in options:
        options["pe"] = canonical_encoding_name(str(options["pe"]))
        if options["pe"] == defaults["pe"]:
            del options["pe"]
    if overrides.get("pe_options"):
        options["pe_options"] = {**options.get("pe_options", {}), **overrides["pe_options"]}
    if isinstance(options.get("pe_options"), dict):
        encoding = options.get("pe", defaults["pe"])
        options["pe_options"] = given_options(encoding, options["pe_options"])
        if not options["pe_options"]:
            del options["pe_options"]
    rest = {key: value for key, value in overrides.items() if key != "pe_options"}
    return {**rest, "arch_options": options}, None


def build_architecture(
    arch: str,
    task: Task,
    *,
    pe: str = "none",
    kernel: int | None = None,
    members: int = 1,
    **options: Any,
) -> BenchModel:
    """Architecture ``arch`` for ``task``, ``members`` models side by side, initialised from
    torch's global RNG. ``pe``, ``kernel`` and ``options``: the transformer's
    (``build_model``), or the other architecture's options (``architecture_options``)."""
    entry = get_architecture(arch)
    if entry.build is None:
        return build_model(task, pe, kernel, members=members, **options)
    if "pe" in entry.defaults:  # an architecture with a positional encoding: --pe is its own
        if kernel is not None:
            raise CheBenchError(
                f"{entry.name} takes no DAPE kernel (--kernel): DAPE processes square "
                "self-attention maps, not cross-attention or one decoding step"
            )
        options = {**options, "pe": pe}
    resolved = architecture_options(entry.name, options)
    try:
        return entry.build(task, members=members, **resolved)
    except CheBenchError:
        raise
    except (ValueError, TypeError) as exc:
        raise CheBenchError(f"architecture {entry.name!r}: {one_line(exc)}") from None


def build_members(arch: str, task: Task, seeds: Sequence[int], **arguments: Any) -> BenchModel:
    """A pack of ``len(seeds)`` members (``build_architecture``'s ``arguments``), member m
    initialised exactly as the model built alone after ``torch.manual_seed(seeds[m])``; the
    global RNG is left after the last one."""
    models = []
    for seed in seeds:
        torch.manual_seed(seed)
        models.append(build_architecture(arch, task, **arguments))
    if len(models) == 1:
        return models[0]
    with torch.random.fork_rng(devices=[]):  # the pack's own initialisation is overwritten
        pack = build_architecture(arch, task, members=len(models), **arguments)
    return load_member_states(pack, models)


#: What ``che-bench models`` says of the built-ins.
_DESCRIPTIONS = {
    TRANSFORMER: "the CHE encoder (5 layers x 64 wide x 8 heads in the paper preset) with a "
    "positional encoding (--pe) and DAPE (--kernel)",
    "rnn": "CHE's vanilla RNN (hk.VanillaRNN, ReLU)",
    "lstm": "CHE's LSTM (hk.LSTM)",
    "stack_rnn": "CHE's Stack-RNN: a vanilla RNN with a differentiable stack (push, pop, no-op)",
    "stack_lstm": "CHE's Stack-LSTM: an LSTM with a differentiable stack (push, pop, no-op)",
    "ndstack_rnn": "CHE's NDStack-RNN: a vanilla RNN with DuSell & Chiang's differentiable "
    "nondeterministic stack (push, pop, replace over states and symbols)",
    "tape_rnn": "CHE's Tape-RNN: a vanilla RNN with a tape (write, stay, left, right, jumps)",
}


def _register_built_ins() -> None:
    ARCHITECTURES.add(
        TRANSFORMER,
        Architecture(
            TRANSFORMER,
            Encoder.label or TRANSFORMER,
            None,
            description=_DESCRIPTIONS[TRANSFORMER],
        ),
    )
    for name in RECURRENT:
        ARCHITECTURES.add(
            name,
            Architecture(
                name,
                RECURRENT_LABELS[name],
                _recurrent_builder(name),
                recurrent_defaults(name),
                RECURRENT_PRESETS,
                _DESCRIPTIONS[name],
            ),
        )
    register_model(AutoregressiveTransformer)  # CHE's other transformer
    for model in STATE_TRACKING_MODELS:
        register_model(model)


def _recurrent_builder(name: str) -> Callable[..., BenchModel]:
    def build(task: Task, *, members: int, **options: Any) -> BenchModel:
        return build_recurrent(name, task, members=members, **options)

    return build


_register_built_ins()
