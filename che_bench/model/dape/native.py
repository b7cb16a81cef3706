"""DAPE's filter on a CPU as one compiled kernel (``fused_filter.c``): both convolutions and
the activation of a query row while the row is in cache, with no im2col matrix and no hidden
map of a tile, then (for the attention at evaluation) the row's softmax. In training, the
same rows with the adjoint weights give the backward through the hidden map, and the
weights' gradients are long dot products over zero-padded rows of the hidden map, its
gradient and their inputs, which the kernel writes out (``native_training``).

It sums in an order of its own (channel by channel, from the addend or the residual), so its
numbers equal the ``chunks`` filter's within float32 rounding, not bit for bit; they are the
same on any number of threads.

The C file is compiled on first use and cached (``che_bench.native_build``). Without a
compiler, or with ``CHE_BENCH_NATIVE_FILTER=0`` (which the portable CPU mode sets), the
``chunks`` filter evaluates and trains.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from che_bench import native_build
from che_bench.cpu import NATIVE_FILTER_SWITCH as SWITCH

SOURCE = Path(__file__).with_name("fused_filter.c")
#: The maps of ``struct filter_rows``: each one's pointer field and its strides' fields.
_MAPS = {
    "out": ("ob", "oh", "oi"),
    "in": ("ib", "ih", "ii"),
    "residual": ("rh", "ri", "rj"),
    "addend": ("ad", "ai", "aj"),
    "gate": ("gd", "gb", "gi"),
    "hidden_out": ("hd", "hb", "hi"),
    "in_copy": ("cb", "ch", "ci"),
    "source": ("sb", "sh", "si"),
    "source_copy": ("xb", "xh", "xi"),
    "in_sum": ("qh", "qi"),
    "hidden_sum": ("ed", "ei"),
}
#: Per map, the dimensions along which a part's sequences and query rows lie: ``[b, H, r, T]``
#: maps, ``[D, b, r, T]`` maps, and batch-free ``[C, r or 1, T or 1]`` terms.
_PART_AXES = {
    "out": (0, 2),
    "in": (0, 2),
    "residual": (None, 1),
    "addend": (None, 1),
    "gate": (1, 2),
    "hidden_out": (1, 2),
    "in_copy": (0, 2),
    "source": (0, 2),
    "source_copy": (0, 2),
    "in_sum": (None, 1),
    "hidden_sum": (None, 1),
}


class Convolutions(NamedTuple):
    """f's two convolutions' weights as the kernel reads them: input channel, tap, output
    channel (a tap's weights of a block of outputs side by side), contiguous; ``of`` lays
    out ``[D, H, k]`` and ``[H, D, k]`` weights once, not at every call."""

    first: torch.Tensor
    second: torch.Tensor

    @classmethod
    def of(cls, first: torch.Tensor, second: torch.Tensor) -> Convolutions:
        return cls(*(weight.permute(1, 2, 0).contiguous() for weight in (first, second)))


#: ``enum base`` of fused_filter.c: what a row's second convolution is added to.
_OUT_BASE, _NO_BASE, _INPUT_BASE = range(3)


class _WeightGrads(ctypes.Structure):
    """``struct weight_grads`` of fused_filter.c: one call's weight gradients."""

    _fields_ = [
        *[
            (field, ctypes.c_void_p if field in ("small", "big", "out") else ctypes.c_long)
            for field in (
                *("small", "small_channel", "small_row", "big", "big_channel", "big_row"),
                *("out", "on", "om", "smalls", "bigs", "rows", "span", "kernel", "direction"),
            )
        ]
    ]


class _FilterRows(ctypes.Structure):
    """``struct filter_rows`` of fused_filter.c: one call over a tile's rows."""

    _fields_ = [
        *[
            (field, ctypes.c_void_p if field == name else ctypes.c_long)
            for name, strides in _MAPS.items()
            for field in (name, *strides)
        ],
        *[(weight, ctypes.c_void_p) for weight in ("w0", "w1", "w2")],
        *[
            (size, ctypes.c_long)
            for size in ("batch", "heads", "rows", "length", "width", "kernel", "span")
        ],
        *[(flag, ctypes.c_int) for flag in ("base", "normalise")],
        ("first_row", ctypes.c_long),
    ]


@dataclass(frozen=True)
class NativeFilter:
    """The loaded kernel, what built it (``description``, recorded with every DAPE run: the
    compiler, its target, the vector instructions and the lanes) and the floats in its
    vectors of keys (``lanes``)."""

    library: ctypes.CDLL
    description: str
    lanes: int

    def add(
        self,
        scores: torch.Tensor,
        content: torch.Tensor,
        residual: torch.Tensor | None,
        addend: torch.Tensor,
        weights: Convolutions,
        softmax: bool = False,
        first_row: int | None = None,
        onto_content: bool = False,
    ) -> None:
        """``scores += residual + f(content)`` in place for float32 ``[b, H, r, T]`` scores
        and content (unit stride along T), ``residual`` ``[H or 1, r or 1, T or 1]`` (or
        None), the first convolution's batch-free ``addend`` ``[D, r or 1, T or 1]`` and
        f's ``weights``; ``onto_content``: ``scores = content +
        (residual + f(content))``, scores written, not read. With ``softmax`` the logits then
        become the attention's probabilities, causal when ``first_row`` (the query index of
        the tile's first row) is given. With several torch threads, parts of the tile run on
        as many threads (the same numbers: rows are independent)."""
        maps = {"out": scores, "in": content, "residual": residual, "addend": addend}
        base = _INPUT_BASE if onto_content else _OUT_BASE
        prepared = _Prepared.of(self.library, maps, weights, softmax, base, None)
        prepared.launch(slice(0, scores.shape[0]), slice(0, scores.shape[2]), first_row)

    def weight_grads(
        self, out: torch.Tensor, small: torch.Tensor, big: torch.Tensor, direction: int
    ) -> None:
        """``out[n, m, s] += sum_{r, p} small[r, n, p] big[r, m, p + direction (s - k // 2)]``
        for a contiguous ``out`` ``[N, M, k]`` and rows ``[rows, N | M, S]`` written by
        ``backward_rows`` (S a multiple of ``lanes``, unit stride along it); ``big``
        must read 0 for k // 2 floats before its first row and after its last. Parts of the
        big channels run on the torch threads (the same numbers on any number)."""
        smalls, bigs, kernel = out.shape
        call = _WeightGrads(small=small.data_ptr(), big=big.data_ptr(), out=out.data_ptr())
        call.small_channel, call.small_row = small.stride(1), small.stride(0)
        call.big_channel, call.big_row = big.stride(1), big.stride(0)
        call.on, call.om = out.stride(0), out.stride(1)
        call.smalls, call.rows, call.span = smalls, small.shape[0], small.shape[2]
        call.kernel, call.direction = kernel, direction

        def run(part: slice) -> None:
            part_call = _WeightGrads.from_buffer_copy(call)
            part_call.bigs = part.stop - part.start
            part_call.big += 4 * part.start * call.big_channel
            part_call.out += 4 * part.start * call.om
            failed = self.library.dape_filter_weight_grads(ctypes.byref(part_call))
            if failed == -1:
                raise MemoryError("DAPE's native weight gradients could not allocate their sums")
            if failed:
                raise ValueError(f"DAPE's native weight gradients take no {kernel}-tap kernel")

        native_build.run_parts(run, native_build.split(bigs, torch.get_num_threads()))

    def backward_rows(
        self,
        grad_content: torch.Tensor,
        grad: torch.Tensor,
        forward: tuple[torch.Tensor, torch.Tensor, Convolutions],
        adjoints: Convolutions,
        written: tuple[torch.Tensor, ...],
        plus_grad: bool = False,
        sums: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Callable[[slice, slice], None]:
        """The backward of f through its content for ``[B, H, R, T]`` gradients ``grad`` of
        the logits, prepared once, as a function of a chunk (sequences, query rows) of them:
        ``grad_content`` = f's gradient of the content (written over; plus ``grad`` with
        ``plus_grad``: the scores' whole gradient when they are f's content), with
        ``adjoints`` the weights of the two convolutions' adjoints (``[D, H, k]`` and
        ``[H, D, k]`` before they were laid out). The activated hidden map is recomputed row
        by row from ``forward``: the forward's content ``[B, H, R, T]``, its addend (as
        ``add``) and f's weights. Each chunk writes at the start of ``written``, as its own
        maps zero-padded to S >= T + k // 2 keys (unit stride along them), as
        ``weight_grads`` takes them: that hidden map ``[D, b, r, S]``, the content ``[b, H,
        r, S]``, the gradient of the hidden map before its activation ``[D, b, r, S]`` and
        ``grad`` ``[b, H, r, S]``. ``sums``, when given, receive added over the sequences
        ``grad`` (``[H, R, T]``) and that gradient of the hidden map (``[D, R, T]``): the
        batch-free residual's and addend's gradients."""
        content, addend, forward_weights = forward
        names = "gate", "source_copy", "hidden_out", "in_copy"
        maps = {"out": grad_content, "in": grad, "source": content, "addend": addend}
        if sums is not None:
            maps |= {"in_sum": sums[0], "hidden_sum": sums[1]}
        base = _INPUT_BASE if plus_grad else _NO_BASE
        rows = dict(zip(names, written, strict=True))
        source_weights = forward_weights.first
        prepared = _Prepared.of(self.library, maps | rows, adjoints, False, base, source_weights)
        return functools.partial(prepared.launch, first_row=None, local=frozenset(names))


@dataclass(frozen=True)
class _Prepared:
    """A kernel call over whole maps: the call's struct, each map's pointer with how far one
    sequence and one query row move it (bytes), and the laid-out weights it points to."""

    library: ctypes.CDLL
    call: _FilterRows
    located: dict[str, tuple[int, int, int]]
    weights: tuple[torch.Tensor, ...]

    @classmethod
    def of(
        cls,
        library: ctypes.CDLL,
        maps: Mapping[str, torch.Tensor | None],
        weights: Convolutions,
        softmax: bool,
        base: int,
        source_weights: torch.Tensor | None,
    ) -> _Prepared:
        out = maps["out"]
        assert out is not None
        _, heads, _, length = out.shape
        _, kernel, width = weights.first.shape
        written = [maps.get(name) for name in ("hidden_out", "in_copy", "source_copy")]
        span = next((rows.shape[-1] for rows in written if rows is not None), length)
        call = _FilterRows(heads=heads, length=length, width=width, kernel=kernel, span=span)
        laid_out = (weights.first if source_weights is None else source_weights, *weights)
        call.w0, call.w1, call.w2 = (weight.data_ptr() for weight in laid_out)
        call.base, call.normalise = base, softmax
        located = {}
        for name, tensor in maps.items():
            if tensor is not None:
                strides = _broadcast_strides(tensor)[: len(_MAPS[name])]
                for field, stride in zip(_MAPS[name], strides, strict=True):
                    setattr(call, field, stride)
                sequence, row = _PART_AXES[name]
                steps = 0 if sequence is None else strides[sequence], strides[row]
                size = tensor.element_size()
                located[name] = tensor.data_ptr(), size * steps[0], size * steps[1]
        return cls(library, call, located, laid_out)

    def launch(
        self,
        sequences: slice,
        rows: slice,
        first_row: int | None,
        local: frozenset[str] = frozenset(),
    ) -> None:
        """The call over ``sequences`` x query ``rows`` of the maps, in parts on the torch
        threads (``_parts``); the maps named in ``local`` start at the chunk's first row."""

        def run(part: tuple[slice, slice]) -> None:
            part_sequences, part_rows = part
            part_call = _FilterRows.from_buffer_copy(self.call)
            part_call.batch = part_sequences.stop - part_sequences.start
            part_call.rows = part_rows.stop - part_rows.start
            part_call.first_row = -1 if first_row is None else first_row + part_rows.start
            for name, (pointer, sequence_bytes, row_bytes) in self.located.items():
                first = (0, 0) if name in local else (sequences.start, rows.start)
                offset = (part_sequences.start + first[0]) * sequence_bytes
                offset += (part_rows.start + first[1]) * row_bytes
                setattr(part_call, name, pointer + offset)
            if self.library.dape_filter_rows(ctypes.byref(part_call)):
                raise MemoryError("DAPE's native filter could not allocate its row buffers")

        batch, count = sequences.stop - sequences.start, rows.stop - rows.start
        # Sums over the sequences take parts of the rows: each row's in one part, in order.
        sums = "in_sum" in self.located or "hidden_sum" in self.located
        native_build.run_parts(run, _parts(batch, count, torch.get_num_threads(), sums))


def _parts(batch: int, rows: int, threads: int, by_rows: bool = False) -> list[tuple[slice, slice]]:
    """A tile's (sequences, rows) split into at most ``threads`` parts: by sequence when
    there are enough (and not ``by_rows``), else by row."""
    if batch >= threads and not by_rows:
        return [(part, slice(0, rows)) for part in native_build.split(batch, threads)]
    return [(slice(0, batch), part) for part in native_build.split(rows, threads)]


def _broadcast_strides(tensor: torch.Tensor) -> list[int]:
    """Strides with 0 along the size-1 (broadcast) dimensions."""
    pairs = zip(tensor.shape, tensor.stride(), strict=True)
    return [0 if size == 1 else stride for size, stride in pairs]


def usable(*maps: torch.Tensor) -> bool:
    """Whether the kernel can take these maps: float32 on a CPU, unit stride along the keys."""
    return all(
        tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.stride(-1) == 1
        for tensor in maps
    )


@functools.cache
def native_filter() -> NativeFilter | None:
    """The kernel, compiled and loaded once per process; None when switched off or when no
    compiler builds it (a warning says why if a compiler was found)."""
    built = native_build.switched_build(
        SOURCE, _declare, SWITCH, "DAPE's native filter", "filtering with the chunks"
    )
    if built is None:
        return None
    lanes = built.library.dape_fused_filter_lanes()
    isa = built.library.dape_fused_filter_isa().decode()
    return NativeFilter(built.library, f"{built.description}, {isa}, {lanes} lanes", lanes)


def _declare(library: ctypes.CDLL) -> None:
    library.dape_filter_rows.argtypes = [ctypes.POINTER(_FilterRows)]
    library.dape_filter_rows.restype = ctypes.c_int
    library.dape_filter_weight_grads.argtypes = [ctypes.POINTER(_WeightGrads)]
    library.dape_filter_weight_grads.restype = ctypes.c_int
    library.dape_fused_filter_isa.restype = ctypes.c_char_p


def describe() -> str:
    """How DAPE's filter runs on a CPU in this process, for a run's record: the chunks, or
    the native kernel, which evaluates and trains DAPE V2 (rows of more than two of its
    vectors; a record without "trains" predates its training in the kernel's own order)."""
    kernel = native_filter()
    return "chunks" if kernel is None else f"native ({kernel.description}; trains DAPE V2)"
