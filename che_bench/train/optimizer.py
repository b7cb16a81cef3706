"""Adam or AdamW for a pack: one optimizer over the member axis, each member with its own
learning rate, gradient clipping (global norm per member) and state, as if it trained alone;
the learning-rate schedule, a function of the step alone (so a resumed run follows it
exactly)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from che_bench.errors import CheBenchError
from che_bench.model.base import default_no_weight_decay
from che_bench.train.layout import layout_matches, member_layout

if TYPE_CHECKING:
    from che_bench.config import RunConfig


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate of update ``k`` (0-based) as a fraction of the configured one
    (``factor``). ``constant``: ``k / warmup_steps`` during the warm-up, then 1.
    ``warmup_cosine`` (the xLSTM harness's LinearWarmupCosineAnnealing, decaying until the
    last step): the same warm-up, then ``r + (1 - r) * (1 + cos(pi * d)) / 2`` with
    ``d = (k - warmup_steps) / (steps - warmup_steps)`` and ``r = min_lr_ratio``, which reaches
    ``r`` at ``k = steps``. As in the harness, whose scheduler starts at step 0, the first update
    of a warm-up has rate 0."""

    kind: str = "constant"
    warmup_steps: int = 0
    steps: int = 0
    min_lr_ratio: float = 1e-3

    @classmethod
    def of(cls, config: RunConfig) -> LrSchedule:
        return cls(config.lr_schedule, config.warmup_steps, config.steps, config.min_lr_ratio)

    def factor(self, update: int) -> float:
        if update < self.warmup_steps:
            return update / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        if update >= self.steps:
            return self.min_lr_ratio
        decayed = (update - self.warmup_steps) / (self.steps - self.warmup_steps)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * decayed))


def pack_optimizer(model: torch.nn.Module, configs: Sequence[RunConfig]) -> PackOptimizer:
    """The optimizer of the pack ``configs`` (they share everything but the learning rate)."""
    config = configs[0]
    return PackOptimizer(
        model,
        [c.lr for c in configs],
        config.adam_betas,
        config.adam_eps,
        config.grad_clip_norm,
        weight_decay=config.weight_decay,
        decoupled=config.optimizer == "adamw",
        schedule=LrSchedule.of(config),
    )


def weight_decay_mask(model: torch.nn.Module) -> torch.Tensor:
    """``[1, P]``: 1 at the flat columns of the parameters that decay, 0 at those in the
    model's ``no_weight_decay()`` (``default_no_weight_decay`` for a model without one)."""
    exempt_of = getattr(model, "no_weight_decay", None)
    exempt = exempt_of() if exempt_of is not None else default_no_weight_decay(model)
    first = next(model.parameters())
    parts = [
        first.new_full((p[0].numel(),), 0.0 if name in exempt else 1.0)
        for name, p in model.named_parameters()
    ]
    return torch.cat(parts)[None]


class PackOptimizer:
    """Adam (``decoupled``: AdamW) after global-norm gradient clipping (none with
    ``max_norm`` 0), per member, for a model whose parameters all have a leading member axis.
    ``weight_decay`` applies to the parameters ``weight_decay_mask`` selects: an L2 term added
    to the clipped gradient (Adam, as torch's), or ``p -= lr * weight_decay * p`` before the
    update (AdamW); ``schedule`` scales every member's learning rate alike.

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
        *,
        weight_decay: float = 0.0,
        decoupled: bool = False,
        schedule: LrSchedule | None = None,
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
        self.weight_decay, self.decoupled = float(weight_decay), decoupled
        self.schedule = schedule or LrSchedule()
        self.decay_mask = weight_decay_mask(model) if self.weight_decay else None
        self.exp_avg = torch.zeros_like(self.flat)
        self.exp_avg_sq = torch.zeros_like(self.flat)
        self.steps = 0
        #: Each member's gradient norm before clipping at the last step (on the device).
        self.grad_norms = torch.zeros_like(self.lrs[:, 0])
        #: The shapes of one member's parameters: its row of the flat buffers is portable to
        #: a pack of any width (``che_bench.train.layout``).
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
        if self.max_norm > 0:
            # torch.nn.utils.clip_grad_norm_'s factor, per member.
            self.flat_grad.mul_((self.max_norm / (norms + 1e-6)).clamp(max=1.0))
        factor = self.schedule.factor(self.steps)
        lrs = self.lrs if factor == 1.0 else self.lrs * factor  # (a Python float: no sync)
        self.steps += 1
        grad = self.flat_grad
        if self.decay_mask is not None:
            if self.decoupled:
                self.flat.mul_(1 - (lrs * self.weight_decay) * self.decay_mask)
            else:
                grad.add_(self.flat * self.decay_mask, alpha=self.weight_decay)
        self.exp_avg.lerp_(grad, 1 - self.beta1)
        self.exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        bias_correction1 = 1 - self.beta1**self.steps
        bias_correction2 = 1 - self.beta2**self.steps
        denominator = (self.exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(self.eps)
        self.flat.sub_(self.exp_avg / denominator * (lrs / bias_correction1))

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
