"""DAPE's filter at evaluation on a CPU as one compiled kernel (``fused_filter.c``): both
convolutions and the activation of a query row while the row is in cache, with no im2col
matrix and no hidden map of a tile, then (for the attention) the row's softmax. It sums in
its own order, so its logits equal the ``chunks`` filter's within float32 rounding, not bit
for bit (tested); training never uses it.

The C file is compiled on first use and cached (``che_bench.native_build``). Without a
compiler, or with ``CHE_BENCH_NATIVE_FILTER=0`` (which the portable CPU mode sets),
evaluation keeps the ``chunks`` filter.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from che_bench import native_build
from che_bench.cpu import NATIVE_FILTER_SWITCH as SWITCH

SOURCE = Path(__file__).with_name("fused_filter.c")
_POINTER, _LONG = ctypes.c_void_p, ctypes.c_long
#: dape_fused_filter's parameters, as fused_filter.c declares them.
_ARGUMENTS: list[Any] = [_POINTER, _POINTER, *[_LONG] * 3, *[_POINTER, *[_LONG] * 3] * 2, _POINTER]
_ARGUMENTS += [_POINTER, *[_LONG] * 6, ctypes.c_int, _LONG]


@dataclass(frozen=True)
class NativeFilter:
    """The loaded kernel and what built it (``description``, recorded with every DAPE run)."""

    library: ctypes.CDLL
    description: str

    def add(
        self,
        scores: torch.Tensor,
        content: torch.Tensor,
        residual: torch.Tensor,
        addend: torch.Tensor,
        weights: tuple[torch.Tensor, torch.Tensor],
        softmax: bool = False,
        first_row: int | None = None,
    ) -> None:
        """``scores += residual + f(content)`` in place for float32 ``[b, H, r, T]`` scores
        and content of the same strides (unit stride along T), ``residual`` ``[H or 1, r or
        1, T or 1]``, the first convolution's batch-free ``addend`` ``[D, r or 1, T or 1]``
        and contiguous ``weights``, ``[D, H, k]`` and ``[H, D, k]``. With ``softmax`` the
        logits then become the attention's probabilities, causal when ``first_row`` (the
        query index of the tile's first row) is given. With several torch threads, parts of
        the tile run on as many threads (the same numbers: rows are independent)."""

        def call(part: tuple[slice, slice]) -> None:
            sequences, rows = part
            part_first_row = None if first_row is None else first_row + rows.start
            tile = scores[sequences, :, rows], content[sequences, :, rows]
            terms = _rows(residual, rows), _rows(addend, rows)
            self._add(*tile, *terms, weights, softmax, part_first_row)

        parts = _parts(scores.shape[0], scores.shape[2], torch.get_num_threads())
        native_build.run_parts(call, parts)

    def _add(
        self,
        scores: torch.Tensor,
        content: torch.Tensor,
        residual: torch.Tensor,
        addend: torch.Tensor,
        weights: tuple[torch.Tensor, torch.Tensor],
        softmax: bool,
        first_row: int | None,
    ) -> None:
        batch, heads, rows, length = scores.shape
        width, _, kernel = weights[0].shape
        failed = self.library.dape_fused_filter(
            scores.data_ptr(), content.data_ptr(), *scores.stride()[:3],
            residual.data_ptr(), *_broadcast_strides(residual),
            addend.data_ptr(), *_broadcast_strides(addend),
            weights[0].data_ptr(), weights[1].data_ptr(),
            batch, heads, rows, length, width, kernel,
            softmax, -1 if first_row is None else first_row,
        )  # fmt: skip
        if failed:
            raise MemoryError("DAPE's native filter could not allocate its row buffers")


def _parts(batch: int, rows: int, threads: int) -> list[tuple[slice, slice]]:
    """A tile's (sequences, rows) split into at most ``threads`` parts: by sequence when
    there are enough, else by row."""
    if batch >= threads:
        return [(part, slice(0, rows)) for part in native_build.split(batch, threads)]
    return [(slice(0, batch), part) for part in native_build.split(rows, threads)]


def _rows(terms: torch.Tensor, rows: slice) -> torch.Tensor:
    """The query ``rows`` of ``[C, r or 1, T or 1]`` terms."""
    return terms if terms.shape[1] == 1 else terms[:, rows]


def _broadcast_strides(tensor: torch.Tensor) -> list[int]:
    """Strides with 0 along the size-1 (broadcast) dimensions."""
    pairs = zip(tensor.shape, tensor.stride(), strict=True)
    return [0 if size == 1 else stride for size, stride in pairs]


def usable(scores: torch.Tensor, content: torch.Tensor) -> bool:
    """Whether the kernel can take these scores and content: float32 on a CPU, the same
    strides, unit stride along the keys."""
    return (
        scores.dtype == content.dtype == torch.float32
        and scores.device.type == "cpu"
        and scores.stride() == content.stride()
        and scores.stride(-1) == 1
    )


@functools.cache
def native_filter() -> NativeFilter | None:
    """The kernel, compiled and loaded once per process; None when switched off or when no
    compiler builds it (a warning says why if a compiler was found)."""
    built = native_build.switched_build(
        SOURCE, _declare, SWITCH, "DAPE's native filter", "evaluating with the chunks filter"
    )
    if built is None:
        return None
    lanes = built.library.dape_fused_filter_lanes()
    return NativeFilter(built.library, f"{built.description}, {lanes} lanes")


def _declare(library: ctypes.CDLL) -> None:
    library.dape_fused_filter.argtypes = _ARGUMENTS
    library.dape_fused_filter.restype = ctypes.c_int


def describe() -> str:
    """How DAPE's filter evaluates on a CPU in this process, for a run's record."""
    kernel = native_filter()
    return "chunks" if kernel is None else f"native ({kernel.description})"
