"""The model conformance checks (`che-bench check-model NAME`) over every built-in recurrent
baseline at tiny sizes, and their verdicts on a broken plugin model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
    assert "architecture lstm: all 11 checks passed" in capsys.readouterr().out


def test_the_speed_line_is_measured_at_the_run_s_thread_count(monkeypatch, capsys):
    """Runs use one torch thread unless given --threads: the step is timed so, whatever this
    process had set, and the thread count is set back after."""
    from che_bench.checks import speed

    measured_at = []

    def step_seconds(configs, device, repeats, warm_up=1):
        measured_at.append(torch.get_num_threads())
        return 0.05

    monkeypatch.setattr(speed, "step_seconds", step_seconds)
    for check in [name for name in model_checks.MODEL_CHECKS if name != "shapes"]:
        monkeypatch.setitem(model_checks.MODEL_CHECKS, check, lambda arch, options: [])
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["check-model", "rnn"]) == 0
        assert main(["check-model", "rnn", "--threads", "2"]) == 0
        assert measured_at == [1, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
    out = " ".join(capsys.readouterr().out.split())  # the speed line wraps to the terminal
    assert "speed: 50.0 ms per training step (reverse_string, batch 32, n = 40, cpu, 1 thread); " in out
    assert "cpu, 2 threads); the quick preset's" in out
    assert main(["check-model", "rnn", "--threads", "0"]) == 2


@pytest.mark.parametrize("columns", [100, 160])
def test_the_speed_line_fits_the_terminal(columns, monkeypatch, capsys):
    """It was one line of about 190 characters, wider than a terminal of 100 or 160 columns."""
    from che_bench.checks import speed

    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setattr(speed, "step_seconds", lambda configs, device, repeats, warm_up=1: 0.05)
    for check in [name for name in model_checks.MODEL_CHECKS if name != "shapes"]:
        monkeypatch.setitem(model_checks.MODEL_CHECKS, check, lambda arch, options: [])
    assert main(["check-model", "rnn"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= columns
    speed_text = " ".join(out[out.index("speed: "):].split())
    assert speed_text.startswith("speed: 50.0 ms per training step (reverse_string, batch 32, ")
    assert speed_text.endswith("(at most: shorter lengths are faster; evaluation not included)")


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


def _register_decay(name, *, ignores_activation=False, peeks_ahead=False, state_on_cpu=False,
                    drops_carry=False, choices=True):
    """A tiny linear recurrence, h_t = a * h_{t-1} + x_t per channel (a learned in (0, 1)),
    run as a chunked scan of 64 tokens with its plain loop as ``reference_forward``; each
    flag plants one bug a check must catch."""

    class Decay(BenchModel):
        defaults = {"width": 4, "activation": "tanh"}
        option_choices = {"activation": ("tanh", "relu")} if choices else {}
        causal_outputs = True

        def __init__(self, task, members=1, width=4, activation="tanh"):
            super().__init__()
            if activation not in ("tanh", "relu"):
                raise CheBenchError(f"activation must be tanh or relu, got {activation!r}")
            self.task, self.members, self.activation = task, members, activation
            self.build_options = {"width": width, "activation": activation}
            self.table = MemberEmbedding(members, task.input_size + 1, width, 1.0)
            self.decay_logit = torch.nn.Parameter(torch.randn(members, width))
            self.head = MemberLinear(members, width, task.output_size)

        def _features(self, inputs):
            tokens, read = self.with_output_tokens(self.member_inputs(inputs))
            x = self.table(tokens)  # [M, B, T, W]
            if peeks_ahead:  # position t also reads token t + 1
                x = x + torch.cat([x[:, :, 1:], torch.zeros_like(x[:, :, :1])], dim=2)
            return x, read, F.logsigmoid(self.decay_logit)  # log a [M, W]

        def _read_out(self, h, read):
            h = h[:, :, h.shape[2] - read:]
            use_relu = self.activation == "relu" and not ignores_activation
            return self.head(torch.relu(h) if use_relu else torch.tanh(h))

        def forward(self, inputs, draws=None, *, evaluating=None, dropout_seeds=None):
            x, read, log_a = self._features(inputs)
            members, batch, _, width = x.shape
            if state_on_cpu:
                carry = torch.zeros(members, batch, width)
            else:
                carry = x.new_zeros(members, batch, width)
            outputs = []
            for chunk in x.split(64, dim=2):
                t = torch.arange(chunk.shape[2], device=x.device)
                lags = (t[:, None] - t[None, :])[None, :, :, None]  # [1, L, L, 1]
                weights = torch.exp(lags.clamp(min=0) * log_a[:, None, None]) * (lags >= 0)
                h = torch.einsum("mtsw,mbsw->mbtw", weights, chunk)
                if not drops_carry:
                    h = h + torch.exp((t[:, None] + 1) * log_a[:, None])[:, None] * carry[:, :, None]
                carry = h[:, :, -1]
                outputs.append(h)
            return self._read_out(torch.cat(outputs, dim=2), read)

        def reference_forward(self, inputs):
            x, read, log_a = self._features(inputs)
            h = x.new_zeros(x.shape[0], x.shape[1], x.shape[3])
            outputs = []
            for step in range(x.shape[2]):
                h = torch.exp(log_a)[:, None] * h + x[:, :, step]
                outputs.append(h)
            return self._read_out(torch.stack(outputs, dim=2), read)

    Decay.name = name
    return register_model(Decay)


DECLARED_CHECKS = ("option_effects", "causal", "device", "reference")


def test_a_clean_model_passes_the_checks_of_what_it_declares(scratch_registries):
    _register_decay("test_decay")
    for check in DECLARED_CHECKS:
        assert model_checks.run_model_check(check, "test_decay") == [], check


def test_a_string_option_accepted_but_ignored_fails_its_declared_choices(scratch_registries):
    _register_decay("test_ignores_activation", ignores_activation=True)
    assert model_checks.run_model_check("option_effects", "test_ignores_activation") == [
        "options take effect: expected activation='relu' (instead of 'tanh') to change the "
        "parameters or the logits, got the same ones (an option that changes neither, such as "
        "a memory budget, belongs in the model class's inert_options)"]


def test_a_string_option_without_declared_choices_fails(scratch_registries):
    _register_decay("test_undeclared_choices", choices=False)
    assert model_checks.run_model_check("option_effects", "test_undeclared_choices") == [
        "options take effect: expected activation='tanh' to be checked, got no value to try: "
        "list the values it takes in the model class's option_choices (or name it in "
        "inert_options if it changes nothing)"]


def test_a_declared_choice_the_model_refuses_fails(scratch_registries):
    model = _register_decay("test_refused_choice")
    model.option_choices = {"activation": ("tanh", "gelu")}
    assert model_checks.run_model_check("option_effects", "test_refused_choice") == [
        "options take effect: expected activation='gelu', one of its option_choices, to build, "
        "got activation must be tanh or relu, got 'gelu'"]


def test_options_needing_declared_choices_are_strings_and_sequences_without_a_number():
    from che_bench.checks.option_effects import needs_choices

    assert all(needs_choices(value) for value in ("tanh", ["input", "forget"], (), []))
    assert not any(needs_choices(value) for value in (1, 0.5, True, None, ("a", 1), (64,), {}))


def test_an_output_that_reads_the_next_input_fails_the_causal_check(scratch_registries):
    _register_decay("test_peeks_ahead", peeks_ahead=True)
    failures = model_checks.run_model_check("causal", "test_peeks_ahead")
    assert failures[0].startswith(
        "causal outputs (the model declares causal_outputs, mqar n=24): expected the logits up "
        "to position 9 unchanged with tokens after it changed, got others from position 9 "
        "(max |difference|")


def test_a_tensor_made_on_the_cpu_fails_the_meta_device_check(scratch_registries):
    _register_decay("test_state_on_cpu", state_on_cpu=True)
    [failure] = model_checks.run_model_check("device", "test_state_on_cpu")
    assert failure.startswith(
        "meta device (training forward): expected a pack of 2 to run with every tensor on the "
        "inputs' device and no value read back, got RuntimeError:")
    assert "device cpu" in failure


def test_a_chunked_scan_that_drops_its_carry_fails_the_reference_check(scratch_registries):
    _register_decay("test_drops_carry", drops_carry=True)
    failures = model_checks.run_model_check("reference", "test_drops_carry")
    # n = 1 and 40 (2 and 80 tokens: 80 > 64) ... the first length past one chunk fails.
    assert [line.split(":")[0] for line in failures] == [
        "reference forward (reverse_string n=40, 80 tokens)",
        "reference forward (reverse_string n=200, 400 tokens)",
        "reference forward (reverse_string n=500, 1000 tokens)"]
    assert "expected the fast forward's logits without gradients to equal reference_forward's, " \
           "got max |difference|" in failures[0]


def test_the_recurrent_baselines_are_checked_causal_but_the_tape_rnn(monkeypatch):
    """The Tape-RNN's jumps move by the input's length, so its outputs depend on how long the
    input is: it does not declare causal outputs, and would fail the check if it did."""
    from che_bench.model.architectures import build_architecture
    from che_bench.model.recurrent.tape_rnn import TapeMemory
    from che_bench.tasks import get_task

    def declared(name):
        options = model_checks.check_options(name)
        return build_architecture(name, get_task("mqar"), **options).causal_outputs

    assert [name for name in RECURRENT if not declared(name)] == ["tape_rnn"]
    monkeypatch.setattr(TapeMemory, "causal", True)
    [failure] = model_checks.run_model_check("causal", "tape_rnn")
    assert "unchanged with the input cut after it, got others from position 1" in failure


@pytest.mark.parametrize("name", ["mamba", "deltanet", "gated_deltanet", "deltaproduct", "mlstm"])
def test_state_tracking_models_declare_their_plain_recurrence_as_reference(name):
    """So check-model's reference check compares their chunked (and native) kernels with it
    (test_mamba, test_deltanet and test_xlstm run the check)."""
    from che_bench.model.architectures import build_architecture
    from che_bench.tasks import get_task

    model = build_architecture(name, get_task("reverse_string"), width=8, **(
        {"d_state": 2} if name == "mamba" else {"heads": 2})).eval()
    inputs = torch.randint(0, 2, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(model.reference_forward(inputs), model(inputs))
