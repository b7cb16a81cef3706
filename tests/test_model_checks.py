"""The model conformance checks (`che-bench check-model NAME`) over every built-in recurrent
baseline at tiny sizes, and their verdicts on a broken plugin model."""

from __future__ import annotations

import pytest

from che_bench.checks import model_checks
from che_bench.cli import main
from che_bench.errors import CheBenchError
from che_bench.members import MemberEmbedding, MemberLinear
from che_bench.model import BenchModel, register_model
from che_bench.model.recurrent import ARCHITECTURES as RECURRENT


@pytest.mark.parametrize("check", list(model_checks.MODEL_CHECKS))
@pytest.mark.parametrize("name", list(RECURRENT))
def test_every_built_in_recurrent_baseline_conforms(name, check):
    assert model_checks.run_model_check(check, name) == []


def test_built_ins_are_checked_at_tiny_sizes_plugins_with_their_defaults():
    assert model_checks.check_options("tape_rnn") == {
        "hidden_size": 16, "memory_cell_size": 4, "memory_size": 8, "mlp_layers_size": (16,)}
    assert model_checks.check_options("lstm", {"fused": False}) == {
        "hidden_size": 16, "fused": False}
    with pytest.raises(CheBenchError, match="check-encoding"):
        model_checks.check_options("transformer")


def _register_broken():
    @register_model
    class BatchMixer(BenchModel):
        """Broken on purpose: it centres its features over the batch, so a sequence's logits
        depend on the sequences beside it."""

        name = "test_batch_mixer"
        defaults = {"width": 8}

        def __init__(self, task, members=1, width=8):
            super().__init__()
            self.task, self.members, self.build_options = task, members, {"width": width}
            self.table = MemberEmbedding(members, task.input_size, width, 1.0)
            self.head = MemberLinear(members, width, task.output_size)

        def forward(self, inputs, draws=None, *, evaluating=None, dropout_seeds=None):
            if inputs.dim() == 2:
                inputs = inputs.expand(self.members, -1, -1)
            features = self.table(inputs).mean(2, keepdim=True)  # [M, B, 1, W]
            features = features - features.mean(1, keepdim=True)
            outputs = self.task.output_length(inputs.shape[-1])
            return self.head(features).expand(-1, -1, outputs, -1)

    return BatchMixer


def test_a_model_whose_logits_depend_on_the_batch_fails_the_batch_check(scratch_registries):
    _register_broken()
    failures = model_checks.run_model_check("batch", "test_batch_mixer")
    assert failures and all(
        line.startswith("logits independent of the batch (row ") for line in failures
    )
    assert "expected the sequence's logits alone, got max |difference|" in failures[0]
    assert model_checks.run_model_check("pack", "test_batch_mixer") == []


def test_a_model_that_forgets_its_options_fails_the_options_check(scratch_registries):
    broken = _register_broken()

    @register_model
    class Forgetful(broken):
        name = "test_forgetful_model"

        def __init__(self, task, members=1, width=8):
            super().__init__(task, members, width)
            self.build_options = {}

    failures = model_checks.run_model_check("options", "test_forgetful_model")
    assert "options recorded: expected build_options == {'width': 8}, got {}" in failures
    assert any("expected another build_key() when built with width=16" in f for f in failures)


def test_an_option_that_changes_nothing_fails_unless_declared_inert(scratch_registries):
    broken = _register_broken()

    @register_model
    class Switched(broken):
        name = "test_switched"
        defaults = {"width": 8, "switch": False, "memory_budget_bytes": 1 << 30}

        def __init__(self, task, members=1, width=8, switch=False, memory_budget_bytes=1 << 30):
            super().__init__(task, members, width)
            self.switch = switch
            # Recorded, so runs with either value are told apart, yet never read below.
            self.build_options = {"width": width, "switch": switch,
                                  "memory_budget_bytes": memory_budget_bytes}

    assert model_checks.run_model_check("option_effects", "test_switched") == [
        "options take effect: expected switch=True (instead of False) to change the parameters "
        "or the logits, got the same ones (an option that changes neither, such as a memory "
        "budget, belongs in the model class's inert_options)"]
    Switched.inert_options = frozenset({"switch", "memory_budget_bytes"})
    assert model_checks.run_model_check("option_effects", "test_switched") == []

    @register_model
    class Signed(Switched):
        """The switch negates the logits: the parameters are the same, the outputs are not."""

        name = "test_signed"
        inert_options = BenchModel.inert_options

        def forward(self, inputs, draws=None, *, evaluating=None, dropout_seeds=None):
            logits = super().forward(inputs)
            return -logits if self.switch else logits

    assert model_checks.run_model_check("option_effects", "test_signed") == []


def test_options_are_changed_to_values_a_model_likely_takes():
    from che_bench.checks.option_effects import other_values

    assert other_values(True) == [False]
    assert other_values(4) == [8, 5, 2, 3] and other_values(0) == [1, 2]
    assert other_values(1) == [2, 0]
    assert other_values(0.1) == [0.2, 0.05] and other_values(0.0) == [0.5, 0.1]
    assert other_values((64, 64)) == [(128, 64), (65, 64), (32, 64), (63, 64)]
    assert other_values(["a", 3]) == [["a", 6], ["a", 4], ["a", 1], ["a", 2]]
    assert other_values("haiku") == other_values(None) == other_values(()) == []


def test_the_cli_fails_a_broken_model_and_refuses_unknown_names(scratch_registries, capsys):
    _register_broken()
    assert main(["check-model", "test_batch_mixer"]) == 1
    out, err = capsys.readouterr()
    assert "FAIL batch" in out and "ok   pack" in out and "ok   shapes" in out
    assert "logits independent of the batch (row 0 of 4" in out
    assert "architecture test_batch_mixer:" in err and "checks failed" in err
    assert main(["check-model", "no_such_model"]) == 2
    assert "unknown architecture 'no_such_model'" in capsys.readouterr().err
    assert main(["check-model", "transformer"]) == 2
    assert "check-encoding" in capsys.readouterr().err
    assert main(["check-model", "rnn", "--arch-option", "stack_size=3"]) == 2


def test_the_cli_passes_a_built_in(capsys):
    assert main(["check-model", "lstm", "--arch-option", "fused=false"]) == 0
    assert "architecture lstm: all 8 checks passed" in capsys.readouterr().out


def test_a_check_that_raises_is_one_failure_line(scratch_registries, monkeypatch):
    _register_broken()

    def boom(*args, **kwargs):
        raise RuntimeError("no luck")

    monkeypatch.setitem(model_checks.MODEL_CHECKS, "seed", boom)
    assert model_checks.run_model_check("seed", "test_batch_mixer") == [
        "seed: expected to run, got RuntimeError: no luck"
    ]


def test_the_training_check_reads_a_fall_of_the_loss_and_a_learnt_run_s_late_spike():
    """The loss fell when the last 10 steps' mean is below the first 10's, or when some 10
    steps' mean is under half of it (a model that learnt, then met an Adam spike); flat noise
    or a rise is no fall."""
    chance = [0.69, 0.70, 0.68, 0.71] * 5
    learnt_then_spiked = chance[:10] + [0.3] * 10 + [0.02] * 30 + [0.9] * 50
    assert model_checks.loss_fell(chance[:10] + [0.6] * 90)
    assert model_checks.loss_fell(learnt_then_spiked)
    assert not model_checks.loss_fell(chance * 5)
    assert not model_checks.loss_fell(chance[:10] + [0.4] * 80 + [0.8] * 10)
