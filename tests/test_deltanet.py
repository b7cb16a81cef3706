"""DeltaNet, Gated DeltaNet and DeltaProduct as models: the fast model (chunkwise, or native
for the gated two) equals the same model run token by token, the eigenvalue switch, packs,
gradients, training, option errors, the evaluation's memory split and the checks of
``che-bench check-model``."""

from __future__ import annotations

import pytest
import torch

from che_bench.checks import model_checks
from che_bench.errors import CheBenchError
from che_bench.members import MemberLinear
from che_bench.model.architectures import build_architecture
from che_bench.model.state_tracking import deltanet
from che_bench.model.state_tracking.delta_rule_recurrent import recurrent_delta_product
from che_bench.model.state_tracking.position_wise import read_out_positions
from che_bench.model.state_tracking.stack import StateTrackingModel
from che_bench.tasks import get_task
from tests.model_helpers import (
    TINY,
    assert_the_split_evaluation_is_the_whole_one,
    assert_training_on_parity_reduces_the_loss,
    inputs_for,
    peak_bytes,
    tiny,
)

MODELS = ("deltanet", "gated_deltanet", "deltaproduct")


@pytest.mark.parametrize("negative", [False, True])
@pytest.mark.parametrize("name", MODELS)
def test_the_fast_model_is_the_model_run_token_by_token(
    name, negative, monkeypatch, delta_rule_implementation
):
    model = tiny(name, negative_eigenvalues=negative).eval()
    inputs = inputs_for("parity_check", 500)
    with torch.no_grad():
        fast = model(inputs)
        monkeypatch.setattr(deltanet, "delta_product", recurrent_delta_product)
        slow = model(inputs)
    torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_without_the_short_conv_q_k_v_read_their_own_token_only(name, monkeypatch):
    """``short_conv=false`` (DeltaProduct's S3 runs): no convolution's parameters, and the
    first layer's queries at token t change only when token t does (the conv reads t-3..t)."""
    model = tiny(name, short_conv=False).eval()
    assert not any(".conv." in key for key in model.state_dict())
    assert any(".conv." in key for key in tiny(name).state_dict())
    queries = []

    def recording(q, k, v, beta, log_decay=None, chunk=64):
        queries.append(q)  # [M, B, H, T, d]
        return recurrent_delta_product(q, k, v, beta, log_decay)

    monkeypatch.setattr(deltanet, "delta_product", recording)
    inputs = inputs_for("parity_check", 8)
    changed = inputs.clone()
    changed[:, 3] = 1 - changed[:, 3]
    with torch.no_grad():
        model(inputs), model(changed)
    first, second = queries[0], queries[len(model.blocks)]
    differs = (first != second).any(-1).flatten(end_dim=-2).any(0)  # per token
    assert differs.nonzero().flatten().tolist() == [3]


@pytest.mark.parametrize("name", MODELS)
def test_negative_eigenvalues_double_beta_and_nothing_else(name, monkeypatch):
    seen = []

    def recording(q, k, v, beta, log_decay=None, chunk=64):
        seen.append((beta, log_decay))
        return recurrent_delta_product(q, k, v, beta, log_decay)

    monkeypatch.setattr(deltanet, "delta_product", recording)
    models = [tiny(name, negative_eigenvalues=flag) for flag in (False, True)]
    for a, b in zip(*(model.state_dict().values() for model in models), strict=True):
        assert torch.equal(a, b)  # same parameters: the switch is not a parameter
    with torch.no_grad():
        for model in models:
            model(inputs_for("parity_check", 6))
    (plain, gate), (doubled, gate_too) = seen[0], seen[len(seen) // 2]
    torch.testing.assert_close(doubled, 2 * plain)
    assert plain.max() < 1 < doubled.max() < 2
    assert (gate is None) == (name == "deltanet")
    if gate is not None:
        torch.testing.assert_close(gate, gate_too)


@pytest.mark.parametrize("name", MODELS)
def test_every_parameter_of_every_member_gets_a_gradient(name):
    model = tiny(name, task="reverse_string", members=2)
    model(inputs_for("reverse_string", 6)).square().sum().backward()
    for parameter_name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all()
        assert (parameter.grad.flatten(1).norm(dim=1) > 0).all(), parameter_name


def _logits_and_gradients(model, task, n, batch=4):
    model.zero_grad()
    logits = model(inputs_for(task, n, batch=batch))
    logits.square().sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _every_position(self, block, x, read):
    return StateTrackingModel.last_block(self, block, x, read)


@pytest.mark.parametrize("task", ["parity_check", "duplicate_string"])
@pytest.mark.parametrize("name", ["gated_deltanet", "deltaproduct"])
def test_the_last_block_at_the_read_out_positions_only_computes_the_same_model(
    name, task, monkeypatch
):
    model = tiny(name, task=task, members=2)
    assert not type(model).every_position_weight_gradients
    cut, cut_gradients = _logits_and_gradients(model, task, 9)
    monkeypatch.setattr(type(model), "last_block", _every_position)
    whole, whole_gradients = _logits_and_gradients(model, task, 9)
    torch.testing.assert_close(cut, whole, rtol=1e-6, atol=1e-7)
    for parameter_name, gradient in whole_gradients.items():
        # Rounding, relative to the gradient's scale (the sums run in another order).
        difference = (cut_gradients[parameter_name] - gradient).abs().max()
        assert difference <= 1e-5 * gradient.abs().max(), parameter_name


@pytest.fixture
def one_thread():
    """torch on one thread, as training runs by default: on more, the embedding's gradient
    sums its rows in an order that varies from run to run (batch 16 at n = 9 on the Xeon)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("members", [1, 2])
@pytest.mark.parametrize("task", ["parity_check", "duplicate_string"])
def test_deltanet_last_block_at_the_read_out_positions_gives_every_position_gradients(
    task, members, monkeypatch, one_thread
):
    """DeltaNet's committed results were trained with the last block at every position: at
    its default width its logits and every gradient are those bit for bit, wherever a row's
    products and norms do not depend on how many rows there are (``position_wise``): a batch
    of 16 (training's: 32, 256), as on the Intel Xeon a product rounds a row otherwise among
    fewer (``rows_round_alike``)."""
    torch.manual_seed(0)
    model = build_architecture("deltanet", get_task(task), members=members)
    assert type(model).every_position_weight_gradients
    at_read, at_read_gradients = _logits_and_gradients(model, task, 9, batch=16)
    monkeypatch.setattr(type(model), "last_block", _every_position)
    whole, whole_gradients = _logits_and_gradients(model, task, 9, batch=16)
    torch.testing.assert_close(at_read, whole, rtol=1e-6, atol=1e-7)
    for parameter_name, gradient in whole_gradients.items():
        torch.testing.assert_close(at_read_gradients[parameter_name], gradient)
    tokens, read = model.with_output_tokens(model.member_inputs(inputs_for(task, 9, batch=16)))
    if not rows_round_alike(model.blocks[-1], tokens.shape[1:], read):
        pytest.skip("this CPU's products or norms round a row otherwise among fewer rows")
    assert torch.equal(at_read, whole)
    for parameter_name, gradient in whole_gradients.items():
        assert torch.equal(at_read_gradients[parameter_name], gradient), parameter_name


def rows_round_alike(block, rows, read):
    """Whether this CPU gives the last ``read`` of ``rows = (batch, steps)`` positions the same
    bits among those rows alone as among every position's, in each layer of DeltaNet's
    position-wise stage (``block``'s, with its members): the layer's output and its input's
    gradient, the operations the block runs at every position and at the read-out positions,
    each input in the block's layout (the mixer's norm reads a view of the rule's transposed
    output, a linear map a contiguous input). How a product blocks its rows, and so sums them,
    can depend on their number: on the Intel Xeon (family 6 model 207, MKL 2024.2) ``bmm`` with
    the transposed weight ``member_linear`` passes rounds a row otherwise among 1 to 5 rows
    (fan-in 128) or 1 to 15 (fan-in 512) than among 10 or 41 times as many, and with the
    untransposed weight of the input's gradient, alone."""
    generator = torch.Generator().manual_seed(0)
    members, mixer = block.mlp_norm.weight.shape[0], block.mixer
    rule_output = torch.randn(
        members, rows[0], mixer.heads, rows[1], mixer.head_dim, generator=generator
    )
    layers = [(mixer.norm, rule_output.transpose(2, 3))]
    for layer in (mixer.out, block.mlp_norm, block.mlp.up, block.mlp.down):
        fan_in = layer.fan_in if isinstance(layer, MemberLinear) else layer.dim
        layers.append((layer, torch.randn(members, *rows, fan_in, generator=generator)))
    return all(
        _layer_rounds_read_rows_alike(layer, inputs, read, generator, contiguous=index > 0)
        for index, (layer, inputs) in enumerate(layers)
    )


def _layer_rounds_read_rows_alike(layer, inputs, read, generator, contiguous):
    """Whether ``layer``'s output and input gradient at the last ``read`` positions of
    ``inputs`` are, bit for bit, those it gives them among every position's rows (the output
    gradient random at those positions, zero at the others)."""
    inputs.requires_grad_()
    whole = layer(inputs)
    gradient = torch.randn(read_out_positions(whole, read).shape, generator=generator)
    padded = torch.zeros_like(whole)
    read_out_positions(padded, read).copy_(gradient)
    (whole_gradient,) = torch.autograd.grad(whole, inputs, padded)
    rows = read_out_positions(inputs.detach(), read)
    rows = (rows.contiguous() if contiguous else rows).requires_grad_()
    part = layer(rows)
    (part_gradient,) = torch.autograd.grad(part, rows, gradient)
    return torch.equal(read_out_positions(whole, read), part) and torch.equal(
        read_out_positions(whole_gradient, read), part_gradient
    )


@pytest.mark.parametrize("name", MODELS)
def test_a_few_steps_on_parity_reduce_the_loss(name):
    assert_training_on_parity_reduces_the_loss(tiny(name, negative_eigenvalues=True, width=16))


def test_weight_decay_spares_the_forget_gate_only_as_the_harness_does():
    assert tiny("deltanet").no_weight_decay() == set()
    for name in ("gated_deltanet", "deltaproduct"):
        assert tiny(name, layers=2).no_weight_decay() == {
            f"blocks.{layer}.mixer.{parameter}"
            for layer in (0, 1)
            for parameter in ("a_log", "dt_bias")
        }


def test_the_initialisation_is_grazzi_et_al_s_fork_of_fla():
    """Mixer maps xavier-uniform with gain 2^-2.5 (each with its own fan-out), MLP and read-out
    N(0, 0.02), the MLP's down-projection scaled by 1 / sqrt(2 * layers)."""
    model = build_architecture("deltanet", get_task("parity_check"), layers=2, width=128)
    mixer, mlp = model.blocks[0].mixer, model.blocks[0].mlp
    q_map = mixer.project.weight[0, :128]
    beta_map = mixer.project.weight[0, 384:388]
    assert q_map.abs().max() <= 2**-2.5 * (6 / 256) ** 0.5 < beta_map.abs().max()
    assert beta_map.abs().max() <= 2**-2.5 * (6 / 132) ** 0.5
    assert mlp.up.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert mlp.down.weight.std().item() == pytest.approx(0.01, rel=0.05)
    assert model.head.weight.std().item() == pytest.approx(0.02, rel=0.3)


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("deltanet", {"negative_eigenvalues": "yes"}, "negative_eigenvalues must be true or false"),
        ("gated_deltanet", {"width": 10, "heads": 4}, "width 10 is not a multiple of heads 4"),
        ("deltaproduct", {"householder": 0}, "householder must be a positive integer"),
        ("deltaproduct", {"forget_gate": 1}, "forget_gate must be true or false"),
        ("deltanet", {"short_conv": "no"}, "short_conv must be true or false"),
        ("deltanet", {"householder": 2}, "deltanet takes no option householder"),
    ],
)
def test_bad_options_are_one_line_errors(name, options, message):
    with pytest.raises(CheBenchError, match=message) as caught:
        build_architecture(name, get_task("parity_check"), **options)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name", MODELS)
def test_evaluation_split_to_the_memory_budget_computes_the_same_logits(name):
    assert_the_split_evaluation_is_the_whole_one(tiny(name))


@pytest.mark.parametrize("name", MODELS)
def test_the_memory_estimate_covers_a_default_model_at_500_tokens(name):
    """The split relies on it: at most twice the measured peak, never below it (so a batch of
    64 at n = 500 runs in a 1 GiB budget in one or two parts)."""
    model = build_architecture(name, get_task("parity_check")).eval()
    measured = peak_bytes(model, inputs_for("parity_check", 500)) / 2
    assert measured <= model.query_row_bytes(500) <= 2 * measured
    assert 64 * model.query_row_bytes(500) <= 2 * model.memory_budget_bytes


@pytest.mark.parametrize("check", list(model_checks.MODEL_CHECKS))
@pytest.mark.parametrize("name", MODELS)
def test_check_model_passes(name, check):
    assert model_checks.run_model_check(check, name, TINY) == []


@pytest.mark.parametrize("arch", ["deltanet", "gated_deltanet", "deltaproduct"])
def test_the_blocks_run_on_the_meta_device_so_without_host_synchronisation(arch):
    """The GPU path with no data to read: any ``.item()``, ``int(tensor)`` or ``bool(tensor)``
    inside forward or backward (chunk sizes included) would fail here."""
    model = build_architecture(
        arch,
        get_task("parity_check"),
        members=2,
        layers=1,
        width=8,
        heads=2,
        negative_eigenvalues=True,
    )
    block = model.blocks[0].to("meta")
    for read in (None, 2):  # as a block before the last, and as the last
        x = torch.randn(2, 3, 150, 8, device="meta", requires_grad=True)
        block.zero_grad()
        block(x, read).sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
        assert all(parameter.grad is not None for parameter in block.parameters())
