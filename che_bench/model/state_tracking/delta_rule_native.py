"""The gated delta product on a CPU as its plain recurrence, compiled (``delta_rule_native.c``):
forward and backward per sequence while its d x d state is in L1, where the chunkwise form
(``delta_rule``) spends its time in thousands of tiny batched matrix products. Gated DeltaNet
and DeltaProduct train and evaluate with it on a CPU (``delta_rule.delta_product``); DeltaNet
keeps the chunkwise form, whose roundings its committed results have. It sums in its own
order, so it equals the chunkwise form within float32 rounding, not bit for bit (tested).

The backward replays the recurrence from states the forward saved every ``BLOCK`` tokens, so
it stores ``T / BLOCK`` states per sequence, not T. Sequences are split over torch's threads
(the same numbers: sequences are independent). Compiled on first use and cached
(``che_bench.native_build``); without a compiler, with ``CHE_BENCH_NATIVE_DELTA_RULE=0``
(which the portable CPU mode sets), or off the CPU, the chunkwise form runs.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from che_bench import native_build
from che_bench.cpu import NATIVE_DELTA_RULE_SWITCH as SWITCH

SOURCE = Path(__file__).with_name("delta_rule_native.c")
#: Tokens between saved states: the backward keeps n * BLOCK + 1 states of a block at once.
BLOCK = 16
_P, _L = ctypes.c_void_p, ctypes.c_long


@dataclass(frozen=True)
class NativeDeltaRule:
    """The loaded kernel, what built it (``description``, recorded with the runs), the floats
    in its vectors (``lanes``) and in the longest state row it takes (``widest``)."""

    library: ctypes.CDLL
    description: str
    lanes: int
    widest: int

    def usable(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether it takes these inputs: on a CPU, ``d_k = d_v`` within its widest row."""
        d = q.shape[-1]
        return q.device.type == "cpu" and k.shape[-1] == v.shape[-1] == d and d <= self.widest

    def apply(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        beta: torch.Tensor,
        log_decay: torch.Tensor | None,
    ) -> torch.Tensor:
        """``delta_rule.delta_product``'s outputs (same arguments and shapes), differentiable."""
        out = _DeltaProduct.apply(self, q, k, v, beta, log_decay)
        return out.to(v.dtype)


class _DeltaProduct(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        kernel: NativeDeltaRule,
        *inputs: Any,  # q, k, v, beta, log_decay (or None), as delta_product takes them
    ) -> Tensor:
        q, k, v, beta, gate = _flat(*inputs)
        sequences, steps, d = q.shape
        n = k.shape[1] // steps if steps else 1
        blocks = -(-steps // BLOCK)
        width = -(-d // kernel.lanes) * kernel.lanes  # a state row, padded to whole vectors
        out = torch.empty_like(q)
        checkpoints = q.new_empty(sequences, blocks, d, width)
        if steps:
            _run(kernel.library.delta_product_forward, sequences,
                 [q, k, v, beta, gate, out, checkpoints], [steps, n, d, BLOCK])  # fmt: skip
        ctx.library = kernel.library
        ctx.originals = [None if x is None else (x.shape, x.dtype) for x in inputs]
        ctx.save_for_backward(q, k, v, beta, gate, checkpoints)
        return out.view(ctx.originals[0][0])

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, beta, gate, checkpoints = ctx.saved_tensors
        sequences, steps, d = q.shape
        n = k.shape[1] // steps if steps else 1
        d_out = d_out.float().reshape(q.shape).contiguous()
        grads = [None if x is None else torch.empty_like(x) for x in (q, k, v, beta, gate)]
        if steps:
            tensors = [q, k, v, beta, gate, checkpoints, d_out, *grads]
            _run(ctx.library.delta_product_backward, sequences, tensors, [steps, n, d, BLOCK])
        return (
            None,
            *(
                None if grad is None else grad.view(original[0]).to(original[1])
                for grad, original in zip(grads, ctx.originals, strict=True)
            ),
        )


def _flat(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, log_decay: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """The inputs as contiguous float32 ``[sequences, rows, d]`` (beta, gate: ``[sequences,
    rows]``)."""
    steps, d = q.shape[-2:]
    rows = k.shape[-2]
    gate = None if log_decay is None else log_decay.float().reshape(-1, steps).contiguous()
    return (
        q.float().reshape(-1, steps, d).contiguous(),
        k.float().reshape(-1, rows, d).contiguous(),
        v.float().reshape(-1, rows, d).contiguous(),
        beta.float().reshape(-1, rows).contiguous(),
        gate,
    )


def _run(
    function: Callable[..., int],
    sequences: int,
    tensors: list[torch.Tensor | None],
    sizes: list[int],
) -> None:
    """``function`` over the sequences, split over torch's threads; every tensor is
    ``[sequences, ...]`` (None: a null pointer)."""
    parts = native_build.split(sequences, torch.get_num_threads())

    def call(part: slice) -> None:
        pointers = [None if x is None else x[part].data_ptr() for x in tensors]
        if function(*pointers, part.stop - part.start, *sizes):
            raise MemoryError("the delta rule's native kernel could not allocate its state")

    native_build.run_parts(call, parts)


def _declare(library: ctypes.CDLL) -> None:
    library.delta_product_forward.argtypes = [*[_P] * 7, *[_L] * 5]
    library.delta_product_backward.argtypes = [*[_P] * 12, *[_L] * 5]
    for function in (library.delta_product_forward, library.delta_product_backward):
        function.restype = ctypes.c_int


@functools.cache
def native_delta_rule() -> NativeDeltaRule | None:
    """The kernel, compiled and loaded once per process; None when switched off or when no
    compiler builds it (a warning says why if a compiler was found)."""
    built = native_build.switched_build(
        SOURCE,
        _declare,
        SWITCH,
        "the delta rule's native kernel",
        "Gated DeltaNet and DeltaProduct run the chunkwise form",
    )
    if built is None:
        return None
    lanes, widest = built.library.delta_product_lanes(), built.library.delta_product_widest()
    return NativeDeltaRule(built.library, f"{built.description}, {lanes} lanes", lanes, widest)


def describe(device: torch.device) -> str:
    """How Gated DeltaNet's and DeltaProduct's delta rule runs on ``device`` in this process
    (off the CPU: the chunkwise form, with nothing compiled)."""
    if device.type != "cpu":
        return "chunkwise"
    kernel = native_delta_rule()
    return "chunkwise" if kernel is None else f"native ({kernel.description})"
