"""Conformance checks of a registered architecture (``che-bench check-model NAME``): what
che-bench relies on from any model other than the transformer (whose encodings
``check-encoding`` checks), plugins' models included.

The built-in recurrent baselines are checked at tiny sizes (``TINY_RECURRENT``), a plugin's
model with its own ``defaults`` (so a plugin declares small ones, or is checked with small
options given). Each check returns its failures, one line each (what, where, expected vs
got); an empty list is a pass.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from che_bench.checks.conformance_hooks import differ, output_problem
from che_bench.checks.guarded import guarded
from che_bench.checks.model_declarations import (
    check_causal_outputs,
    check_meta_device,
    check_reference_forward,
    in_place_task,
)
from che_bench.checks.option_effects import check_options_take_effect
from che_bench.errors import CheBenchError, one_line
from che_bench.model.architectures import (
    TRANSFORMER,
    build_architecture,
    canonical_architecture,
    get_architecture,
)
from che_bench.model.base import BenchModel
from che_bench.model.packs import member_state_dict, stack_members
from che_bench.model.recurrent import ARCHITECTURES as RECURRENT
from che_bench.tasks import Task, get_task
from che_bench.train.metrics import token_loss
from che_bench.train.optimizer import PackOptimizer
from che_bench.train.step import training_step

#: The options the built-in recurrent baselines are checked with (those each one takes).
TINY_RECURRENT: dict[str, Any] = {
    "hidden_size": 16,
    "stack_cell_size": 4,
    "stack_size": 8,
    "memory_cell_size": 4,
    "memory_size": 8,
    "mlp_layers_size": (16,),
}
#: The options other built-ins are checked with: tiny, and dropout off (a pack draws one
#: mask for all its members, so only without dropout does its training step equal theirs).
TINY_OTHERS: dict[str, dict[str, Any]] = {
    "autoregressive_transformer": {"layers": 1, "dim": 16, "heads": 2, "ffn": 32, "dropout": 0.0}
}
#: Training lengths (the model trains on <= 40) and test lengths, up to the protocol's 500.
TRAIN_LENGTHS = (1, 20, 40)
TEST_LENGTHS = (41, 200, 500)
#: The task with the longest model inputs (3n tokens: 1500 at n = 500) and a short-input one.
LONG_TASK, SHORT_TASK = "duplicate_string", "reverse_string"
#: The training check: a task a tiny model learns something of within a hundred steps.
TRAIN_TASK, TRAIN_STEPS, TRAIN_BATCH, TRAIN_LR = "even_pairs", 100, 32, 1e-2

Check = Callable[[str, dict[str, Any]], list[str]]


def check_options(arch: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The options ``arch`` is checked with: tiny sizes for a built-in recurrent baseline
    (``TINY_RECURRENT``) or another built-in (``TINY_OTHERS``), the plugin's defaults
    otherwise, ``options`` over either. The transformer is a CheBenchError
    (``check-encoding`` checks it)."""
    name = canonical_architecture(arch)
    if name == TRANSFORMER:
        raise CheBenchError(
            "the transformer is checked through its encoding: che-bench check-encoding NAME"
        )
    defaults = get_architecture(name).defaults
    tiny = {key: TINY_RECURRENT[key] for key in defaults if key in TINY_RECURRENT}
    tiny = tiny if name in RECURRENT else TINY_OTHERS.get(name, {})
    return {**tiny, **(options or {})}


def _model(
    arch: str, options: dict[str, Any], seed: int = 0, task: str = SHORT_TASK, members: int = 1
) -> BenchModel:
    torch.manual_seed(seed)
    return build_architecture(arch, get_task(task), members=members, **options)


def _inputs(task: Task, n: int, batch: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(task.sample(n, batch, np.random.default_rng(seed)).inputs.copy())


def _lengths(task: Task) -> list[int]:
    """The training and test lengths, raised to the task's minimum, within its maximum."""
    lengths = [max(n, task.min_length) for n in TRAIN_LENGTHS + TEST_LENGTHS]
    return sorted({n for n in lengths if task.max_length is None or n <= task.max_length})


def check_shapes_and_finite(arch: str, options: dict[str, Any]) -> list[str]:
    """Logits ``[1, batch, output_length(n), output_size]``, finite, at the training lengths
    (training mode, with gradients) and at test lengths up to 500 (evaluation, without), on
    the longest-input task and on an in-place task (unless the model refuses that one with a
    CheBenchError, as computation tokens do)."""
    failures = []
    for task_name in dict.fromkeys(filter(None, (LONG_TASK, in_place_task()))):
        task = get_task(task_name)
        try:
            model = _model(arch, options, task=task_name)
        except CheBenchError:
            if task_name == LONG_TASK:
                raise
            continue
        for n in _lengths(task):
            training = n <= max(TRAIN_LENGTHS)
            model.train(training)
            with torch.set_grad_enabled(training):
                logits = model(_inputs(task, n, 2), evaluating=not training)
            where = f"{task_name} n={n}, {'train' if training else 'eval'}"
            failures.append(output_problem(logits, task, n, 2, where))
    return [failure for failure in failures if failure]


def check_pack_equals_members(arch: str, options: dict[str, Any]) -> list[str]:
    """A pack of 3 members (``stack_members`` of models built from seeds 0, 1, 2) computes,
    per member, what that member computes alone (shared ``[B, n]`` and own ``[M, B, n]``
    inputs), each member's weights (``member_state_dict``) load into a one-member model
    that computes the same, and a training step of the pack (``pack_training_failures``)
    is each member's step alone."""
    task = get_task(SHORT_TASK)
    members = [_model(arch, options, seed=seed).eval() for seed in (0, 1, 2)]
    pack = stack_members(members).eval()
    shared = _inputs(task, 9, 3)
    own = torch.stack([_inputs(task, 9, 3, seed=seed) for seed in (0, 1, 2)])
    failures = []
    with torch.no_grad():
        for label, inputs in (("shared [B, n] inputs", shared), ("own [M, B, n] inputs", own)):
            pack.seed_draws([10, 11, 12])
            packed = pack(inputs, evaluating=True)
            for m, member in enumerate(members):
                member.seed_draws([10 + m])
                alone = member(inputs if inputs.dim() == 2 else inputs[m], evaluating=True)
                difference = differ(packed[m], alone[0])
                if difference:
                    failures.append(
                        f"pack of 3 equals its members alone ({label}, member {m}): "
                        f"expected equal logits, got {difference}"
                    )
        for m, member in enumerate(members):
            single = _model(arch, options, seed=9).eval()
            single.load_state_dict(member_state_dict(pack, m))
            single.seed_draws([20])
            member.seed_draws([20])
            difference = differ(single(shared, evaluating=True), member(shared, evaluating=True))
            if difference:
                failures.append(
                    f"member_state_dict (member {m}) loaded into a one-member model: expected "
                    f"that member's logits, got {difference}"
                )
    return failures + pack_training_failures(arch, options)


def pack_training_failures(arch: str, options: dict[str, Any]) -> list[str]:
    """In training, a pack of 3 gives each member its gradient alone. The optimizer re-homes a
    pack's parameters into one flat ``[M, P]`` buffer, so each is a view whose members are not
    adjacent in memory: a forward pass that ``view``s a parameter across the member axis fails
    only here."""
    task = get_task(SHORT_TASK)
    pack = stack_members([_model(arch, options, seed=seed) for seed in (0, 1, 2)]).train()
    alone = [_model(arch, options, seed=seed).train() for seed in (0, 1, 2)]
    inputs = torch.stack([_inputs(task, 9, 3, seed=seed) for seed in (0, 1, 2)])
    targets = torch.from_numpy(task.sample(9, 3, np.random.default_rng(0)).targets.copy())
    try:
        packed = _gradients(pack, inputs, targets)
    except Exception as exc:  # any error a pack's training step meets: the check's finding
        return [f"training step of a pack of 3: expected it to run, got {one_line(exc)}"]
    failures = []
    for m, member in enumerate(alone):
        for name, gradient in _gradients(member, inputs[m : m + 1], targets).items():
            difference = differ(packed[name][m : m + 1], gradient)
            if difference:
                failures.append(
                    f"a pack's gradient (member {m}, {name}): expected that member's "
                    f"gradient alone, got {difference}"
                )
                break
    return failures


def _gradients(
    model: BenchModel, inputs: torch.Tensor, targets: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Each parameter's gradient of the summed member losses, the parameters re-homed into
    the optimizer's flat buffer first as in training."""
    PackOptimizer(model, [TRAIN_LR] * model.members, (0.9, 0.999), 1e-8, 1.0)
    model.seed_draws(list(range(model.members)))
    model.zero_grad()
    logits = model(inputs)
    token_loss(logits, targets[None].expand(model.members, -1, -1)).sum().backward()
    return {
        name: torch.zeros_like(parameter) if parameter.grad is None else parameter.grad.clone()
        for name, parameter in model.named_parameters()
    }


def check_state_dict_round_trip(arch: str, options: dict[str, Any]) -> list[str]:
    """Weights saved as a kept model is (``torch.save``, loaded with ``weights_only``) load
    into a freshly built model, which then computes the same logits."""
    model = _model(arch, options, seed=0).eval()
    buffer = io.BytesIO()
    torch.save(member_state_dict(model, 0), buffer)
    buffer.seek(0)
    restored = _model(arch, options, seed=1).eval()
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    inputs = _inputs(get_task(SHORT_TASK), 30, 2)
    with torch.no_grad():
        model.seed_draws([5])
        expected = model(inputs, evaluating=True)
        restored.seed_draws([5])
        difference = differ(restored(inputs, evaluating=True), expected)
    if difference:
        return [f"state_dict round trip: expected the same logits after loading, got {difference}"]
    return []


def check_options_recorded(arch: str, options: dict[str, Any]) -> list[str]:
    """``describe()`` is JSON and names the architecture, ``build_options`` holds the options
    the model was built with, and a model built with any number or flag option changed has
    another ``build_key()`` (so that runs and packs never mix the two)."""
    name = canonical_architecture(arch)
    model = _model(arch, options)
    failures = []
    try:
        described = json.loads(json.dumps(model.describe()))
    except TypeError as exc:
        return [f"options recorded: expected describe() to be JSON, got {exc}"]
    if described.get("architecture") != name:
        failures.append(
            f"options recorded: expected describe()['architecture'] == {name!r}, "
            f"got {described.get('architecture')!r}"
        )
    resolved = {**get_architecture(name).defaults, **options}
    if getattr(model, "build_options", None) != resolved:
        failures.append(
            f"options recorded: expected build_options == {resolved}, "
            f"got {getattr(model, 'build_options', None)}"
        )
    for key, value in resolved.items():
        changed = _changed(value)
        if changed is None:
            continue
        try:
            other = _model(arch, {**options, key: changed})
        except CheBenchError:  # not a value the model takes: nothing to compare
            continue
        if other.build_key() == model.build_key():
            failures.append(
                f"options recorded: expected another build_key() when built with "
                f"{key}={changed!r} instead of {value!r}, got the same"
            )
    return failures


def _changed(value: Any) -> Any:
    """Another valid-looking value of an option (None: not one this check changes)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2 if value else 1
    if isinstance(value, float):
        return value * 2 if value else 0.5
    return None


def loss_fell(losses: list[float]) -> bool:
    """Whether a training's loss fell: the mean of its last 10 steps is below that of its first
    10, or the mean of some 10 steps after those is under half of it (a model that learnt,
    then met one of Adam's spikes at the check's high learning rate: a tiny DeltaProduct
    reaches 0.02 by step 50 of ``check_training_reduces_loss`` and is back at chance by 60)."""
    windows = [float(np.mean(losses[start : start + 10])) for start in range(0, len(losses), 10)]
    return windows[-1] < windows[0] or min(windows[1:]) < 0.5 * windows[0]


def check_training_reduces_loss(arch: str, options: dict[str, Any]) -> list[str]:
    """A hundred training steps (Adam at lr 1e-2, batch 32, lengths 2..10 of even_pairs)
    reduce the loss (``loss_fell``), all finite."""
    task = get_task(TRAIN_TASK)
    model = _model(arch, options, task=TRAIN_TASK).train()
    optimizer = PackOptimizer(model, [TRAIN_LR], (0.9, 0.999), 1e-8, 1.0)
    rng = np.random.default_rng(0)
    model.seed_draws([0])
    losses = []
    for _ in range(TRAIN_STEPS):
        batch = task.sample(int(rng.integers(2, 11)), TRAIN_BATCH, rng)
        inputs = torch.from_numpy(batch.inputs.copy())
        targets = torch.from_numpy(batch.targets.copy())[None]
        step_losses, _ = training_step(model, optimizer, inputs, targets, [])
        losses.append(float(step_losses[0]))
    if not np.isfinite(losses).all():
        return [f"training ({TRAIN_TASK}): expected finite losses, got non-finite ones"]
    if not loss_fell(losses):
        first, last = float(np.mean(losses[:10])), float(np.mean(losses[-10:]))
        return [
            f"training ({TRAIN_TASK}, {TRAIN_STEPS} steps at lr {TRAIN_LR}): expected the "
            f"loss to fall, got mean {first:.4f} over the first 10 steps, {last:.4f} over the "
            "last 10 and never half the first 10's over 10 steps"
        ]
    return []


def check_seed_reproducible(arch: str, options: dict[str, Any]) -> list[str]:
    """Two builds after ``torch.manual_seed(0)`` have identical weights; seed 1 gives other
    weights (initialisation draws from torch's global RNG)."""
    states = [_model(arch, options, seed=seed).state_dict() for seed in (0, 0, 1)]
    failures = []
    if states[0].keys() != states[1].keys() or any(
        not torch.equal(states[0][key], states[1][key]) for key in states[0]
    ):
        failures.append(
            "same seed same weights: expected equal weights for seed 0 twice, got others"
        )
    if all(torch.equal(states[0][key], states[2][key]) for key in states[0]):
        failures.append("same seed same weights: expected other weights for seed 1, got the same")
    return failures


def check_batch_independent(arch: str, options: dict[str, Any]) -> list[str]:
    """In evaluation, each row of a batch of 4 has the logits of that sequence alone."""
    task = get_task(SHORT_TASK)
    model = _model(arch, options).eval()
    inputs = _inputs(task, 12, 4)
    failures = []
    with torch.no_grad():
        model.seed_draws([3])
        batched = model(inputs, evaluating=True)
        for row in range(inputs.shape[0]):
            model.seed_draws([3])
            alone = model(inputs[row : row + 1], evaluating=True)
            difference = differ(batched[:, row : row + 1], alone)
            if difference:
                failures.append(
                    f"logits independent of the batch (row {row} of 4, {SHORT_TASK} n=12): "
                    f"expected the sequence's logits alone, got {difference}"
                )
    return failures


MODEL_CHECKS: dict[str, Check] = {
    "shapes": check_shapes_and_finite,
    "pack": check_pack_equals_members,
    "state_dict": check_state_dict_round_trip,
    "options": check_options_recorded,
    "option_effects": check_options_take_effect,
    "training": check_training_reduces_loss,
    "seed": check_seed_reproducible,
    "batch": check_batch_independent,
    "device": check_meta_device,
    "causal": check_causal_outputs,
    "reference": check_reference_forward,
}


def run_model_check(check: str, arch: str, options: dict[str, Any] | None = None) -> list[str]:
    """The failures of one model check of ``arch`` with ``check_options(arch, options)``; an
    exception inside it is one failure line."""
    resolved = check_options(arch, options)
    return guarded(check, lambda: MODEL_CHECKS[check](arch, resolved))
