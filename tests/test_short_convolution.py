"""The state-tracking models' short convolution (``MemberCausalConv1d``): both layouts compute
the causal depthwise map of its definition, with the same gradients to rounding, per member;
which models run which layout."""

from __future__ import annotations

import pytest
import torch

from che_bench.model.architectures import build_architecture
from che_bench.model.state_tracking.layers import MemberCausalConv1d
from che_bench.tasks import get_task


def by_definition(conv: MemberCausalConv1d, x: torch.Tensor) -> torch.Tensor:
    """``y_t[c] = b[c] + sum_j w[c, j] x_{t-K+1+j}[c]``, zeros before the first token."""
    steps, kernel = x.shape[2], conv.kernel
    padded = torch.cat([x.new_zeros(*x.shape[:2], kernel - 1, x.shape[3]), x], dim=2)
    weight = conv.weight.double()
    out = sum(
        padded[:, :, j : j + steps] * weight[:, None, None, :, j] for j in range(kernel)
    )
    return out if conv.bias is None else out + conv.bias.double()[:, None, None, :]


def pair(members: int, bias: bool) -> tuple[MemberCausalConv1d, MemberCausalConv1d]:
    torch.manual_seed(0)
    first = MemberCausalConv1d(members, 24, 4, bias=bias)
    last = MemberCausalConv1d(members, 24, 4, bias=bias, channels_last=True)
    last.load_state_dict(first.state_dict())
    return first, last


@pytest.mark.parametrize("steps", [1, 3, 41])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("members", [1, 3])
def test_both_layouts_compute_the_definition_with_the_same_gradients(members, bias, steps):
    first, last = pair(members, bias)
    x = torch.randn(members, 5, steps, 24)
    outputs, gradients = [], []
    for conv in (first, last):
        leaf = x.clone().requires_grad_()
        out = conv(leaf)
        out.backward(torch.ones_like(out).cumsum(2))
        outputs.append(out)
        gradients.append((leaf.grad, conv.weight.grad))
        expected = by_definition(conv, x.double())
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
    assert outputs[1].shape == outputs[0].shape == x.shape
    for a, b in zip(gradients[0], gradients[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # sums reordered


def test_a_member_of_a_channels_last_pack_is_the_member_alone():
    _, pack = pair(3, True)
    x = torch.randn(3, 4, 9, 24)
    alone = MemberCausalConv1d(1, 24, 4, channels_last=True)
    with torch.no_grad():
        alone.weight.copy_(pack.weight[1:2])
        alone.bias.copy_(pack.bias[1:2])
    torch.testing.assert_close(pack(x)[1:2], alone(x[1:2]), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("name", "channels_last"),
    [
        ("deltanet", False),  # committed results trained channels-first
        ("gated_deltanet", True),
        ("deltaproduct", True),
        ("mamba", False),
        ("mlstm", False),
    ],
)
def test_which_models_run_the_short_convolution_channels_last(name, channels_last):
    sizes = {"width": 16} if name == "mamba" else {"width": 16, "heads": 2}
    model = build_architecture(name, get_task("parity_check"), **sizes)
    convs = [m for m in model.modules() if isinstance(m, MemberCausalConv1d)]
    assert convs and all(conv.channels_last is channels_last for conv in convs)
