"""Mamba-1 (Gu & Dao 2023, arXiv 2312.00752), the selective state-space model of the
formal-language experiments of Grazzi et al. (ICLR 2025, arXiv 2411.12537), with their
negative-eigenvalue switch (spec state_tracking.md 1.a and 1.f).

Block (pre-norm residual): ``x <- x + Mixer(RMSNorm(x))``. The mixer, for ``u_t`` in ``R^E``
with ``ED = expand * E`` channels and ``N = d_state`` states per channel:

1. ``[x_t, z_t] = W_in u_t``;  ``x = SiLU(causal depthwise conv_{d_conv}(x))``;
2. ``[delta_t, B_t, C_t] = W_x x_t`` (sizes ``R = ceil(E / 16)``, ``N``, ``N``);
   ``dt_t = softplus(W_dt delta_t + b_dt)`` in ``R^ED``;
3. ``A = -exp(A_log)``;  ``a_t[c, n] = exp(dt_t[c] A[c, n])`` in (0, 1), or with
   ``negative_eigenvalues`` ``2 exp(dt_t[c] A[c, n]) - 1`` in (-1, 1) (the input term is
   unchanged: Grazzi et al.'s ``deltaA = 2 * deltaA - 1``);
4. ``h_t = a_t h_{t-1} + dt_t x_t B_t`` (outer product over channels and states), ``h_0 = 0``;
5. ``y_t = h_t C_t + D x_t``;  output ``W_out(y_t * SiLU(z_t))``.

The fast form of step 4 (``selective_scan``) is a loop over chunks of a few tokens
(``chunk_length``) that carries the state; within a chunk a Brent-Kung scan of the pairs
``(a_t, b_t)`` under ``(a1, b1) o (a2, b2) = (a1 a2, a2 b1 + b2)`` takes ``2 log2(chunk)``
vectorised steps, in place. It multiplies only (never a log-space sum, which a negative
``a_t`` would break, and never a division by a product of ``a``s, which underflows). Its
gradient is computed by hand: the same scan run backwards in time gives ``dL/dh``. Only each
chunk's first state is kept (the gradient recomputes the rest), so a forward pass holds one
chunk of ``[ED, N]`` states per sequence, never all ``T``. ``mamba_recurrent`` holds the
plain recurrence it must equal.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from che_bench.members import MemberLinear, init_members_, per_member
from che_bench.model.base import positive_int, switch
from che_bench.model.state_tracking.layers import MemberCausalConv1d, MemberRMSNorm
from che_bench.model.state_tracking.mamba_recurrent import mixer_recurrent
from che_bench.model.state_tracking.position_wise import read_out_positions
from che_bench.model.state_tracking.stack import COMMON_DEFAULTS, StateTrackingModel

#: Tokens per chunk of the scan on a GPU, and on a CPU: a chunk's states
#: ``[chunk, M, B, ED, N]`` are what evaluation holds at any length. Fixed per device (a
#: sequence's logits never depend on the batch it is in): a GPU launches fewer kernels with
#: long chunks; a CPU runs faster with short ones, whose buffers stay in its cache (and a
#: fresh buffer must be paged in). Measured at width 128, batch 256, n = 40.
CHUNK, CPU_CHUNK = 64, 8


def chunk_length(device: torch.device) -> int:
    """Tokens per chunk of the scan on ``device``."""
    return CPU_CHUNK if device.type == "cpu" else CHUNK


#: Initial time steps, ``dt ~ exp(U(log DT_MIN, log DT_MAX))`` floored at ``DT_FLOOR``
#: (mamba-ssm's and mambapy's defaults, spec 1.a).
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4


# -- the scan -----------------------------------------------------------------------------


def _combine_(
    a: torch.Tensor, b: torch.Tensor, first: int, offset: int, reverse: bool, update_a: bool
) -> None:
    """One level of the scan: every ``2 * offset``-th element from ``first`` on takes in the
    element ``offset`` before it (after it, ``reverse``): ``b <- b + a * b_src``,
    ``a <- a * a_src`` (the two views are disjoint)."""
    length, stride = b.shape[0], 2 * offset
    count = len(range(first, length, stride))
    if not count:
        return
    start = length - 1 - first - stride * (count - 1) if reverse else first
    source = start + offset if reverse else start - offset
    target = slice(start, start + stride * (count - 1) + 1, stride)
    sources = slice(source, source + stride * (count - 1) + 1, stride)
    b[target].addcmul_(a[target], b[sources])
    if update_a:
        a[target].mul_(a[sources])


def scan_(a: torch.Tensor, b: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """``b`` scanned in place along dim 0 and returned: ``b_t <- a_t b_{t-1} + b_t``, or with
    ``reverse`` ``b_t <- a_t b_{t+1} + b_t`` (then ``a_t`` links ``t`` to ``t + 1``). A
    Brent-Kung scan: an up-sweep and a down-sweep of ``log2(T)`` levels each, ``2T``
    combinations in all; ``a`` is overwritten with partial products."""
    length, offset = b.shape[0], 1
    while 2 * offset <= length:  # up-sweep: segment totals at the tree's nodes
        _combine_(a, b, 2 * offset - 1, offset, reverse, update_a=True)
        offset *= 2
    while offset >= 1:  # down-sweep: every element gets its full prefix
        _combine_(a, b, 3 * offset - 1, offset, reverse, update_a=offset > 1)
        offset //= 2
    return b


def _decay_(out: torch.Tensor, dt: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """``exp(dt A)`` into ``out`` ``[T, M, B, ED, N]``: ``dt [T, M, B, ED]``, ``A [M, ED, N]``.
    Into a buffer: a fresh tensor of this size can cost more to page in than the arithmetic."""
    return torch.exp(torch.mul(dt[..., None], A[:, None], out=out), out=out)


def _transition_(out: torch.Tensor, decay: torch.Tensor, negative: bool) -> torch.Tensor:
    """``a = decay``, or ``2 decay - 1`` if ``negative`` (Grazzi et al.), into ``out``."""
    if negative:
        return torch.mul(decay, 2, out=out).sub_(1)
    return out if out is decay else out.copy_(decay)


def _inputs_(out: torch.Tensor, dt: torch.Tensor, x: torch.Tensor, B: torch.Tensor) -> None:
    """``b_t[c, n] = dt_t[c] x_t[c] B_t[n]`` into ``out``."""
    torch.mul((dt * x)[..., None], B[..., None, :], out=out)


def _chunk_shape(x: torch.Tensor, A: torch.Tensor) -> tuple[int, ...]:
    """The shape of one chunk's states, ``[min(T, chunk), M, B, ED, N]``."""
    return (min(x.shape[0], chunk_length(x.device)), *x.shape[1:], A.shape[-1])


def _scan_chunks(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    negative: bool,
    starts: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``y_t = C_t h_t`` ``[T, M, B, ED]`` for time-major inputs; each chunk's first state
    ``h_{start-1}`` appended to ``starts`` if given (what the gradient recomputes from)."""
    a_buffer, b_buffer = x.new_empty(_chunk_shape(x, A)), x.new_empty(_chunk_shape(x, A))
    y = torch.empty_like(x)
    state = x.new_zeros(a_buffer.shape[1:])
    chunk = a_buffer.shape[0]
    for start in range(0, x.shape[0], chunk):
        part = slice(start, start + chunk)
        length = min(chunk, x.shape[0] - start)
        a = _transition_(a_buffer[:length], _decay_(a_buffer[:length], dt[part], A), negative)
        b = b_buffer[:length]
        _inputs_(b, dt[part], x[part], B[part])
        b[0].addcmul_(a[0], state)  # the state carried in from the chunk before
        if starts is not None:
            starts.append(state)
        scan_(a, b)
        y[part] = torch.einsum("tmbcn,tmbn->tmbc", b, C[part])
        state = b[-1].clone()
    return y


class _SelectiveScan(torch.autograd.Function):
    """``_scan_chunks`` with its gradient by hand (module docstring); time-major inputs."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        negative: bool,
    ) -> torch.Tensor:
        ctx.starts = []
        y = _scan_chunks(x, dt, A, B, C, negative, ctx.starts)
        ctx.save_for_backward(x, dt, A, B, C)
        ctx.negative = negative
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, dt, A, B, C = ctx.saved_tensors
        grads = [torch.empty_like(t) for t in (x, dt, B, C)]
        grad_A = torch.zeros_like(A)
        buffers = [x.new_empty(_chunk_shape(x, A)) for _ in range(4)]
        grad_y = grad_y.contiguous()
        later: tuple[torch.Tensor, torch.Tensor] | None = None  # (a, dL/dh) after the chunk
        for index in reversed(range(len(ctx.starts))):
            part = slice(index * buffers[0].shape[0], (index + 1) * buffers[0].shape[0])
            inputs = [t[part] for t in (x, dt, B, C, grad_y)]
            chunk_grads = [t[part] for t in grads]
            later = _chunk_gradients(
                inputs, A, ctx.starts[index], later, buffers, chunk_grads, grad_A, ctx.negative
            )
        return grads[0], grads[1], grad_A, grads[2], grads[3], None


def _chunk_gradients(
    inputs: list[torch.Tensor],
    A: torch.Tensor,
    before: torch.Tensor,
    later: tuple[torch.Tensor, torch.Tensor] | None,
    buffers: list[torch.Tensor],
    grads: list[torch.Tensor],
    grad_A: torch.Tensor,
    negative: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's gradients into ``grads`` (views of x's, dt's, B's, C's) and ``grad_A``,
    from its inputs (x, dt, B, C, dL/dy), its first state ``before`` and ``later``, the
    first ``a`` and ``dL/dh`` of the chunk after it; returns this chunk's."""
    x, dt, B, C, grad_y = inputs
    decay, scratch, states, grad_h = (buffer[: x.shape[0]] for buffer in buffers)
    # The chunk's states again, from its first one.
    a = _transition_(scratch, _decay_(decay, dt, A), negative)
    _inputs_(states, dt, x, B)
    states[0].addcmul_(a[0], before)
    carried_a = a[0].clone()
    scan_(a, states)
    # dL/dh_t = C_t dL/dy_t + a_{t+1} dL/dh_{t+1}: the scan backwards in time.
    torch.mul(grad_y[..., None], C[..., None, :], out=grad_h)
    if later is not None:
        grad_h[-1].addcmul_(*later)
    link = scratch
    _transition_(link[:-1], decay[1:], negative)
    link[-1] = 0  # unused: no token follows the last within the chunk
    scan_(link, grad_h, reverse=True)
    # b_t = dt_t x_t B_t, whose gradient is dL/dh_t; y_t = C_t h_t.
    summed = torch.einsum("tmbcn,tmbn->tmbc", grad_h, B)
    grads[0].copy_(summed * dt)
    grad_dt = summed.mul_(x)
    grads[2].copy_(torch.einsum("tmbc,tmbcn->tmbn", dt * x, grad_h))
    grads[3].copy_(torch.einsum("tmbc,tmbcn->tmbn", grad_y, states))
    # dL/da_t = dL/dh_t h_{t-1}; da/d(dt A) = exp(dt A), twice that when negative.
    grad_a = link
    torch.mul(grad_h[1:], states[:-1], out=grad_a[1:])
    torch.mul(grad_h[0], before, out=grad_a[0])
    grad_a.mul_(decay)
    scale = 2.0 if negative else 1.0
    grad_dt.add_(torch.mul(grad_a, A[:, None], out=decay).sum(-1), alpha=scale)
    grads[1].copy_(grad_dt)
    grad_A.add_(torch.mul(grad_a, dt[..., None], out=decay).sum((0, 2)), alpha=scale)
    return carried_a, grad_h[0].clone()


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    negative: bool = False,
) -> torch.Tensor:
    """``y_t = C_t h_t`` ``[M, Bt, T, ED]`` with ``h_t = a_t h_{t-1} + dt_t x_t B_t``, ``h_0 =
    0``, ``a_t = exp(dt_t A)`` (``2 exp(dt_t A) - 1`` if ``negative``): ``x``, ``dt``
    ``[M, Bt, T, ED]``, ``A [M, ED, N]``, ``B``, ``C`` ``[M, Bt, T, N]``. Differentiable;
    without gradients it keeps no states."""
    x, dt, B, C = (t.permute(2, 0, 1, 3).contiguous() for t in (x, dt, B, C))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, dt, A, B, C)):
        y = _SelectiveScan.apply(x, dt, A, B, C, negative)
    else:
        y = _scan_chunks(x, dt, A, B, C, negative)
    return y.permute(1, 2, 0, 3)


# -- the model ----------------------------------------------------------------------------


def _init_dt_bias(bias: torch.Tensor) -> None:
    """``softplus^-1(dt)`` with ``dt = exp(U(log DT_MIN, log DT_MAX))`` floored at
    ``DT_FLOOR``, so that the initial time steps spread log-uniformly (mamba-ssm)."""
    span = math.log(DT_MAX) - math.log(DT_MIN)
    dt = torch.exp(torch.rand_like(bias) * span + math.log(DT_MIN)).clamp(min=DT_FLOOR)
    bias.copy_(dt + torch.log(-torch.expm1(-dt)))


class MambaMixer(nn.Module):
    """The selective SSM of steps 1-5 (module docstring): ``[M, B, T, E] -> [M, B, T, E]``,
    initialised as mamba-ssm and mambapy do (PyTorch's defaults elsewhere)."""

    def __init__(
        self, members: int, width: int, d_state: int, expand: int, d_conv: int, negative: bool
    ) -> None:
        super().__init__()
        inner, rank = expand * width, math.ceil(width / 16)
        self.rank, self.d_state, self.negative = rank, d_state, negative
        self.in_proj = MemberLinear(members, width, 2 * inner, bias=False, init="torch")
        self.conv = MemberCausalConv1d(members, inner, d_conv)
        self.x_proj = MemberLinear(members, inner, rank + 2 * d_state, bias=False, init="torch")
        self.dt_proj = MemberLinear(members, rank, inner, init="torch")
        bound = rank**-0.5  # dt_init "random", dt_scale 1
        init_members_(self.dt_proj.weight, lambda w: nn.init.uniform_(w, -bound, bound))
        init_members_(self.dt_proj.bias_parameter(), _init_dt_bias)
        # S4D-real: A[c, n] = -(n + 1) for every channel.
        log_states = torch.arange(1, d_state + 1, dtype=torch.float32).log()
        self.A_log = nn.Parameter(log_states.expand(members, inner, d_state).clone())
        self.D = nn.Parameter(torch.ones(members, inner))
        self.out_proj = MemberLinear(members, inner, width, bias=False, init="torch")

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        x, z = self.in_proj(u).chunk(2, dim=-1)
        x = F.silu(self.conv(x))
        delta, B, C = self.x_proj(x).split([self.rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(delta))
        y = selective_scan(x, dt, -torch.exp(self.A_log), B, C, self.negative)
        y = y + x * per_member(self.D, x.dim())
        return self.out_proj(y * F.silu(z))


class MambaBlock(nn.Module):
    """``x + Mixer(RMSNorm(x))`` (RMSNorm eps 1e-5, as mamba-ssm's and mambapy's)."""

    def __init__(self, members: int, width: int, **mixer: Any) -> None:
        super().__init__()
        self.norm = MemberRMSNorm(members, width, eps=1e-5)
        self.mixer = MambaMixer(members, width, **mixer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


class Mamba(StateTrackingModel):
    """Mamba-1, the selective state-space model (Gu & Dao 2023), as Grazzi et al. (ICLR 2025)
    train it on formal languages; negative_eigenvalues=true puts its transitions in (-1, 1).

    Options: ``layers``, ``width`` (E), ``d_state`` (N), ``expand`` (ED = expand * E),
    ``d_conv`` (the short convolution's kernel) and ``negative_eigenvalues``. ``d_conv``
    defaults to 4: Grazzi et al.'s App. E.1.1 ("kernel size 4"), mamba-ssm and mambapy; their
    code (``xlstm/mamba/mamba.py``'s ``MambaConfig``, not overridden by the formal-language
    yamls) runs 1, which ``d_conv=1`` reproduces. No ``heads``: Mamba-1 has none. No norm
    before the read-out, as Grazzi et al.'s ``MambaLM`` (mamba-ssm's LM has one).
    """

    name: ClassVar[str] = "mamba"
    label: ClassVar[str | None] = "Mamba"
    defaults: ClassVar[dict[str, Any]] = {
        **{key: value for key, value in COMMON_DEFAULTS.items() if key != "heads"},
        "d_state": 16,
        "expand": 2,
        "d_conv": 4,
        "negative_eigenvalues": False,
    }
    #: Per token, in multiples of E: a forward pass without gradients peaks at about 17 (a
    #: default model at n = 500 on a CPU, measured with the profiler); 20 leaves a margin.
    activation_widths: ClassVar[int] = 20

    def check_options(self, settings: dict[str, Any]) -> dict[str, Any]:
        for key in ("d_state", "expand", "d_conv"):
            positive_int(key, settings[key])
        switch("negative_eigenvalues", settings["negative_eigenvalues"])
        return super().check_options(settings)

    def make_block(self, layer: int) -> nn.Module:
        settings = self.settings
        return MambaBlock(
            self.members,
            self.width,
            d_state=settings["d_state"],
            expand=settings["expand"],
            d_conv=settings["d_conv"],
            negative=settings["negative_eigenvalues"],
        )

    def make_final_norm(self) -> nn.Module | None:
        return None

    def reference_forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The logits with every block's mixer run as its plain recurrence, one token at a
        time (``mixer_recurrent``): what ``check-model`` compares the chunked scan with."""
        tokens, read = self.with_output_tokens(self.member_inputs(inputs))
        x = self.embedding(tokens)
        for block in self.blocks:
            assert isinstance(block, MambaBlock)
            x = x + mixer_recurrent(block.mixer, block.norm(x))
        return self.head(read_out_positions(x, read))

    def extra_floats(self, tokens: int) -> int:
        """The scan's chunk on the model's device: its transitions, inputs and states,
        ``[chunk, ED, N]`` each."""
        chunk = chunk_length(self.embedding.weight.device)
        return (
            3 * min(tokens, chunk) * self.settings["expand"] * self.width * self.settings["d_state"]
        )

    def no_weight_decay(self) -> set[str]:
        """``A_log`` and ``D`` only: Grazzi et al.'s harness decays every parameter but those
        flagged ``_no_weight_decay`` (``xlstm/experiments/main.py``), and mamba flags these
        two (embedding, norms, biases and read-out decay)."""
        return {
            name for name, _ in self.named_parameters() if name.rsplit(".", 1)[-1] in ("A_log", "D")
        }
