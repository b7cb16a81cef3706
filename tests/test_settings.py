"""Run settings declared once (che_bench.settings), and the causal switch."""

from __future__ import annotations

import dataclasses

import pytest
from test_store import synthetic_result

from che_bench import settings
from che_bench.cli import build_parser
from che_bench.commands.run import cell_configs, overrides_from_args
from che_bench.config import RunConfig, make_config
from che_bench.errors import CheBenchError
from che_bench.model.encoder import build_model
from che_bench.protocol import PRESETS
from che_bench.reports.tables import summarize
from che_bench.run.suites import parse_suite
from che_bench.store import ResultStore

#: RunConfig fields that are not run settings: the grid point itself, the resolved option
#: dicts and the fixed parts of the published protocol.
NOT_SETTINGS = {"task", "pe", "kernel", "preset", "model_options", "dape_options", "eval_seed",
                "adam_betas", "adam_eps"}


def test_every_config_field_is_declared_once():
    fields = {field.name for field in dataclasses.fields(RunConfig)}
    declared = {setting.name for setting in settings.settings_where(settings.RUN)}
    assert fields - NOT_SETTINGS == declared
    assert len(settings.BY_NAME) == len(settings.SETTINGS)
    options = make_config("even_pairs", "alibi", 3, "smoke")
    assert set(options.model_options) == {s.name for s in settings.settings_where(settings.MODEL)}
    assert set(options.dape_options) == {s.name for s in settings.settings_where(settings.DAPE)}


def help_of(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return capsys.readouterr().out


def test_presets_flags_and_overrides_derive_from_the_declaration(capsys):
    for preset in settings.PRESET_NAMES:
        assert PRESETS[preset] == {s.name: s.presets[preset] for s in settings.SETTINGS if s.presets}
    run_help, sweep_help = help_of("run", capsys), help_of("sweep", capsys)
    for setting in settings.SETTINGS:
        if setting.flag is not None:
            assert setting.flag in (sweep_help if setting.where == settings.RUNTIME else run_help)
    for setting in settings.run_settings():  # every run setting is a suite override
        value = {int: 2, float: 0.5, str: None, settings.SWITCH: True,
                 settings.KEY_VALUES: {}}[setting.kind]
        # (the cosine's floor needs the cosine)
        schedule = {"lr_schedule": "warmup_cosine"} if setting.name == "min_lr_ratio" else {}
        if value is not None and setting.where != settings.DAPE:
            make_config("even_pairs", "none", None, "smoke", **{setting.name: value}, **schedule)


def test_causal_is_recorded_labelled_and_out_of_the_id_while_off(tmp_path):
    plain = make_config("reverse_string", "rope", 3, "smoke")
    causal = make_config("reverse_string", "rope", 3, "smoke", causal=True)
    assert "causal" not in plain.to_dict() and causal.to_dict()["causal"] is True
    assert make_config("reverse_string", "rope", 3, "smoke", causal=False).run_id() == plain.run_id()
    assert causal.run_id() != plain.run_id()
    model = build_model(causal.build_task(), causal.pe, causal.kernel, **causal.model_kwargs())
    assert model.describe()["causal"] is True and model.describe()["dape"]["tril"] is True
    args = build_parser().parse_args(["run", "--task", "reverse_string", "--pe", "rope",
                                      "--kernel", "3", "--preset", "smoke", "--causal"])
    assert overrides_from_args(args)["causal"] is True
    assert cell_configs(args)[0].run_id() == causal.run_id()
    store = ResultStore(tmp_path / "s.sqlite")
    store.record(synthetic_result("reverse_string", "rope", 3, causal=True))
    store.record(synthetic_result("reverse_string", "rope", 3))
    assert set(summarize(store)["column"]) == {"DAPE_k3_RoPE", "DAPE_k3_RoPE (causal)"}


def test_a_task_defined_causally_defaults_to_causal_and_no_causal_overrides_it():
    """mqar is Zoology's causal task: causal unless --no-causal; CHE's tasks stay bidirectional."""
    assert make_config("mqar", "rope", None, "smoke").causal is True
    assert make_config("reverse_string", "rope", None, "smoke").causal is False
    for flag, causal in (("--no-causal", False), ("--causal", True)):
        args = build_parser().parse_args(["run", "--task", "mqar", "--pe", "rope", "--preset",
                                          "smoke", flag])
        config = cell_configs(args)[0]
        assert config.causal is causal
        # Stored as given: a bidirectional mqar run keeps the id it has without the field.
        assert ("causal" in config.to_dict()) is causal


def test_a_suite_sets_causal_in_its_overrides(tmp_path):
    suite = parse_suite({"preset": "smoke", "tasks": ["parity_check"], "encodings": ["none"],
                         "overrides": {"causal": True}}, tmp_path / "causal.toml")
    assert [config.causal for config in suite.configs()] == [True]
    with pytest.raises(CheBenchError, match="causal must be true or false"):
        parse_suite({"preset": "smoke", "tasks": ["parity_check"], "encodings": ["none"],
                     "overrides": {"causal": "yes"}}, tmp_path / "bad.toml").configs()


def test_zero_steps_are_refused_in_one_line_wherever_they_come_from(tmp_path, capsys):
    """Issue 26, item 12: ``--steps 0`` stored a "complete" run that learned nothing."""
    from che_bench.cli import main

    store = tmp_path / "s.sqlite"
    assert main(["run", "--task", "parity_check", "--preset", "smoke", "--steps", "0",
                 "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "steps must be an integer >= 1, got 0" in err
    assert not store.exists()
    with pytest.raises(CheBenchError, match="steps must be an integer >= 1"):
        make_config("parity_check", preset="smoke", steps=0)
    with pytest.raises(CheBenchError, match="steps must be an integer >= 1"):
        parse_suite({"preset": "smoke", "tasks": ["parity_check"], "encodings": ["none"],
                     "overrides": {"steps": 0}}, tmp_path / "s.toml").configs()
    assert make_config("parity_check", preset="smoke", steps=1).steps == 1
