"""mLSTM and sLSTM (xLSTM): the fast forms equal their plain recurrences and the xlstm
package's backends (cells and whole block stacks), the initialisation, packs, gradients,
training, option errors (negative eigenvalues refused), the evaluation's memory split and
``che-bench check-model``."""

from __future__ import annotations

import pytest
import torch

from che_bench.checks import model_checks
from che_bench.cli import main
from che_bench.errors import CheBenchError
from che_bench.model.architectures import build_architecture, build_members
from che_bench.model.state_tracking import mlstm, slstm
from che_bench.model.state_tracking.mlstm_recurrent import mlstm_recurrent
from che_bench.model.state_tracking.slstm_recurrent import slstm_recurrent
from che_bench.tasks import get_task
from tests.model_helpers import (
    TINY,
    assert_the_split_evaluation_is_the_whole_one,
    assert_training_on_parity_reduces_the_loss,
    inputs_for,
    tiny,
)
from tests.references import reference

MODELS = ("mlstm", "slstm")


def mlstm_inputs(steps, seed=0, batch=2, heads=3, size=8):
    """q, k, v [B, H, T, d] and gate pre-activations [B, H, T] with forget biases as
    initialised (3..6) and input gates spread wide enough to move the stabiliser."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, steps, size, generator=generator) for _ in range(3))
    igate = 2 * torch.randn(batch, heads, steps, generator=generator)
    fgate = 3 + 2 * torch.randn(batch, heads, steps, generator=generator)
    return q, k, v, igate, fgate


def slstm_inputs(steps, seed=0, heads=3, batch=2, size=5):
    """Input pre-activations [N, T, B, 4d] and a recurrent map [N, d, 4d] large enough that
    the recurrence matters."""
    generator = torch.Generator().manual_seed(seed)
    pre = 2 * torch.randn(heads, steps, batch, 4 * size, generator=generator)
    recurrent = 0.5 * torch.randn(heads, size, 4 * size, generator=generator)
    return pre, recurrent


# -- the fast forms are the recurrences -----------------------------------------------------


@pytest.mark.parametrize("steps", [1, 37, 500])
def test_the_mlstm_parallel_form_is_the_recurrence(steps):
    """The two forms stabilise differently (the recurrence's m includes the empty initial
    state), which changes only the normaliser's 1e-6 term: equal to float32 tolerance."""
    inputs = mlstm_inputs(steps)
    fast, slow = mlstm.mlstm_parallel(*inputs), mlstm_recurrent(*inputs)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)


def test_the_mlstm_parallel_form_has_the_recurrence_s_gradients():
    inputs = [part.requires_grad_() for part in mlstm_inputs(60)]
    weights = torch.randn(mlstm.mlstm_parallel(*inputs).shape)
    fast = torch.autograd.grad((mlstm.mlstm_parallel(*inputs) * weights).sum(), inputs)
    slow = torch.autograd.grad((mlstm_recurrent(*inputs) * weights).sum(), inputs)
    for one, two in zip(fast, slow, strict=True):
        torch.testing.assert_close(one, two, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("chunk", [1, 7, 64, 300])
def test_the_mlstm_chunkwise_form_is_the_parallel_form(chunk):
    """The same stabiliser: equal up to rounding, at any chunk size (300 tokens, so the last
    chunk is partial for every size but 1 and 300)."""
    inputs = mlstm_inputs(300)
    parallel = mlstm.mlstm_parallel(*inputs)
    chunkwise = mlstm.mlstm_chunkwise(*inputs, chunk=chunk)
    torch.testing.assert_close(chunkwise, parallel, rtol=1e-4, atol=1e-4)


def test_the_mlstm_chunkwise_form_has_the_recurrence_s_gradients():
    inputs = [part.requires_grad_() for part in mlstm_inputs(150)]
    # Seeded: the two forms stabilise differently (see above), so the tolerance holds for
    # these draws, not for every draw.
    weights = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1))
    fast = torch.autograd.grad((mlstm.mlstm_chunkwise(*inputs) * weights).sum(), inputs)
    slow = torch.autograd.grad((mlstm_recurrent(*inputs) * weights).sum(), inputs)
    for one, two in zip(fast, slow, strict=True):
        torch.testing.assert_close(one, two, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("steps", [65, 120, 210])
def test_the_mlstm_chunkwise_gradients_stay_the_recurrence_s_as_the_forget_gates_close(steps):
    """Forget gates near sigmoid(-2): the summed log-forget passes -88 within the first
    chunk, so a padded last chunk whose cumulative sum restarts at 0 overflowed exp(-F_s),
    and the padding's inf times its zero gradient made every gradient NaN (issue 44)."""
    q, k, v, igate, _ = mlstm_inputs(steps, seed=2)
    fgate = -2 + 0.5 * torch.randn(igate.shape, generator=torch.Generator().manual_seed(3))
    inputs = [part.requires_grad_() for part in (q, k, v, igate, fgate)]
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    fast = torch.autograd.grad((mlstm.mlstm_chunkwise(*inputs) * weights).sum(), inputs)
    slow = torch.autograd.grad((mlstm_recurrent(*inputs) * weights).sum(), inputs)
    for one, two in zip(fast, slow, strict=True):
        assert torch.isfinite(one).all()
        torch.testing.assert_close(one, two, rtol=1e-3, atol=1e-3)


def test_mlstm_with_a_negative_forget_bias_has_finite_gradients_past_one_chunk():
    """The issue's case: forget bias -2, duplicate_string at n = 40 (120 tokens, two chunks,
    the last one padded): every parameter's gradient finite."""
    model = tiny("mlstm", task="duplicate_string")
    with torch.no_grad():
        for block in model.blocks:
            block.layer.gates.bias_parameter()[:, block.layer.heads :] = -2.0
    logits = model(inputs_for("duplicate_string", 40))
    assert logits.shape[-2] + 40 > mlstm.CHUNK  # the inputs, then the 2n outputs
    logits.square().sum().backward()
    for name, parameter in model.named_parameters():
        assert torch.isfinite(parameter.grad).all(), name


@pytest.mark.parametrize("steps", [1, 2, 500])
def test_the_slstm_scan_is_the_literal_recurrence_in_value_and_gradient(steps):
    pre, recurrent = (part.requires_grad_() for part in slstm_inputs(steps))
    fast, slow = slstm.slstm_scan(pre, recurrent), slstm_recurrent(pre, recurrent)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    weights = torch.randn(fast.shape, generator=torch.Generator().manual_seed(1))
    # One step never reads the recurrent map: its gradient is then zero.
    grads = {"allow_unused": True, "materialize_grads": True}
    fast_grads = torch.autograd.grad((fast * weights).sum(), (pre, recurrent), **grads)
    slow_grads = torch.autograd.grad((slow * weights).sum(), (pre, recurrent), **grads)
    for one, two in zip(fast_grads, slow_grads, strict=True):
        torch.testing.assert_close(one, two, rtol=1e-4, atol=1e-4)


def test_the_slstm_scan_stays_finite_with_extreme_gates():
    pre, recurrent = slstm_inputs(200)
    pre = (40 * pre).requires_grad_()
    out = slstm.slstm_scan(pre, recurrent)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(pre.grad).all()


@pytest.mark.parametrize(
    "name, module, fast, slow",
    [
        ("mlstm", mlstm, "mlstm_chunkwise", mlstm_recurrent),
        ("slstm", slstm, "slstm_scan", slstm_recurrent),
    ],
)
def test_the_model_is_the_model_run_token_by_token(name, module, fast, slow, monkeypatch):
    model = tiny(name, members=2).eval()
    inputs = inputs_for("parity_check", 500)
    with torch.no_grad():
        expected = model(inputs)
        monkeypatch.setattr(module, fast, slow)
        torch.testing.assert_close(model(inputs), expected, rtol=1e-4, atol=1e-4)


# -- the xlstm package (test-only reference) ------------------------------------------------


@pytest.mark.parametrize("steps", [1, 64, 300])
def test_the_mlstm_cell_equals_xlstm_s_parallel_and_recurrent_backends(steps):
    backends = reference("xlstm.blocks.mlstm.backends")
    q, k, v, igate, fgate = mlstm_inputs(steps)
    ours = mlstm.mlstm_parallel(q, k, v, igate, fgate)
    parallel = backends.parallel_stabilized_simple(q, k, v, igate[..., None], fgate[..., None])
    torch.testing.assert_close(ours, parallel, rtol=1e-4, atol=1e-4)
    size = q.shape[-1]
    state = (q.new_zeros(*q.shape[:2], size, size), q.new_zeros(*q.shape[:2], size, 1))
    state = (*state, q.new_zeros(*q.shape[:2], 1, 1))
    outputs = []
    for t in range(steps):
        step = [part[:, :, t : t + 1].clone() for part in (q, k, v)]
        gates = (igate[:, :, t, None, None], fgate[:, :, t, None, None])
        h, state = backends.recurrent_step_stabilized_simple(*state, *step, *gates)
        outputs.append(h)
    recurrent = torch.cat(outputs, dim=2)
    ours_recurrent = mlstm_recurrent(q, k, v, igate, fgate)
    torch.testing.assert_close(ours_recurrent, recurrent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, recurrent, rtol=1e-4, atol=1e-4)


def test_the_slstm_cell_equals_xlstm_s_vanilla_pointwise_step():
    vanilla = reference("xlstm.blocks.slstm.src.vanilla.slstm")
    pre, recurrent = slstm_inputs(120, heads=1)  # one head: the reference's [B, 4d] layout
    states = pre.new_zeros(4, pre.shape[2], pre.shape[3] // 4)
    outputs = []
    for t in range(pre.shape[1]):
        states, _ = vanilla.slstm_forward_pointwise(
            pre[0, t], states[0] @ recurrent[0], pre.new_zeros(1, pre.shape[3]), states, {}
        )
        outputs.append(states[0])
    torch.testing.assert_close(slstm.slstm_scan(pre, recurrent)[0], torch.stack(outputs))


def xlstm_stack(model, steps):
    """The xlstm package's block stack for ``model`` (one member), its weights copied."""
    xlstm = reference("xlstm")
    if model.name == "mlstm":
        layer = xlstm.mLSTMLayerConfig(
            conv1d_kernel_size=model.settings["conv_kernel"], num_heads=model.heads
        )
        blocks = {"mlstm_block": xlstm.mLSTMBlockConfig(mlstm=layer)}
    else:
        layer = xlstm.sLSTMLayerConfig(
            backend="vanilla", num_heads=model.heads, dtype="float32",
            conv1d_kernel_size=model.settings["conv_kernel"],
        )  # fmt: skip
        feedforward = xlstm.FeedForwardConfig(proj_factor=1.3, act_fn="gelu")
        blocks = {"slstm_block": xlstm.sLSTMBlockConfig(slstm=layer, feedforward=feedforward)}
    config = xlstm.xLSTMBlockStackConfig(
        **blocks, context_length=steps, num_blocks=model.layers, embedding_dim=model.width
    )
    stack = xlstm.xLSTMBlockStack(config)
    copy = mlstm_weights if model.name == "mlstm" else slstm_weights
    with torch.no_grad():
        for ours, theirs in zip(model.blocks, stack.blocks, strict=True):
            theirs.xlstm_norm.weight.copy_(ours.norm.weight[0])
            copy(ours, theirs)
        stack.post_blocks_norm.weight.copy_(model.norm.weight[0])
    return stack


def mlstm_weights(ours, theirs):
    layer, heads = ours.layer, ours.layer.heads
    pairs = {
        "proj_up.weight": layer.up.weight[0],
        "conv1d.conv.weight": layer.conv.weight[0][:, None],
        "conv1d.conv.bias": layer.conv.bias[0],
        "q_proj.weight": layer.q.weight[0],
        "k_proj.weight": layer.k.weight[0],
        "v_proj.weight": layer.v.weight[0],
        "mlstm_cell.igate.weight": layer.gates.weight[0][:heads],
        "mlstm_cell.igate.bias": layer.gates.bias[0][:heads],
        "mlstm_cell.fgate.weight": layer.gates.weight[0][heads:],
        "mlstm_cell.fgate.bias": layer.gates.bias[0][heads:],
        "mlstm_cell.outnorm.weight": layer.norm_weight[0],
        "learnable_skip": layer.skip[0],
        "proj_down.weight": layer.down.weight[0],
    }
    parameters = dict(theirs.xlstm.named_parameters())
    assert set(parameters) == set(pairs)
    for name, value in pairs.items():
        parameters[name].copy_(value)


def slstm_weights(ours, theirs):
    layer, mine = theirs.xlstm, ours.layer
    theirs.ffn_norm.weight.copy_(ours.ffn_norm.weight[0])
    theirs.ffn.proj_up.weight.copy_(ours.ffn.up.weight[0])
    theirs.ffn.proj_down.weight.copy_(ours.ffn.down.weight[0])
    if mine.conv is not None:
        layer.conv1d.conv.weight.copy_(mine.conv.weight[0][:, None])
        layer.conv1d.conv.bias.copy_(mine.conv.bias[0])
    size = mine.size
    weight = mine.weight[0].view(mine.heads, 4, size, size)
    # xlstm's sLSTMLayer feeds fgate's output to the input gate and igate's to the forget
    # gate (both small-initialised alike): the names are swapped, not the model.
    for gate, name in enumerate(("fgate", "igate", "zgate", "ogate")):
        getattr(layer, name).weight.copy_(weight[:, gate])
    layer.slstm_cell.recurrent_kernel[:] = mine.recurrent[0].view(mine.heads, size, 4, size)
    layer.slstm_cell.bias[:] = mine.bias[0]
    layer.group_norm.weight.copy_(mine.norm_weight[0])


@pytest.mark.parametrize(
    "name, options",
    [("mlstm", {}), ("mlstm", {"conv_kernel": 2}), ("slstm", {}), ("slstm", {"conv_kernel": 4})],
)
def test_the_block_stack_equals_xlstm_s(name, options):
    model = tiny(name, width=32, heads=4, layers=3, **options)
    with torch.no_grad():  # off the initialisation, whose zeros would hide a wrong mapping
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    steps = 50
    stack = xlstm_stack(model, steps)
    x = torch.randn(1, 3, steps, model.width)
    ours = x
    for block in model.blocks:
        ours = block(ours)
    torch.testing.assert_close(model.norm(ours)[0], stack(x[0]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_the_initialisation_is_xlstm_s(name):
    """Width 128, 3 blocks (the forget biases depend on the block): what xlstm initialises
    to constants (the same under two seeds) we initialise to the same values; what it draws,
    we draw with the same spread."""
    ours = xlstm_stack(tiny(name, width=128, heads=4, layers=3), 41).state_dict()
    reference_stack = xlstm_stack(tiny(name, width=128, heads=4, layers=3), 41)
    fresh = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        fresh.append(type(reference_stack)(reference_stack.config).state_dict())
    for key, theirs in fresh[0].items():
        if torch.equal(theirs, fresh[1][key]):
            torch.testing.assert_close(ours[key], theirs, msg=key)
        elif theirs.numel() >= 200:
            assert 0.85 < ours[key].std() / theirs.std() < 1.15, key
    model = tiny(name, width=128, heads=4)
    for table in (model.embedding.weight, model.head.weight):  # N(0, 2 / (5 width))
        assert 0.85 < table.std() * (5 * 128 / 2) ** 0.5 < 1.15


# -- che-bench's contract -------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_a_pack_of_two_equals_its_members_alone(name):
    arguments = {**TINY, "conv_kernel": 2}
    pack = build_members(name, get_task("parity_check"), [0, 1], **arguments)
    inputs = inputs_for("parity_check", 30, batch=3)
    with torch.no_grad():
        together = pack(inputs)
        for member, seed in enumerate((0, 1)):
            alone = build_members(name, get_task("parity_check"), [seed], **arguments)
            torch.testing.assert_close(together[member], alone(inputs)[0])


@pytest.mark.parametrize("name", MODELS)
def test_every_parameter_of_every_member_gets_a_gradient(name):
    model = tiny(name, task="reverse_string", members=2, conv_kernel=2)
    model(inputs_for("reverse_string", 6)).square().sum().backward()
    for parameter_name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all()
        assert (parameter.grad.flatten(1).norm(dim=1) > 0).all(), parameter_name


@pytest.mark.parametrize("name, options", [("mlstm", {}), ("slstm", {"conv_kernel": 2})])
def test_the_blocks_never_read_a_value_back_to_the_host(name, options):
    """The GPU path without host synchronisation: the blocks run forward and backward on
    meta tensors, which hold no values (``.item()``, ``bool(tensor)`` or a data-dependent
    branch would raise)."""
    model = tiny(name, members=2, **options).to("meta")
    x = torch.randn(2, 3, 70, model.width, device="meta", requires_grad=True)
    for block in model.blocks:
        x = block(x)
    model.head(model.norm(x)).sum().backward()
    assert all(parameter.grad is not None for parameter in model.blocks.parameters())


@pytest.mark.parametrize("name", MODELS)
def test_a_few_steps_on_parity_reduce_the_loss(name):
    assert_training_on_parity_reduces_the_loss(tiny(name, width=16))


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("mlstm", {"negative_eigenvalues": False}, "Grazzi et al.*do not extend mLSTM"),
        ("slstm", {"negative_eigenvalues": True}, "Grazzi et al.*do not extend mLSTM or sLSTM"),
        ("mlstm", {"conv_kernel": 0}, "conv_kernel must be a positive integer"),
        ("slstm", {"conv_kernel": -1}, "conv_kernel must be an integer >= 0"),
        ("slstm", {"width": 10, "heads": 4}, "width 10 is not a multiple of heads 4"),
        ("mlstm", {"width": 12, "heads": 12}, "inner width 64 .* not a multiple of heads 12"),
        ("slstm", {"householder": 2}, "slstm takes no option householder"),
    ],
)
def test_bad_options_are_one_line_errors(name, options, message):
    with pytest.raises(CheBenchError, match=message) as caught:
        build_architecture(name, get_task("parity_check"), **options)
    assert "\n" not in str(caught.value)
    if "negative_eigenvalues" in options:  # the class itself refuses it too
        model_class = type(tiny(name))
        with pytest.raises(CheBenchError, match=message):
            model_class(get_task("parity_check"), **options)


def test_negative_eigenvalues_on_the_command_line_exit_2_with_the_reason(capsys):
    arguments = ["--arch-option", "negative_eigenvalues=true"]
    assert main(["check-model", "slstm", *arguments]) == 2
    error = capsys.readouterr().err.strip()
    assert "do not extend" in error and "\n" not in error


@pytest.mark.parametrize("name", MODELS)
def test_evaluation_split_to_the_memory_budget_computes_the_same_logits(name):
    assert_the_split_evaluation_is_the_whole_one(tiny(name))


def test_the_default_models_evaluate_500_tokens_at_batch_64_within_the_budget():
    """The estimate the split relies on (measured at n = 500, default sizes: mLSTM 10.3-11.6
    MB per sequence, sLSTM 2.8): a batch of 64 fits 1 GiB whole."""
    for name in MODELS:
        model = build_architecture(name, get_task("parity_check"))
        assert model.memory_budget_bytes // model.query_row_bytes(500) >= 64
    model = build_architecture("mlstm", get_task("parity_check"))
    assert 11e6 < model.query_row_bytes(500) < 13e6


@pytest.mark.parametrize("check", list(model_checks.MODEL_CHECKS))
@pytest.mark.parametrize("name", MODELS)
def test_check_model_passes(name, check):
    assert model_checks.run_model_check(check, name, TINY) == []
