"""One execution path for `run` and `sweep`, runtime options as one typed object, and the
settings and shared flags declared once (with their validators)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_sweep import write_suite

from che_bench.cli import build_parser, main
from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.eval.reevaluation import reevaluation_config
from che_bench.run import runner, sweep
from che_bench.run.options import RuntimeOptions
from che_bench.run.suites import parse_suite

TINY_RUN = ["run", "--task", "even_pairs", "--preset", "smoke", "--steps", "2", "--test-lengths",
            "41", "--eval-samples", "4", "--eval-batch-size", "4", "--device", "cpu"]


def subcommand_actions(command: str) -> dict[str, tuple]:
    """``command``'s flags: dest -> (option strings, help, default, type, metavar)."""
    parser = build_parser()
    subparsers = next(action for action in parser._actions if action.dest == "command")
    return {action.dest: (tuple(action.option_strings), action.help, action.default,
                          action.type, action.metavar)
            for action in subparsers.choices[command]._actions}


def test_shared_flags_are_declared_once():
    run, sweep_flags = subcommand_actions("run"), subcommand_actions("sweep")
    evaluate, selftest = subcommand_actions("evaluate"), subcommand_actions("selftest")
    for name in ("test_lengths", "eval_samples", "eval_batch_size", "dropout_at_eval",
                 "score_from_42", "device", "threads", "deterministic", "no_progress", "store"):
        assert evaluate[name] == run[name], name
    for name in ("device", "threads", "no_progress", "store", "tf32", "log_every"):
        assert sweep_flags[name] == run[name], name
    for name in ("device", "threads"):
        assert selftest[name] == run[name], name


def test_a_validator_gives_one_message_from_every_command_and_the_python_api(tmp_path, capsys):
    message = "--threads must be an integer >= 1, got 0"
    suite = write_suite(tmp_path)
    store = tmp_path / "store.sqlite"
    for argv in ([*TINY_RUN, "--store", str(store)], ["sweep", str(suite), "--store", str(store)],
                 ["evaluate", "abc", "--store", str(store)], ["selftest"]):
        assert main([*argv, "--threads", "0"]) == 2
        assert capsys.readouterr().err == f"che-bench: error: {message}\n"
    with pytest.raises(CheBenchError, match=f"^{message}$"):
        RuntimeOptions(threads=0)
    assert not store.exists()  # refused before anything was written


def test_a_run_setting_validator_applies_to_suites_the_api_and_reevaluation():
    message = "dropout_at_eval must be true or false, got 'yes'$"  # a suite says where first
    suite = {"preset": "smoke", "tasks": ["even_pairs"], "encodings": ["none"],
             "overrides": {"dropout_at_eval": "yes"}}
    with pytest.raises(CheBenchError, match=message):
        parse_suite(suite, Path("bad.toml")).configs()
    with pytest.raises(CheBenchError, match=message):
        make_config("even_pairs", preset="smoke", dropout_at_eval="yes")
    with pytest.raises(CheBenchError, match=message):
        reevaluation_config(make_config("even_pairs", preset="smoke"), dropout_at_eval="yes")


def test_config_and_store_import_no_torch():
    code = ("import sys, che_bench.config, che_bench.store.result_store, che_bench.run.options; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_run_and_sweep_go_through_one_executor(tmp_path, monkeypatch):
    real_run_sweep, calls = sweep.run_sweep, []

    def recording_run_sweep(configs, store, make_backend, **kwargs):
        calls.append((type(make_backend()).__name__, [config.run_id() for config in configs]))
        return real_run_sweep(configs, store, make_backend, **{**kwargs, "max_runs": 0})

    monkeypatch.setattr(sweep, "run_sweep", recording_run_sweep)
    store = str(tmp_path / "store.sqlite")
    suite = write_suite(tmp_path)
    assert main([*TINY_RUN, "--store", store, "--no-progress"]) == 0
    assert main(["sweep", str(suite), "--store", store, "--no-progress"]) == 0
    run_id = make_config("even_pairs", preset="smoke", steps=2, test_lengths="41",
                         eval_samples=4, eval_batch_size=4).run_id()
    assert calls[0] == ("InProcessBackend", [run_id])
    assert calls[1][0] == "LocalBackend" and len(calls[1][1]) == 4


def test_runtime_options_reach_the_runner_as_one_object(tmp_path, monkeypatch):
    real_execute_pack, received = runner.execute_pack, []

    def recording_execute_pack(configs, options, **kwargs):
        received.append(options)
        return real_execute_pack(configs, options, **kwargs)

    monkeypatch.setattr(runner, "execute_pack", recording_execute_pack)
    store = tmp_path / "store.sqlite"
    assert main([*TINY_RUN, "--store", str(store), "--no-progress", "--log-every", "1",
                 "--no-keep-model"]) == 0
    (options,) = received
    assert options == RuntimeOptions(device="cpu", log_every=1, progress=False,
                                     checkpoint_dir=tmp_path / "store.checkpoints")
