"""CHE's recurrent baselines: layout, shapes, members, Haiku's cells, stack and tape semantics,
training."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from che_bench.errors import CheBenchError
from che_bench.model.packs import member_state_dict, stack_members
from che_bench.model.recurrent import (
    ARCHITECTURES,
    build_recurrent,
    recurrent_defaults,
)
from che_bench.model.recurrent.stack_rnn import update_stack
from che_bench.model.recurrent.tape_rnn import jump_indices, update_tape
from che_bench.tasks import get_task
from tests.model_helpers import assert_training_on_parity_reduces_the_loss

TINY = {"hidden_size": 8}
TINY_MEMORY = {
    "stack_rnn": {"stack_cell_size": 3, "stack_size": 5},
    "stack_lstm": {"stack_cell_size": 3, "stack_size": 5},
    "tape_rnn": {"memory_cell_size": 3, "memory_size": 6, "mlp_layers_size": (4,)},
    "ndstack_rnn": {"stack_size": 5},
}


def tiny(name, task, seed=0, **options):
    torch.manual_seed(seed)
    return build_recurrent(name, task, **TINY, **TINY_MEMORY.get(name, {}), **options)


def inputs_for(task, n, batch=3, seed=0):
    return torch.from_numpy(task.sample(n, batch, np.random.default_rng(seed)).inputs.copy())


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize(
    "task_name, n, outputs",
    [("parity_check", 1, 1), ("parity_check", 6, 1), ("duplicate_string", 1, 2),
     ("duplicate_string", 4, 8), ("binary_addition", 5, 6), ("mqar", 16, 16)],
)
def test_forward_returns_logits_of_every_output_position(name, task_name, n, outputs):
    task = get_task(task_name)
    logits = tiny(name, task)(inputs_for(task, n))
    assert logits.shape == (1, 3, outputs, task.output_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_pack_member_computes_what_the_model_alone_does(name):
    task = get_task("reverse_string")
    alone = [tiny(name, task, seed=seed) for seed in (0, 1)]
    pack = stack_members(alone)
    assert pack.members == 2 and pack.describe() == alone[0].describe()
    shared, own = inputs_for(task, 5), torch.stack([inputs_for(task, 5, seed=s) for s in (2, 3)])
    with torch.no_grad():
        for member, model in enumerate(alone):
            torch.testing.assert_close(pack(shared)[member], model(shared)[0])
            torch.testing.assert_close(pack(own)[member], model(own[member : member + 1])[0])
            state = member_state_dict(pack, member)
            assert all(torch.equal(state[key], value) for key, value in model.state_dict().items())


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_parameter_gets_a_gradient(name):
    task = get_task("reverse_string")
    model = tiny(name, task, members=2)
    model(inputs_for(task, 6)).square().sum().backward()
    for parameter_name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all()
        assert (parameter.grad.flatten(1).norm(dim=1) > 0).all(), parameter_name


def test_stack_push_pop_and_no_op():
    stack = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [0.0, 0.0]])  # top first
    push = torch.tensor([9.0, 8.0])
    moves = {
        "push": ([1.0, 0.0, 0.0], [[9, 8], [1, 1], [2, 2], [3, 3]]),
        "pop": ([0.0, 1.0, 0.0], [[2, 2], [3, 3], [0, 0], [0, 0]]),
        "no-op": ([0.0, 0.0, 1.0], [[1, 1], [2, 2], [3, 3], [0, 0]]),
    }
    for action, expected in moves.values():
        new = update_stack(stack, torch.tensor(action), push)
        torch.testing.assert_close(new, torch.tensor(expected, dtype=torch.float32))
    # A full stack drops its bottom cell on a push; actions blend linearly.
    full = torch.tensor([[1.0], [2.0], [3.0]])
    torch.testing.assert_close(update_stack(full, torch.tensor([1.0, 0, 0]), torch.tensor([7.0])),
                               torch.tensor([[7.0], [1.0], [2.0]]))
    blend = update_stack(full, torch.tensor([0.5, 0.25, 0.25]), torch.tensor([7.0]))
    torch.testing.assert_close(blend, torch.tensor([[4.25], [1.75], [1.75]]))


def test_tape_writes_at_the_head_then_moves_or_jumps_by_the_input_length():
    size, n = 6, 2
    tape = torch.arange(1.0, 7.0).view(1, 1, size, 1)  # head (index 0) holds 1
    write = torch.tensor([[[10.0]]])
    written = [10.0, 2, 3, 4, 5, 6]
    # roll(x, s)[i] = x[i - s]: CHE's jnp.roll(eye, s) applied to the written tape.
    expected = {
        0: written,                       # write and stay
        1: [2, 3, 4, 5, 6, 10.0],         # write and move left (roll -1)
        2: [6, 10.0, 2, 3, 4, 5],         # write and move right (roll +1)
        3: [3, 4, 5, 6, 10.0, 2],         # jump left by n = 2 (roll -2)
        4: [5, 6, 10.0, 2, 3, 4],         # jump right by n = 2 (roll +2)
    }
    indices = jump_indices(size, n)
    for action, values in expected.items():
        probabilities = torch.nn.functional.one_hot(torch.tensor([[action]]), 5).float()
        new = update_tape(tape, probabilities, write, indices)
        assert new.flatten().tolist() == values, action
    # A jump longer than the tape wraps around: n = 8 on 6 cells moves 2.
    torch.testing.assert_close(jump_indices(size, 8), indices)


def haiku_reference_logits(model, inputs):
    """The CHE lstm written out from Haiku's definitions, one sequence at a time."""
    task, hidden = model.task, model.cell.hidden_size
    weight, bias = model.cell.gates.weight[0], model.cell.gates.bias[0]
    head_w, head_b = model.head.weight[0], model.head.bias[0]
    placeholders = task.output_length(inputs.shape[1])
    tokens = torch.cat([inputs, torch.full((inputs.shape[0], placeholders), task.input_size)], 1)
    x = torch.nn.functional.one_hot(tokens, task.input_size + 1).float()
    h = c = torch.zeros(inputs.shape[0], hidden)
    outputs = []
    for step in range(tokens.shape[1]):
        gated = torch.cat([x[:, step], h], dim=1) @ weight.T + bias
        i, g, f, o = gated.split(hidden, dim=1)
        c = torch.sigmoid(f + 1) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outputs.append(torch.relu(h) @ head_w.T + head_b)
    return torch.stack(outputs[-placeholders:], dim=1)


def test_lstm_is_haikus_cell_on_the_empty_target_layout():
    task = get_task("duplicate_string")
    model = tiny("lstm", task, fused=False)
    inputs = inputs_for(task, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(inputs)[0], haiku_reference_logits(model, inputs))


def test_vanilla_rnn_is_haikus_cell_with_two_biases():
    task = get_task("parity_check")
    model = tiny("rnn", task)
    w_in, b_in = model.cell.input_to_hidden.weight[0], model.cell.input_to_hidden.bias[0]
    w_h, b_h = model.cell.hidden_to_hidden.weight[0], model.cell.hidden_to_hidden.bias[0]
    with torch.no_grad():
        torch.nn.init.normal_(b_in)
        torch.nn.init.normal_(b_h)
        inputs = inputs_for(task, 3)
        x = torch.nn.functional.one_hot(torch.cat([inputs, torch.full((3, 1), 2)], 1), 3).float()
        h = torch.zeros(3, 8)
        for step in range(4):
            h = torch.relu(x[:, step] @ w_in.T + b_in + h @ w_h.T + b_h)
        expected = torch.relu(h) @ model.head.weight[0].T + model.head.bias[0]
        torch.testing.assert_close(model(inputs)[0, :, 0], expected)


def test_fused_lstm_evaluation_matches_the_batched_loop():
    task = get_task("reverse_string")
    torch.manual_seed(0)
    fused = build_recurrent("lstm", task, hidden_size=32)
    looped = build_recurrent("lstm", task, hidden_size=32, fused=False)
    looped.load_state_dict(fused.state_dict())
    inputs = inputs_for(task, 20, batch=4)
    assert fused.describe()["fused"] and not looped.describe()["fused"]
    with torch.inference_mode():
        torch.testing.assert_close(fused(inputs), looped(inputs), rtol=1e-5, atol=1e-5)


def test_fused_lstm_training_on_a_gpu_has_the_batched_loops_gradients(monkeypatch):
    """A one-member lstm trains with torch's kernel on a GPU: forced here on the CPU, its
    outputs and every parameter's gradient are the batched loop's."""
    import che_bench.model.recurrent.base as base

    task = get_task("reverse_string")
    torch.manual_seed(0)
    fused = build_recurrent("lstm", task, hidden_size=16)
    looped = build_recurrent("lstm", task, hidden_size=16, fused=False)
    looped.load_state_dict(fused.state_dict())
    inputs = inputs_for(task, 12, batch=4)
    monkeypatch.setattr(base, "FUSED_TRAINING_DEVICES", ("cpu",))
    calls = []
    original = type(fused.cell).fused_unroll
    monkeypatch.setattr(type(fused.cell), "fused_unroll",
                        lambda cell, tokens: calls.append(1) or original(cell, tokens))
    for model in (fused, looped):
        model(inputs).square().sum().backward()
    assert calls == [1]  # the fused model only
    for (name, a), b in zip(fused.named_parameters(), looped.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_haiku_initialisation_and_the_reference_parameter_counts():
    torch.manual_seed(0)
    task = get_task("reverse_string")  # input_size 2: one-hot of 3 classes
    lstm = build_recurrent("lstm", task)
    gates = lstm.cell.gates
    assert gates.weight.shape == (1, 4 * 256, 3 + 256)  # one map of [x, h], as hk.LSTM
    fan_in_bound = 2 / math.sqrt(3 + 256)
    assert gates.weight.abs().max() <= fan_in_bound + 1e-6
    assert 0.8 / math.sqrt(259) < gates.weight.std() < 0.95 / math.sqrt(259)
    assert torch.all(gates.bias == 0) and torch.all(lstm.head.bias == 0)
    counts = {name: build_recurrent(name, task).describe()["parameters"] for name in ARCHITECTURES}
    # in->h (3+E)*256+256, h->h 256*256+256 (two biases), read-out 256*2+2; stack: push 8 and
    # 3 actions of h; tape: MLP 256-64-64-8 and 5 actions of h; ndstack: reads 3 symbols,
    # 84 actions of h (2 states, 3 symbols).
    assert counts == {"rnn": 67_330, "lstm": 266_754, "stack_rnn": 72_205,
                      "stack_lstm": 277_773, "ndstack_rnn": 89_686, "tape_rnn": 91_791}


def test_describe_names_the_architecture_and_its_sizes():
    described = build_recurrent("tape_rnn", get_task("parity_check")).describe()
    json.dumps(described)
    assert described["architecture"] == "tape_rnn" and described["hidden_size"] == 256
    assert (described["memory_cell_size"], described["memory_size"]) == (8, 40)
    assert described["mlp_layers_size"] == [64, 64]
    assert recurrent_defaults("stack_lstm")["stack_cell_size"] == 8
    assert recurrent_defaults("stack_lstm")["stack_size"] == 30


@pytest.mark.parametrize(
    "name, options, message",
    [("gru", {}, "unknown architecture"), ("rnn", {"stack_size": 3}, "takes no option"),
     ("lstm", {"hidden_size": 0}, "positive integer"),
     ("tape_rnn", {"mlp_layers_size": (64, -1)}, "positive integer")],
)
def test_bad_options_are_one_line_errors(name, options, message):
    with pytest.raises(CheBenchError, match=message):
        build_recurrent(name, get_task("parity_check"), **options)


def test_bad_inputs_are_one_line_errors():
    model = tiny("rnn", get_task("parity_check"))
    with pytest.raises(CheBenchError, match="input ids"):
        model(torch.tensor([[0, 2]]))
    with pytest.raises(CheBenchError, match="inputs must be"):
        model(torch.zeros(2, 1, 3, dtype=torch.long))


def test_a_small_memory_budget_splits_the_batch_without_changing_the_outputs():
    task = get_task("reverse_string")
    model = tiny("stack_lstm", task).eval()
    inputs = inputs_for(task, 5, batch=5)
    with torch.no_grad():
        whole = model(inputs)
        model.set_memory_budget(2 * model.query_row_bytes(5))
        torch.testing.assert_close(model(inputs), whole)


def test_draw_calls_are_no_ops_of_the_right_width():
    model = tiny("rnn", get_task("parity_check"), members=2)
    model.seed_draws([1, 2])
    assert model.sample_draws(5) is None and model.draw_states() == [None, None]
    model.set_draw_states(model.draw_states())
    with pytest.raises(ValueError):
        model.seed_draws([1])


def test_a_few_training_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = build_recurrent("lstm", get_task("parity_check"), hidden_size=16)
    assert_training_on_parity_reduces_the_loss(model, steps=50)
