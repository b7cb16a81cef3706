"""``check-model``'s checks of what a model runs on and what it declares: training and
evaluation on the meta device (as on a GPU: every tensor on the inputs' device, no read of a
value back to the host), causal outputs (``BenchModel.causal_outputs``) and the fast forward
against the model's plain, slow one (``BenchModel.reference_forward``).

``check-encoding`` reuses the causal check (``causal_failures``) in its causal mode. Each
check returns its failures, one line each; an empty list is a pass.
"""

from __future__ import annotations

from typing import Any

import torch

from che_bench.errors import CheBenchError, one_line
from che_bench.model.architectures import build_architecture
from che_bench.model.base import BenchModel
from che_bench.tasks import Task, get_task, list_tasks

#: Where the causal check cuts its inputs: outputs 0..CAUSAL_CUT must not see what follows.
CAUSAL_LENGTH, CAUSAL_CUT = 24, 9
#: The task (2n tokens) and lengths of the reference check: past 64 tokens (the width of a
#: chunked scan's chunk) and up to the protocol's longest test length, 500.
REFERENCE_TASK, REFERENCE_LENGTHS = "reverse_string", (1, 40, 200, 500)
#: The reference agrees with the fast forward to float32 rounding over up to 1000 tokens:
#: within a relative REFERENCE_RTOL and REFERENCE_ATOL times the largest value compared
#: (at least 1). mLSTM's gradients at 1000 tokens differ by 1.4e-4 of their largest in
#: float32 and by 2e-13 in float64: rounding, which this leaves room for.
REFERENCE_RTOL, REFERENCE_ATOL = 1e-3, 1e-3


def _model(arch: str, options: dict[str, Any], task: Task, members: int = 1) -> BenchModel:
    torch.manual_seed(0)
    return build_architecture(arch, task, members=members, **options)


def check_meta_device(arch: str, options: dict[str, Any]) -> list[str]:
    """A pack of 2 trains (forward and backward) and evaluates on the meta device, with
    logits of the expected shape and a gradient for every parameter: a tensor made on the
    CPU whatever the inputs' device, or a value read back to the host (``.item()``, a size
    that depends on the data), fails here as it would on a GPU."""
    task = get_task("reverse_string")
    model = _model(arch, options, task, members=2).to("meta").train()
    inputs = torch.randint(0, task.input_size, (2, 3, 9), device="meta")
    expected = (2, 3, task.output_length(9), task.output_size)
    given = {}
    if model.uses_targets:
        given["targets"] = torch.randint(0, task.output_size, expected[:3], device="meta")
    stage = "training forward"
    try:
        logits = model(inputs, **given)
        stage = "backward"
        logits.float().sum().backward()
        stage = "evaluation"
        model.eval()
        with torch.no_grad():
            evaluated = model(inputs, evaluating=True)
    except Exception as exc:  # any error the device meets: the check's finding
        return [
            f"meta device ({stage}): expected a pack of 2 to run with every tensor on the "
            f"inputs' device and no value read back, got {type(exc).__name__}: {one_line(exc)}"
        ]
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    failures = [
        f"meta device ({label}): expected logits {list(expected)} on meta, got "
        f"{list(tensor.shape)} on {tensor.device}"
        for label, tensor in (("training", logits), ("evaluation", evaluated))
        if tuple(tensor.shape) != expected or tensor.device.type != "meta"
    ]
    if missing:
        failures.append(
            f"meta device: expected a gradient for every parameter, got none for "
            f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
        )
    return failures


def in_place_task() -> str | None:
    """The first registered task whose outputs sit at its inputs (``output_layout``)."""
    return next((name for name in list_tasks() if get_task(name).output_layout == "in_place"), None)


def causal_failures(model: BenchModel, task: Task, label: str, cut: bool = True) -> list[str]:
    """The logits of ``model`` (in evaluation, on in-place ``task``) at positions
    0..CAUSAL_CUT are the same when the tokens after CAUSAL_CUT change and (if ``cut``) when
    the input stops after CAUSAL_CUT; ``label`` says where, in the failure lines."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, task.input_size, (2, CAUSAL_LENGTH), generator=generator)
    changed = inputs.clone()
    changed[:, CAUSAL_CUT + 1 :] = (inputs[:, CAUSAL_CUT + 1 :] + 1) % task.input_size
    seen = slice(0, CAUSAL_CUT + 1)
    model.eval()
    with torch.no_grad():
        model.seed_draws(list(range(model.members)))
        whole = model(inputs, evaluating=True)[:, :, seen]
        failures = []
        variants = [
            ("tokens after it changed", changed),
            ("the input cut after it", inputs[:, seen]),
        ]
        for variant, other in variants[: 2 if cut else 1]:
            model.seed_draws(list(range(model.members)))
            logits = model(other, evaluating=True)[:, :, seen]
            if not torch.allclose(logits, whole, rtol=1e-5, atol=1e-5):
                first = int((logits - whole).abs().amax(dim=(0, 1, 3)).gt(1e-5).nonzero()[0])
                failures.append(
                    f"causal outputs ({label}, {task.name} n={CAUSAL_LENGTH}): expected the "
                    f"logits up to position {CAUSAL_CUT} unchanged with {variant}, got others "
                    f"from position {first} (max |difference| "
                    f"{(logits - whole).abs().max().item():.3g})"
                )
    return failures


def check_causal_outputs(arch: str, options: dict[str, Any]) -> list[str]:
    """For a model that declares ``causal_outputs``: ``causal_failures`` on the first
    in-place task (none to check when there is none, or the model refuses it)."""
    name = in_place_task()
    if name is None:
        return []
    task = get_task(name)
    try:
        model = _model(arch, options, task)
    except CheBenchError:
        _model(arch, options, get_task(REFERENCE_TASK))  # an error not about the task: raised
        return []  # an in-place task refused (computation tokens): nothing to check
    if not model.causal_outputs:
        return []
    return causal_failures(model, task, "the model declares causal_outputs")


def check_reference_forward(arch: str, options: dict[str, Any]) -> list[str]:
    """For a model whose ``reference_forward`` gives logits: the fast ``forward`` equals it,
    without gradients and with them, and so does every parameter's gradient of a fixed random
    weighting of the logits, on ``REFERENCE_TASK`` at ``REFERENCE_LENGTHS`` (up to 1000
    tokens), in evaluation mode."""
    task = get_task(REFERENCE_TASK)
    model = _model(arch, options, task).eval()
    failures: list[str] = []
    for n in REFERENCE_LENGTHS:
        inputs = torch.randint(
            0, task.input_size, (2, n), generator=torch.Generator().manual_seed(n)
        )
        model.zero_grad()
        reference = model.reference_forward(inputs)
        if reference is None:
            return []
        weights = torch.randn(reference.shape, generator=torch.Generator().manual_seed(1))
        (reference * weights).sum().backward()
        expected = {name: _grad(p) for name, p in model.named_parameters()}
        model.zero_grad()
        with torch.no_grad():
            without = model(inputs, evaluating=True)
        fast = model(inputs, evaluating=True)
        (fast * weights).sum().backward()
        where = f"{REFERENCE_TASK} n={n}, {inputs.shape[1] + task.output_length(n)} tokens"
        compared = [
            ("logits without gradients", without, reference.detach()),
            ("logits", fast.detach(), reference.detach()),
        ]
        compared += [
            (f"gradient of {name}", _grad(p), expected[name])
            for name, p in model.named_parameters()
        ]
        for what, got, wanted in compared:
            difference = _reference_difference(got, wanted)
            if difference:
                failures.append(
                    f"reference forward ({where}): expected the fast forward's "
                    f"{what} to equal reference_forward's, got {difference}"
                )
                break  # the first disagreement at this length says enough
    return failures


def _grad(parameter: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(parameter) if parameter.grad is None else parameter.grad.clone()


def _reference_difference(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    if got.shape != expected.shape:
        return f"shape {list(got.shape)} instead of {list(expected.shape)}"
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    if torch.allclose(got, expected, rtol=REFERENCE_RTOL, atol=REFERENCE_ATOL * scale):
        return None
    return f"max |difference| {(got - expected).abs().max().item():.3g}"
