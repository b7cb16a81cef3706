"""The field's reference recurrences for ``bench_state_tracking.py``, each adapted to the
signature of che-bench's kernel it replaces in the same model (the ``references`` extra of
pyproject.toml, test-only dependencies; ``Reference.kernel`` raises ImportError when the package
is missing)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch


def mambapy_scan(block: Any) -> Callable[..., torch.Tensor]:
    """``selective_scan(x, dt, A, B, C, negative)`` through mambapy's ``selective_scan_seq``
    (one member at a time: A differs per member)."""

    def kernel(x, dt, A, B, C, negative=False):
        if negative:
            raise ValueError("mambapy's scan has no negative eigenvalues")
        this = SimpleNamespace(config=SimpleNamespace(d_inner=x.shape[-1], d_state=A.shape[-1]))
        members = range(x.shape[0])
        return torch.stack([block.selective_scan_seq(this, x[m], dt[m], A[m], B[m], C[m], 0.0)
                            for m in members])

    return kernel


def fla_delta_rule(recurrence: Any) -> Callable[..., torch.Tensor]:
    """DeltaNet's ``delta_product`` through fla's ``delta_rule_recurrence`` (layout [B, H, T, d]
    as ours; it scales q by d^-1/2 itself, ours arrives scaled)."""

    def kernel(q, k, v, beta, log_decay=None, chunk=0):
        if log_decay is not None or k.shape[-2] != q.shape[-2]:
            raise ValueError("delta_rule_recurrence: no gate, one sub-step per token")
        out, _ = recurrence(*(x.flatten(0, 1) for x in (q * q.shape[-1] ** 0.5, k, v, beta)))
        return out.unflatten(0, q.shape[:2])

    return kernel


def fla_gated_delta_rule(recurrent: Any) -> Callable[..., torch.Tensor]:
    """Gated DeltaNet's ``delta_product`` through fla's ``naive_recurrent_gated_delta_rule``."""

    def kernel(q, k, v, beta, log_decay=None, chunk=0):
        if log_decay is None or k.shape[-2] != q.shape[-2]:
            raise ValueError("naive_recurrent_gated_delta_rule: a gate, one sub-step per token")
        fla_layout = [x.flatten(0, 1).transpose(1, 2) for x in (q, k, v, beta, log_decay)]
        out, _ = recurrent(*fla_layout, scale=1.0)
        return out.transpose(1, 2).unflatten(0, q.shape[:2])

    return kernel


def fla_gated_delta_product(recurrent: Any) -> Callable[..., torch.Tensor]:
    """DeltaProduct's ``delta_product`` through fla's ``naive_recurrent_gated_delta_product``."""

    def kernel(q, k, v, beta, log_decay=None, chunk=0):
        q_, k_, v_, beta_ = (x.flatten(0, 1).transpose(1, 2) for x in (q, k, v, beta))
        gate = None if log_decay is None else log_decay.flatten(0, 1).transpose(1, 2)
        n = k.shape[-2] // q.shape[-2]
        out, _ = recurrent(q_, k_, v_, gate, beta_, 1.0, num_householder=n)
        return out.transpose(1, 2).unflatten(0, q.shape[:2])

    return kernel


def xlstm_mlstm_steps(step: Any) -> Callable[..., torch.Tensor]:
    """``mlstm_chunkwise`` as xlstm's ``recurrent_step_stabilized_simple`` token by token."""

    def kernel(q, k, v, igate, fgate):
        lead = q.shape[:2]
        q, k, v, igate, fgate = (x.flatten(0, 1) for x in (q, k, v, igate, fgate))
        batch, heads, _, size = q.shape
        state = (q.new_zeros(batch, heads, size, size), q.new_zeros(batch, heads, size, 1),
                 q.new_zeros(batch, heads, 1, 1))
        outputs = []
        # One unbind per input (not an index per step, whose backward is quadratic in T); the
        # step squeezes its q, k, v in place, so it gets copies.
        for q_t, k_t, v_t, i_t, f_t in zip(*(x.unbind(2) for x in (q, k, v, igate, fgate)),
                                           strict=True):
            h, state = step(*state, q_t[:, :, None].clone(), k_t[:, :, None].clone(),
                            v_t[:, :, None].clone(), i_t[..., None, None], f_t[..., None, None])
            outputs.append(h)
        return torch.cat(outputs, dim=2).unflatten(0, lead)

    return kernel


def xlstm_mlstm_parallel(parallel: Any) -> Callable[..., torch.Tensor]:
    """``mlstm_chunkwise`` as xlstm's ``parallel_stabilized_simple``."""

    def kernel(q, k, v, igate, fgate):
        flat = [x.flatten(0, 1) for x in (q, k, v)]
        gates = [x.flatten(0, 1)[..., None] for x in (igate, fgate)]
        return parallel(*flat, *gates).unflatten(0, q.shape[:2])

    return kernel


def xlstm_slstm(vanilla: Any) -> Callable[..., torch.Tensor]:
    """``slstm_scan(pre [N, T, B, 4d], recurrent [N, d, 4d])`` as xlstm's vanilla
    ``slstm_forward`` with N heads (its gate-major layout: [i of every head, f, z, o])."""

    def kernel(pre, recurrent):
        heads, steps, batch, gates = pre.shape
        size = gates // 4
        x = pre.view(heads, steps, batch, 4, size).permute(1, 2, 3, 0, 4).flatten(2)
        states = pre.new_zeros(4, batch, heads * size)
        bias = pre.new_zeros(4 * heads * size)  # pre holds the bias
        pointwise = vanilla.slstm_pointwise_function_registry["slstm"]
        every, _, _ = vanilla.slstm_forward(x, states, recurrent.transpose(1, 2), bias, pointwise)
        return every[0, 1:].view(steps, batch, heads, size).permute(2, 0, 1, 3)

    return kernel


@dataclass(frozen=True)
class Reference:
    """A reference kernel: ``label``, where it is (``module``, ``attribute``), the adapter that
    gives it che-bench's kernel signature, and whether it runs step by step (the goal's)."""

    label: str
    module: str
    attribute: str | None  # None: the adapter takes the module
    adapter: Callable[[Any], Callable[..., torch.Tensor]]
    stepwise: bool = True

    def kernel(self) -> Callable[..., torch.Tensor]:
        """The adapted kernel; ImportError when the package is missing."""
        module = importlib.import_module(self.module)
        return self.adapter(module if self.attribute is None else getattr(module, self.attribute))


FLA = "fla.ops.{}.naive"
REFERENCES: dict[str, list[Reference]] = {
    "mamba": [Reference("mambapy:selective_scan_seq", "mambapy.mamba", "MambaBlock",
                        mambapy_scan)],
    "deltanet": [Reference("fla:delta_rule_recurrence", FLA.format("delta_rule"),
                           "delta_rule_recurrence", fla_delta_rule)],
    "gated_deltanet": [Reference("fla:naive_recurrent_gated_delta_rule",
                                 FLA.format("gated_delta_rule"),
                                 "naive_recurrent_gated_delta_rule", fla_gated_delta_rule)],
    "deltaproduct": [Reference("fla:naive_recurrent_gated_delta_product",
                               FLA.format("gated_delta_product"),
                               "naive_recurrent_gated_delta_product", fla_gated_delta_product)],
    "mlstm": [Reference("xlstm:recurrent_step_stabilized_simple", "xlstm.blocks.mlstm.backends",
                        "recurrent_step_stabilized_simple", xlstm_mlstm_steps),
              Reference("xlstm:parallel_stabilized_simple", "xlstm.blocks.mlstm.backends",
                        "parallel_stabilized_simple", xlstm_mlstm_parallel, stepwise=False)],
    "slstm": [Reference("xlstm:slstm_forward", "xlstm.blocks.slstm.src.vanilla", None,
                        xlstm_slstm)],
}
