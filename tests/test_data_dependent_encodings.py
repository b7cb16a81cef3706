"""FoX and stick-breaking (issue 46) against independent float64 computations written plainly
here (loops over queries and keys), causal and bidirectional, trained (one chunk of rows) and
evaluated in row chunks, alone and under DAPE (k = 1) and DAPE V2 (k = 3); against fla's naive
references where the ``references`` extra is installed; and the interface they use (the
layer's input, a bias per sequence, an own normalisation) through packs, the memory plan, the
meta device, the attention maps and the autoregressive model's refusal."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from che_bench.encodings import build_encoding
from che_bench.encodings import common
from che_bench.encodings.fox import ForgetBias
from che_bench.encodings.stick_breaking import StickWeights
from che_bench.errors import CheBenchError
from che_bench.model.architectures import build_architecture
from che_bench.model.attention import Attention
from che_bench.model.dape import DapeProcessor
from che_bench.model.encoder import build_model
from che_bench.tasks import get_task
from tests.references import reference
from tests.test_dape import conv2d_reference

HEADS, DIM, LENGTH, BATCH = 3, 12, 7, 2
HEAD_DIM = DIM // HEADS
CASES = [(pe, causal) for pe in ("fox", "stick_breaking") for causal in (False, True)]


def layer_of(pe: str, causal: bool, kernel: int | None = None, **options) -> Attention:
    """One float64 attention layer with ``pe``'s first hook (gates drawn wide, so that the
    bias varies) and, with a ``kernel``, a DAPE processor."""
    torch.manual_seed(0)
    encoding = build_encoding(
        pe, dim=DIM, heads=HEADS, layers=1, train_max_tokens=20, members=1, **options
    )
    hook = encoding.layer_hooks()[0]
    with torch.no_grad():
        for parameter in hook.parameters():
            parameter.normal_(0.0, 0.5)
    dape = None
    if kernel is not None:
        dape = DapeProcessor(HEADS, kernel, width=4, with_bias=encoding.carries_bias,
                             tril=causal, sequence_bias=hook.sequence_bias)
    return Attention(DIM, HEADS, hook, dape, causal, 1 << 30).double()


def project(linear, x: torch.Tensor) -> torch.Tensor:
    """``x [B, T, D]`` through member 0 of a ``MemberLinear``."""
    out = x @ linear.weight[0].T
    return out if linear.bias is None else out + linear.bias[0]


def plain_forget_bias(hook, x: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, T]``: log f summed over (j, i] for j <= i, log f' over [i, j) for j > i."""
    log_left = F.logsigmoid(project(hook.left_gate, x))  # [B, T, H]
    log_right = F.logsigmoid(project(hook.right_gate, x))
    bias = torch.zeros(BATCH, HEADS, LENGTH, LENGTH, dtype=x.dtype)
    for b in range(BATCH):
        for h in range(HEADS):
            for i in range(LENGTH):
                for j in range(LENGTH):
                    if j <= i:
                        bias[b, h, i, j] = sum(log_left[b, s, h] for s in range(j + 1, i + 1))
                    else:
                        bias[b, h, i, j] = sum(log_right[b, s, h] for s in range(i, j))
    return bias


def plain_stick(logits: torch.Tensor, causal: bool, remainder: bool = True) -> torch.Tensor:
    """``[B, H, T, T]`` weights: each query breaks its stick over its keys nearest first (to
    the left; to the right for the second half of the heads in a bidirectional model)."""
    weights = torch.zeros_like(logits)
    batch, heads, length, _ = logits.shape
    leftward = heads if causal else (heads + 1) // 2
    for b in range(batch):
        for h in range(heads):
            for i in range(length):
                keys = range(i - 1, -1, -1) if h < leftward else range(i + 1, length)
                stick = 1.0
                for j in keys:
                    beta = torch.sigmoid(logits[b, h, i, j])
                    weights[b, h, i, j] = stick * beta
                    stick = stick * (1 - beta)
                if remainder:
                    weights[b, h, i, i] = stick
    return weights


def plain_layer(layer: Attention, x: torch.Tensor, pe: str, remainder: bool = True):
    """The layer's output ``[B, T, D]`` for ``x [B, T, D]``, computed plainly."""
    q, k, v = (
        project(linear, x).view(BATCH, LENGTH, HEADS, HEAD_DIM).transpose(1, 2)
        for linear in (layer.query, layer.key, layer.value)
    )
    scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    bias = plain_forget_bias(layer.hook, x) if pe == "fox" else None
    if layer.dape is not None:
        logits = conv2d_reference(layer.dape, scores[None], None if bias is None else bias[None])[0]
    else:
        logits = scores if bias is None else scores + bias
    future = torch.arange(LENGTH)[None, :] > torch.arange(LENGTH)[:, None]
    if pe == "fox":
        weights = torch.softmax(logits.masked_fill(future, -math.inf) if layer.causal else logits, -1)
    else:
        weights = plain_stick(logits, layer.causal, remainder)
    out = (weights @ v).transpose(1, 2).reshape(BATCH, LENGTH, DIM)
    return project(layer.output, out)


def layer_input() -> torch.Tensor:
    return torch.randn(1, BATCH, LENGTH, DIM, generator=torch.Generator().manual_seed(3),
                       dtype=torch.float64)


def outputs(layer: Attention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output in training (one chunk) and in evaluation by one-row chunks."""
    trained = layer(x)[0]
    layer.memory_budget_bytes = 1  # one query row per chunk
    with torch.no_grad():
        chunked = layer(x)[0]
    return trained, chunked


@pytest.mark.parametrize("kernel", [None, 1, 3])
@pytest.mark.parametrize("pe, causal", CASES)
def test_the_layer_equals_a_plain_float64_computation(pe, causal, kernel):
    layer = layer_of(pe, causal, kernel)
    x = layer_input()
    expected = plain_layer(layer, x[0], pe)
    for got in outputs(layer, x):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_stick_breaking_without_remainder_drops_the_leftover_stick():
    layer = layer_of("stick_breaking", True, stick_remainder="none")
    x = layer_input()
    expected = plain_layer(layer, x[0], "stick_breaking", remainder=False)
    for got in outputs(layer, x):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_the_plain_computations_see_what_they_test():
    """The oracles are not vacuous: a bias that ignores the right gates, or a stick broken
    farthest key first, differs from them."""
    layer = layer_of("fox", False)
    x = layer_input()[0]
    bias = plain_forget_bias(layer.hook, x)
    assert not torch.allclose(bias, bias.tril() + bias.tril(-1).transpose(-1, -2))
    logits = torch.randn(BATCH, HEADS, LENGTH, LENGTH, dtype=torch.float64)
    weights = plain_stick(logits, causal=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(BATCH, HEADS, LENGTH, dtype=torch.float64))
    assert weights[..., 0, 0].eq(1).all()  # the first query has no key: all its stick is left


# -- fla's naive references (the ``references`` extra) ------------------------------------------


def fla_layout(layer: Attention, x: torch.Tensor):
    """q, k, v ``[B, T, H, d]`` of ``x`` (float32, as fla computes)."""
    return [
        project(linear, x).view(BATCH, LENGTH, HEADS, HEAD_DIM)
        for linear in (layer.query, layer.key, layer.value)
    ]


def heads_output(layer: Attention, x: torch.Tensor) -> torch.Tensor:
    """The layer's attention output before its output projection, ``[B, T, H, d]``."""
    with torch.no_grad():
        layer.output.weight.copy_(torch.eye(DIM))
        return layer(x[None])[0].view(BATCH, LENGTH, HEADS, HEAD_DIM)


def test_causal_fox_equals_fla_s_naive_forgetting_attention():
    naive = reference("fla.ops.forgetting_attn.naive")
    layer = layer_of("fox", True).float()
    x = layer_input()[0].float()
    q, k, v = fla_layout(layer, x)
    log_forget = F.logsigmoid(project(layer.hook.left_gate, x))  # [B, T, H]
    expected = naive.naive_forgetting_attn(q, k, v, log_forget)
    torch.testing.assert_close(heads_output(layer, x), expected, rtol=1e-5, atol=1e-5)


def test_causal_stick_breaking_equals_fla_s_naive_reference_with_the_remainder_on_v_i():
    naive = reference("fla.ops.stickbreaking_attn.naive")
    layer = layer_of("stick_breaking", True).float()
    x = layer_input()[0].float()
    q, k, v = fla_layout(layer, x)
    out, remainder = naive.naive_stickbreaking_attn(q, k, v)
    expected = out + remainder[..., None] * v  # the official tests' remainder correction
    torch.testing.assert_close(heads_output(layer, x), expected, rtol=1e-5, atol=1e-5)


# -- the interface through the model ------------------------------------------------------------


def tiny_model(pe: str, kernel=None, **options):
    torch.manual_seed(0)
    return build_model(get_task("reverse_string"), pe, kernel, layers=2, dim=16, heads=2, ffn=32,
                       **options)


def test_fox_s_bias_reaches_dape_per_sequence_as_its_bias_channels():
    model = tiny_model("fox", 3)
    dape = model.blocks[0].attention.dape
    assert dape.weight1.shape[2] == 4 and dape.sequence_bias  # [S; D]: 2H channels
    assert not tiny_model("stick_breaking", 3).blocks[0].attention.dape.with_bias


@pytest.mark.parametrize("pe", ["fox", "stick_breaking"])
def test_the_memory_plan_counts_the_bias_the_normalisation_and_the_state(pe):
    plain = tiny_model("rope").query_row_bytes(100)  # 200 tokens, 2 heads
    model = tiny_model(pe)
    hook = model.blocks[0].attention.hook
    extra = 4 * (hook.extra_maps * 2 * 200 + hook.state_floats(200))
    assert model.query_row_bytes(100) == plain + extra > plain


@pytest.mark.parametrize("kernel", [None, 3])
@pytest.mark.parametrize("pe, causal", CASES)
def test_the_layer_trains_and_evaluates_on_the_meta_device(pe, causal, kernel):
    """The GPU path: no tensor made on the CPU, no value read back to the host (the encoder
    itself checks its token ids on the host, so the layer is run alone)."""
    layer = layer_of(pe, causal, kernel).to("meta")
    x = torch.randn(1, BATCH, LENGTH, DIM, device="meta", dtype=torch.float64)
    layer(x).sum().backward()
    assert all(p.grad is not None and p.grad.is_meta for p in layer.parameters())
    layer.memory_budget_bytes = 1
    with torch.no_grad():
        assert layer(x).shape == x.shape


def test_the_captured_maps_are_the_stick_breaking_weights():
    model = tiny_model("stick_breaking", 1).eval()
    model.set_memory_budget(2000)  # several row chunks
    inputs = torch.from_numpy(get_task("reverse_string").sample(6, 1, np.random.default_rng(0)).inputs)
    with torch.no_grad(), model.capture_attention() as captured:
        model(inputs)
    layer = captured[0]
    assert len(layer) > 1
    weights = torch.cat([chunk["probabilities"] for chunk in layer], -2)[0, 0]
    logits = torch.cat([chunk["logits"] for chunk in layer], -2)[0, 0]
    expected = plain_stick(logits[None].double(), causal=False)[0].float()
    torch.testing.assert_close(weights, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:2]))
    assert weights[0].triu(1).eq(0).all() and weights[1].tril(-1).eq(0).all()  # left, right


@pytest.mark.parametrize("pe", ["fox", "stick_breaking"])
def test_the_autoregressive_transformer_refuses_them_in_one_line(pe):
    with pytest.raises(CheBenchError, match=f"cannot use --pe {pe}: its attention reads"):
        build_architecture("autoregressive_transformer", get_task("reverse_string"), pe=pe,
                           layers=1, dim=16, heads=2, ffn=32)


# -- the hand-written backward passes ---------------------------------------------------------


@pytest.mark.parametrize("rows", [slice(0, 5), slice(2, 4)])
def test_the_forget_bias_s_gradient_is_autograd_s(rows):
    left, right = torch.randn(2, 2, 1, 3, 5, dtype=torch.float64, requires_grad=True)
    bias = ForgetBias.apply(left, right, rows.start, rows.stop)
    query = torch.arange(rows.start, rows.stop)[:, None]
    plain = torch.where(torch.arange(5) > query, right[..., None, :] - right[..., rows, None],
                        left[..., rows, None] - left[..., None, :])
    torch.testing.assert_close(bias, plain)
    assert torch.autograd.gradcheck(
        lambda a, b: ForgetBias.apply(a, b, rows.start, rows.stop), (left, right)
    )


@pytest.mark.parametrize("leftward", [0, 1, 3])  # of 3 heads
@pytest.mark.parametrize("remainder", [True, False])
@pytest.mark.parametrize("rows", [slice(0, 5), slice(2, 4)])
def test_the_stick_weights_gradient_is_autograd_s(leftward, remainder, rows):
    logits = torch.randn(1, 2, 3, rows.stop - rows.start, 5, dtype=torch.float64) * 2
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda z: StickWeights.apply(z, rows.start, leftward, remainder), (logits,)
    )


@pytest.mark.parametrize("pe", ["fox", "stick_breaking"])
def test_the_maps_and_gradients_are_the_same_block_by_block(pe, monkeypatch):
    """One cache block or one per map (``CACHE_BLOCK_FLOATS``): the same numbers."""
    generator = torch.Generator().manual_seed(5)
    if pe == "fox":
        inputs = torch.randn(2, 3, 2, 4, 9, generator=generator, dtype=torch.float64).unbind()
        function = lambda left, right: ForgetBias.apply(left, right, 3, 8)  # noqa: E731
    else:
        inputs = (torch.randn(3, 2, 4, 5, 9, generator=generator, dtype=torch.float64),)
        function = lambda logits: StickWeights.apply(logits, 3, 1, True)  # noqa: E731
    results = []
    for block_floats in (1 << 17, 8):
        monkeypatch.setattr(common, "CACHE_BLOCK_FLOATS", block_floats)
        leaves = [tensor.clone().requires_grad_(True) for tensor in inputs]
        out = function(*leaves)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view(out.shape))
        results.append([out, *(leaf.grad for leaf in leaves)])
    for blocked, whole in zip(*results, strict=True):
        torch.testing.assert_close(blocked, whole, rtol=1e-12, atol=1e-12)


def test_the_stick_weights_take_logits_laid_out_in_any_order():
    """DAPE's convolutions hand over a transposed map (members and sequences swapped)."""
    logits = torch.randn(2, 3, 2, 4, 6, dtype=torch.float64).transpose(0, 1).requires_grad_(True)
    weights = StickWeights.apply(logits, 1, 1, True)
    weights.sum().backward()
    expected = StickWeights.apply(logits.detach().contiguous(), 1, 1, True)
    torch.testing.assert_close(weights, expected)
    assert logits.grad.shape == logits.shape


def test_no_stick_weight_is_subnormal():
    """Far keys' weights underflow; a subnormal float takes the CPU's slow path (exp 30 to 70
    times slower), so the weights stop at e times the smallest normal float."""
    logits = torch.full((1, 1, 2, 1, 300), 3.0)  # each key takes most of what is left
    weights = StickWeights.apply(logits, 299, 1, True)
    tiny = torch.finfo(torch.float32).tiny
    assert (weights[0, 0, 0, 0, :299] >= tiny).all()  # head 0 looks left, over 299 keys
    assert (weights[weights != 0] >= tiny).all()


@pytest.mark.parametrize("pe", ["fox", "path"])
def test_a_causal_model_builds_no_parameters_for_keys_right_of_the_query(pe):
    """``build_encoding(causal=True)``: the right gates / right Householders are not built
    (they would be dead weights, counted as parameters and never trained)."""
    from che_bench.encodings.base import build_encoding

    sizes = dict(dim=16, heads=4, layers=2, train_max_tokens=40)
    both = build_encoding(pe, **sizes)
    causal = build_encoding(pe, **sizes, causal=True)
    assert any("right" in name for name, _ in both.named_parameters())
    assert not any("right" in name for name, _ in causal.named_parameters())
    count = lambda encoding: sum(p.numel() for p in encoding.parameters())  # noqa: E731
    assert count(causal) == count(both) // 2
    assert "causal" not in type(both).option_names()
