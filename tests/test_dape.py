"""DAPE / DAPE V2 processor: definition, locality, leakage, gradients, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from che_bench.encodings import AttentionHook
from che_bench.errors import CheBenchError
from che_bench.model.attention import Attention
from che_bench.model.dape import VARIANTS, DapeProcessor


def conv2d_reference(processor: DapeProcessor, scores, bias, rows=None):
    """DAPE V2 written with nn.functional.conv2d over a materialised [B, C, T, T] map, one
    member at a time: scores ``[M, B, H, R, T]`` of the query ``rows`` (default: from 0),
    bias ``[M or 1, 1, H, R, T]``."""
    heads, kernel = processor.heads, processor.kernel
    logits = []
    for m in range(scores.shape[0]):
        member_scores = scores[m]
        member_bias = None if bias is None else bias[m if bias.shape[0] > 1 else 0]
        if processor.concat_bias:
            z = torch.cat([member_scores, member_bias.expand_as(member_scores)], dim=1)
        elif processor.variant == "add_residual" and member_bias is not None:
            z = member_scores + member_bias
        else:
            z = member_scores
        if processor.tril:
            num_rows, length = member_scores.shape[-2:]
            first = 0 if rows is None else rows.start
            query = torch.arange(first, first + num_rows)[:, None]
            z = z.masked_fill(torch.arange(length) > query, 0.0)
        pad = (0, kernel // 2)
        hidden = F.leaky_relu(F.conv2d(z, processor.weight1[m][:, :, None], processor.bias1[m],
                                       padding=pad), 0.01)
        f = F.conv2d(hidden, processor.weight2[m][:, :, None], processor.bias2[m], padding=pad)
        concat = member_bias is None or processor.variant == "concat"
        base = member_scores if concat else member_scores + member_bias
        assert f.shape[1] == heads
        logits.append(base + f)
    return torch.stack(logits)


def packed_processor(members: int, *args, **kwargs) -> DapeProcessor:
    """A processor of ``members`` members, each initialised differently."""
    return DapeProcessor(*args, members=members, **kwargs)


@pytest.mark.parametrize("kernel", [1, 3, 5])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("tril", [False, True])
@pytest.mark.parametrize("implementation", ["chunks", "convolution"])
def test_matches_conv2d_reference_values_and_gradients(
    kernel, variant, with_bias, tril, implementation, members=2, bias_members=2
):
    torch.manual_seed(kernel)
    processor = packed_processor(members, 3, kernel, width=5, variant=variant,
                                 with_bias=with_bias, tril=tril)
    processor.implementation = implementation
    scores = torch.randn(members, 2, 3, 7, 7, requires_grad=True)
    bias = torch.randn(bias_members, 1, 3, 7, 7, requires_grad=True) if with_bias else None
    inputs = [scores] + ([bias] if with_bias else []) + list(processor.parameters())
    upstream = torch.randn(members, 2, 3, 7, 7)
    ours = processor(scores, bias)
    reference = conv2d_reference(processor, scores, bias)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(
        torch.autograd.grad(ours, inputs, upstream), torch.autograd.grad(reference, inputs, upstream)
    ):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_one_bias_shared_by_the_members_gets_their_summed_gradient():
    for implementation in ("chunks", "convolution"):
        test_matches_conv2d_reference_values_and_gradients(
            3, "concat_residual", True, False, implementation, members=3, bias_members=1
        )


@pytest.mark.parametrize("implementation", ["chunks", "convolution"])
def test_gradcheck_in_double_precision(implementation):
    torch.manual_seed(0)
    processor = DapeProcessor(2, 3, width=3, with_bias=True, members=2).double()
    processor.implementation = implementation
    scores = torch.randn(2, 2, 2, 4, 6, dtype=torch.double, requires_grad=True)
    bias = torch.randn(2, 1, 2, 4, 6, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s, b: processor(s, b), (scores, bias))


def test_kernel_one_is_a_per_position_mlp_over_the_channels():
    torch.manual_seed(1)
    heads, width = 4, 6
    processor = DapeProcessor(heads, 1, width=width, with_bias=True)
    scores, bias = torch.randn(1, 2, heads, 5, 9), torch.randn(1, 1, heads, 5, 9)
    w1, w2 = processor.weight1[0, :, :, 0], processor.weight2[0, :, :, 0]
    expected = torch.empty_like(scores)
    for b in range(2):
        for i in range(5):
            for j in range(9):
                z = torch.cat([scores[0, b, :, i, j], bias[0, 0, :, i, j]])
                hidden = F.leaky_relu(w1 @ z + processor.bias1[0], 0.01)
                f = w2 @ hidden + processor.bias2[0]
                expected[0, b, :, i, j] = scores[0, b, :, i, j] + bias[0, 0, :, i, j] + f
    torch.testing.assert_close(processor(scores, bias), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [3, 5])
def test_v2_output_depends_only_on_its_row_and_nearby_keys(kernel):
    torch.manual_seed(2)
    processor = DapeProcessor(2, kernel, width=8)
    scores = torch.randn(1, 1, 2, 6, 15)
    base = processor(scores)
    row, key = 3, 7
    perturbed = scores.clone()
    perturbed[0, 0, 1, row, key] += 5.0
    changed = (processor(perturbed) - base).abs().amax(dim=(0, 1, 2)) > 1e-6
    reach = kernel - 1
    allowed = torch.zeros_like(changed)
    allowed[row, key - reach : key + reach + 1] = True
    assert not changed[~allowed].any()
    assert changed[row, key - reach] and changed[row, key + reach]  # the reach is exactly k-1


def test_tril_zeroes_the_future_of_the_filter_input_only():
    torch.manual_seed(3)
    scores = torch.randn(1, 2, 2, 8, 8)
    future = torch.arange(8) > torch.arange(8)[:, None]
    noisy = scores + 3 * torch.randn_like(scores) * future
    with_tril = DapeProcessor(2, 3, width=4, tril=True)
    without = DapeProcessor(2, 3, width=4, tril=False)
    without.load_state_dict(with_tril.state_dict())
    torch.testing.assert_close(with_tril(noisy)[..., ~future], with_tril(scores)[..., ~future])
    assert (without(noisy)[..., ~future] - without(scores)[..., ~future]).abs().max() > 1e-3
    # The residual keeps the unmasked future scores.
    assert (with_tril(noisy)[..., future] - with_tril(scores)[..., future]).abs().max() > 1e-3


@pytest.mark.parametrize("tril", [True, False])
def test_causal_attention_leaks_the_future_only_without_tril(tril):
    torch.manual_seed(4)
    dape = DapeProcessor(2, 3, width=8, tril=tril)
    attention = Attention(8, 2, AttentionHook(), dape, causal=True, memory_budget_bytes=1 << 30)
    x = torch.randn(1, 2, 12, 8)
    later = x.clone()
    later[:, :, 7:] = torch.randn(2, 5, 8)  # change every token from position 7 on
    with torch.no_grad():
        difference = (attention(later) - attention(x))[:, :, :7].abs().max()
    if tril:
        assert difference < 1e-6
    else:
        assert difference > 1e-3


@pytest.mark.parametrize(
    "arguments",
    [
        {"kernel": 2},
        {"kernel": 0},
        {"kernel": -3},
        {"kernel": True},
        {"kernel": 3.0},
        {"kernel": 3, "variant": "concat_plus"},
        {"kernel": 3, "width": 0},
    ],
)
def test_invalid_processor_arguments_raise(arguments):
    with pytest.raises(CheBenchError):
        DapeProcessor(4, **arguments)


def test_missing_bias_is_an_error():
    with pytest.raises(CheBenchError):
        DapeProcessor(2, 3, with_bias=True)(torch.randn(1, 1, 2, 3, 3), None)


@pytest.mark.parametrize("cache_bytes", [1, 4 * 5 * 7 * 3])  # one row at a time; 3 rows
@pytest.mark.parametrize("keep_bytes", [0, 1 << 30])  # backward recomputes / reuses f's maps
def test_cache_chunking_inside_the_filter_is_exact(monkeypatch, cache_bytes, keep_bytes):
    import che_bench.model.dape.kernel as dape

    monkeypatch.setattr(dape, "CACHE_CHUNK_BYTES", cache_bytes)
    monkeypatch.setattr(dape, "KEEP_BYTES", keep_bytes)
    test_matches_conv2d_reference_values_and_gradients(3, "concat_residual", True, False, "chunks")
    test_matches_conv2d_reference_values_and_gradients(5, "add_residual", False, True, "chunks")
