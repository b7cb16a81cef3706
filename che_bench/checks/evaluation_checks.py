"""Check (g) of the self-test: evaluation on the device computes what it computes on the CPU.

A batch of ``TASK`` at a long length (n = 500; quick: n = 40, 80 model tokens, past the
state-tracking forms' 64-token chunks) is evaluated as ``evaluate`` runs it (eval mode,
inference mode, no targets) on the CPU and, from the same weights, on the device; the
device's logits must stay within check (a)'s logits tolerance of the CPU's. What only
evaluation runs:

* the transformer's row chunks: a memory budget that cuts the device's maps into
  ``ROW_CHUNKS`` chunks of query rows (the CPU's, narrower, into fewer), with no DAPE, DAPE
  and DAPE V2 k = 3, 5, 7, and causal DAPE V2 (its key masks offset per chunk);
* every other built-in architecture, under the evaluation's memory budget on the device:
  the one-member LSTM's fused kernel (cuDNN on a GPU) against the CPU's batched loop, the
  autoregressive transformer's greedy decoding (its own outputs fed back, one position at a
  time over cached keys and values: one argmax that flips on the device fails the case), the
  state-tracking models' chunked forms over many chunks.

On a CPU the device copy takes the GPU's implementations (``gpu_implementations``): DAPE's
grouped convolutions, the LSTM's fused kernel (the CPU copy runs the loop), Mamba's scan in
the GPU's chunks, the delta rule's chunkwise form instead of the native kernel.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from che_bench.checks.architecture_check import build_small, built_in_architectures
from che_bench.checks.comparison import (
    LOGITS_TOLERANCE,
    Case,
    model_sizes,
    relative_error,
    sample_batch,
    use_device_dape,
)
from che_bench.checks.speed import TASK
from che_bench.errors import one_line
from che_bench.eval.evaluation import use_evaluation_budget
from che_bench.model.architectures import TRANSFORMER, get_architecture
from che_bench.model.base import BenchModel
from che_bench.model.encoder import build_model
from che_bench.model.recurrent.base import RecurrentModel
from che_bench.model.state_tracking import delta_rule, deltanet, mamba

#: The evaluated length and batch, quick and not.
QUICK_LENGTH, LENGTH = 40, 500
QUICK_BATCH, BATCH = 2, 4
#: Row chunks the device's transformer maps are cut into.
ROW_CHUNKS = 4
#: The transformer's encoding, and its DAPE settings (kernel, causal) in the check.
ENCODING = "kerple"
DAPE_SETTINGS: tuple[tuple[int | None, bool], ...] = (
    (None, False),
    (1, False),
    (3, False),
    (5, False),
    (7, False),
    (3, True),
)


def chunkwise_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """``delta_rule.delta_product`` in its chunkwise form, as on a GPU (on a CPU the gated
    rule and the product run the native kernel unless given a chunk)."""
    steps = q.shape[-2]
    n = k.shape[-2] // steps if steps else 1
    return delta_rule.delta_product(q, k, v, beta, log_decay, chunk or delta_rule.chunk_limit(n))


@contextmanager
def gpu_implementations(device: torch.device) -> Iterator[None]:
    """On a CPU, the state-tracking models' GPU implementations inside the block: Mamba's
    scan in the GPU's chunks, the delta rule's chunkwise form (``chunkwise_delta_product``).
    On a GPU nothing changes."""
    if device.type != "cpu":
        yield
        return
    chunk, rule = mamba.CPU_CHUNK, deltanet.delta_product
    mamba.CPU_CHUNK, deltanet.delta_product = mamba.CHUNK, chunkwise_delta_product
    try:
        yield
    finally:
        mamba.CPU_CHUNK, deltanet.delta_product = chunk, rule


def use_loop(model: BenchModel) -> None:
    """Make a recurrent ``model`` evaluate with the batched loop, not torch's fused kernel."""
    for module in model.modules():
        if isinstance(module, RecurrentModel):
            module.fused = False


def evaluation_logits(model: BenchModel, inputs: torch.Tensor) -> torch.Tensor:
    """``model``'s logits of an evaluation forward on ``inputs`` (its device's), on the CPU."""
    model.eval()
    with torch.inference_mode():
        return model(inputs).cpu()


def evaluation_case(
    subject: str, reference: BenchModel, tested: BenchModel, inputs: torch.Tensor
) -> Case:
    """(g): ``tested`` (on its device) against ``reference`` (on the CPU), on ``inputs``; an
    error on the device fails the case with its line."""
    device = next(tested.parameters()).device
    expected = evaluation_logits(reference, inputs)
    try:
        with gpu_implementations(device):
            got = evaluation_logits(tested, inputs.to(device))
        measured, error = relative_error(got, expected), ""
    except RuntimeError as exc:  # the device's kernels refused, or it ran out of memory
        measured, error = math.inf, one_line(exc)
    what = f"relative error vs the CPU's evaluation, n = {inputs.shape[-1]}"
    return Case("g", subject, "logits", measured, LOGITS_TOLERANCE, what, error)


def row_chunk_budget(model: BenchModel, inputs: torch.Tensor, device: torch.device) -> int:
    """A memory budget that cuts ``model``'s maps of ``inputs`` on ``device`` into
    ``ROW_CHUNKS`` chunks of query rows."""
    tokens = model.task.model_length(inputs.shape[-1])
    rows = -(-tokens // ROW_CHUNKS)
    return model.query_row_bytes(inputs.shape[-1], device) * inputs.shape[0] * rows


def transformer_case(kernel: int | None, causal: bool, device: torch.device, quick: bool) -> Case:
    """(g) for the transformer with DAPE ``kernel`` (None: none), ``causal`` or not."""
    length, batch = (QUICK_LENGTH, QUICK_BATCH) if quick else (LENGTH, BATCH)
    task, inputs, _ = sample_batch(TASK, length, batch, seed=3)
    torch.manual_seed(0)
    sizes = model_sizes(quick)
    reference = build_model(task, ENCODING, kernel, dropout=0.0, causal=causal, **sizes)
    tested = copy.deepcopy(reference).to(device)
    use_device_dape(tested, device)
    budget = row_chunk_budget(tested, inputs, device)
    for model in (reference, tested):
        model.set_memory_budget(budget)
    subject = (
        f"transformer {ENCODING} k={kernel or '-'}{' causal' if causal else ''}, "
        f"{ROW_CHUNKS} row chunks"
    )
    return evaluation_case(subject, reference, tested, inputs)


def architecture_case(name: str, device: torch.device, quick: bool) -> Case:
    """(g) for a built-in architecture other than the transformer, built as check (f) builds
    it (``build_small``)."""
    length, batch = (QUICK_LENGTH, QUICK_BATCH) if quick else (LENGTH, BATCH)
    task, inputs, _ = sample_batch(TASK, length, batch, seed=3)
    reference = build_small(name, task, quick)
    tested = copy.deepcopy(reference).to(device)
    use_evaluation_budget(tested, device)
    use_loop(reference)
    return evaluation_case(get_architecture(name).label, reference, tested, inputs)


def check_evaluation(device: torch.device, quick: bool) -> list[Case]:
    """(g) for the transformer's DAPE settings and every other built-in architecture."""
    transformer = [
        transformer_case(kernel, causal, device, quick) for kernel, causal in DAPE_SETTINGS
    ]
    others = [
        architecture_case(name, device, quick)
        for name in built_in_architectures()
        if name != TRANSFORMER
    ]
    return transformer + others
