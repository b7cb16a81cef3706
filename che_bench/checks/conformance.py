"""Conformance checks of an encoding or a task: what che-bench relies on, for any registered one.

``che-bench check-encoding NAME`` / ``check-task NAME`` run them (plugins included), and the
project's tests run the same functions over every built-in. The encoding checks are here (the
checks of the attention hooks alone, dtypes, bias shape, reference bias and translation
invariance, are in ``che_bench.checks.conformance_hooks``; option effects in
``che_bench.checks.option_effects``), the task checks in ``che_bench.checks.task_checks``.
Every encoding check takes ``causal``: with it, the encoding is checked in a causal model
(``check-encoding --causal``, which adds the causal check of its logits). Each check returns
its failures, one line each (what, where, expected vs got); an empty list is a pass. Models
are tiny, so a whole encoding or task checks in well under a minute on a laptop CPU.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from che_bench.checks.conformance_hooks import (
    check_bias_shape,
    check_dtypes,
    check_reference_bias,
    check_translation_invariance,
    differ,
    dtype_problem,
    output_problem,
)
from che_bench.checks.guarded import guarded
from che_bench.checks.model_declarations import causal_failures, in_place_task
from che_bench.checks.option_effects import TINY_ENCODER, check_encoding_options_take_effect
from che_bench.checks.task_checks import TASK_CHECKS
from che_bench.errors import one_line
from che_bench.model.encoder import Encoder, build_model
from che_bench.model.packs import member_state_dict, stack_members
from che_bench.tasks import Task, get_task

#: A tiny encoder: the checks are about the encoding, not the model's size.
TINY = TINY_ENCODER
#: Training lengths (the model trains on <= 40) and test lengths, up to the protocol's 500.
TRAIN_LENGTHS = (1, 20, 40)
TEST_LENGTHS = (41, 200, 500)
#: The task with the longest model inputs (3n tokens: 1500 at n = 500) and a short-input one.
LONG_TASK, SHORT_TASK = "duplicate_string", "reverse_string"
KERNELS = (None, 1, 3)
#: The evaluation memory budget checked at n = 500: far below one [B, H, T, T] score map.
SMALL_BUDGET_BYTES = 4 << 20

Check = Callable[..., list[str]]


# --- encodings ------------------------------------------------------------------------------


def _model(
    pe: str,
    kernel: int | None,
    options: dict[str, Any],
    seed: int = 0,
    task: str = SHORT_TASK,
    **settings: Any,
) -> Encoder:
    torch.manual_seed(seed)
    return build_model(get_task(task), pe, kernel, **TINY, **settings, **options)


def _inputs(task: str, n: int, batch: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(get_task(task).sample(n, batch, np.random.default_rng(seed)).inputs)


def check_shapes_and_finite(pe: str, options: dict[str, Any], causal: bool = False) -> list[str]:
    """Logits of shape [members, batch, output_length(n), classes], finite, at the training
    lengths and at test lengths up to 500 (1500 tokens), training and evaluation mode."""
    failures = []
    task = get_task(LONG_TASK)
    model = _model(pe, None, options, task=LONG_TASK, causal=causal)
    for n in TRAIN_LENGTHS + TEST_LENGTHS:
        mode = "train" if n in TRAIN_LENGTHS else "eval"
        model.train(mode == "train")
        with torch.set_grad_enabled(mode == "train"):
            logits = model(_inputs(LONG_TASK, n, 2))
        where = f"{LONG_TASK} n={n} ({task.input_length(n) + task.output_length(n)} tokens, {mode})"
        failures.append(output_problem(logits, task, n, 2, where))
    return [failure for failure in failures if failure]


def check_pack_equals_members(
    pe: str,
    options: dict[str, Any],
    causal: bool = False,
    kernels: tuple[int | None, ...] = KERNELS,
) -> list[str]:
    """A pack of 3 members computes, per member, what that member computes alone (shared and
    per-member inputs, each member with its own random draws), and gives back each member's
    weights; with DAPE kernels none, 1 and 3."""
    failures = []
    for kernel in kernels:
        members = [
            _model(pe, kernel, options, seed=seed, causal=causal).eval() for seed in (3, 4, 5)
        ]
        pack = stack_members(members).eval()
        shared = _inputs(SHORT_TASK, 9, 3)
        own = torch.stack([_inputs(SHORT_TASK, 9, 3, seed=seed) for seed in (0, 1, 2)])
        with torch.no_grad():
            for label, inputs, member_inputs in (
                ("shared inputs", shared, [shared] * 3),
                ("own inputs", own, list(own)),
            ):
                pack.seed_draws([10, 11, 12])
                packed = pack(inputs)
                for m, member in enumerate(members):
                    member.seed_draws([10 + m])
                    difference = differ(packed[m], member(member_inputs[m])[0])
                    if difference:
                        failures.append(
                            f"pack of 3 equals its members alone (kernel {kernel}, "
                            f"{label}, member {m}): expected equal logits, got {difference}"
                        )
        state = member_state_dict(pack, 1)
        if any(
            not torch.equal(state[name], tensor) for name, tensor in members[1].state_dict().items()
        ):
            failures.append(
                f"pack of 3 equals its members alone (kernel {kernel}): expected "
                "member 1's weights back from the pack, got other values"
            )
    return failures


def check_chunked_equals_unchunked(
    pe: str, options: dict[str, Any], causal: bool = False
) -> list[str]:
    """Evaluation split into query-row chunks and sub-batches (small memory budgets) gives the
    logits of one unchunked pass, beyond the training lengths; kernels none, 1 and 3."""
    failures = []
    inputs = _inputs(LONG_TASK, 17, 3)  # 51 tokens, past the 40 the model trained on
    for kernel in KERNELS:
        model = _model(pe, kernel, options, task=LONG_TASK, causal=causal).eval()
        with torch.no_grad():
            model.seed_draws([7])
            whole = model(inputs)
            for budget in (3 * 51 * 4 * 6 * 5, 2000):  # a few rows per chunk; below one row
                model.set_memory_budget(budget)
                model.seed_draws([7])
                difference = differ(model(inputs), whole)
                if difference:
                    failures.append(
                        f"row-chunked evaluation equals unchunked (kernel {kernel}, "
                        f"budget {budget} bytes): expected equal logits, got {difference}"
                    )
    return failures


def check_state_dict_round_trip(
    pe: str, options: dict[str, Any], causal: bool = False
) -> list[str]:
    """Weights saved as a kept model is (tensors only, loaded with ``weights_only``) load into a
    freshly built model, which then computes the same logits."""
    model = _model(pe, None, options, seed=0, causal=causal).eval()
    buffer = io.BytesIO()
    torch.save(member_state_dict(model, 0), buffer)
    buffer.seek(0)
    restored = _model(pe, None, options, seed=1, causal=causal).eval()
    try:
        restored.load_state_dict(torch.load(buffer, weights_only=True))
    except Exception as exc:
        return [
            f"state_dict round trip: expected the saved weights to load, got {type(exc).__name__}: "
            + one_line(exc)
        ]
    inputs = _inputs(SHORT_TASK, 30, 2)
    with torch.no_grad():
        model.seed_draws([5])
        expected = model(inputs)
        restored.seed_draws([5])
        difference = differ(restored(inputs), expected)
    return (
        [f"state_dict round trip: expected the same logits after loading, got {difference}"]
        if difference
        else []
    )


def check_options_recorded(pe: str, options: dict[str, Any], causal: bool = False) -> list[str]:
    """``options()`` names every option the encoding takes, as JSON, and building with the
    recorded options gives the same options back."""
    encoding = _model(pe, None, options, causal=causal).encoding
    recorded = encoding.options()
    failures = []
    missing = sorted(set(encoding.option_names()) - set(recorded))
    if missing:
        failures.append(
            f"options recorded: expected every option in options(), missing {', '.join(missing)}"
        )
    try:
        json.dumps(recorded)
    except TypeError as exc:
        return [*failures, f"options recorded: expected JSON values, got {exc}"]
    given = {key: value for key, value in recorded.items() if key in encoding.option_names()}
    rebuilt = _model(pe, None, given, causal=causal).encoding.options()
    if rebuilt != recorded:
        failures.append(
            f"options recorded: expected {recorded} when built with them, got {rebuilt}"
        )
    return failures


def check_training_step(pe: str, options: dict[str, Any], causal: bool = False) -> list[str]:
    """A training step alone and with DAPE (kernel 1) and DAPE V2 (kernel 3) on top: finite
    logits and a finite gradient for every parameter of the encoding (n = 40), then finite
    logits at evaluation (n = 100; the shapes check covers n = 500)."""
    failures = []
    for kernel in KERNELS:
        model = _model(pe, kernel, options, task=LONG_TASK, causal=causal)
        logits = model(_inputs(LONG_TASK, 40, 2))
        logits.float().logsumexp(-1).mean().backward()
        bad = [
            name
            for name, parameter in model.encoding.named_parameters()
            if parameter.grad is None or not torch.isfinite(parameter.grad).all()
        ]
        if not torch.isfinite(logits).all() or bad:
            failures.append(
                f"training step (kernel {kernel}, n=40): expected finite logits and "
                f"gradients, got non-finite or missing ones ({', '.join(bad) or 'logits'})"
            )
        model.encoding.project_()
        with torch.no_grad():
            far = model.eval()(_inputs(LONG_TASK, 100, 2))
        if not torch.isfinite(far).all():
            failures.append(
                f"training step (kernel {kernel}), then evaluation at n=100: expected "
                "finite logits, got non-finite values"
            )
    return failures


def check_memory_budget(pe: str, options: dict[str, Any], causal: bool = False) -> list[str]:
    """At n = 500 (1500 tokens) under a small evaluation budget, no tensor made during the
    forward pass is larger than the budget (a full [B, H, T, T] score map is 34x larger):
    the encoding's hooks work on the query rows they are given and declare the maps they
    hold (``score_maps``)."""
    model = _model(pe, None, options, task=LONG_TASK, causal=causal).eval()
    model.set_memory_budget(SMALL_BUDGET_BYTES)
    with torch.no_grad(), _largest_tensor() as largest:
        model(_inputs(LONG_TASK, 500, 4))
    if largest["bytes"] <= SMALL_BUDGET_BYTES:
        return []
    return [
        f"memory budget at n=500 ({LONG_TASK}, batch 4): expected no tensor above "
        f"{SMALL_BUDGET_BYTES} bytes, got {largest['bytes']} bytes from {largest['op']} "
        f"{largest['shape']}"
    ]


def check_draws_reproducible(pe: str, options: dict[str, Any], causal: bool = False) -> list[str]:
    """The same draw seed gives the same logits; for a randomized encoding another seed gives
    other logits (its positions are drawn), in training and at evaluation."""
    failures = []
    model = _model(pe, None, options, causal=causal).eval()
    randomized = model.encoding.randomized
    inputs = _inputs(SHORT_TASK, 30, 2)
    for mode, evaluating in (("training draws", False), ("evaluation", True)):
        with torch.no_grad():
            runs = []
            for seed in (21, 21, 22):
                model.seed_draws([seed])
                runs.append(model(inputs, evaluating=evaluating))
        difference = differ(runs[1], runs[0])
        if difference:
            failures.append(
                f"draws reproducible per seed ({mode}): expected equal logits for "
                f"seed 21 twice, got {difference}"
            )
        active = model.encoding.draws_active(evaluating)
        if randomized and active and differ(runs[2], runs[0]) is None:
            failures.append(
                f"draws reproducible per seed ({mode}): expected other logits for "
                "another seed (a randomized encoding draws positions), got the same"
            )
    return failures


def check_causal_logits(pe: str, options: dict[str, Any], causal: bool = True) -> list[str]:
    """In a causal model on an in-place task, the logits up to position t are the same when
    the tokens after t change and when the input stops at t (an encoding that reads the
    sequence's length, or the future, fails here). An encoding that draws its positions at
    evaluation draws them for the whole length by design: only the first is compared."""
    name = in_place_task()
    if name is None:
        return []
    model = _model(pe, None, options, task=name, causal=True)
    drawing = model.encoding.draws_active(True)
    return causal_failures(model, get_task(name), pe, cut=not drawing)


ENCODING_CHECKS: dict[str, Check] = {
    "shapes": check_shapes_and_finite,
    "dtypes": check_dtypes,
    "bias": check_bias_shape,
    "reference": check_reference_bias,
    "translation": check_translation_invariance,
    "pack": check_pack_equals_members,
    "chunks": check_chunked_equals_unchunked,
    "state_dict": check_state_dict_round_trip,
    "options": check_options_recorded,
    "option_effects": check_encoding_options_take_effect,
    "training": check_training_step,
    "memory": check_memory_budget,
    "draws": check_draws_reproducible,
}
#: The checks of ``check-encoding --causal``: the encoding in a causal model, and its logits
#: causal.
CAUSAL_ENCODING_CHECKS: dict[str, Check] = {**ENCODING_CHECKS, "causal": check_causal_logits}


def encoding_checks(causal: bool) -> dict[str, Check]:
    """The checks of an encoding in a bidirectional or a causal model."""
    return CAUSAL_ENCODING_CHECKS if causal else ENCODING_CHECKS


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any torch operation returns."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                size = tensor.numel() * tensor.element_size()
                if size > self.record["bytes"]:
                    self.record.update(bytes=size, op=str(func), shape=list(tensor.shape))
        return out


@contextmanager
def _largest_tensor() -> Iterator[dict[str, Any]]:
    record: dict[str, Any] = {"bytes": 0, "op": None, "shape": None}
    with _LargestTensor(record):
        yield record


def run_encoding_check(
    check: str, pe: str, options: dict[str, Any] | None = None, causal: bool = False
) -> list[str]:
    """The failures of one encoding check (in a causal model if ``causal``); an exception
    inside it is one failure line, which names the hook method at fault when one returns
    another dtype than its inputs' (``dtype_problem``)."""
    given = dict(options or {})
    return guarded(
        check,
        lambda: encoding_checks(causal)[check](pe, given, causal=causal),
        lambda: dtype_problem(pe, given),
    )


def run_task_check(check: str, task: Task) -> list[str]:
    """The failures of one task check; an exception inside it is one failure line."""
    return guarded(check, lambda: TASK_CHECKS[check](task))
