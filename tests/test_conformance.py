"""The conformance checks over every built-in encoding and task (the copy `check-encoding` and
`check-task` run), and their verdicts on broken ones."""

from __future__ import annotations

import pytest
import torch

from che_bench.checks import conformance
from che_bench.cli import main
from che_bench.encodings import AttentionHook, PositionalEncoding, list_encodings, register
from che_bench.encodings.base import ENCODINGS
from che_bench.tasks import TASKS, Task, get_task, list_tasks, register_task
from che_bench.tasks.base import single_class

ENCODINGS_BUILT_IN = [cls.name for cls in list_encodings() if ENCODINGS.origin(cls.name) is None]
TASKS_BUILT_IN = [name for name in list_tasks() if TASKS.origin(name) is None]


@pytest.mark.parametrize("check", list(conformance.ENCODING_CHECKS))
@pytest.mark.parametrize("name", ENCODINGS_BUILT_IN)
def test_every_built_in_encoding_conforms(name, check):
    assert conformance.run_encoding_check(check, name) == []


@pytest.mark.parametrize("check", ["causal", "translation", "reference", "bias"])
@pytest.mark.parametrize("name", ENCODINGS_BUILT_IN)
def test_every_built_in_encoding_passes_the_hook_checks_in_a_causal_model(name, check):
    assert conformance.run_encoding_check(check, name, causal=True) == []


@pytest.mark.parametrize("check", list(conformance.TASK_CHECKS))
@pytest.mark.parametrize("name", TASKS_BUILT_IN)
def test_every_built_in_task_conforms(name, check):
    assert conformance.run_task_check(check, get_task(name)) == []


#: The state-tracking tasks' listed settings with code paths of their own beyond the default
#: one (A5, FFL(0.8)): a product group, DeltaProduct's variants, PaTH's final-only form.
STATE_TRACKING_SETTINGS = [
    ("word_problem", params)
    for params in TASKS.get("word_problem").listed_params
    if "variant" in params or params["group"] == "A4_x_Z5"
]


@pytest.mark.parametrize("name, params", STATE_TRACKING_SETTINGS, ids=str)
def test_the_state_tracking_tasks_conform_in_their_variants(name, params):
    task = get_task(name, **params)
    failures = [failure for check in conformance.TASK_CHECKS
                for failure in conformance.run_task_check(check, task)]
    assert failures == []


def test_check_task_takes_flip_flop_s_sparse_split(capsys):
    assert main(["check-task", "flip_flop", "--param", "p_ignore=0.98"]) == 0
    assert "task flip_flop: all 5 checks passed" in capsys.readouterr().out


class WholeMapHook(AttentionHook):
    """Broken on purpose: its bias covers every query row, whatever rows it is asked for."""

    carries_bias = True

    def bias(self, rows, length, ctx):
        offsets = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        return -offsets.abs().float()[None, None, None].expand(1, 1, 4, length, length)


def test_a_broken_encoding_fails_with_one_line_per_fault(scratch_registries, capsys):
    @register
    class Forgetful(PositionalEncoding):
        name = "test_forgetful"
        description = "ignores its rows and forgets its option"
        kind = "relative"
        carries_bias = True

        def __init__(self, *, dim, heads, layers, train_max_tokens, members=1, scale=1.0):
            super().__init__(dim=dim, heads=heads, layers=layers,
                             train_max_tokens=train_max_tokens, members=members)
            self.hooks = torch.nn.ModuleList(WholeMapHook() for _ in range(self.layers))

    assert main(["check-encoding", "test_forgetful"]) == 1
    out = capsys.readouterr().out
    assert "FAIL chunks" in out and "FAIL options" in out and "FAIL memory" in out
    assert "ok   draws" in out
    assert "options recorded: expected every option in options(), missing scale" in out


def test_a_correct_encoding_passes(capsys):
    assert main(["check-encoding", "alibi", "--pe-option", "alibi_mode=symmetric"]) == 0
    out = capsys.readouterr().out
    assert "encoding alibi: all 13 checks passed" in out
    assert "speed: " in out and " ms per training step (" in out


def test_a_task_whose_oracle_disagrees_is_named_with_its_length(scratch_registries, capsys):
    @register_task
    class OffByOne(Task):
        """Broken on purpose: the oracle counts ones, the sampler counts them from n = 30 on
        plus one."""

        name = "test_off_by_one"
        level = "regular"
        output_length_formula = "1"
        input_size, output_size = 2, 2

        def output_length(self, n):
            return 1

        def _sample(self, n, batch_size, rng):
            from che_bench.tasks import Batch

            inputs = rng.integers(0, 2, size=(batch_size, n))
            targets, mask = single_class((inputs.sum(1) + (n >= 30)) % 2)
            return Batch(inputs, targets, mask)

        def _solve(self, inputs):
            return single_class(inputs.sum(1) % 2)

    assert main(["check-task", "test_off_by_one"]) == 1
    out = capsys.readouterr().out
    assert "sampler and oracle agree (n=30): expected the sampled targets" in out
    assert "(n=29)" not in out and "ok   ids" in out


def test_ids_of_another_type_or_out_of_range_are_named():
    from che_bench.tasks import Batch

    task = get_task("parity_check")
    sample = task.sample
    task.sample = lambda n, batch_size, rng: Batch(  # broken on purpose
        (batch := sample(n, batch_size, rng)).inputs + 5, batch.targets.astype("int32"), batch.mask
    )
    assert conformance.run_task_check("ids", task)[:2] == [
        "ids, shapes and masks (n=1): input ids 5..6 (expected 0..1)",
        "ids, shapes and masks (n=1): targets int32 [16, 1] (expected int64 [16, 1])",
    ]


def test_unknown_names_are_usage_errors(capsys):
    assert main(["check-encoding", "alibo"]) == 2
    assert "did you mean 'alibi'" in capsys.readouterr().err
    assert main(["check-task", "parity_check", "--param", "modulus=3"]) == 2


def test_a_check_that_crashes_is_one_failure_line():
    task = get_task("parity_check")
    task.sample = lambda n, batch_size, rng: (_ for _ in ()).throw(RuntimeError("boom\nmore"))
    assert conformance.run_task_check("seed", task) == ["seed: expected to run, got RuntimeError: boom"]


class PositionSumHook(AttentionHook):
    """Broken on purpose: its bias depends on i + j, an absolute position, not on j - i."""

    def bias(self, rows, length, ctx):
        positions = torch.arange(length, dtype=torch.float32)
        total = positions[rows][:, None] + positions[None, :]
        return (-0.1 * total)[None, None, None].expand(1, 1, 4, -1, -1)


class HeadsRowsKeysHook(AttentionHook):
    """Broken on purpose: its bias ``[H, R, T]`` broadcasts in plain attention but lacks the
    member and batch axes that packs and DAPE need."""

    def bias(self, rows, length, ctx):
        offsets = torch.arange(length)[rows][:, None] - torch.arange(length)[None, :]
        return -offsets.abs().float().expand(4, -1, -1)


def bias_encoding(name, hook_class, carries_bias=True, kind="relative"):
    """Register a relative encoding whose every layer uses ``hook_class``."""

    class Encoding(PositionalEncoding):
        description = "broken on purpose"

        def __init__(self, *, dim, heads, layers, train_max_tokens, members=1):
            super().__init__(dim=dim, heads=heads, layers=layers,
                             train_max_tokens=train_max_tokens, members=members)
            self.hooks = torch.nn.ModuleList(hook_class() for _ in range(layers))

    Encoding.name, Encoding.kind, Encoding.carries_bias = name, kind, carries_bias
    register(Encoding)


def test_a_relative_bias_of_absolute_positions_fails_translation_invariance(scratch_registries):
    bias_encoding("test_position_sum", PositionSumHook)
    assert conformance.run_encoding_check("bias", "test_position_sum") == []
    [first, *_] = conformance.run_encoding_check("translation", "test_position_sum")
    assert first == ("translation invariance (layer 0): expected the logits of query i and key j "
                     "to depend on j - i only (kind 'relative'), got max |difference| 1.6 between "
                     "(i, j) and (i + 8, j + 8)")


def test_absolute_embeddings_in_a_relative_encoding_fail_translation_invariance(scratch_registries):
    from che_bench.encodings.sin_cos import SinCosEncoding

    class Mislabelled(SinCosEncoding):
        name, kind = "test_mislabelled", "relative"

    register(Mislabelled)
    [failure] = conformance.run_encoding_check("translation", "test_mislabelled")
    assert failure.startswith("translation invariance (embeddings): expected no position in the "
                              "embeddings of a relative encoding, got max |difference|")


def test_a_bias_of_the_wrong_shape_fails_with_the_expected_shape(scratch_registries, capsys):
    bias_encoding("test_heads_rows_keys", HeadsRowsKeysHook)
    assert conformance.run_encoding_check("shapes", "test_heads_rows_keys") == []  # it broadcasts
    failures = conformance.run_encoding_check("bias", "test_heads_rows_keys")
    assert failures[:2] == [
        ("bias shape (layer 0, rows 0:24 of 24 keys, 3 members): expected [3 or 1, 1, 4, 24, 24], "
         "got [4, 24, 24]"),
        ("bias shape (layer 0, rows 5:9 of 24 keys, 3 members): expected [3 or 1, 1, 4, 4, 24], "
         "got [4, 4, 24]"),
    ]


def test_a_bias_needs_carries_bias_on_the_encoding_class(scratch_registries):
    class FlaggedHook(HeadsRowsKeysHook):
        carries_bias = True  # on the hook only: che-bench reads the encoding class's

    bias_encoding("test_hook_flag_only", FlaggedHook, carries_bias=False)
    [first, *_] = conformance.run_encoding_check("bias", "test_hook_flag_only")
    assert first == ("bias shape (layer 0, rows 0:24 of 24 keys, 3 members): expected None (the "
                     "encoding class does not set carries_bias, so DAPE would not take the bias), "
                     "got a bias [4, 24, 24]")


def test_a_crash_keeps_the_line_that_says_what_went_wrong():
    task = get_task("parity_check")
    message = "Error(s) in loading state_dict for Encoder:\n\tsize mismatch for e.left: [1, 4]"
    task.sample = lambda n, batch_size, rng: (_ for _ in ()).throw(RuntimeError(message))
    assert conformance.run_task_check("seed", task) == [
        ("seed: expected to run, got RuntimeError: Error(s) in loading state_dict for Encoder: "
         "size mismatch for e.left: [1, 4]")]


class OffsetSlopeHook(AttentionHook):
    """bias[i, j] = -0.1 * (j - i) for keys on the right and -0.3 * (i - j) on the left, from
    ``scale``; ``transposed`` plants the bug of a map with i and j swapped (same shape)."""

    def __init__(self, scale=1.0, transposed=False, dtype=torch.float32):
        super().__init__()
        self.scale, self.transposed, self.dtype = scale, transposed, dtype

    def _value(self, offset):
        return torch.where(offset > 0, -0.1 * offset, 0.3 * offset) * self.scale

    def bias(self, rows, length, ctx):
        positions = torch.arange(length, dtype=self.dtype)
        offset = positions[None, :] - positions[rows, None]  # j - i
        if self.transposed:  # i - j: the map of j - i transposed
            offset = positions[rows, None] - positions[None, :]
        return self._value(offset)[None, None, None].expand(1, 1, 4, -1, -1)

    def reference_bias(self, query, key, ctx):
        return self._value(torch.tensor(float(key - query))).expand(1, 1, 4)


def slope_encoding(name, *, uses_scale=True, transposed=False, dtype=torch.float32):
    """Register a relative encoding of ``OffsetSlopeHook``s with an option ``scale``."""

    class Encoding(PositionalEncoding):
        description, kind, carries_bias = "an asymmetric slope", "relative", True

        def __init__(self, *, dim, heads, layers, train_max_tokens, members=1, scale=1.0):
            super().__init__(dim=dim, heads=heads, layers=layers,
                             train_max_tokens=train_max_tokens, members=members)
            used = scale if uses_scale else 1.0
            self.hooks = torch.nn.ModuleList(
                OffsetSlopeHook(used, transposed, dtype) for _ in range(layers))
            self.resolved_options = {"scale": scale}

    Encoding.name = name
    register(Encoding)


def test_a_clean_bias_encoding_passes_every_check(scratch_registries):
    slope_encoding("test_slope")
    for check in conformance.ENCODING_CHECKS:
        assert conformance.run_encoding_check(check, "test_slope") == [], check


def test_an_encoding_option_that_changes_nothing_fails(scratch_registries):
    slope_encoding("test_ignored_scale", uses_scale=False)
    assert conformance.run_encoding_check("option_effects", "test_ignored_scale") == [
        "options take effect: expected scale=2.0 (instead of 1.0) to change the parameters or "
        "the logits, got the same ones (an option that changes neither, such as a memory "
        "budget, belongs in the encoding class's inert_options)"]


def test_a_transposed_bias_of_the_right_shape_fails_its_reference(scratch_registries):
    slope_encoding("test_transposed", transposed=True)
    assert conformance.run_encoding_check("bias", "test_transposed") == []  # the right shape
    failures = conformance.run_encoding_check("reference", "test_transposed")
    assert failures[0] == (
        "reference bias (layer 0, rows 0:24 of 24 keys): expected bias() to equal "
        "reference_bias(i, j) at every query i and key j, got max |difference| 4.6 "
        "(first at i=0, j=1)")
    assert failures[1].startswith("reference bias (layer 0, rows 5:9 of 24 keys)")


def test_a_float64_bias_is_named_by_every_check_it_breaks(scratch_registries):
    slope_encoding("test_float64", dtype=torch.float64)
    cause = "layer 0's OffsetSlopeHook.bias returns torch.float64"
    assert conformance.run_encoding_check("dtypes", "test_float64") == [
        f"dtypes: expected torch.float32 (the inputs' dtype) from every hook, got {cause}"]
    [crash] = conformance.run_encoding_check("shapes", "test_float64")
    assert crash.startswith("shapes: expected to run, got RuntimeError: ")
    assert crash.endswith(f"({cause})") and "\n" not in crash


class LengthScaledEmbedding(PositionalEncoding):
    """An absolute encoding of position / T: in a causal model the output at t depends on
    how long the sequence is (``per_length`` False: position / T_train_max, causal)."""

    name, description, kind, adds_to_embedding = "test_length_scaled", "i / T", "absolute", True
    per_length = True

    def embed(self, x, draws=None):
        positions = torch.arange(x.shape[-2], dtype=x.dtype)
        scale = x.shape[-2] if self.per_length else self.train_max_tokens
        return x + (positions / scale)[:, None]


def test_an_encoding_that_reads_the_sequence_s_length_fails_the_causal_mode(scratch_registries):
    register(LengthScaledEmbedding)
    [failure] = conformance.run_encoding_check("causal", "test_length_scaled", causal=True)
    assert failure.startswith(
        "causal outputs (test_length_scaled, mqar n=24): expected the logits up to position 9 "
        "unchanged with the input cut after it, got others from position 1")  # 0 / T is 0

    class PerTrainingLength(LengthScaledEmbedding):
        name, per_length = "test_train_length_scaled", False

    register(PerTrainingLength)
    assert conformance.run_encoding_check("causal", "test_train_length_scaled", causal=True) == []
    assert "causal" not in conformance.encoding_checks(False)


def test_check_encoding_causal_and_its_speed_line_at_the_run_s_threads(monkeypatch, capsys):
    from che_bench.checks import speed

    measured = []
    monkeypatch.setattr(speed, "step_seconds", lambda configs, device, repeats, warm_up=1: (
        measured.append((configs[0].causal, torch.get_num_threads())) or 0.05))
    assert main(["check-encoding", "alibi", "--causal", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "ok   causal" in out and "encoding alibi (causal): all 14 checks passed" in out
    assert measured == [(True, 2)]
    assert "speed: 50.0 ms per training step (reverse_string, batch 32, n = 40, cpu, 2 threads)" in out


def test_logits_of_another_shape_or_not_finite_are_one_failure_line():
    """check-encoding's and check-model's shape check (``output_problem``)."""
    from che_bench.checks.conformance_hooks import output_problem

    task = get_task("reverse_string")
    logits = torch.zeros(1, 2, task.output_length(3), task.output_size)
    assert output_problem(logits, task, 3, 2, "here") is None
    classes = task.output_size
    assert output_problem(logits[:, :1], task, 3, 2, "here") == (
        f"output shape (here): expected [1, 2, 3, {classes}], got [1, 1, 3, {classes}]")
    logits[0, 1, 0, 0] = float("nan")
    assert output_problem(logits, task, 3, 2, "here") == (
        "finite outputs (here): expected finite logits, got 1 non-finite values")
