"""CHE's four training-length curricula (issue 29, item 3): each draws the lengths CHE's
``experiments/curriculum.py`` defines, on worked examples derived by hand here (CHE's numpy
draws replayed on Python's own Mersenne Twister, no JAX); a run's schedule repeats under its
seeds, resumes exactly, is shared by a pack; the uniform default keeps every run id; bad
options are one-line errors."""

from __future__ import annotations

import json
import random
from fractions import Fraction

import numpy as np
import pytest

from che_bench import curricula
from che_bench.cli import main
from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.reports.paper import paper_protocol_differences
from che_bench.run.runner import execute_runs
from che_bench.run.suites import parse_suite
from che_bench.store import ResultStore
from che_bench.tasks import get_task
from che_bench.train.batches import BatchStream
from tests.run_helpers import run_interrupted_at

LENGTHS = range(1, 41)


def python_twister(seed: int) -> random.Random:
    """Python's Mersenne Twister at the state ``np.random.seed(seed)`` leaves (CHE's
    TrainingWorker seeds numpy so): its 32-bit words and doubles are numpy's legacy ones."""
    _, keys, position, _, _ = np.random.RandomState(seed).get_state()
    twister = random.Random()
    twister.setstate((3, (*(int(key) for key in keys), int(position)), None))
    return twister


def legacy_randint(twister: random.Random, high: int) -> int:
    """numpy's legacy ``randint(0, high)``: nothing drawn for one value, else 32-bit words
    masked to the next power of two minus 1 until one is below ``high``."""
    if high == 1:
        return 0
    mask = (1 << (high - 1).bit_length()) - 1
    while (value := twister.getrandbits(32) & mask) >= high:
        pass
    return value


def lengths_of(curriculum, steps, rng):
    return [curriculum.length(step, rng) for step in range(steps)]


def test_fixed_trains_on_one_length_and_draws_nothing():
    rng = np.random.default_rng(0)
    before = rng.bit_generator.state
    fixed = curricula.build("fixed", {"sequence_length": 7}, LENGTHS, 100)
    assert lengths_of(fixed, 5, rng) == [7] * 5
    assert rng.bit_generator.state == before
    assert curricula.build("fixed", {}, LENGTHS, 100).length(0, rng) == 40  # default: longest


def test_regular_increase_steps_up_every_increase_frequency_steps():
    # CHE: initial + amount * (step // frequency), step 0 first.
    curriculum = curricula.build(
        "regular_increase",
        {"initial_sequence_length": 2, "increase_frequency": 3, "increase_amount": 2},
        LENGTHS,
        8,
    )
    assert lengths_of(curriculum, 8, np.random.default_rng(0)) == [2, 2, 2, 4, 4, 4, 6, 6]


def test_regular_increase_sampling_all_lengths_draws_as_che_draws():
    options = {"initial_sequence_length": 3, "increase_frequency": 2, "increase_amount": 5,
               "sample_all_length": True}
    curriculum = curricula.build("regular_increase", options, LENGTHS, 14)
    twister = python_twister(4)
    # Step t: 3 + 5 * randint(0, t // 2 + 1); steps 0 and 1 draw nothing.
    expected = [3 + 5 * legacy_randint(twister, step // 2 + 1) for step in range(14)]
    assert lengths_of(curriculum, 14, np.random.RandomState(4)) == expected
    assert expected[:2] == [3, 3] and len(set(expected)) > 3
    # che-bench's own generator: the same lengths' support, nothing drawn at one value.
    rng = np.random.default_rng(1)
    before = rng.bit_generator.state
    assert lengths_of(curriculum, 2, rng) == [3, 3] and rng.bit_generator.state == before
    drawn = lengths_of(curriculum, 14, rng)[2:]
    assert all((length - 3) % 5 == 0 and length <= 3 + 5 * (step // 2)
               for step, length in enumerate(drawn, start=2))


@pytest.mark.parametrize("tau, weights", [(0.5, (4, 2, 1)), (2.0, (1, 2, 4))])
def test_reverse_exponential_weighs_each_length_by_tau_to_its_power(tau, weights):
    # tau ** n over n = 1..3, normalised: thresholds of one uniform double, as np.random.choice.
    total = sum(weights)
    thresholds = (Fraction(weights[0], total), Fraction(weights[0] + weights[1], total))
    curriculum = curricula.build("reverse_exponential", {"tau": tau}, range(1, 4), 100)
    np.testing.assert_allclose(curriculum.weights(), [w / total for w in weights], rtol=1e-6)
    twister = python_twister(7)
    expected = []
    for _ in range(200):
        u = twister.random()
        assert all(abs(u - threshold) > 1e-6 for threshold in thresholds)
        expected.append(1 + sum(u >= threshold for threshold in thresholds))
    assert lengths_of(curriculum, 200, np.random.RandomState(7)) == expected
    counts = np.bincount(expected, minlength=4)[1:]
    assert list(np.argsort(counts)) == list(np.argsort(weights))


def test_the_uniform_curriculum_draws_what_every_run_drew_before():
    rng, replay = np.random.default_rng(3), np.random.default_rng(3)
    uniform = curricula.build("uniform", {}, range(2, 41), 10)
    assert lengths_of(uniform, 50, rng) == [int(replay.integers(2, 41)) for _ in range(50)]


def test_the_uniform_default_keeps_run_ids_and_records_nothing():
    plain = make_config("parity_check", "kerple", 3, "smoke")
    assert plain.run_id() == make_config("parity_check", "kerple", 3, "smoke",
                                         curriculum="uniform").run_id()
    assert "curriculum" not in plain.to_dict() and "curriculum_options" not in plain.to_dict()
    fixed = make_config("parity_check", "kerple", 3, "smoke", curriculum="fixed")
    assert fixed.to_dict()["curriculum_options"] == {"sequence_length": 40}
    assert fixed.run_id() != plain.run_id()
    # The defaults filled in are recorded: giving them names the same run.
    assert fixed.run_id() == make_config("parity_check", "kerple", 3, "smoke", curriculum="fixed",
                                         curriculum_options={"sequence_length": 40}).run_id()


def test_regular_increase_defaults_reach_train_max_length_at_the_last_step():
    config = make_config("parity_check", preset="quick", curriculum="regular_increase")
    options = config.curriculum_options
    assert options == {"initial_sequence_length": 1, "increase_frequency": 38,
                       "increase_amount": 1, "sample_all_length": False}
    curriculum = curricula.build("regular_increase", options, LENGTHS, config.steps)
    rng = np.random.default_rng(0)
    assert curriculum.length(0, rng) == 1 and curriculum.length(config.steps - 1, rng) == 40


def stream_lengths(configs, steps, states=None):
    stream = BatchStream(get_task(configs[0].task), configs)
    if states is not None:
        stream.restore(states)
    batches = iter(stream)
    drawn = [next(batches) for _ in range(steps)]
    return [batch.length for batch in drawn], drawn[-1].rng_states, stream


@pytest.mark.parametrize("length_seed", [None, 5])
def test_a_schedule_repeats_under_its_seeds_and_resumes_where_it_stopped(length_seed):
    config = make_config("parity_check", preset="smoke", steps=40, seed=1, length_seed=length_seed,
                         curriculum="regular_increase",
                         curriculum_options={"increase_frequency": 4, "sample_all_length": True})
    whole, _, _ = stream_lengths([config], 40)
    assert whole == stream_lengths([config], 40)[0]
    assert len(set(whole)) > 3 and max(whole) <= 10
    first, states, _ = stream_lengths([config], 25)
    rest, _, _ = stream_lengths([config], 15, {**states, "step": 25})
    assert first + rest == whole


def test_a_pack_shares_its_length_schedule():
    configs = [make_config("parity_check", preset="smoke", seed=seed, length_seed=0, steps=30,
                           curriculum="reverse_exponential", curriculum_options={"tau": 0.9})
               for seed in range(3)]
    assert len({config.pack_key() for config in configs}) == 1
    pack, _, _ = stream_lengths(configs, 30)
    assert pack == stream_lengths(configs[1:2], 30)[0]


def test_an_interrupted_run_resumes_on_its_curriculum(tmp_path):
    configs = [make_config("parity_check", preset="smoke", arch="lstm", seed=seed, steps=8,
                           length_seed=0, arch_options={"hidden_size": 16}, test_lengths="41",
                           eval_samples=4, eval_batch_size=4, curriculum="regular_increase",
                           curriculum_options={"increase_frequency": 2, "increase_amount": 9})
               for seed in range(2)]
    reference = execute_runs(configs, device="cpu", progress=False, log_every=1)
    run_interrupted_at(5, configs, tmp_path, log_every=1)
    resumed = execute_runs(configs, device="cpu", progress=False, log_every=1,
                           checkpoint_dir=tmp_path)
    assert [result.timings["resumed_from_step"] for result in resumed] == [5, 0]
    def curves(results):
        return [[(row["step"], row["loss"], row["accuracy"], row["grad_norm"])
                 for row in result.history] for result in results]

    assert curves(resumed) == curves(reference)  # bit for bit: the schedule went on at step 5


TINY = ["--preset", "smoke", "--steps", "6", "--test-lengths", "41", "--eval-samples", "4",
        "--eval-batch-size", "4", "--no-progress", "--device", "cpu", "--arch", "lstm",
        "--arch-option", "hidden_size=16"]


def test_a_run_on_a_curriculum_from_the_command_line(tmp_path, capsys):
    store = tmp_path / "s.sqlite"
    assert main(["run", "--task", "parity_check", *TINY, "--store", str(store),
                 "--curriculum", "regular_increase",
                 "--curriculum-option", "sample_all_length=true"]) == 0
    [config] = [json.loads(config) for config in ResultStore(store).runs()["config"]]
    assert config["curriculum"] == "regular_increase"
    assert config["curriculum_options"] == {"initial_sequence_length": 1, "increase_frequency": 1,
                                            "increase_amount": 1, "sample_all_length": True}


@pytest.mark.parametrize("arguments, message", [
    (["--curriculum", "fixed", "--curriculum-option", "sequence_length=41"],
     "curriculum option sequence_length must be a training length, 1..40, got 41"),
    (["--curriculum", "reverse_exponential", "--curriculum-option", "tau=0"],
     "curriculum option tau must be a positive number, got 0"),
    (["--curriculum", "reverse_exponential"], "needs its option tau"),
    (["--curriculum", "reverse_exponential", "--curriculum-option", "tau=100"],
     "tau=100.0 gives no weights"),
    (["--curriculum", "steep"], "curriculum must be one of uniform, fixed, regular_increase"),
    (["--curriculum-option", "tau=0.5"], "curriculum uniform takes no option tau"),
    (["--curriculum", "regular_increase", "--curriculum-option", "increase_frequency=1",
      "--curriculum-option", "increase_amount=8"],
     "curriculum regular_increase reaches length 41 at step 5, above train_max_length 40"),
    (["--curriculum", "regular_increase", "--curriculum-option", "sample_all_length=yes"],
     "curriculum option sample_all_length must be true or false"),
])
def test_bad_curriculum_input_is_a_one_line_error(tmp_path, capsys, arguments, message):
    code = main(["run", "--task", "parity_check", *TINY, "--store", str(tmp_path / "s.sqlite"),
                 *arguments])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_suite_sets_a_curriculum_in_its_overrides(tmp_path):
    suite = parse_suite({"tasks": ["parity_check"], "architectures": ["lstm"], "preset": "smoke",
                         "overrides": {"curriculum": "fixed",
                                       "curriculum_options": {"sequence_length": 12}}},
                        tmp_path / "suite.toml")
    [config] = suite.configs()
    assert (config.curriculum, config.curriculum_options) == ("fixed", {"sequence_length": 12})
    with pytest.raises(CheBenchError, match="tau must be a positive number"):
        make_config("parity_check", preset="smoke", curriculum="reverse_exponential",
                    curriculum_options={"tau": -1.0})


def test_a_reports_command_line_recreates_a_curriculum_run():
    from che_bench.commands.command_lines import run_command_line

    config = make_config("parity_check", preset="quick", arch="lstm",
                         curriculum="reverse_exponential", curriculum_options={"tau": 0.5})
    assert run_command_line(config.to_dict(), config.run_id()) == [
        "run", "--task", "parity_check", "--preset", "quick", "--curriculum",
        "reverse_exponential", "--curriculum-option", "tau=0.5", "--arch", "lstm"]
    assert "curriculum reverse_exponential" in paper_protocol_differences(config.to_dict())
    assert not any("curriculum" in difference
                   for difference in paper_protocol_differences(make_config(
                       "parity_check", preset="paper").to_dict()))


def bench_check():
    """benchmarks/bench_architectures_check.py, imported from its file."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_architectures_check.py"
    spec = importlib.util.spec_from_file_location("bench_architectures_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_side_by_side_draws_ches_length_sequence_for_each_curriculum():
    check = bench_check()
    # UniformCurriculum: random.choice after random.seed(seed), as before curricula.
    python_random = random.Random(2)
    assert check.length_schedule("uniform", {}, 20, 2) == (
        [python_random.choice(range(1, 41)) for _ in range(20)], {})
    # RegularIncreaseCurriculum with sample_all_length: np.random.randint after np.random.seed.
    twister = python_twister(2)
    lengths, options = check.length_schedule(
        "regular_increase", {"increase_frequency": 3, "sample_all_length": True}, 20, 2)
    assert lengths == [1 + legacy_randint(twister, step // 3 + 1) for step in range(20)]
    assert options == {"initial_sequence_length": 1, "increase_frequency": 3,
                       "increase_amount": 1, "sample_all_length": True}
    run = check.train("lstm", "parity_check", 3, 2, "fixed", {"sequence_length": 5},
                      {"hidden_size": 8})
    assert [record["length"] for record in run["records"]] == [5, 5, 5]
    assert run["curriculum"] == {"name": "fixed", "options": {"sequence_length": 5}}
