"""``position_wise.at_read_positions``: a stage at the read-out positions with the gradients of
the stage at every position (the whole models' bit-for-bit test is in test_deltanet.py)."""

from __future__ import annotations

import pytest
import torch

from che_bench.members import MemberLinear
from che_bench.model.state_tracking.layers import MemberRMSNorm
from che_bench.model.state_tracking.position_wise import (
    EVERY_POSITION,
    at_read_positions,
    read_out_positions,
)


def _stage(layers):
    norm, up, down = layers

    def stage(x, ops):
        return x + ops.last_linear(down, torch.tanh(ops.linear(up, ops.norm(norm, x))))

    return stage


def _layers(bias=False):
    torch.manual_seed(0)
    return MemberRMSNorm(2, 6), MemberLinear(2, 6, 10, bias=bias), MemberLinear(2, 10, 6, bias=bias)


def test_the_gradients_are_those_of_the_stage_at_every_position():
    layers = _layers()
    x = torch.randn(2, 3, 7, 6, requires_grad=True)
    at_read = at_read_positions(_stage(layers), (x,), 2)
    expected = read_out_positions(_stage(layers)(x, EVERY_POSITION), 2)
    torch.testing.assert_close(at_read, expected)
    weight = torch.randn_like(expected)
    params = [x, *(p for layer in layers for p in layer.parameters())]
    got = torch.autograd.grad((at_read * weight).sum(), params)
    wanted = torch.autograd.grad((expected * weight).sum(), params)
    for mine, theirs in zip(got, wanted, strict=True):
        torch.testing.assert_close(mine, theirs)
    assert (got[0][:, :, :5] == 0).all()


def test_without_gradients_the_stage_runs_at_the_read_out_positions_alone():
    layers = _layers()
    x = torch.randn(2, 3, 7, 6)
    with torch.no_grad():
        got = at_read_positions(_stage(layers), (x,), 2)
        expected = _stage(layers)(read_out_positions(x, 2), EVERY_POSITION)
    assert torch.equal(got, expected)


def test_a_linear_map_with_a_bias_is_refused():
    x = torch.randn(2, 3, 7, 6, requires_grad=True)
    with pytest.raises(ValueError, match="bias"):
        at_read_positions(_stage(_layers(bias=True)), (x,), 2)
