"""CHE's ndstack_rnn: the fast form against a plain restatement of CHE's JAX code (with its
clamped reads and dropped writes past stack_size), a hand-checked stack, packs, gradients,
training, options, and the run machinery (resume, kept model, re-evaluation, table)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from che_bench.cli import main
from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.model.packs import stack_members
from che_bench.model.recurrent import build_recurrent, recurrent_defaults
from che_bench.model.recurrent.ndstack_rnn import (
    READ_EPSILON,
    NDStackMemory,
    action_sizes,
    advance,
    initial_state,
)
from che_bench.run.kept_models import load_model
from che_bench.run.runner import execute_runs
from che_bench.store import ResultStore
from che_bench.tasks import get_task
from tests.model_helpers import assert_training_on_parity_reduces_the_loss
from tests.ndstack_oracle import che_update, oracle_logits
from tests.run_helpers import run_interrupted_at

TASK = get_task("reverse_string")  # n inputs then n empty outputs: 2n steps


def model(seed=0, **options):
    torch.manual_seed(seed)
    return build_recurrent("ndstack_rnn", TASK, **{"hidden_size": 12, **options})


def inputs(n, batch=3, seed=0):
    return torch.from_numpy(TASK.sample(n, batch, np.random.default_rng(seed)).inputs.copy())


def grads(module):
    """Each parameter's gradient, zeros where none reached it (stack_size 1 never uses its
    actions; CHE's gradient there is zero)."""
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize(
    "options, n",
    [
        ({}, 4),
        ({}, 20),
        ({"stack_size": 6}, 9),  # 2n = 8 < 30, 40 > 30, 18 > 6
        ({"stack_states": 3, "stack_symbols": 2, "read_states": True, "stack_size": 7}, 6),
        ({"stack_size": 1}, 3),
        ({"stack_size": 2}, 3),
        ({"members": 2}, 3),
    ],
)
def test_the_fast_form_computes_ches_step_by_step_update(options, n):
    fast = model(**options)
    x = inputs(n)
    logits = fast(x)
    expected = oracle_logits(fast, x)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    # Gradients too: past stack_size they reach the earlier steps through the frozen read.
    logits.square().sum().backward()
    fast_grads = grads(fast)
    fast.zero_grad()
    oracle_logits(fast, x).square().sum().backward()
    for got, want in zip(fast_grads, grads(fast), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


#: Which action block gets most of each step's weight (push, pop, replace): pushes first, then
#: pops and replacements in turn, so that every term of the update carries weight.
KINDS = [0, 0, 0, 0, 1, 2, 1, 1, 0, 2, 1, 0, 1, 1, 2, 1]


@pytest.mark.parametrize("states, symbols, read_states", [(2, 3, False), (3, 2, True)])
def test_every_step_of_the_stack_is_ches_also_past_the_array(states, symbols, read_states):
    """Sharp random actions (at random initialisation a model's pops carry too little weight
    to show in its logits), float64, against CHE's update on the full array."""
    size, batch = 9, 4
    memory = NDStackMemory(1, 4, states, symbols, size, read_states)
    sizes = action_sizes(states, symbols)
    state = memory.initial(1, batch, torch.zeros(1, dtype=torch.float64))
    gamma = torch.zeros(batch, size, size, states, symbols, states, symbols, dtype=torch.float64)
    alpha = torch.zeros(batch, size, states, symbols, dtype=torch.float64)
    alpha[:, 0, 0, 0] = 1.0
    generator = torch.Generator().manual_seed(0)
    for t, kind in enumerate(KINDS, start=1):
        logits = 2 * torch.randn(batch, sum(sizes), generator=generator, dtype=torch.float64)
        logits[:, sum(sizes[:kind]) : sum(sizes[: kind + 1])] += 6.0
        actions = torch.softmax(logits, dim=-1)
        state = memory.step(state, actions[None])
        push, pop, replace = actions.split(sizes, dim=-1)
        shape = (batch, states, symbols, states)
        gamma, alpha, read = che_update(
            gamma, alpha, push.reshape(*shape, symbols), pop.reshape(shape),
            replace.reshape(*shape, symbols), t, read_states,
        )
        torch.testing.assert_close(state.read[0], read, rtol=1e-12, atol=1e-12)
    assert state.steps == size - 1


def test_past_stack_size_the_read_stops_changing_as_in_ches_jax_code():
    short = model(stack_size=6)
    x = inputs(9)
    long = model(stack_size=40)  # the same weights with room for every step
    long.load_state_dict(short.state_dict())
    with torch.no_grad():
        frozen, unbounded = short(x), long(x)
    # Both agree up to the last column CHE writes; after it CHE's stack is frozen.
    assert not torch.allclose(frozen, unbounded, atol=1e-4)
    reads = []
    memory = short.memory
    plan = memory.plan(9)
    state = memory.initial(1, 3, torch.zeros(1))
    for _ in range(12):
        state = memory.write(state, torch.rand(1, 3, 12), plan)
        reads.append(state.read)
    assert state.steps == 5  # columns 1..5 of a 6 x 6 array
    assert all(torch.equal(read, reads[4]) for read in reads[5:])


def forced(states, symbols, kind, source, target):
    """One action with all the weight: push or replace (q, x) -> (r, y), or pop (q, x) -> r."""
    pairs = states * symbols
    push, pop, replace = (torch.zeros(1, 1, pairs, width) for width in (pairs, states, pairs))
    {"push": push, "pop": pop, "replace": replace}[kind][0, 0, source, target] = 1.0
    return push, pop, replace


def test_push_push_pop_replace_by_hand():
    states, symbols = 2, 3
    pair = lambda q, x: q * symbols + x  # noqa: E731
    state = initial_state(1, 1, states, symbols, symbols, torch.zeros(1))
    steps = [
        ("push", pair(0, 0), pair(0, 1)),
        ("push", pair(0, 1), pair(0, 2)),
        ("pop", pair(0, 2), 0),
        ("replace", pair(0, 1), pair(1, 0)),
    ]
    tops = []
    for kind, source, target in steps:
        state = advance(state, *forced(states, symbols, kind, source, target), read_states=False)
        tops.append(state.read[0, 0])
    unit = 1 / (1 + READ_EPSILON)
    # push 1, push 2, pop: 1 on top again; replace it by (state 1, symbol 0).
    for top, symbol in zip(tops, [1, 2, 1, 0], strict=True):
        torch.testing.assert_close(top, unit * torch.eye(symbols)[symbol])
    assert state.alpha[0, 0, -1].tolist() == [0, 0, 0, 1, 0, 0]  # (q, x) = (1, 0)


def test_a_pack_of_two_computes_its_members_alone():
    alone = [model(seed) for seed in (0, 1)]
    pack = stack_members(alone)
    x = inputs(17)  # 34 steps: past the stack's 30
    with torch.no_grad():
        for member, single in enumerate(alone):
            torch.testing.assert_close(pack(x)[member], single(x)[0])


def test_every_parameter_gets_a_gradient_and_training_lowers_the_loss():
    two = model(members=2, stack_size=8)
    two(inputs(6)).square().sum().backward()
    for name, parameter in two.named_parameters():
        assert (parameter.grad.flatten(1).norm(dim=1) > 0).all(), name
    torch.manual_seed(0)
    parity = build_recurrent("ndstack_rnn", get_task("parity_check"), hidden_size=16)
    assert_training_on_parity_reduces_the_loss(parity, steps=50)


def test_defaults_and_the_parameter_count():
    defaults = recurrent_defaults("ndstack_rnn")
    assert {
        key: defaults[key]
        for key in ("hidden_size", "stack_states", "stack_symbols", "stack_size", "read_states")
    } == {
        "hidden_size": 256,
        "stack_states": 2,
        "stack_symbols": 3,
        "stack_size": 30,
        "read_states": False,
    }
    # in->h (3 + 3) * 256 + 256, h->h 256 * 256 + 256, read-out 256 * 2 + 2, actions
    # 256 * 84 + 84 (push 36, pop 12, replace 36).
    assert build_recurrent("ndstack_rnn", TASK).describe()["parameters"] == 89_686


@pytest.mark.parametrize(
    "options, message",
    [
        ({"stack_states": 0}, "positive integer"),
        ({"stack_symbols": -1}, "positive integer"),
        ({"stack_size": 2.5}, "positive integer"),
        ({"read_states": "yes"}, "true or false"),
        ({"stack_cell_size": 8}, "takes no option"),
    ],
)
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(CheBenchError, match=message) as error:
        build_recurrent("ndstack_rnn", TASK, **options)
    assert "\n" not in str(error.value)


SMALL = {"hidden_size": 8, "stack_size": 5}
TINY_RUN = {
    "steps": 6,
    "test_lengths": "41",
    "eval_samples": 4,
    "eval_batch_size": 4,
    "length_seed": 0,
}


def test_an_interrupted_run_resumes_to_the_uninterrupted_numbers(tmp_path):
    configs = [
        make_config(
            "parity_check",
            preset="smoke",
            arch="ndstack_rnn",
            seed=seed,
            arch_options=SMALL,
            **TINY_RUN,
        )
        for seed in range(2)
    ]
    reference = execute_runs(configs, device="cpu", progress=False, log_every=1)
    run_interrupted_at(4, configs, tmp_path, log_every=1)
    resumed = execute_runs(
        configs, device="cpu", progress=False, log_every=1, checkpoint_dir=tmp_path
    )
    assert [result.timings["resumed_from_step"] for result in resumed] == [4, 0]
    curves = [
        [
            [(row["step"], row["loss"], row["accuracy"]) for row in result.history]
            for result in results
        ]
        for results in (resumed, reference)
    ]
    assert curves[0] == curves[1]  # bit for bit
    assert [r.per_length for r in resumed] == [r.per_length for r in reference]


def test_the_cli_runs_keeps_reevaluates_and_tabulates_it(tmp_path, capsys):
    store = tmp_path / "s.sqlite"
    common = [
        "--preset",
        "smoke",
        "--steps",
        "4",
        "--eval-samples",
        "4",
        "--eval-batch-size",
        "4",
        "--no-progress",
        "--device",
        "cpu",
        "--store",
        str(store),
    ]
    assert (
        main(
            [
                "run",
                "--task",
                "reverse_string",
                "--arch",
                "ndstack_rnn",
                "--test-lengths",
                "41",
                "--arch-option",
                "hidden_size=8",
                "--arch-option",
                "stack_size=5",
                *common,
            ]
        )
        == 0
    )
    run_id = ResultStore(store).runs()["run_id"][0]
    config, kept = load_model(store, run_id)
    assert config.arch == "ndstack_rnn" and kept.memory.size == 5
    assert (
        main(
            [
                "evaluate",
                run_id,
                "--test-lengths",
                "41,60",
                "--store",
                str(store),
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert len(ResultStore(store).evaluations([run_id])) == 2
    capsys.readouterr()
    assert main(["table", "--store", str(store)]) == 0
    assert "NDStack-RNN" in capsys.readouterr().out
