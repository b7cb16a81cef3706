"""Every run setting, declared once: name, type, default (per preset where presets differ),
command-line flag and help, and whether and how it enters the run id. The presets
(``protocol.PRESETS``), the flags of ``che-bench run``, ``sweep``, ``evaluate`` and ``selftest``
(``che_bench.commands.common``), the keys ``make_config`` and a suite's ``[overrides]`` accept,
the checks of their values (one validator each), the fields of ``RuntimeOptions``, the fields
left out of the run id at their default, and the ``che-bench run`` commands a report prints
all derive from ``SETTINGS``. Adding a setting is one entry here (plus its use); one added
after runs were stored must be ``IN_ID_UNLESS_DEFAULT`` (``tests/test_run_ids.py``)."""

from __future__ import annotations

from typing import Any

# (The curricula; Setting, its validators and the names of where it lives, re-exported.)
from che_bench.curricula import CURRICULA, UNIFORM
from che_bench.runtime_settings import RUNTIME_SETTINGS
from che_bench.setting_types import (
    DAPE,
    IN_ID_UNLESS_DEFAULT,
    KEY_VALUES,
    MODEL,
    RUNTIME,
    SWITCH,
    Setting,
    at_least,
    fraction,
    non_negative_number,
    one_of,
    positive_number,
    true_or_false,
)
from che_bench.setting_types import IN_ID as IN_ID
from che_bench.setting_types import RUN as RUN
from che_bench.setting_types import Validator as Validator
from che_bench.setting_types import stored_value as stored_value
from che_bench.setting_types import task_default as task_default

PRESET_NAMES = ("paper", "quick", "smoke", "state_tracking")
#: Optimizers: Adam (CHE's) and AdamW (decoupled weight decay, the xLSTM harness's).
OPTIMIZERS = ("adam", "adamw")
#: Learning-rate schedules (``train.optimizer.LrSchedule``): constant after an optional linear
#: warm-up (CHE's, without one), or linear warm-up then cosine decay (the xLSTM harness's).
LR_SCHEDULES = ("constant", "warmup_cosine")
#: Training batches: every sequence of a step at one length (CHE's), or each its own (the
#: xLSTM harness's, ``batch_lengths``).
ONE_LENGTH, MIXED = "one", "mixed"
#: Training precision: float32, or the xLSTM harness's bf16 autocast (``train_precision``).
FLOAT32, BFLOAT16 = "float32", "bfloat16"


def _per_preset(paper: Any, quick: Any, smoke: Any, state_tracking: Any) -> dict[str, Any]:
    return dict(zip(PRESET_NAMES, (paper, quick, smoke, state_tracking), strict=True))


def _unless_state_tracking(default: Any, state_tracking: Any) -> dict[str, Any]:
    """``default`` under every preset but ``state_tracking`` (the xLSTM harness's protocol)."""
    return _per_preset(default, default, default, state_tracking)


SETTINGS: tuple[Setting, ...] = (
    # Training.
    Setting(
        "steps",
        int,
        "optimizer steps",
        presets=_per_preset(200_000, 1500, 20, 20_000),
        # A run of 0 steps would be stored as complete having learned nothing.
        check=at_least(1),
    ),
    Setting(
        "batch_size",
        int,
        "training sequences per step",
        presets=_per_preset(128, 32, 8, 256),
        check=at_least(1),
    ),
    Setting(
        "lr",
        float,
        "learning rate (the peak of a schedule)",
        presets=_per_preset(1e-4, 1e-3, 1e-3, 1e-3),
        check=positive_number,
    ),
    # The optimizer and its schedule: CHE's (Adam, clipping at 1, constant lr) unless a preset
    # or flag says otherwise; out of the run id at those (grad_clip_norm was always in it).
    Setting(
        "optimizer",
        str,
        "adam (CHE's: Adam, an L2 term for --weight-decay) or adamw (decoupled weight decay)",
        in_id=IN_ID_UNLESS_DEFAULT,
        default="adam",
        presets=_unless_state_tracking("adam", "adamw"),
        check=one_of(*OPTIMIZERS),
    ),
    Setting(
        "weight_decay",
        float,
        "weight decay of the decayed parameters (a model's weight matrices; not its biases, "
        "norms and embeddings: BenchModel.no_weight_decay)",
        in_id=IN_ID_UNLESS_DEFAULT,
        default=0.0,
        presets=_unless_state_tracking(0.0, 0.1),
        check=non_negative_number,
    ),
    Setting(
        "grad_clip_norm",
        float,
        "clip each run's gradient to this global norm before the update (0: no clipping)",
        default=1.0,
        presets=_unless_state_tracking(1.0, 0.0),
        check=non_negative_number,
    ),
    Setting(
        "lr_schedule",
        str,
        "constant (after --warmup-steps of linear warm-up, if any) or warmup_cosine (linear "
        "warm-up, then cosine decay to --min-lr-ratio x lr at the last step)",
        in_id=IN_ID_UNLESS_DEFAULT,
        default="constant",
        presets=_unless_state_tracking("constant", "warmup_cosine"),
        check=one_of(*LR_SCHEDULES),
    ),
    Setting(
        "warmup_steps",
        int,
        "steps of linear learning-rate warm-up from 0",
        in_id=IN_ID_UNLESS_DEFAULT,
        default=0,
        presets=_unless_state_tracking(0, 2000),
        check=at_least(0),
    ),
    Setting(
        "min_lr_ratio",
        float,
        "warmup_cosine's last learning rate, as a fraction of --lr",
        in_id=IN_ID_UNLESS_DEFAULT,
        default=1e-3,
        presets=_unless_state_tracking(1e-3, 1e-3),
        check=fraction,
    ),
    Setting("seed", int, "model-initialisation seed (default 0)", default=0, check=at_least(0)),
    Setting(
        "data_seed", int, "training-data seed (default: --seed)", follows="seed", check=at_least(0)
    ),
    Setting(
        "length_seed",
        int,
        "seed of the training-length schedule (default: one run draws its lengths from its data "
        "seed; --seeds/--lrs use 0, so that the runs share one schedule and can train as a pack)",
        in_id=IN_ID_UNLESS_DEFAULT,
        check=at_least(0),
    ),
    Setting(
        "train_max_length",
        int,
        "longest training length n",
        presets=_per_preset(40, 40, 40, 39),
        check=at_least(1),
    ),
    # CHE's length curricula (che_bench.curricula); out of the run id at uniform (as before).
    Setting(
        "curriculum",
        str,
        "CHE's training-length curricula: uniform, fixed, regular_increase, reverse_exponential",
        in_id=IN_ID_UNLESS_DEFAULT,
        default=UNIFORM,
        check=one_of(*CURRICULA),
    ),
    Setting(
        "curriculum_options",
        KEY_VALUES,
        "curriculum option (repeatable), e.g. tau=0.5; docs/protocol.md lists them",
        flag="--curriculum-option",
        in_id=IN_ID_UNLESS_DEFAULT,
        default={},
    ),
    Setting(
        "batch_lengths",
        str,
        "one (CHE's: every sequence of a step at the step's length) or mixed (each sequence "
        "its own length from the curriculum, padded after it, as the xLSTM harness's batches; "
        "models that read per-sequence lengths, the causal state-tracking ones)",
        in_id=IN_ID_UNLESS_DEFAULT,
        default=ONE_LENGTH,
        check=one_of(ONE_LENGTH, MIXED),
    ),
    Setting(
        "train_precision",
        str,
        "float32, or bfloat16: each training step's forward pass and loss under bf16 autocast "
        "with float32 weights and optimizer, as the xLSTM harness trains (evaluation: float32)",
        in_id=IN_ID_UNLESS_DEFAULT,
        default=FLOAT32,
        check=one_of(FLOAT32, BFLOAT16),
    ),
    Setting(
        "sample_set",
        int,
        "Merrill et al.'s fixed data: this many distinct sequences a length, drawn once; 1/5 at "
        "--train-max-length held out to test there (default: fresh sequences every step)",
        in_id=IN_ID_UNLESS_DEFAULT,
        check=at_least(2),
    ),
    # Evaluation protocol.
    Setting(
        "test_lengths",
        str,
        "e.g. 41:500, 41:500:20,500 or 41,100,500",
        presets=_per_preset("41:500", "41:500:20,500", "41,100,200", "39:255"),
    ),
    Setting(
        "train_eval_lengths",
        str,
        "in-distribution lengths, or 'auto'",
        presets=_per_preset("auto", "auto", "auto", "auto"),
    ),
    Setting(
        "eval_samples",
        int,
        "test sequences per length",
        presets=_per_preset(512, 64, 8, 64),
        check=at_least(1),
    ),
    Setting(
        "eval_batch_size",
        int,
        "sequences per accuracy sub-batch",
        presets=_per_preset(64, 32, 8, 64),
        check=at_least(1),
    ),
    Setting(
        "dropout_at_eval",
        SWITCH,
        "keep dropout on during evaluation (as the reference code does)",
        default=False,
        check=true_or_false,
    ),
    Setting(
        "score_from_42",
        SWITCH,
        "average the score over 42..500 like the reference scripts",
        default=False,
        check=true_or_false,
    ),
    # The architecture.
    Setting(
        "arch",
        str,
        "architecture: transformer (default: the encoder, the only one with --pe, --kernel "
        "and the transformer's flags), CHE's rnn, lstm, stack_rnn, stack_lstm, ndstack_rnn, "
        "tape_rnn, or a plugin's (see `che-bench models`)",
        in_id=IN_ID_UNLESS_DEFAULT,
        default="transformer",
    ),
    Setting(
        "arch_options",
        KEY_VALUES,
        "option of a non-transformer architecture (repeatable), e.g. hidden_size=128; VALUE "
        "parsed as JSON when possible",
        flag="--arch-option",
        in_id=IN_ID_UNLESS_DEFAULT,
        default={},
    ),
    # The model.
    Setting("layers", int, "encoder layers", where=MODEL, presets=_per_preset(5, 2, 1, 2)),
    Setting("dim", int, "model width", where=MODEL, presets=_per_preset(64, 64, 16, 128)),
    Setting("heads", int, "attention heads", where=MODEL, presets=_per_preset(8, 8, 2, 4)),
    Setting(
        "ffn",
        int,
        "FFN width (default 4 x dim when --dim is given)",
        where=MODEL,
        presets=_per_preset(256, 256, 32, 512),
    ),
    Setting("dropout", float, "dropout rate", where=MODEL, presets=_per_preset(0.1, 0.1, 0.1, 0.0)),
    Setting(
        "causal",
        SWITCH,
        "decoder-style attention: each position sees only itself and earlier ones; "
        "--no-causal: bidirectional (default: the task's, bidirectional for the CHE "
        "encoder's tasks, causal for mqar, word_problem and flip_flop, as in their sources)",
        in_id=IN_ID_UNLESS_DEFAULT,
        default=False,
        task_default="causal",
        check=true_or_false,
    ),
    Setting(
        "pe_options",
        KEY_VALUES,
        "encoding option (repeatable); VALUE parsed as JSON when possible",
        flag="--pe-option",
        default={},
    ),
    Setting(
        "task_params",
        KEY_VALUES,
        "task parameter (repeatable); VALUE parsed as JSON when possible",
        flag="--task-param",
        default={},
    ),
    Setting(
        "eval_task_params",
        KEY_VALUES,
        "task parameter of the evaluation only (repeatable), e.g. p_ignore=0.98 (a split)",
        flag="--eval-task-param",
        in_id=IN_ID_UNLESS_DEFAULT,
        default={},
    ),
    # DAPE (only with a kernel).
    Setting("dape_width", int, "DAPE hidden width", where=DAPE, default=32),
    Setting(
        "dape_variant",
        str,
        "concat_residual, concat or add_residual",
        where=DAPE,
        default="concat_residual",
    ),
    Setting(
        "dape_tril",
        str,
        "DAPE lower-triangular mask: auto (with causal attention), true or false",
        where=DAPE,
        default="auto",
        flag=None,
    ),
    # Runtime options: how a run executes, recorded with it, never in its run id.
    *RUNTIME_SETTINGS,
)

BY_NAME: dict[str, Setting] = {setting.name: setting for setting in SETTINGS}


def settings_where(where: str) -> tuple[Setting, ...]:
    """The settings that live in ``where`` (RUN, MODEL, DAPE or RUNTIME), in declaration order."""
    return tuple(setting for setting in SETTINGS if setting.where == where)


def run_settings() -> tuple[Setting, ...]:
    """Every setting of a run's configuration (what ``make_config`` takes)."""
    return tuple(setting for setting in SETTINGS if setting.where != RUNTIME)


def preset_values(preset: str) -> dict[str, Any]:
    """The settings a preset fixes (those that differ between presets)."""
    return {setting.name: setting.presets[preset] for setting in SETTINGS if setting.presets}


def omitted_at_default() -> dict[str, Any]:
    """Run-config fields left out of the run id while they hold these values."""
    omitted = (setting for setting in SETTINGS if setting.in_id == IN_ID_UNLESS_DEFAULT)
    return {setting.name: setting.default for setting in omitted}
