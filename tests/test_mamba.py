"""Mamba-1 (``che_bench.model.state_tracking.mamba``): the chunked scan equals the plain
recurrence and mambapy (values and gradients, both eigenvalue ranges), the initialisation,
the eigenvalue switch, gradients, training, option errors, the evaluation's memory split and
the checks of ``che-bench check-model``."""

from __future__ import annotations

import math

import pytest
import torch

from che_bench.checks import model_checks
from che_bench.errors import CheBenchError
from che_bench.model.architectures import build_architecture
from che_bench.model.state_tracking import mamba
from che_bench.model.state_tracking.mamba import CHUNK, CPU_CHUNK, scan_, selective_scan
from che_bench.model.state_tracking.mamba_recurrent import (
    mixer_recurrent,
    selective_scan_recurrent,
)
from che_bench.tasks import get_task
from tests.model_helpers import (
    assert_the_split_evaluation_is_the_whole_one,
    assert_training_on_parity_reduces_the_loss,
    inputs_for,
    peak_bytes,
)
from tests.model_helpers import tiny as tiny_model
from tests.references import reference

TINY = {"width": 8, "d_state": 3}


def tiny(task="parity_check", seed=0, members=1, **options):
    return tiny_model("mamba", task, seed, members, sizes=TINY, **options)


def scan_inputs(steps, members=2, batch=2, inner=4, states=3, seed=0):
    """Random ``x, dt, A, B, C`` in the ranges the mixer gives them, requiring gradients."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator)

    x, B, C = (
        draw(members, batch, steps, inner),
        *(draw(members, batch, steps, states) for _ in range(2)),
    )
    dt = torch.nn.functional.softplus(draw(members, batch, steps, inner) - 1)
    A = -torch.exp(draw(members, inner, states))
    return [t.requires_grad_() for t in (x, dt, A, B, C)]


@pytest.mark.parametrize("reverse", [False, True])
def test_the_brent_kung_scan_is_the_sequential_scan_at_every_length(reverse):
    for length in range(1, 41):
        a, b = torch.rand(length, 3) * 2 - 1, torch.randn(length, 3)
        expected = b.clone()
        order = range(length - 2, -1, -1) if reverse else range(1, length)
        for t in order:
            expected[t] += a[t] * expected[t + 1 if reverse else t - 1]
        torch.testing.assert_close(scan_(a.clone(), b.clone(), reverse), expected)


@pytest.mark.parametrize("chunk", [CPU_CHUNK, CHUNK])
@pytest.mark.parametrize("negative", [False, True])
def test_the_chunked_scan_is_the_recurrence_with_its_gradients(negative, chunk, monkeypatch):
    monkeypatch.setattr(mamba, "chunk_length", lambda device: chunk)
    for steps in (1, chunk - 1, chunk + 1, 500):
        inputs = scan_inputs(steps, seed=steps)
        fast, slow = (
            scan(*inputs, negative) for scan in (selective_scan, selective_scan_recurrent)
        )
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-4)
        weights = torch.randn_like(fast)
        for got, expected in zip(
            torch.autograd.grad(fast, inputs, weights),
            torch.autograd.grad(slow, inputs, weights),
            strict=True,
        ):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_without_gradients_the_scan_keeps_no_states(monkeypatch):
    """Evaluation takes the plain chunk loop, not the autograd function that keeps each
    chunk's first state."""

    def refuse(*args):
        raise AssertionError("the autograd function ran without gradients")

    monkeypatch.setattr(mamba._SelectiveScan, "apply", refuse)
    inputs = scan_inputs(50)
    with torch.no_grad():
        fast = selective_scan(*inputs)
        torch.testing.assert_close(fast, selective_scan_recurrent(*inputs))


@pytest.mark.parametrize("negative", [False, True])
def test_the_mixer_is_its_recurrence_token_by_token(negative):
    model = tiny(members=2, negative_eigenvalues=negative)
    mixer = model.blocks[0].mixer
    u = torch.randn(2, 2, 500, TINY["width"])
    with torch.no_grad():
        torch.testing.assert_close(mixer(u), mixer_recurrent(mixer, u), atol=1e-5, rtol=1e-4)


def test_negative_eigenvalues_map_each_transition_to_2a_minus_1_and_leave_the_input():
    """One channel, one state, an input at t = 0 only: h_t = a^t b_0, so the output alternates
    in sign with the switch (a = 2 e^{dt A} - 1 < 0) and decays without it."""
    steps, decay = 6, 0.2
    x = torch.zeros(1, 1, steps, 1)
    x[..., 0, 0] = 1.0
    dt = torch.full((1, 1, steps, 1), 1.0)
    A = torch.full((1, 1, 1), math.log(decay))
    ones = torch.ones(1, 1, steps, 1)
    for negative, a in ((False, decay), (True, 2 * decay - 1)):
        y = selective_scan(x, dt, A, ones, ones, negative)
        torch.testing.assert_close(y.flatten(), a ** torch.arange(steps, dtype=torch.float32))


def mambapy_copy(model, mambapy):
    """mambapy's ``Mamba`` with member 0's weights of ``model``'s blocks."""
    settings = model.settings
    config = mambapy.MambaConfig(
        d_model=settings["width"],
        n_layers=settings["layers"],
        d_state=settings["d_state"],
        expand_factor=settings["expand"],
        d_conv=settings["d_conv"],
    )
    reference_model = mambapy.Mamba(config)
    with torch.no_grad():
        for ours, theirs in zip(model.blocks, reference_model.layers, strict=True):
            mixer, other = ours.mixer, theirs.mixer
            theirs.norm.weight.copy_(ours.norm.weight[0])
            other.conv1d.weight.copy_(mixer.conv.weight[0, :, None])
            other.conv1d.bias.copy_(mixer.conv.bias[0])
            for name in ("in_proj", "x_proj", "dt_proj", "out_proj"):
                getattr(other, name).weight.copy_(getattr(mixer, name).weight[0])
            other.dt_proj.bias.copy_(mixer.dt_proj.bias[0])
            other.A_log.copy_(mixer.A_log[0])
            other.D.copy_(mixer.D[0])
    return reference_model


def blocks(model, x):
    for block in model.blocks:
        x = block(x)
    return x


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("d_conv", [4, 1])
def test_the_blocks_equal_mambapy_with_the_same_weights(d_conv, parallel):
    """mambapy's parallel scan (``pscan``) and its loop (``selective_scan_seq``), outputs and
    input gradients, in the original range [0, 1]."""
    mambapy = reference("mambapy.mamba")
    model = tiny(d_conv=d_conv, width=16, d_state=4)
    theirs = mambapy_copy(model, mambapy)
    theirs.config.pscan = parallel
    x = torch.randn(3, 100, 16, requires_grad=True)
    ours_out, theirs_out = blocks(model, x[None])[0], theirs(x)
    torch.testing.assert_close(ours_out, theirs_out, atol=1e-5, rtol=1e-4)
    weights = torch.randn_like(ours_out)
    (ours_grad,) = torch.autograd.grad(ours_out, x, weights)
    (theirs_grad,) = torch.autograd.grad(theirs_out, x, weights)
    torch.testing.assert_close(ours_grad, theirs_grad, atol=1e-5, rtol=1e-4)


def test_negative_eigenvalues_equal_mambapy_s_scan_given_2a_minus_1(monkeypatch):
    """Grazzi et al.'s extension as their code makes it: mambapy's ``pscan`` given
    ``2 exp(dt A) - 1`` in place of ``exp(dt A)``, input term unchanged; the parameter
    gradients too."""
    mambapy = reference("mambapy.mamba")
    real_pscan = mambapy.pscan
    monkeypatch.setattr(mambapy, "pscan", lambda deltaA, BX: real_pscan(2 * deltaA - 1, BX))
    model = tiny(width=16, d_state=4, negative_eigenvalues=True)
    theirs = mambapy_copy(model, mambapy)
    x = torch.randn(3, 100, 16)
    ours_out, theirs_out = blocks(model, x[None])[0], theirs(x)
    torch.testing.assert_close(ours_out, theirs_out, atol=1e-5, rtol=1e-4)
    weights = torch.randn_like(ours_out)
    (ours_out * weights).sum().backward()
    (theirs_out * weights).sum().backward()
    for ours, other in zip(model.blocks, theirs.layers, strict=True):
        for name in ("A_log", "D"):
            torch.testing.assert_close(
                getattr(ours.mixer, name).grad[0],
                getattr(other.mixer, name).grad,
                rtol=1e-4,
                atol=1e-4,
            )
        torch.testing.assert_close(
            ours.mixer.dt_proj.weight.grad[0],
            other.mixer.dt_proj.weight.grad,
            rtol=1e-4,
            atol=1e-4,
        )


def test_the_initialisation_is_mamba_s():
    model = build_architecture("mamba", get_task("parity_check"))
    mixer = model.blocks[0].mixer
    torch.testing.assert_close(mixer.A_log[0, 5], torch.arange(1.0, 17.0).log())
    assert torch.equal(mixer.D, torch.ones(1, 256))
    dt = torch.nn.functional.softplus(mixer.dt_proj.bias)
    assert 1e-3 <= dt.min() < 2e-3 and 0.08 < dt.max() <= 0.1
    assert mixer.dt_proj.weight.shape == (1, 256, 8)  # rank ceil(128 / 16)
    assert mixer.dt_proj.weight.abs().max() <= 8**-0.5
    assert mixer.conv.weight.shape == (1, 256, 4) and model.norm is None
    assert model.no_weight_decay() == {
        f"blocks.{layer}.mixer.{name}" for layer in (0, 1) for name in ("A_log", "D")
    }


def test_every_parameter_of_every_member_gets_a_gradient():
    model = tiny(task="reverse_string", members=2, negative_eigenvalues=True)
    model(inputs_for("reverse_string", 6)).square().sum().backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all()
        assert (parameter.grad.flatten(1).norm(dim=1) > 0).all(), name


def test_a_few_steps_on_parity_reduce_the_loss():
    assert_training_on_parity_reduces_the_loss(tiny(negative_eigenvalues=True, width=16))


def test_the_mixer_runs_on_the_meta_device_so_without_host_synchronisation():
    """The GPU path (the long chunk) with no data to read: any ``.item()``, ``int(tensor)``
    or ``bool(tensor)`` inside forward or backward would fail here."""
    mixer = tiny(members=2, negative_eigenvalues=True).blocks[0].mixer.to("meta")
    assert mamba.chunk_length(torch.device("meta")) == CHUNK
    u = torch.randn(2, 3, 2 * CHUNK + 5, TINY["width"], device="meta", requires_grad=True)
    mixer(u).sum().backward()
    assert u.grad is not None and u.grad.shape == u.shape
    assert all(parameter.grad is not None for parameter in mixer.parameters())


@pytest.mark.parametrize(
    "options, message",
    [
        ({"heads": 4}, "mamba takes no option heads"),
        ({"negative_eigenvalues": "yes"}, "negative_eigenvalues must be true or false"),
        ({"d_state": 0}, "d_state must be a positive integer"),
        ({"d_conv": 0}, "d_conv must be a positive integer"),
        ({"expand": 1.5}, "expand must be a positive integer"),
    ],
)
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(CheBenchError, match=message) as caught:
        build_architecture("mamba", get_task("parity_check"), **options)
    assert "\n" not in str(caught.value)


def test_evaluation_split_to_the_memory_budget_computes_the_same_logits():
    assert_the_split_evaluation_is_the_whole_one(tiny())


def test_the_memory_estimate_covers_a_default_model_at_500_tokens():
    """At most twice the measured peak, never below it; a batch of 64 at n = 500 fits the
    default 1 GiB budget in one part (the scan never holds [T, ED, N] states)."""
    model = build_architecture("mamba", get_task("parity_check")).eval()
    measured = peak_bytes(model, inputs_for("parity_check", 500)) / 2
    assert measured <= model.query_row_bytes(500) <= 2 * measured
    assert 64 * model.query_row_bytes(500) <= model.memory_budget_bytes


@pytest.mark.parametrize("options", [{}, {"negative_eigenvalues": True, "d_conv": 1}])
@pytest.mark.parametrize("check", list(model_checks.MODEL_CHECKS))
def test_check_model_passes(check, options):
    """Including a pack of three equal to its members alone, the batch-independence of the
    logits and a short training run."""
    small = {"width": 16, "d_state": 4}  # width 8 does not learn even_pairs in 100 steps
    assert model_checks.run_model_check(check, "mamba", {**small, **options}) == []
