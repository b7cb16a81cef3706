"""bf16 products on a CPU whose torch has no native bf16 product (``che_bench.members``):
autocast's results but for the order of the float32 sums, forward and backward, and torch's
own product everywhere else."""

import numpy as np
import pytest
import torch

from che_bench import members
from che_bench.members import batched_product, bf16_product, emulates_bf16_products
from che_bench.model.architectures import build_architecture
from che_bench.tasks import get_task
from che_bench.train.step import autocast_to

BF16 = torch.bfloat16
#: One bf16 unit (8 significant bits) relative to the value, with room for the float32 sums.
BF16_UNIT = 2.0**-7


def _operands(seed, bias=True):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(3, 37, 24, generator=generator, requires_grad=True)
    b = torch.randn(3, 24, 16, generator=generator, requires_grad=True)
    c = torch.randn(3, 16, generator=generator, requires_grad=True) if bias else None
    return a, b, c


def _forward_backward(product, seed, bias):
    """The product's output and its operands' gradients, forward and backward under CPU bf16
    autocast as the training step runs them."""
    a, b, c = _operands(seed, bias)
    gradient = torch.randn(3, 37, 16, generator=torch.Generator().manual_seed(seed + 1))
    with torch.autocast("cpu", dtype=BF16):
        out = product(a, b, c)
        out.backward(gradient.to(BF16))
    return out, [t.grad for t in (a, b, c) if t is not None]


def _autocast_product(a, b, c):
    return torch.bmm(a, b) if c is None else torch.baddbmm(c[:, None], a, b)


def _within_a_bf16_unit(ours, reference):
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    ours, reference = ours.float(), reference.float()
    assert torch.all((ours - reference).abs() <= BF16_UNIT * reference.abs() + 1e-30)
    assert (ours == reference).float().mean() > 0.95  # a moved rounding is the exception


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_emulated_product_is_autocast_s_but_for_the_order_of_the_sums(seed, bias):
    out, grads = _forward_backward(bf16_product, seed, bias)
    reference, reference_grads = _forward_backward(_autocast_product, seed, bias)
    assert out.dtype == BF16
    _within_a_bf16_unit(out, reference)
    for grad, reference_grad in zip(grads, reference_grads, strict=True):
        assert grad.dtype == torch.float32
        _within_a_bf16_unit(grad, reference_grad)


def test_the_emulated_gradients_are_bf16_values():
    _, grads = _forward_backward(bf16_product, 0, True)
    for grad in grads:
        assert torch.equal(grad, grad.to(BF16).float())


def test_the_emulation_takes_over_only_under_cpu_bf16_autocast_without_native_products(
    monkeypatch,
):
    monkeypatch.setattr(members, "native_bf16_products", lambda: False)
    assert not emulates_bf16_products()
    with torch.autocast("cpu", dtype=torch.float16):
        assert not emulates_bf16_products()
    with torch.autocast("cpu", dtype=BF16):
        assert emulates_bf16_products()
        with torch.autocast("cpu", enabled=False):
            assert not emulates_bf16_products()
    monkeypatch.setattr(members, "native_bf16_products", lambda: True)
    with torch.autocast("cpu", dtype=BF16):
        assert not emulates_bf16_products()


@pytest.mark.parametrize("native", [False, True])
def test_batched_product_is_torch_s_own_but_where_it_emulates(monkeypatch, native):
    monkeypatch.setattr(members, "native_bf16_products", lambda: native)
    a, b, c = _operands(2)
    with torch.no_grad():
        assert torch.equal(batched_product(a, b, c), torch.baddbmm(c[:, None], a, b))
        with torch.autocast("cpu", dtype=BF16):
            ours, torch_s = batched_product(a, b, c), torch.baddbmm(c[:, None], a, b)
            emulated = bf16_product(a, b, c)
    assert torch.equal(ours, emulated if not native else torch_s)


def test_deltanet_under_bf16_autocast_agrees_with_and_without_the_emulation(monkeypatch):
    """A tiny DeltaNet's bf16 forward and gradients by the emulation match those by torch's
    own bf16 products to bf16 rounding (compounded over the layers: a loose bound)."""
    batch = get_task("modular_arithmetic").sample(9, 8, np.random.default_rng(0))
    inputs = torch.from_numpy(batch.inputs)
    results = {}
    for native in (True, False):
        monkeypatch.setattr(members, "native_bf16_products", lambda native=native: native)
        torch.manual_seed(0)
        model = build_architecture(
            "deltanet", get_task("modular_arithmetic"), layers=1, width=16, heads=2
        )
        with autocast_to(BF16, inputs.device):
            logits = model(inputs, model.sample_draws(inputs.shape[-1])).float()
            logits.square().mean().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        results[native] = logits.detach(), torch.cat([g.flatten() for g in grads])
    (logits, grads), (emulated_logits, emulated_grads) = results[True], results[False]
    assert torch.allclose(emulated_logits, logits, rtol=0.05, atol=0.02)
    assert torch.allclose(emulated_grads, grads, rtol=0.1, atol=0.02 * grads.abs().max())
