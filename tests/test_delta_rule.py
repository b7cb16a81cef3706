"""The gated delta rule and delta product (``delta_rule``: the chunkwise (WY) form, and for a
gate or a product the native recurrence too, ``delta_rule_implementation``) against the plain
recurrence (``delta_rule_recurrent``) and against fla-core's naive implementations (the
``references`` extra), at both eigenvalue ranges: beta in (0, 1) and Grazzi et al.'s (0, 2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from che_bench.model.state_tracking.delta_rule import MAX_CHUNK, chunk_length, delta_product
from che_bench.model.state_tracking.delta_rule_recurrent import recurrent_delta_product
from tests.references import reference

BETA_SCALES = (1.0, 2.0)  # beta in (0, 1): eigenvalues in [0, 1]; (0, 2): in (-1, 1)


def rule_inputs(steps, n=1, gated=False, beta_scale=1.0, heads=2, d=4, seed=0, gate_scale=1.0):
    """q (scaled), unit k, v, beta, log-decay for ``[2, heads, T, d]`` (k, v, beta: T * n rows)."""
    generator = torch.Generator().manual_seed(seed)
    rows = steps * n

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).float()

    q = normal(2, heads, steps, d) * d**-0.5
    k = F.normalize(normal(2, heads, rows, d), dim=-1)
    v = normal(2, heads, rows, d)
    beta = torch.rand(2, heads, rows, generator=generator) * beta_scale
    log_decay = -torch.rand(2, heads, steps, generator=generator) * gate_scale if gated else None
    return q, k, v, beta, log_decay


@pytest.mark.parametrize("beta_scale", BETA_SCALES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(
    "steps, n", [(1, 1), (41, 1), (64, 1), (65, 1), (500, 1), (7, 2), (130, 2), (33, 3), (500, 3)]
)
def test_the_fast_form_is_the_recurrence(steps, n, gated, beta_scale, delta_rule_implementation):
    args = rule_inputs(steps, n, gated, beta_scale, gate_scale=0.1)
    expected = recurrent_delta_product(*args)
    torch.testing.assert_close(delta_product(*args), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("beta_scale", BETA_SCALES)
@pytest.mark.parametrize("n", [1, 2])
def test_its_gradients_are_the_recurrence_s(n, beta_scale):
    """Across chunk boundaries (chunks of 8 over 29 tokens), for every input."""
    args = [
        None if x is None else x.requires_grad_()
        for x in rule_inputs(29, n, True, beta_scale, seed=1)
    ]
    weights = torch.randn(2, 2, 29, 4, generator=torch.Generator().manual_seed(2))
    grads = []
    for rule in (lambda *a: delta_product(*a, chunk=8), recurrent_delta_product):
        (rule(*args) * weights).sum().backward()
        grads.append([x.grad.clone() for x in args])
        for x in args:
            x.grad = None
    for fast, slow in zip(*grads, strict=True):
        torch.testing.assert_close(fast, slow, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk", [1, 5, 6, 16, 64])
@pytest.mark.parametrize("n", [2, 3])
def test_a_delta_product_s_chunks_hold_whole_tokens_of_any_size(n, chunk):
    """A chunk limit below n, or not a multiple of it, still gives whole tokens per chunk."""
    args = rule_inputs(23, n, True, 2.0, gate_scale=0.1)
    expected = recurrent_delta_product(*args)
    torch.testing.assert_close(delta_product(*args, chunk=chunk), expected, atol=2e-5, rtol=1e-4)


def test_a_strong_gate_stays_finite_in_value_and_gradient(delta_rule_implementation):
    """Decays of e^-60 per token: the in-chunk differences above the diagonal would overflow
    if exponentiated before masking."""
    q, k, v, beta, _ = rule_inputs(40, 1, seed=3)
    log_decay = torch.full((2, 2, 40), -60.0, requires_grad=True)
    out = delta_product(q, k, v, beta, log_decay)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(log_decay.grad).all()
    torch.testing.assert_close(out, recurrent_delta_product(q, k, v, beta, log_decay))


@pytest.mark.parametrize("steps, n, chunk", [(130, 1, 64), (29, 1, 8), (29, 2, 8)])
def test_a_strong_gate_past_one_padded_chunk_has_the_recurrence_s_gradients(steps, n, chunk):
    """Decays of e^-3 per token over chunks whose last one is padded (130 tokens: 3 chunks
    of 44; 29: 4 of 8): the in-chunk log-decay passes -88, and the padding (gate 0, k = v =
    beta = 0) must neither overflow nor feed a NaN into the gradients (mLSTM's padding did,
    issue 44)."""
    q, k, v, beta, _ = rule_inputs(steps, n, seed=4)
    log_decay = -3 - torch.rand(2, 2, steps, generator=torch.Generator().manual_seed(5))
    args = [x.requires_grad_() for x in (q, k, v, beta, log_decay)]
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    fast = torch.autograd.grad((delta_product(*args, chunk=chunk) * weights).sum(), args)
    slow = torch.autograd.grad((recurrent_delta_product(*args) * weights).sum(), args)
    for one, two in zip(fast, slow, strict=True):
        assert torch.isfinite(one).all()
        torch.testing.assert_close(one, two, atol=2e-5, rtol=1e-4)


def test_chunks_split_a_length_with_the_least_padding():
    assert [chunk_length(t, MAX_CHUNK) for t in (1, 41, 64, 65, 500)] == [1, 41, 64, 33, 63]
    assert chunk_length(41, limit=16) == 14
    assert delta_product(*rule_inputs(0)).shape == (2, 2, 0, 4)


def test_negative_eigenvalues_flip_the_state_along_the_key():
    """beta = 2 reflects the state along k (I - 2kk^T), beta = 1 erases it: a key written
    with value 1, then hit again with value 0, reads back -1 and 0 respectively."""
    k = torch.tensor([1.0, 0.0]).expand(1, 2, 2)
    v = torch.tensor([[1.0], [0.0]])[None]
    q = k.clone()
    for beta_second, expected in ((1.0, 0.0), (2.0, -1.0)):
        beta = torch.tensor([[1.0, beta_second]])
        assert delta_product(q, k, v, beta)[0, -1, 0] == pytest.approx(expected)


# -- fla-core 0.6.0's naive implementations (test-only references) ---------------------------


@pytest.mark.parametrize("beta_scale", BETA_SCALES)
def test_delta_rule_equals_fla_delta_rule_recurrence_and_chunkwise(beta_scale):
    naive = reference("fla.ops.delta_rule.naive")
    q, k, v, beta, _ = rule_inputs(96, beta_scale=beta_scale, d=8)
    ours = delta_product(q, k, v, beta)
    # fla scales q by d^-1/2 itself; layout [B, H, T, d] as ours.
    recurrence, _ = naive.delta_rule_recurrence(q * 8**0.5, k, v, beta)
    torch.testing.assert_close(ours, recurrence, atol=2e-5, rtol=1e-4)
    chunkwise, _ = naive.delta_rule_chunkwise(q * 8**0.5, k, v, beta, chunk_size=32)
    torch.testing.assert_close(ours, chunkwise, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("beta_scale", BETA_SCALES)
def test_gated_delta_rule_equals_fla_naive_recurrent_and_chunk(
    beta_scale, delta_rule_implementation
):
    naive = reference("fla.ops.gated_delta_rule.naive")
    q, k, v, beta, log_decay = rule_inputs(150, gated=True, beta_scale=beta_scale, d=8)
    ours = delta_product(q, k, v, beta, log_decay)

    def fla_layout(x):  # [B, H, T, ...] -> [B, T, H, ...]
        return x.transpose(1, 2)

    q_, k_, v_, beta_, g_ = map(fla_layout, (q, k, v, beta, log_decay))
    recurrent, _ = naive.naive_recurrent_gated_delta_rule(q_, k_, v_, beta_, g_, scale=1.0)
    torch.testing.assert_close(ours, fla_layout(recurrent), atol=2e-5, rtol=1e-4)
    chunk, _ = naive.naive_chunk_gated_delta_rule(q_, k_, v_, g_, beta_, chunk_size=64, scale=1.0)
    torch.testing.assert_close(ours, fla_layout(chunk), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("beta_scale", BETA_SCALES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("n", [2, 3])
def test_delta_product_equals_fla_naive_recurrent_gated_delta_product(
    n, gated, beta_scale, delta_rule_implementation
):
    naive = reference("fla.ops.gated_delta_product.naive")
    q, k, v, beta, log_decay = rule_inputs(70, n, gated, beta_scale, d=8)
    ours = delta_product(q, k, v, beta, log_decay)
    q_, k_, v_, beta_ = (x.transpose(1, 2) for x in (q, k, v, beta))
    g_ = None if log_decay is None else log_decay.transpose(1, 2)
    theirs, _ = naive.naive_recurrent_gated_delta_product(
        q_, k_, v_, g_, beta_, scale=1.0, num_householder=n
    )
    torch.testing.assert_close(ours, theirs.transpose(1, 2), atol=2e-5, rtol=1e-4)
