"""The architecture axis end to end: CHE's baselines run, store, resume, pack, re-evaluate and
report like transformer runs; a PE or transformer flag given to one is a one-line error."""

from __future__ import annotations

import json

import pytest
import torch

from che_bench.cli import main
from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.model.architectures import build_architecture, build_members
from che_bench.model.packs import member_state_dict
from che_bench.run.kept_models import load_model
from che_bench.run.suites import parse_suite
from che_bench.store import ResultStore
from che_bench.tasks import get_task

TINY = ["--preset", "smoke", "--steps", "6", "--test-lengths", "41,60", "--eval-samples", "4",
        "--eval-batch-size", "4", "--no-progress", "--device", "cpu",
        "--arch-option", "hidden_size=16"]


def run_cli(store, *args: str) -> int:
    return main(["run", "--task", "parity_check", *TINY, "--store", str(store), *args])


def stored(store) -> list[dict]:
    return [json.loads(config) for config in ResultStore(store).runs()["config"]]


@pytest.mark.parametrize("arch", ["rnn", "lstm", "stack_rnn", "stack_lstm", "tape_rnn"])
def test_each_baseline_runs_stores_and_resumes(tmp_path, capsys, arch):
    store = tmp_path / "s.sqlite"
    assert run_cli(store, "--arch", arch) == 0
    first = capsys.readouterr().out
    config = stored(store)[0]
    assert (config["arch"], config["pe"], config["kernel"]) == (arch, "none", None)
    assert config["arch_options"] == {"hidden_size": 16} and config["model_options"] == {}
    label = {"rnn": "RNN", "lstm": "LSTM", "stack_rnn": "Stack-RNN", "stack_lstm": "Stack-LSTM",
             "tape_rnn": "Tape-RNN"}[arch]
    assert label in first
    assert run_cli(store, "--arch", arch) == 0  # the same command again: nothing to do
    assert "already complete" in capsys.readouterr().out
    assert len(stored(store)) == 1


def test_the_transformer_is_the_default_and_keeps_its_run_ids():
    plain = make_config("parity_check", "kerple", 3, "smoke")
    assert plain.run_id() == make_config("parity_check", "kerple", 3, "smoke",
                                         arch="transformer").run_id()
    assert "arch" not in plain.to_dict() and "arch_options" not in plain.to_dict()
    lstm = make_config("parity_check", preset="smoke", arch="lstm")
    assert lstm.to_dict()["arch"] == "lstm" and lstm.run_id() != plain.run_id()


@pytest.mark.parametrize("arguments, message", [
    (["--arch", "lstm", "--pe", "kerple"], "--pe applies to the transformer only"),
    (["--arch", "lstm", "--kernel", "3"], "--kernel applies to the transformer only"),
    (["--arch", "lstm", "--layers", "2", "--causal"], "--layers, --causal apply to the"),
    (["--arch", "lstn"], "unknown architecture 'lstn'; did you mean 'lstm'"),
    (["--arch", "lstm", "--arch-option", "depth=2"], "lstm takes no option depth"),
    (["--arch", "lstm", "--arch-option", "hidden_size=0"], "hidden_size must be a positive"),
    (["--arch-option", "hidden_size=8"], "--arch-option applies to architectures other than"),
])
def test_bad_architecture_arguments_are_one_line_errors(tmp_path, capsys, arguments, message):
    store = tmp_path / "s.sqlite"
    if arguments[-1] == "hidden_size=8":  # the transformer, without TINY's recurrent option
        code = main(["run", "--task", "parity_check", "--preset", "smoke", "--store", str(store),
                     *arguments])
    else:
        code = main(["run", "--task", "parity_check", "--preset", "smoke", "--store", str(store),
                     "--no-progress", *arguments])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not store.exists() or ResultStore(store).runs().empty


def test_each_architecture_has_its_paper_preset():
    # CHE's 1,000,000 steps for the baselines; DAPE V2's 200,000 for the transformer.
    assert make_config("parity_check", preset="paper", arch="lstm").steps == 1_000_000
    assert make_config("parity_check", preset="paper").steps == 200_000
    lstm = make_config("parity_check", preset="paper", arch="tape_rnn")
    assert (lstm.batch_size, lstm.grad_clip_norm, lstm.eval_samples, lstm.eval_batch_size) == (
        128, 1.0, 512, 64)
    assert lstm.test_lengths == tuple(range(41, 501))
    assert make_config("parity_check", preset="quick", arch="lstm").steps == 1500


def test_a_pack_of_baselines_equals_its_runs_alone(tmp_path, capsys):
    alone, packed = tmp_path / "alone.sqlite", tmp_path / "packed.sqlite"
    assert run_cli(alone, "--arch", "stack_rnn", "--seeds", "0:2", "--pack", "1") == 0
    assert run_cli(packed, "--arch", "stack_rnn", "--seeds", "0:2", "--pack", "2") == 0
    capsys.readouterr()
    first, second = (ResultStore(path).runs().set_index("run_id") for path in (alone, packed))
    assert sorted(first.index) == sorted(second.index)
    for column in ("score", "train_accuracy"):
        assert second.loc[first.index, column].tolist() == pytest.approx(
            first[column].tolist(), abs=1e-6)


def test_a_pack_member_is_the_model_built_alone():
    task = get_task("reverse_string")
    pack = build_members("tape_rnn", task, [3, 4], hidden_size=8, memory_size=5)
    torch.manual_seed(4)
    alone = build_architecture("tape_rnn", task, hidden_size=8, memory_size=5)
    for name, tensor in member_state_dict(pack, 1).items():
        assert torch.equal(tensor, alone.state_dict()[name]), name


def test_a_baseline_reevaluates_from_its_kept_model(tmp_path, capsys):
    store = tmp_path / "s.sqlite"
    assert run_cli(store, "--arch", "lstm") == 0
    run_id = ResultStore(store).runs()["run_id"][0]
    config, model = load_model(store, run_id)
    assert config.arch == "lstm" and model.architecture == "lstm"
    assert main(["evaluate", run_id, "--test-lengths", "41,80", "--store", str(store),
                 "--no-progress", "--device", "cpu"]) == 0
    assert len(ResultStore(store).evaluations([run_id])) == 2
    capsys.readouterr()


def test_tables_and_listings_filter_and_group_by_architecture(tmp_path, capsys):
    store = tmp_path / "s.sqlite"
    assert run_cli(store, "--arch", "lstm") == 0
    assert main(["run", "--task", "parity_check", "--pe", "kerple", *TINY[:-2],
                 "--store", str(store)]) == 0
    capsys.readouterr()
    assert main(["table", "--store", str(store)]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    # The transformer's columns first, named as transformers beside another architecture ...
    assert header.index("Transformer · Kerple") < header.index("LSTM")
    assert main(["table", "--store", str(store), "--arch", "lstm"]) == 0
    table = capsys.readouterr().out
    assert "LSTM" in table and "Kerple" not in table
    # ... and by the published table's names alone.
    assert main(["table", "--store", str(store), "--arch", "transformer", "--compare",
                 "paper"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "Kerple paper (diff)" in header and "Transformer" not in header
    assert main(["export", "--store", str(store), "--arch", "transformer"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert len(rows) == 2 and rows[1].startswith("parity_check,transformer,kerple")
    assert main(["runs", "--store", str(store), "--arch", "lstm"]) == 0
    listing = capsys.readouterr().out
    assert "LSTM" in listing and "Kerple" not in listing
    assert main(["table", "--store", str(store), "--compare", "paper"]) == 0
    notes = capsys.readouterr().out
    assert "LSTM: no published reference" in notes and "DAPE V2 (arXiv" in notes
    assert main(["table", "--store", str(store), "--compare", "paper", "--arch", "lstm"]) == 0
    notes = capsys.readouterr().out  # no transformer column: DAPE V2's table is not named
    assert "LSTM: no published reference" in notes and "DAPE V2 (arXiv" not in notes
    assert main(["report", "--store", str(store), "--arch", "lstm",
                 "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "LSTM" in page and "--arch lstm" in page
    assert main(["report", "--store", str(store), "--out", str(tmp_path / "all.html")]) == 0
    assert "runs per architecture</b>: Transformer: 1 (Kerple); LSTM: 1" in (
        tmp_path / "all.html").read_text()
    assert main(["table", "--store", str(store), "--arch", "gru2"]) == 2
    assert "unknown architecture 'gru2'" in capsys.readouterr().err


def test_a_suite_crosses_architectures_with_the_transformers_encodings(tmp_path):
    suite = parse_suite({
        "tasks": ["parity_check", "reverse_string"],
        "architectures": ["lstm", {"name": "tape_rnn", "options": {"memory_size": 5}},
                          "transformer"],
        "encodings": [{"name": "kerple", "kernels": ["none", 3]}],
        "seeds": [0, 1], "preset": "smoke",
        "overrides": {"causal": False},
    }, tmp_path / "suite.toml")
    configs = suite.configs()
    assert len(configs) == 2 * 2 * (2 + 2)
    tape = [config for config in configs if config.arch == "tape_rnn"]
    assert {json.dumps(config.arch_options) for config in tape} == {'{"memory_size": 5}'}
    assert {(c.pe, c.kernel) for c in configs if c.is_transformer} == {("kerple", None),
                                                                       ("kerple", 3)}
    only_baselines = parse_suite({"tasks": ["parity_check"], "architectures": ["rnn"]},
                                 tmp_path / "b.toml")
    assert [config.arch for config in only_baselines.configs()] == ["rnn"]
    with pytest.raises(CheBenchError, match="missing 'encodings'"):
        parse_suite({"tasks": ["parity_check"]}, tmp_path / "c.toml")
    with pytest.raises(CheBenchError, match="c.toml: task parity_check, architecture lstm"):
        parse_suite({"tasks": ["parity_check"], "architectures": ["lstm"],
                     "overrides": {"layers": 2}}, tmp_path / "c.toml").configs()


def test_models_lists_every_architecture(capsys):
    assert main(["models"]) == 0
    listing = capsys.readouterr().out
    for name in ("transformer", "rnn", "lstm", "stack_rnn", "stack_lstm", "tape_rnn"):
        assert name in listing
    assert "Stack-LSTM" in listing and '"steps": 1000000' in listing


def test_a_reports_command_line_recreates_a_baseline_run():
    from che_bench.commands.command_lines import run_command_line

    config = make_config("mqar", preset="paper", arch="tape_rnn", seed=3,
                         arch_options={"memory_size": 5})
    assert run_command_line(config.to_dict(), config.run_id()) == [
        "run", "--task", "mqar", "--preset", "paper", "--seed", "3", "--arch", "tape_rnn",
        "--arch-option", "memory_size=5"]
