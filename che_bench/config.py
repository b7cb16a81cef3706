"""The configuration of a run: what defines it (``RunConfig``), how runs group into packs.

``make_config`` resolves a preset plus overrides into a validated ``RunConfig``; what a run
produced is ``che_bench.outcomes``' (``Scores``, ``RunResult``). This module
imports nothing that trains or evaluates, so configuration flows one way: config -> training,
evaluation -> runner. It does not import torch either (``che_bench.model.check``'s
``check_evaluation`` builds the model once, imported when a config is checked), so the store
and the command line load it cheaply.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from che_bench import curricula, protocol, settings
from che_bench.errors import CheBenchError

#: The default architecture (``che_bench.model.architectures.TRANSFORMER``; this module
#: imports no model code).
TRANSFORMER = settings.BY_NAME["arch"].default

#: Model options a config records (and the flags that override them).
MODEL_OPTION_NAMES = tuple(setting.name for setting in settings.settings_where(settings.MODEL))
#: DAPE options; only meaningful with a kernel.
DAPE_OPTION_NAMES = tuple(setting.name for setting in settings.settings_where(settings.DAPE))
DAPE_DEFAULTS = {
    setting.name: setting.default for setting in settings.settings_where(settings.DAPE)
}
#: Fields added after results were first stored: left out of ``to_dict`` (and so of the run
#: id) while they hold their default, so that earlier run ids stay valid.
OMITTED_AT_DEFAULT = settings.omitted_at_default()
#: Fields that define how a run is evaluated (its evaluation protocol); everything else
#: defines the trained model.
EVALUATION_FIELDS = (
    "test_lengths",
    "train_eval_lengths",
    "eval_samples",
    "eval_batch_size",
    "eval_seed",
    "dropout_at_eval",
    "score_from_42",
    "eval_task_params",
    "sample_set",
)
DEFAULT_MIN_LR_RATIO = settings.BY_NAME["min_lr_ratio"].default
#: Fields in which the members of one pack may differ (everything else shapes every step).
MEMBER_FIELDS = ("seed", "data_seed", "lr")


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run (JSON-serialisable). The device is not part of it."""

    task: str
    task_params: dict[str, Any]
    pe: str
    pe_options: dict[str, Any]
    kernel: int | None
    dape_options: dict[str, Any]
    model_options: dict[str, Any]
    preset: str
    steps: int
    batch_size: int
    lr: float
    seed: int
    data_seed: int
    train_max_length: int
    test_lengths: tuple[int, ...]
    train_eval_lengths: tuple[int, ...]
    eval_samples: int
    eval_batch_size: int
    dropout_at_eval: bool = False
    #: Average the score over lengths > train_max_length + 1 (the reference scripts' 42..500).
    score_from_42: bool = False
    eval_seed: int = protocol.EVAL_SEED
    adam_betas: tuple[float, float] = protocol.ADAM_BETAS
    adam_eps: float = protocol.ADAM_EPS
    grad_clip_norm: float = protocol.GRAD_CLIP_NORM  # 0: no clipping
    #: Seed of the training-length schedule. None (as before this field existed): the lengths
    #: are drawn from the data generator, between the batches. Runs that share a length seed
    #: draw the same length at every step, so they can train side by side as one pack.
    length_seed: int | None = None
    #: Decoder-style (causal) attention instead of the CHE encoder's bidirectional one.
    causal: bool = False
    #: The architecture (``che_bench.model.architectures``) and, for one other than the
    #: transformer, the options given to it (the transformer's are ``model_options``).
    arch: str = TRANSFORMER
    arch_options: dict[str, Any] = field(default_factory=dict)
    #: The optimizer and its learning-rate schedule (``che_bench.train.optimizer``).
    optimizer: str = settings.BY_NAME["optimizer"].default
    weight_decay: float = settings.BY_NAME["weight_decay"].default
    lr_schedule: str = settings.BY_NAME["lr_schedule"].default
    warmup_steps: int = settings.BY_NAME["warmup_steps"].default
    min_lr_ratio: float = DEFAULT_MIN_LR_RATIO
    #: The training-length curriculum (``che_bench.curricula``) and its options, defaults filled.
    curriculum: str = curricula.UNIFORM
    curriculum_options: dict[str, Any] = field(default_factory=dict)
    #: Task parameters of the evaluation only, over ``task_params`` (e.g. flip-flop's splits).
    eval_task_params: dict[str, Any] = field(default_factory=dict)
    #: Training batches of one length per step (CHE's) or mixed lengths (the xLSTM harness's).
    batch_lengths: str = settings.ONE_LENGTH
    #: Training precision: float32, or bf16 autocast (the xLSTM harness's).
    train_precision: str = settings.FLOAT32
    #: Merrill et al.'s fixed data (``tasks.sample_sets``): distinct sequences a length, drawn
    #: once from the evaluation seed, those at train_max_length split 80/20; None: fresh ones.
    sample_set: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-compatible dict (tuples become lists)."""
        # A shallow field dict: asdict's deep copy is needlessly slow for long length tuples.
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        for name, default in OMITTED_AT_DEFAULT.items():
            if fields[name] == default:
                del fields[name]
        return json.loads(json.dumps(fields))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Inverse of ``to_dict``."""
        data = dict(data)
        for name in ("test_lengths", "train_eval_lengths", "adam_betas"):
            if name in data:
                data[name] = tuple(data[name])
        return cls(**data)

    def run_id(self) -> str:
        """Stable short hash of the configuration."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:12]

    def __hash__(self) -> int:  # dict fields are not hashable; the run id identifies a config
        return hash(self.run_id())

    def evaluation_protocol(self) -> dict[str, Any]:
        """How this run is evaluated (JSON-compatible); see ``protocol_id``. Fields left out
        of the run id at their default are left out here too (protocol ids stay valid)."""
        data = self.to_dict()
        return {name: data[name] for name in EVALUATION_FIELDS if name in data}

    def pack_key(self) -> str:
        """Equal for runs that can train as one pack: everything but the member fields."""
        data = self.to_dict()
        for name in MEMBER_FIELDS:
            del data[name]
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @property
    def score_lengths(self) -> tuple[int, ...]:
        """The test lengths the score averages over."""
        return protocol.score_lengths(self.test_lengths, self.train_max_length, self.score_from_42)

    @property
    def is_transformer(self) -> bool:
        return self.arch == TRANSFORMER

    def model_arguments(self) -> dict[str, Any]:
        """Keyword arguments of ``build_architecture`` besides arch and task."""
        if not self.is_transformer:
            return dict(self.arch_options)
        return {"pe": self.pe, "kernel": self.kernel, **self.model_kwargs()}

    def model_kwargs(self) -> dict[str, Any]:
        """The transformer's keyword arguments of ``build_model`` besides task, pe and kernel."""
        return {
            **self.model_options,
            **self.dape_options,
            "causal": self.causal,
            "train_length": self.train_max_length,
            **self.pe_options,
        }

    def build_task(self):
        """The task instance this run trains on (from its sample set's training part)."""
        from che_bench.tasks import get_task
        from che_bench.tasks.sample_sets import TRAINING

        return self._from_sample_set(get_task(self.task, **self.task_params), TRAINING)

    def build_evaluation_task(self):
        """The task instance this run is evaluated on: ``task_params`` updated with
        ``eval_task_params`` (from its sample set's held-out part: then there are none)."""
        from che_bench.tasks import get_task
        from che_bench.tasks.sample_sets import HELD_OUT

        task = get_task(self.task, **{**self.task_params, **self.eval_task_params})
        return self._from_sample_set(task, HELD_OUT)

    def _from_sample_set(self, task, part: str):
        """``task`` drawing from ``part`` of the run's sample set (if it has one)."""
        from che_bench.tasks.sample_sets import SampleSet, SetDraws

        if self.sample_set is None:
            return task
        sample_set = SampleSet(task, self.sample_set, self.eval_seed, self.train_max_length)
        return task.draw_from(SetDraws(sample_set, part))


def group_into_packs(configs: Sequence[RunConfig], width: int | None) -> list[list[RunConfig]]:
    """Consecutive packs of at most ``width`` members (None: no limit) of runs that can train
    together, in the order the runs first appear. Runs without a length seed train alone."""
    cells: dict[str, list[RunConfig]] = {}
    packs: list[list[RunConfig]] = []
    for config in configs:
        if config.length_seed is None:
            packs.append([config])
            continue
        cell = cells.setdefault(config.pack_key(), [])
        if not cell:
            packs.append(cell)
        cell.append(config)
    return [
        pack[start : start + (width or len(pack))]
        for pack in packs
        for start in range(0, len(pack), width or len(pack))
    ]


def unpackable(configs: Sequence[RunConfig]) -> int:
    """How many of ``configs`` cannot pack with any other (no length seed)."""
    return sum(config.length_seed is None for config in configs)


def protocol_id(evaluation_protocol: dict[str, Any]) -> str:
    """Stable short hash of an evaluation protocol: evaluations of different runs under the
    same protocol share it."""
    canonical = json.dumps(evaluation_protocol, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]


def make_config(
    task: str,
    pe: str | None = None,
    kernel: int | None = None,
    preset: str = "quick",
    **overrides: Any,
) -> RunConfig:
    """Resolve ``preset`` plus ``overrides`` into a validated ``RunConfig``.

    Overrides (``None`` means "keep the preset's value") are the run settings of
    ``che_bench.settings``, each checked by its validator: steps, batch_size, lr, seed,
    data_seed, train_max_length, test_lengths and train_eval_lengths (length specs, see
    ``protocol.parse_lengths``; train_eval_lengths also "auto"), eval_samples,
    eval_batch_size, dropout_at_eval, score_from_42, length_seed, task_params (dict), arch,
    and the transformer's (``pe`` and ``kernel`` too): layers, dim, heads, ffn (default
    4 * dim when dim is overridden), dropout, dape_width, dape_variant, dape_tril,
    pe_options (dict), causal; another architecture takes arch_options (dict) instead, and
    trains with its own settings under a preset where it has them. Raises CheBenchError for
    anything invalid.
    """
    from che_bench.model.architectures import architecture_overrides
    from che_bench.model.check import check_evaluation
    from che_bench.tasks import get_task, listed_task_params

    overrides, pe = architecture_overrides(overrides, pe)  # the arch canonical, None dropped
    arch = overrides["arch"]
    values = _preset_with_overrides(preset, overrides, arch)
    # The given task parameters over the preset's where the task lists them (a read-out).
    at_preset = listed_task_params(task, protocol.preset_settings(preset).get("task_params", {}))
    task_obj = get_task(task, **{**at_preset, **dict(overrides.get("task_params", {}))})
    if arch == TRANSFORMER:
        model_fields = _transformer_fields(pe, kernel, values, overrides)
    else:
        model_fields = _other_architecture_fields(arch, pe, kernel, overrides)
    run_fields = _run_fields(values, task_obj)
    if arch != TRANSFORMER:
        run_fields["causal"] = False  # attention's setting; a recurrent model reads in order
    config = RunConfig(task=task_obj.name, preset=preset, **model_fields, **run_fields)
    check_evaluation(config)
    return config


def _transformer_fields(
    pe: str | None, kernel: Any, values: dict[str, Any], overrides: dict[str, Any]
) -> dict[str, Any]:
    """The transformer's encoding, kernel, DAPE and model options."""
    from che_bench.encodings import canonical_encoding_name

    if overrides.get("arch_options"):
        raise CheBenchError(
            "--arch-option applies to architectures other than the transformer (its options: "
            "--layers, --dim, --heads, --ffn, --dropout, --pe-option)"
        )
    kernel = _checked_kernel(kernel)
    return {
        "pe": canonical_encoding_name(pe or "none"),
        "kernel": kernel,
        "dape_options": _dape_options(values, overrides, kernel),
        "model_options": {name: values[name] for name in MODEL_OPTION_NAMES},
    }


#: Settings only the transformer takes.
TRANSFORMER_ONLY = (*MODEL_OPTION_NAMES, *DAPE_OPTION_NAMES, "pe_options", "causal")


def _other_architecture_fields(
    arch: str, pe: str | None, kernel: Any, overrides: dict[str, Any]
) -> dict[str, Any]:
    """No encoding, kernel, DAPE or transformer options (giving one is an error); the
    architecture's given options, checked."""
    from che_bench.model.architectures import architecture_options

    given = ["--pe"] if pe not in (None, "none") else []
    given += ["--kernel"] if kernel is not None else []
    given += [
        settings.BY_NAME[name].flag or name
        for name in TRANSFORMER_ONLY
        # causal = false is what another architecture's config records anyway (a suite's
        # override for its transformers may say so for every run)
        if name in overrides and not (name == "causal" and overrides[name] is False)
    ]
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        raise CheBenchError(
            f"{', '.join(given)} {verb} to the transformer only, not to architecture {arch!r} "
            "(its options: --arch-option KEY=VALUE)"
        )
    architecture_options(arch, dict(overrides.get("arch_options", {})))
    return {"pe": "none", "kernel": None, "dape_options": {}, "model_options": {}}


def _preset_with_overrides(preset: str, overrides: dict[str, Any], arch: str) -> dict[str, Any]:
    """The preset's settings (with the architecture's own under it) updated with
    ``overrides`` (known run settings only); an overridden ``dim`` brings ``ffn = 4 * dim``
    unless ``ffn`` is given too."""
    from che_bench.model.architectures import get_architecture

    values = protocol.preset_settings(preset, get_architecture(arch).presets)
    known = {setting.name for setting in settings.run_settings()}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise CheBenchError(f"unknown run setting(s): {', '.join(unknown)}")
    if "dim" in overrides and "ffn" not in overrides:
        overrides = {**overrides, "ffn": 4 * int(overrides["dim"])}
    values.update(overrides)
    return values


def _checked_kernel(kernel: Any) -> int | None:
    from che_bench.model.dape import check_kernel

    if kernel is None:
        return None
    return check_kernel(int(kernel) if isinstance(kernel, np.integer) else kernel)


def _dape_options(
    values: dict[str, Any], overrides: dict[str, Any], kernel: int | None
) -> dict[str, Any]:
    """The DAPE options, empty without a kernel (where giving one is an error)."""
    if kernel is None:
        given = [name for name in DAPE_OPTION_NAMES if name in overrides]
        if given:
            raise CheBenchError(f"{', '.join(given)} only apply with a DAPE kernel (--kernel)")
        return {}
    return {name: values.get(name, DAPE_DEFAULTS[name]) for name in DAPE_OPTION_NAMES}


def _run_fields(values: dict[str, Any], task) -> dict[str, Any]:
    """The ``RunConfig`` fields of the run settings: each given value, else the one it follows
    (data_seed: seed) or its task's or declared default, checked by its validator; the task's
    resolved parameters; lengths parsed against the task's minimum length."""
    fields: dict[str, Any] = {}
    for setting in settings.settings_where(settings.RUN):
        if setting.name in values:
            value = values[setting.name]
        elif setting.follows is not None:
            value = fields[setting.follows]
        else:
            value = settings.task_default(setting, task)
        fields[setting.name] = setting.validate(value)
    fields["task_params"] = task.params()
    fields["pe_options"] = dict(fields["pe_options"])
    fields["eval_task_params"] = dict(fields["eval_task_params"])
    fields["arch_options"] = dict(fields["arch_options"])
    train_max_length = fields["train_max_length"]
    # (Refuses a train_max_length below the task's minimum length first.)
    fields["curriculum_options"] = curricula.resolved_options(fields, task.min_length)
    if fields["lr_schedule"] == "constant" and fields["min_lr_ratio"] != DEFAULT_MIN_LR_RATIO:
        raise CheBenchError("min_lr_ratio applies to lr_schedule warmup_cosine only")
    fields["test_lengths"] = protocol.parse_lengths(fields["test_lengths"])
    if fields["train_eval_lengths"] == "auto":
        fields["train_eval_lengths"] = protocol.auto_train_eval_lengths(
            task.min_length, train_max_length
        )
    else:
        fields["train_eval_lengths"] = protocol.parse_lengths(fields["train_eval_lengths"])
    return fields
