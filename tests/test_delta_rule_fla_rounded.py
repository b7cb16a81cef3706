"""DeltaNet's delta rule with fla's chunk kernel's roundings (``delta_rule_fla_rounded``): in
float32 it is the plain recurrence; in bf16 it rounds where the kernel stores, checked on a
two-token chunk and on a state carried into the next chunk, written out by hand."""

from __future__ import annotations

import pytest
import torch

from che_bench.model.state_tracking.delta_rule import delta_product
from che_bench.model.state_tracking.delta_rule_fla_rounded import fla_rounded_delta_rule
from che_bench.model.state_tracking.delta_rule_recurrent import recurrent_delta_product
from tests.test_delta_rule import BETA_SCALES, rule_inputs


@pytest.mark.parametrize("beta_scale", BETA_SCALES)
@pytest.mark.parametrize("steps", [1, 2, 41, 64, 65, 200])
def test_in_float32_it_is_the_recurrence(steps, beta_scale):
    q, k, v, beta, _ = rule_inputs(steps, beta_scale=beta_scale, d=8)
    torch.testing.assert_close(
        fla_rounded_delta_rule(q, k, v, beta),
        recurrent_delta_product(q, k, v, beta),
        atol=1e-4,
        rtol=1e-4,
    )


def test_a_two_token_chunk_in_bf16_rounds_where_the_kernel_stores():
    """T = (I + strictly_lower(r(b K) K^T))^-1 = [[1, 0], [-a, 1]] with a = r(b_2 k_2) . k_1,
    so U = [r(b_1 v_1), r(r(b_2 v_2) - r(a) r(b_1 v_1))] (rounded again as stored), and
    o_t = r(sum_{s <= t} r(q_t . k_s) U_s)."""
    q, k, v, beta = (x.bfloat16() for x in rule_inputs(2, beta_scale=2.0, heads=1, d=8)[:4])
    out = fla_rounded_delta_rule(q, k, v, beta)

    def r(x):
        return x.bfloat16().float()

    q, k, v, beta = (x.float()[0, 0] for x in (q, k, v, beta))
    keys, values = r(beta[:, None] * k), r(beta[:, None] * v)
    inverse = r(-(keys[1] @ k[0]))
    u = torch.stack([values[0], r(values[1] + inverse * values[0])])
    expected = torch.stack(
        [r(r(q[0] @ k[0]) * u[0]), r(r(q[1] @ k[0]) * u[0] + r(q[1] @ k[1]) * u[1])]
    )
    assert out.dtype == torch.bfloat16
    # float32 sums of a few terms, in whatever order, rounded to bf16: the same values
    torch.testing.assert_close(out[0, 0].float(), expected, atol=0, rtol=0)


def test_the_next_chunk_reads_the_state_rounded():
    """One write in the first chunk (beta = 0 at its other tokens) makes the float32 state
    exactly ``S = k_0 r(b_0 v_0)^T`` (bf16 times bf16 is exact in float32). Token 64, alone in
    the second chunk (T = I), corrects its value by the rounded state, ``U~ = r(r(b v) -
    r(b k) r(S))``, and reads ``o = r(q r(S) + r(q . k) U~)``."""
    q, k, v, beta = (x.bfloat16() for x in rule_inputs(65, beta_scale=2.0, heads=1, d=8)[:4])
    beta[..., 1:64] = 0
    out = fla_rounded_delta_rule(q, k, v, beta)

    def r(x):
        return x.bfloat16().float()

    q, k, v, beta = (x.float()[0, 0] for x in (q, k, v, beta))
    state = r(k[0][:, None] * r(beta[0] * v[0])[None, :])
    fresh = r(r(beta[64] * v[64]) - r(beta[64] * k[64]) @ state)
    expected = r(q[64] @ state + r(q[64] @ k[64]) * fresh)
    torch.testing.assert_close(out[0, 0, 64].float(), expected, atol=0, rtol=0)


def test_in_bf16_it_rounds_more_than_the_float32_rule():
    """The float32 rule rounds only its output to the inputs' bf16; this one rounds within,
    so it stands further from the recurrence in float32 on the same inputs, but near it."""
    q, k, v, beta = (x.bfloat16() for x in rule_inputs(150, beta_scale=2.0, d=8)[:4])
    exact = recurrent_delta_product(*(x.float() for x in (q, k, v, beta)))
    rounded = fla_rounded_delta_rule(q, k, v, beta).float()
    plain = delta_product(q, k, v, beta).float()
    assert (rounded - exact).abs().max() > (plain - exact).abs().max()
    torch.testing.assert_close(rounded, exact, atol=0.1, rtol=0.05)


def test_a_gate_or_a_product_is_refused():
    q, k, v, beta, gate = rule_inputs(4, gated=True)
    with pytest.raises(ValueError, match="DeltaNet's"):
        fla_rounded_delta_rule(q, k, v, beta, gate)
    q, k, v, beta, _ = rule_inputs(4, n=2)
    with pytest.raises(ValueError, match="DeltaNet's"):
        fla_rounded_delta_rule(q, k, v, beta)
