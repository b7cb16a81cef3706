"""The optimizer and its schedule as run settings (issue 27, item 5): Adam or AdamW, weight
decay on the parameters a model decays, clipping or none, a constant or warm-up + cosine
learning rate; out of the run id at CHE's defaults; exact resume under a schedule."""

from __future__ import annotations

import math

import pytest
import torch
from test_settings import help_of

from che_bench.cli import build_parser, main
from che_bench.commands.run import cell_configs
from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.model.architectures import build_architecture
from che_bench.model.base import default_no_weight_decay
from che_bench.run.runner import execute_runs
from che_bench.train.optimizer import LrSchedule, PackOptimizer, pack_optimizer
from tests.run_helpers import run_interrupted_at

STATE_TRACKING = {"optimizer": "adamw", "weight_decay": 0.1, "grad_clip_norm": 0.0,
                  "lr_schedule": "warmup_cosine", "warmup_steps": 2000, "min_lr_ratio": 1e-3}


def test_the_warmup_cosine_schedule_is_the_harness_s():
    """Linear from 0 over the warm-up, 1 at its end, cosine to the floor at the last step."""
    schedule = LrSchedule("warmup_cosine", warmup_steps=4, steps=12, min_lr_ratio=0.01)
    assert [schedule.factor(k) for k in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert schedule.factor(8) == pytest.approx((1 + 0.01) / 2)  # half way down the cosine
    assert schedule.factor(12) == pytest.approx(0.01) and schedule.factor(13) == 0.01
    assert all(schedule.factor(k) > schedule.factor(k + 1) for k in range(4, 12))
    assert [LrSchedule().factor(k) for k in (0, 5, 10**6)] == [1.0, 1.0, 1.0]
    warm_constant = LrSchedule("constant", warmup_steps=2, steps=10)
    assert [warm_constant.factor(k) for k in range(4)] == [0.0, 0.5, 1.0, 1.0]


def test_the_settings_stay_out_of_the_run_id_at_che_s_defaults():
    plain = make_config("parity_check", "rope", None, "smoke")
    explicit = make_config("parity_check", "rope", None, "smoke", optimizer="adam",
                           weight_decay=0.0, lr_schedule="constant", warmup_steps=0,
                           min_lr_ratio=1e-3, grad_clip_norm=1.0)
    assert explicit.run_id() == plain.run_id()
    assert not {"optimizer", "weight_decay", "lr_schedule"} & set(plain.to_dict())
    adamw = make_config("parity_check", "rope", None, "smoke", optimizer="adamw")
    assert adamw.to_dict()["optimizer"] == "adamw" and adamw.run_id() != plain.run_id()
    assert make_config("parity_check", "rope", None, "smoke", grad_clip_norm=0).grad_clip_norm == 0


@pytest.mark.parametrize("overrides, message", [
    ({"optimizer": "sgd"}, "optimizer must be one of adam, adamw"),
    ({"lr_schedule": "cosine"}, "lr_schedule must be one of constant, warmup_cosine"),
    ({"weight_decay": -0.1}, "weight_decay must be a number >= 0"),
    ({"grad_clip_norm": -1.0}, "grad_clip_norm must be a number >= 0"),
    ({"min_lr_ratio": 2.0, "lr_schedule": "warmup_cosine"}, "min_lr_ratio must be a number in"),
    ({"min_lr_ratio": 0.1}, "min_lr_ratio applies to lr_schedule warmup_cosine only"),
    ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
])
def test_bad_values_are_one_line_errors(overrides, message):
    with pytest.raises(CheBenchError, match=message):
        make_config("parity_check", "rope", None, "smoke", **overrides)


def test_the_flags_set_them_and_a_bad_one_exits_2(capsys, tmp_path):
    run_help = help_of("run", capsys)
    for flag in ("--optimizer", "--weight-decay", "--grad-clip-norm", "--lr-schedule",
                 "--warmup-steps", "--min-lr-ratio"):
        assert flag in run_help
    args = build_parser().parse_args(
        ["run", "--task", "parity_check", "--preset", "smoke", "--optimizer", "adamw",
         "--weight-decay", "0.1", "--grad-clip-norm", "0", "--lr-schedule", "warmup_cosine",
         "--warmup-steps", "2000", "--min-lr-ratio", "0.001"])
    config = cell_configs(args)[0]
    assert {name: getattr(config, name) for name in STATE_TRACKING} == STATE_TRACKING
    assert main(["run", "--task", "parity_check", "--preset", "smoke", "--optimizer", "sgd",
                 "--store", str(tmp_path / "s.sqlite")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def tiny_lstm(members=1, seed=0):
    torch.manual_seed(seed)
    config = make_config("parity_check", preset="smoke", arch="lstm",
                         arch_options={"hidden_size": 8})
    return build_architecture("lstm", config.build_task(), members=members, hidden_size=8)


def loss_of(model, scale):
    inputs = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]])
    logits = model(inputs)
    return scale * logits.square().mean()


@pytest.mark.parametrize("decoupled, clip", [(True, 0.0), (False, 1.0)])
def test_the_pack_optimizer_is_torch_s_adamw_or_adam_with_the_harness_s_groups(decoupled, clip):
    """Against torch.optim.AdamW (or Adam with its L2 term after clipping) with the decayed and
    the exempt parameters in two groups, a LambdaLR of the same schedule, big gradients (so
    that clipping, where on, acts)."""
    ours, theirs = tiny_lstm(), tiny_lstm()
    schedule = LrSchedule("warmup_cosine", warmup_steps=2, steps=6, min_lr_ratio=0.1)
    optimizer = PackOptimizer(ours, [0.01], (0.9, 0.999), 1e-8, clip, weight_decay=0.1,
                              decoupled=decoupled, schedule=schedule)
    exempt = theirs.no_weight_decay()
    assert exempt == {"cell.gates.bias", "head.bias"}
    groups = [
        {"params": [p for n, p in theirs.named_parameters() if n not in exempt],
         "weight_decay": 0.1},
        {"params": [p for n, p in theirs.named_parameters() if n in exempt], "weight_decay": 0.0},
    ]
    kind = torch.optim.AdamW if decoupled else torch.optim.Adam
    reference = kind(groups, lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(reference, schedule.factor)
    for _ in range(6):
        optimizer.zero_grad()
        loss_of(ours, 1000.0).backward()
        optimizer.step()
        reference.zero_grad()
        loss_of(theirs, 1000.0).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(theirs.parameters(), clip)
        reference.step()
        scheduler.step()
    for (name, mine), other in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(mine, other, rtol=1e-5, atol=1e-6, msg=name)


def test_without_decay_the_weights_are_exactly_today_s_adam():
    """weight_decay 0 and a constant schedule keep the update that stored runs were trained
    with, to the bit."""
    ours, theirs = tiny_lstm(), tiny_lstm()
    config = make_config("parity_check", preset="smoke", arch="lstm",
                         arch_options={"hidden_size": 8})
    new = pack_optimizer(ours, [config])
    old = PackOptimizer(theirs, [config.lr], config.adam_betas, config.adam_eps,
                        config.grad_clip_norm)
    assert new.decay_mask is None
    for model, optimizer in ((ours, new), (theirs, old)):
        for _ in range(3):
            optimizer.zero_grad()
            loss_of(model, 1000.0).backward()
            optimizer.step()
    for mine, other in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(mine, other)


def test_the_default_exemptions_and_a_model_s_own():
    transformer = make_config("parity_check", "kerple", 3, "smoke")
    model = build_architecture("transformer", transformer.build_task(), members=1,
                               **transformer.model_arguments())
    decayed = {name for name, _ in model.named_parameters()} - model.no_weight_decay()
    assert "embedding.weight" not in decayed and "head.weight" in decayed
    assert not any("norm" in name or name.endswith("bias") for name in decayed)
    assert not any(name.startswith("encoding") for name in decayed)  # Kerple's r1, r2
    assert all(name.split(".")[-1].startswith("weight") for name in decayed)

    own = tiny_lstm()  # a model's own rule (here: its head left alone too)
    own.no_weight_decay = lambda: default_no_weight_decay(own) | {"head.weight"}
    optimizer = PackOptimizer(own, [0.01], (0.9, 0.999), 1e-8, 0.0, weight_decay=0.5,
                              decoupled=True)
    gates = own.cell.gates.weight[0].numel() + own.cell.gates.bias[0].numel()
    assert optimizer.decay_mask.sum() == own.cell.gates.weight[0].numel()
    assert optimizer.decay_mask[0, gates:].sum() == 0  # the head is left alone


def rows(results):
    return [[{k: v for k, v in row.items() if k != "elapsed_s"} for row in result.history]
            for result in results]


def test_a_run_under_a_schedule_resumes_exactly_and_logs_the_scheduled_rate(tmp_path):
    configs = [make_config("parity_check", preset="smoke", arch="lstm", seed=seed,
                           arch_options={"hidden_size": 8}, steps=8, test_lengths="41",
                           eval_samples=4, eval_batch_size=4, length_seed=0,
                           **{**STATE_TRACKING, "warmup_steps": 3})
               for seed in range(2)]
    reference = execute_runs(configs, device="cpu", progress=False, log_every=1)
    schedule = LrSchedule.of(configs[0])
    assert [row["lr"] for row in reference[0].history] == pytest.approx(
        [configs[0].lr * schedule.factor(step) for step in range(8)])
    assert reference[0].history[0]["lr"] == 0.0 and not math.isnan(reference[0].history[-1]["loss"])

    run_interrupted_at(5, configs, tmp_path, log_every=1)
    resumed = execute_runs(configs, device="cpu", progress=False, log_every=1,
                           checkpoint_dir=tmp_path)
    assert resumed[0].timings["resumed_from_step"] == 5
    assert rows(resumed) == rows(reference)  # bit for bit
    assert [r.per_length for r in resumed] == [r.per_length for r in reference]


def test_a_report_s_command_line_reproduces_the_settings():
    from che_bench.commands.command_lines import run_command_line

    for config in (
        make_config("parity_check", "rope", None, "quick", optimizer="adamw", weight_decay=0.1,
                    lr_schedule="warmup_cosine", warmup_steps=5, min_lr_ratio=0.1),
        make_config("parity_check", preset="state_tracking", arch="lstm", optimizer="adam",
                    grad_clip_norm=1.0),
    ):
        line = run_command_line(config.to_dict(), config.run_id())
        assert line[0] == "run"  # (the words after che-bench)
        assert cell_configs(build_parser().parse_args(line))[0].run_id() == config.run_id()
