"""Adam for a pack: one optimizer over the member axis, each member with its own learning
rate, gradient clipping (global norm per member) and state, as if it trained alone."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from che_bench.errors import CheBenchError
from che_bench.train.checkpoints import (
    layout_matches,
    member_layout,
)


class PackOptimizer:
    """Adam after global-norm gradient clipping, per member, for a model whose parameters
    all have a leading member axis.

    The parameters are re-homed into a flat ``[M, P]`` buffer (each parameter a view of its
    columns), and ``step`` copies the gradients autograd left in ``.grad`` into a second one
    with a single ``cat``, so clipping and the Adam update are a handful of whole-pack
    operations, whatever the number of parameter tensors (``zero_grad`` sets the gradients to
    None: autograd then hands over its own instead of adding each into a zeroed buffer, one
    operator per parameter). Members never mix: the norm, the clipping factor and the
    learning rate are per row. A learning rate of 0 leaves its member's weights unchanged.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        lrs: Sequence[float],
        betas: Sequence[float],
        eps: float,
        max_norm: float,
    ) -> None:
        self.parameters = list(model.parameters())
        first = self.parameters[0]
        members = first.shape[0]
        if len(lrs) != members or any(p.shape[0] != members for p in self.parameters):
            raise ValueError("every parameter needs a leading member axis of one size per lr")
        sizes = [p[0].numel() for p in self.parameters]
        self.flat = first.new_empty(members, sum(sizes))
        self.flat_grad = torch.zeros_like(self.flat)
        offset = 0
        with torch.no_grad():
            for parameter, size in zip(self.parameters, sizes, strict=False):
                columns = slice(offset, offset + size)
                self.flat[:, columns].copy_(parameter.reshape(members, size))
                parameter.data = self.flat[:, columns].view(parameter.shape)
                parameter.grad = None
                offset += size
        self.lrs = torch.tensor(list(lrs), dtype=self.flat.dtype, device=self.flat.device)[:, None]
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.max_norm = float(eps), float(max_norm)
        self.exp_avg = torch.zeros_like(self.flat)
        self.exp_avg_sq = torch.zeros_like(self.flat)
        self.steps = 0
        #: Each member's gradient norm before clipping at the last step (on the device).
        self.grad_norms = torch.zeros_like(self.lrs[:, 0])
        #: The shapes of one member's parameters: its row of the flat buffers is portable to
        #: a pack of any width (``che_bench.train.checkpoints``).
        self.member_shapes = [p.shape[1:] for p in self.parameters]

    def zero_grad(self) -> None:
        for parameter in self.parameters:
            parameter.grad = None

    def _gather_gradients(self) -> None:
        """``flat_grad`` := the parameters' gradients (0 where a parameter got none)."""
        members = self.flat.shape[0]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.parameters]
        torch.cat([grad.reshape(members, -1) for grad in grads], dim=1, out=self.flat_grad)

    @torch.no_grad()
    def step(self) -> None:
        self._gather_gradients()
        norms = torch.linalg.vector_norm(self.flat_grad, dim=1, keepdim=True)
        self.grad_norms = norms[:, 0]
        # torch.nn.utils.clip_grad_norm_'s factor, per member.
        self.flat_grad.mul_((self.max_norm / (norms + 1e-6)).clamp(max=1.0))
        self.steps += 1
        grad = self.flat_grad
        self.exp_avg.lerp_(grad, 1 - self.beta1)
        self.exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        bias_correction1 = 1 - self.beta1**self.steps
        bias_correction2 = 1 - self.beta2**self.steps
        denominator = (self.exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(self.eps)
        self.flat.sub_(self.exp_avg / denominator * (self.lrs / bias_correction1))

    def member_state(self, member: int) -> dict[str, Any]:
        """One member's weights and Adam state (copies, on the CPU)."""
        return {
            "layout": member_layout(self.member_shapes),
            "adam_steps": self.steps,
            "flat": self.flat[member].cpu(),
            "exp_avg": self.exp_avg[member].cpu(),
            "exp_avg_sq": self.exp_avg_sq[member].cpu(),
        }

    @torch.no_grad()
    def load_member_state(self, member: int, state: dict[str, Any]) -> None:
        if (
            not layout_matches(state, self.member_shapes)
            or state["flat"].shape != self.flat[member].shape
        ):
            raise CheBenchError("checkpoint is for another model layout")
        self.flat[member] = state["flat"]
        self.exp_avg[member] = state["exp_avg"]
        self.exp_avg_sq[member] = state["exp_avg_sq"]
        self.steps = int(state["adam_steps"])
