"""The delta rule's native kernel (``delta_rule_native``): values and gradients of the plain
recurrence for every input across its saved-state blocks, widths that are not a multiple of a
vector, several threads bit for bit, which models and paths use it, the switch, and what a run
records."""

from __future__ import annotations

import pytest
import torch

from che_bench import cpu
from che_bench.config import make_config
from che_bench.model.state_tracking import delta_rule, delta_rule_native
from che_bench.model.state_tracking.delta_rule import delta_product
from che_bench.model.state_tracking.delta_rule_recurrent import recurrent_delta_product
from che_bench.run.provenance import software_versions
from tests.test_delta_rule import rule_inputs

CPU = torch.device("cpu")


def gradients(rule, args, weights):
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in args]
    out = rule(*leaves)
    (out * weights).sum().backward()
    return out.detach(), [None if x is None else x.grad for x in leaves]


@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
@pytest.mark.parametrize(
    "steps, n, gated, d",
    [(1, 2, True, 4), (16, 1, True, 32), (17, 2, True, 12), (50, 3, False, 20), (500, 2, True, 32)],
)
def test_values_and_gradients_are_the_recurrence_s(
    steps, n, gated, d, beta_scale, native_delta_rule
):
    """Across blocks of 16 tokens, with widths of one vector, several and a part of one."""
    args = rule_inputs(steps, n, gated, beta_scale, d=d, seed=4, gate_scale=0.1)
    weights = torch.randn(2, 2, steps, d, generator=torch.Generator().manual_seed(5))
    ours = gradients(native_delta_rule.apply, args, weights)
    expected = gradients(recurrent_delta_product, args, weights)
    torch.testing.assert_close(ours[0], expected[0], atol=2e-5, rtol=1e-4)
    for mine, theirs in zip(ours[1], expected[1], strict=True):
        if theirs is None:
            assert mine is None
        else:
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_several_threads_give_one_thread_s_numbers(native_delta_rule):
    args = rule_inputs(37, 2, True, 2.0, heads=3, d=16, seed=6)
    weights = torch.randn(2, 3, 37, 16)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 4):
            torch.set_num_threads(count)
            results.append(gradients(native_delta_rule.apply, args, weights))
    finally:
        torch.set_num_threads(threads)
    (out_1, grads_1), (out_4, grads_4) = results
    assert torch.equal(out_1, out_4)
    assert all(torch.equal(a, b) for a, b in zip(grads_1, grads_4, strict=True))


def test_a_sequence_s_numbers_do_not_depend_on_the_others(native_delta_rule):
    """Packs equal their members alone: each sequence is computed on its own."""
    q, k, v, beta, gate = rule_inputs(30, 2, True, 2.0, d=8, seed=7)
    whole = native_delta_rule.apply(q, k, v, beta, gate)
    alone = native_delta_rule.apply(q[1:], k[1:], v[1:], beta[1:], gate[1:])
    assert torch.equal(whole[1:], alone)


def test_delta_product_uses_it_for_a_gate_or_a_product_only(native_delta_rule, monkeypatch):
    calls = []
    monkeypatch.setattr(
        type(native_delta_rule), "apply", lambda self, *args: calls.append(args) or args[0]
    )
    q, k, v, beta, gate = rule_inputs(9, 1, True, d=8)
    delta_product(q, k, v, beta)  # DeltaNet's plain rule: chunkwise
    delta_product(q, k, v, beta, gate, chunk=4)  # a chunk asked for: chunkwise
    delta_product(q.to("meta"), k.to("meta"), v.to("meta"), beta.to("meta"))  # off the CPU
    assert not calls
    delta_product(q, k, v, beta, gate)
    product = rule_inputs(9, 2, False, d=8)
    delta_product(*product)
    assert len(calls) == 2


def test_the_switch_and_the_portable_mode_turn_it_off(monkeypatch):
    monkeypatch.setenv(delta_rule_native.SWITCH, "0")
    delta_rule_native.native_delta_rule.cache_clear()
    try:
        assert delta_rule_native.native_delta_rule() is None
        assert delta_rule_native.describe(CPU) == "chunkwise"
    finally:
        delta_rule_native.native_delta_rule.cache_clear()
    assert cpu.PORTABLE_ENVIRONMENT[delta_rule_native.SWITCH] == "0"


def test_a_run_records_how_its_delta_rule_ran(delta_rule_implementation):
    for arch in ("gated_deltanet", "deltaproduct"):
        recorded = software_versions(
            make_config("parity_check", None, None, "smoke", arch=arch), CPU
        )
        assert recorded["delta_rule"].startswith(delta_rule_implementation)
    deltanet = make_config("parity_check", None, None, "smoke", arch="deltanet")
    assert "delta_rule" not in software_versions(deltanet, CPU)
    plain = {"householder": 1, "forget_gate": False}  # DeltaNet's plain rule: chunkwise
    plain_product = make_config("parity_check", None, None, "smoke", arch="deltaproduct",
                                arch_options=plain)  # fmt: skip
    assert "delta_rule" not in software_versions(plain_product, CPU)
    dape = make_config("parity_check", "kerple", 3, "smoke")
    assert "delta_rule" not in software_versions(dape, CPU)


def never_compiled():
    pytest.fail("the delta rule's native kernel was loaded for a tensor off the CPU")


def test_a_gpu_run_records_the_chunkwise_form_and_compiles_nothing(monkeypatch):
    """Issue 44: a GPU run compiled the CPU kernel for its record and recorded it as what ran;
    off the CPU the chunkwise form runs. A run of unknown device records no kernel."""
    monkeypatch.setattr(delta_rule_native, "native_delta_rule", never_compiled)
    for arch in ("gated_deltanet", "deltaproduct"):
        config = make_config("parity_check", None, None, "smoke", arch=arch)
        assert software_versions(config, torch.device("cuda"))["delta_rule"] == "chunkwise"
        assert "delta_rule" not in software_versions(config)


def test_a_forward_off_the_cpu_never_loads_the_native_kernel(monkeypatch):
    """Issue 44: the first CUDA forward of Gated DeltaNet compiled the CPU kernel (a minute)
    before looking at the device; on the meta device it must not even be asked for."""
    monkeypatch.setattr(delta_rule, "native_delta_rule", never_compiled)
    for n, gated in ((1, True), (2, False)):
        args = [None if x is None else x.to("meta") for x in rule_inputs(20, n, gated)]
        assert delta_product(*args).shape == (2, 2, 20, 4)
