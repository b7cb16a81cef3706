"""CHE's autoregressive transformer (issue 29, item 2): teacher forcing is causal, greedy
decoding is teacher forcing on its own outputs, it learns, packs equal their members,
check-model passes, bad options are one-line errors, and it runs from the command line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from che_bench.checks import model_checks
from che_bench.commands.command_lines import run_command_line
from che_bench.config import make_config
from che_bench.encodings import build_encoding
from che_bench.encodings.rope import rotate
from che_bench.errors import CheBenchError
from che_bench.model.architectures import build_architecture, build_members
from che_bench.model.autoregressive import CrossAttention
from che_bench.run.suites import parse_suite
from che_bench.tasks import get_task
from che_bench.train.optimizer import PackOptimizer
from che_bench.train.step import training_step

NAME = "autoregressive_transformer"
TINY = {"layers": 2, "dim": 16, "heads": 2, "ffn": 32, "dropout": 0.0}
#: Every encoding the model takes (all but FIRE, CoPE and the randomized ones).
ENCODINGS = ["none", "sin_cos", "learned", "rope", "alibi", "relative", "t5", "kerple",
             "kerple_power"]


def tiny(task: str = "reverse_string", pe: str = "none", seed: int = 0, **options):
    torch.manual_seed(seed)
    return build_architecture(NAME, get_task(task), pe=pe, **{**TINY, **options}).eval()


def batch(task: str, n: int, size: int = 3, seed: int = 0):
    sampled = get_task(task).sample(n, size, np.random.default_rng(seed))
    return torch.from_numpy(sampled.inputs.copy()), torch.from_numpy(sampled.targets.copy())


@pytest.mark.parametrize("pe", ENCODINGS)
def test_teacher_forced_logits_at_t_do_not_read_targets_at_or_after_t(pe):
    """duplicate_string: 2n outputs, so the decoder is longer than the encoded input."""
    options = {"pe_options": {"sin_cos_backward": True}} if pe == "sin_cos" else {}
    model = tiny("duplicate_string", pe, **options)
    inputs, targets = batch("duplicate_string", 5)
    with torch.no_grad():
        logits = model(inputs, targets=targets)
        for t in (0, 3, 9):
            changed = targets.clone()
            changed[:, t:] = 1 - changed[:, t:]
            other = model(inputs, targets=changed)
            torch.testing.assert_close(other[:, :, : t + 1], logits[:, :, : t + 1])
            if t < 9:
                assert not torch.allclose(other[:, :, t + 1 :], logits[:, :, t + 1 :])


@pytest.mark.parametrize("pe", ENCODINGS)
@pytest.mark.parametrize("task", ["reverse_string", "duplicate_string", "parity_check"])
def test_greedy_decoding_is_teacher_forcing_on_its_own_outputs(pe, task):
    model = tiny(task, pe, seed=1)
    inputs, _ = batch(task, 7)
    with torch.no_grad():
        sampled = model(inputs)
        forced = model(inputs, targets=sampled.argmax(-1))
    assert sampled.shape == (1, 3, get_task(task).output_length(7), get_task(task).output_size)
    torch.testing.assert_close(sampled, forced, rtol=1e-5, atol=1e-5)


def test_with_dropout_at_evaluation_decoding_draws_teacher_forcing_s_masks():
    """Evaluation dropout (``--dropout-at-eval``): each decoding step drops its position as a
    teacher-forced pass with the same per-sequence seeds does."""
    model = tiny("duplicate_string", "rope", dropout=0.3).train()
    inputs, _ = batch("duplicate_string", 6)
    seeds = model.sample_dropout_seeds(inputs.shape[0])
    assert seeds is not None and model.eval().sample_dropout_seeds(3) is None
    model.train()
    with torch.no_grad():
        sampled = model(inputs, dropout_seeds=seeds)
        forced = model(inputs, dropout_seeds=seeds, targets=sampled.argmax(-1))
        undropped = model.eval()(inputs, targets=sampled.argmax(-1))
    torch.testing.assert_close(sampled, forced, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(forced, undropped)


def test_cross_attention_rotates_queries_at_output_and_keys_at_input_positions():
    """As CHE's cross-attention applies RoPE: q by positions 0..T_out-1, k by 0..T_in-1."""
    torch.manual_seed(0)
    hook = build_encoding("rope", dim=8, heads=2, layers=1, train_max_tokens=1).layer_hooks()[0]
    cross = CrossAttention(8, 2, hook, 1 << 30, members=1)
    x, memory = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 4, 8)
    got = cross(x, cross.keys(memory))
    q, (k, v) = cross._heads(cross.query(x)), cross.keys(memory)
    angles = torch.arange(6).float()[:, None] * hook.theta
    q, k = rotate(q, angles, "interleaved"), rotate(k, angles[:4], "interleaved")
    weights = torch.softmax(q @ k.transpose(-1, -2) / 2, dim=-1)
    expected = cross.output((weights @ v).transpose(2, 3).reshape(1, 2, 6, 8))
    torch.testing.assert_close(got, expected)
    # one decoding step at output position 5 is that row of the whole
    torch.testing.assert_close(cross(x[:, :, 5:], cross.keys(memory), first=5), got[:, :, 5:])


def test_training_steps_teacher_force_and_lower_the_loss():
    task = get_task("reverse_string")
    model = tiny().train()
    optimizer = PackOptimizer(model, [3e-3], (0.9, 0.999), 1e-8, 1.0)
    rng, losses = np.random.default_rng(0), []
    for step in range(40):
        sampled = task.sample(int(rng.integers(2, 8)), 32, rng)
        inputs = torch.from_numpy(sampled.inputs.copy())
        targets = torch.from_numpy(sampled.targets.copy())[None]
        if step == 0:
            with torch.no_grad():
                forced = model(inputs, targets=targets)
        step_losses, logits = training_step(model, optimizer, inputs, targets, [])
        if step == 0:  # the training step teacher-forces (BenchModel.uses_targets)
            torch.testing.assert_close(logits, forced)
        losses.append(float(step_losses[0]))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])


def test_a_pack_of_two_equals_its_members_alone():
    task = get_task("reverse_string")
    arguments = {"pe": "rope", **TINY}
    pack = build_members(NAME, task, [0, 1], **arguments).eval()
    inputs, targets = batch("reverse_string", 6)
    with torch.no_grad():
        packed, forced = pack(inputs), pack(inputs, targets=targets)
        for member, seed in enumerate((0, 1)):
            alone = tiny(pe="rope", seed=seed)
            torch.testing.assert_close(packed[member], alone(inputs)[0])
            torch.testing.assert_close(forced[member], alone(inputs, targets=targets)[0])


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_pack_s_teacher_forced_training_step_is_each_member_s_alone(micro_batches):
    task = get_task("reverse_string")
    inputs, targets = batch("reverse_string", 6, size=4)
    pack = build_members(NAME, task, [0, 1], pe="alibi", **TINY).train()
    optimizer = PackOptimizer(pack, [1e-2, 1e-2], (0.9, 0.999), 1e-8, 1.0)
    packed, _ = training_step(pack, optimizer, inputs.expand(2, -1, -1),  # [M, B, .] as a run's
                              targets.expand(2, -1, -1), [], micro_batches)
    for member, seed in enumerate((0, 1)):
        alone = tiny(pe="alibi", seed=seed).train()
        optimizer = PackOptimizer(alone, [1e-2], (0.9, 0.999), 1e-8, 1.0)
        losses, _ = training_step(alone, optimizer, inputs[None], targets[None], [])
        torch.testing.assert_close(packed[member], losses[0])
        torch.testing.assert_close(pack.head.weight[member], alone.head.weight[0])


@pytest.mark.parametrize("check", list(model_checks.MODEL_CHECKS))
def test_check_model_passes(check):
    assert model_checks.run_model_check(check, NAME) == []


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"pe": "fire"}, "cannot use --pe fire"),
        ({"pe": "cope"}, "cannot use --pe cope"),
        ({"pe": "random_rope"}, "randomized encoding"),
        ({"kernel": 1}, "--kernel"),
        ({"arch_options": {"dim": 15}}, "not divisible"),
        ({"arch_options": {"dropout": 1.5}}, "dropout"),
        ({"arch_options": {"size": 3}}, "takes no option size"),
        ({"pe": "rope", "pe_options": {"alibi_mode": "symmetric"}}, "does not take"),
    ],
)
def test_bad_options_are_one_line_errors(arguments, message):
    with pytest.raises(CheBenchError, match=message) as caught:
        make_config("reverse_string", preset="smoke", arch=NAME, **arguments)
    assert "\n" not in str(caught.value)


def test_the_encoding_is_an_option_named_once_in_the_run_id():
    def run_id(**arguments):
        return make_config("reverse_string", preset="smoke", arch=NAME, **arguments).run_id()

    assert run_id() == run_id(pe="none")
    assert run_id(pe="rotary") == run_id(pe="rope") != run_id()
    config = make_config("reverse_string", preset="smoke", arch=NAME, pe="rope",
                         pe_options={"rope_base": 100.0})
    assert config.arch_options == {"pe": "rope", "pe_options": {"rope_base": 100.0}}
    assert config.pe == "none" and config.pe_options == {}
    model = build_architecture(NAME, config.build_task(), **config.model_arguments())
    assert model.describe()["pe"] == "rope" and model.describe()["pe_options"]["rope_base"] == 100
    argv = run_command_line(config.to_dict(), config.run_id())  # the report's command line
    assert argv is not None and "pe=rope" in argv
    suite = parse_suite({"preset": "smoke", "tasks": ["reverse_string"], "architectures": [
        {"name": NAME, "options": {"pe": "rotary"}}]}, Path("suite.toml"))
    assert [c.run_id() for c in suite.configs()] == [run_id(pe="rope")]


def test_it_runs_from_the_command_line(tmp_path, capsys):
    from che_bench.cli import main

    tiny_options = [f"--arch-option={key}={value}" for key, value in TINY.items()]
    code = main(["run", "--task", "reverse_string", "--arch", NAME, "--pe", "rope",
                 "--preset", "smoke", "--steps", "3", "--test-lengths", "41,42",
                 "--eval-samples", "4", "--store", str(tmp_path / "store"), "--no-keep-model",
                 "--no-progress", *tiny_options])
    assert code == 0
    assert "AR Transformer" in capsys.readouterr().out
