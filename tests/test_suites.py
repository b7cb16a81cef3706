"""Suite files: parsing, grid expansion, stable run ids, validation before anything runs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from che_bench.config import make_config
from che_bench.errors import CheBenchError
from che_bench.run.suites import load_suite, resolve_suite_path
from che_bench.tasks import list_tasks

REPO = Path(__file__).resolve().parents[1]


def write_suite(tmp_path: Path, text: str, name: str = "suite.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


SMALL = """
    preset = "smoke"
    tasks = ["even_pairs", { name = "modular_arithmetic", params = { modulus = 7 } }]
    encodings = ["none", { name = "nope", kernels = [1] }]
    kernels = ["none", 3]
    seeds = [0, 1]
    learning_rates = [1e-3, 3e-4]
    [overrides]
    steps = 5
    test_lengths = "41,60"
"""


def test_grid_is_the_product_in_seed_major_order_with_stable_ids(tmp_path):
    suite = load_suite(write_suite(tmp_path, SMALL))
    configs = suite.configs()
    # "nope" is an alias of "none" with its own kernel list: 3 kernels per task.
    cells = {(c.task, c.pe, c.kernel) for c in configs}
    assert cells == {(task, "none", kernel) for task in ("even_pairs", "modular_arithmetic")
                     for kernel in (None, 3, 1)}
    assert len(configs) == len(cells) * 2 * 2
    assert [(c.seed, c.lr) for c in configs[:6]] == [(0, 1e-3)] * 6  # seed, then lr outermost
    assert [(c.seed, c.lr) for c in configs[-6:]] == [(1, 3e-4)] * 6
    assert {c.task_params["modulus"] for c in configs if c.task == "modular_arithmetic"} == {7}
    assert {c.steps for c in configs} == {5} and {c.test_lengths for c in configs} == {(41, 60)}

    ids = [c.run_id() for c in configs]
    assert len(set(ids)) == len(ids)
    assert [c.run_id() for c in load_suite(tmp_path / "suite.toml").configs()] == ids


def test_every_grid_point_equals_make_config(tmp_path):
    """The expansion varies seed/lr of a validated cell; it must build what make_config builds."""
    for extra in ("", "data_seed = 11\n"):
        suite = load_suite(write_suite(tmp_path, SMALL + "    " + extra))
        for config in suite.configs():
            overrides = {"steps": 5, "test_lengths": "41,60", "seed": config.seed, "lr": config.lr}
            if extra:
                overrides["data_seed"] = 11
            if config.task == "modular_arithmetic":
                overrides["task_params"] = {"modulus": 7}
            direct = make_config(config.task, pe=config.pe, kernel=config.kernel,
                                 preset="smoke", **overrides)
            assert direct == config and direct.run_id() == config.run_id()


def test_duplicate_points_are_expanded_once(tmp_path):
    suite = load_suite(write_suite(tmp_path, """
        preset = "smoke"
        tasks = ["even_pairs", "even_pairs"]
        encodings = ["none", "nope"]
        kernels = ["none", "none"]
    """))
    assert len(suite.configs()) == 1


def test_all_tasks_expands_from_the_registry(tmp_path):
    suite = load_suite(write_suite(tmp_path, """
        preset = "smoke"
        tasks = "all"
        encodings = "none"
    """))
    assert [c.task for c in suite.configs()] == list_tasks()


def test_defaults_come_from_the_preset(tmp_path):
    suite = load_suite(write_suite(tmp_path, 'tasks = "even_pairs"\nencodings = "none"\n'))
    (config,) = suite.configs()
    assert (config.preset, config.seed, config.kernel) == ("quick", 0, None)
    assert config == make_config("even_pairs", preset="quick")


@pytest.mark.parametrize("body, message", [
    ('tasks = ["even_pairs", "no_such_task"]\nencodings = "none"', "no_such_task"),
    ('tasks = "even_pairs"\nencodings = ["none", "no_such_pe"]', "no_such_pe"),
    ('tasks = "even_pairs"\nencodings = "none"\nkernels = [3, 4]', "kernel"),
    ('tasks = "even_pairs"\nencodings = "none"\nkernels = ["three"]', "three"),
    ('tasks = "even_pairs"\nencodings = "none"\npreset = "huge"', "huge"),
    ('tasks = "even_pairs"\nencodings = "none"\n[overrides]\nstepz = 3', "stepz"),
    ('tasks = "even_pairs"\nencodings = "none"\n[overrides]\nseed = 3', "seed"),
    ('tasks = "even_pairs"\nencodings = "none"\nseeds = [-1]', "seeds"),
    ('tasks = "even_pairs"\nencodings = "none"\nlearning_rates = [0]', "learning_rates"),
    ('tasks = "even_pairs"\nencodings = "none"\n[resources]\nnum_tpus = 1', "num_tpus"),
    ('tasks = "even_pairs"\nencodings = "none"\nlr = 1e-3', "lr"),
    ('tasks = [{ name = "even_pairs", parms = {} }]\nencodings = "none"', "parms"),
    ('tasks = [{ name = "modular_arithmetic", params = { modulus = "x" } }]\n'
     'encodings = "none"', "modular_arithmetic"),
    ('encodings = "none"', "tasks"),
    ('tasks = "even_pairs"\nencodings = [', "TOML"),
])
def test_invalid_suites_are_one_line_errors_naming_the_file(tmp_path, body, message):
    path = write_suite(tmp_path, body + "\n")
    with pytest.raises(CheBenchError) as caught:
        load_suite(path).configs()
    text = str(caught.value)
    assert message in text and str(path) in text and "\n" not in text


def test_invalid_point_anywhere_in_the_grid_is_found_before_running(tmp_path):
    # The bad point is the last cell of the last seed: expansion must still reject the suite.
    suite = load_suite(write_suite(tmp_path, """
        preset = "smoke"
        tasks = ["even_pairs", "parity_check"]
        encodings = ["none", { name = "none", kernels = [2] }]
        seeds = [0, 1, 2]
    """))
    with pytest.raises(CheBenchError, match="kernel 2"):
        suite.configs()


def test_bare_suite_names_are_looked_up_in_tasks_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks").mkdir()
    write_suite(tmp_path / "tasks", 'tasks = "even_pairs"\nencodings = "none"\n', "mine.toml")
    assert resolve_suite_path("mine") == Path("tasks/mine.toml")
    with pytest.raises(CheBenchError, match="mine"):
        resolve_suite_path("other")


def test_shipped_suites_are_valid_and_have_the_documented_grids():
    smoke = load_suite(REPO / "tasks" / "smoke.toml").configs()
    assert {c.task for c in smoke} == set(list_tasks())
    assert {(c.pe, c.kernel) for c in smoke} == {
        (pe, k) for pe in ("none", "alibi", "kerple") for k in (None, 3)}
    assert {c.preset for c in smoke} == {"smoke"}

    table6 = load_suite(REPO / "tasks" / "paper_table6.toml").configs()
    columns = {(c.pe, c.kernel) for c in table6}
    assert columns == {("rope", None), ("relative", None)} | {
        (pe, k) for pe in ("alibi", "kerple", "fire") for k in (None, 1, 3)}
    assert len({c.task for c in table6}) == 14 and "binary_multiplication" not in {
        c.task for c in table6}
    assert {(c.seed, c.lr) for c in table6} == {
        (s, lr) for s in range(10) for lr in (1e-4, 3e-4, 5e-4)}
    assert len(table6) == 14 * 11 * 30 and {c.steps for c in table6} == {200_000}
    # Each cell's 30 runs can train as one pack.
    from che_bench.config import group_into_packs

    assert {c.length_seed for c in table6} == {0}
    assert len(group_into_packs(table6, None)) == 14 * 11

    laptop = load_suite(REPO / "tasks" / "laptop.toml").configs()
    assert {(c.task, c.pe, c.kernel) for c in laptop} == {
        (task, pe, k) for task in ("induction", "missing_duplicate_string")
        for pe, kernels in (("none", (None, 1, 3)), ("kerple", (None, 3))) for k in kernels}
    assert len(laptop) == 30 and {c.preset for c in laptop} == {"quick"}

    recall = load_suite(REPO / "tasks" / "recall.toml").configs()
    assert {(c.task, c.pe, c.kernel) for c in recall} == {
        ("associative_recall", pe, k) for pe in ("none", "rope", "alibi", "kerple", "fire")
        for k in (None, 1, 3, 5, 7)}

    full = load_suite(REPO / "tasks" / "full.toml")
    assert (full.tasks[0].name, full.encodings[0].name) == ("all", "all")


def test_mqar_suites_sweep_both_axes_with_the_recall_grid():
    recall_grid = {(pe, k) for pe in ("none", "rope", "alibi", "kerple", "fire") for k in (None, 1, 3, 5, 7)}
    length = load_suite(REPO / "tasks" / "mqar_length.toml").configs()
    assert {(c.pe, c.kernel) for c in length} == recall_grid and len(length) == 75
    assert {c.task_params["num_pairs"] for c in length} == {8}
    assert {(c.train_max_length, max(c.test_lengths)) for c in length} == {(128, 1024)}
    pairs = load_suite(REPO / "tasks" / "mqar_pairs.toml").configs()
    assert {(c.pe, c.kernel) for c in pairs} == recall_grid
    assert {(c.task_params["axis"], c.task_params["sequence_length"]) for c in pairs} == {("pairs", 256)}
    assert {(c.train_max_length, max(c.test_lengths)) for c in pairs} == {(16, 64)}
    laptop = load_suite(REPO / "tasks" / "laptop_mqar.toml").configs()
    assert {(c.pe, c.kernel) for c in laptop} == {
        (pe, k) for pe in ("none", "rope", "alibi", "kerple") for k in (None, 3)}
    assert len(laptop) == 24 and {c.seed for c in laptop} == {0, 1, 2}


def test_mqar_zoology_suite_is_figure_2_once_runs_take_the_causal_setting():
    try:
        zoology = load_suite(REPO / "tasks" / "mqar.toml").configs()
    except CheBenchError as error:
        if "unknown run setting(s): causal" in str(error):
            pytest.skip("needs the causal run setting (issue 14)")
        raise
    assert {c.task_params["length_per_pair"] for c in zoology} == {16}
    assert {c.train_eval_lengths for c in zoology} == {(64, 128, 256)}
    assert len(zoology) == 5 * 5 * 3 * 4


def test_the_state_tracking_suites_cover_every_listed_setting_and_split():
    from che_bench.tasks import TASKS, get_task

    word = load_suite(REPO / "tasks" / "word_problems.toml").configs()
    listed = [get_task("word_problem", **params).params()
              for params in TASKS.get("word_problem").listed_params]
    default = get_task("word_problem").params()  # A5, the reference setting
    assert [c.task_params for c in word[::3] if c.task_params != default] == listed
    assert default in [c.task_params for c in word[::3]]
    assert [c.arch for c in word[:3]] == ["deltaproduct", "lstm", "transformer"]
    assert word[0].arch_options == {"negative_eigenvalues": True}  # householder=2: its default
    flip = load_suite(REPO / "tasks" / "flip_flop.toml").configs()
    assert [c.task_params["p_ignore"] for c in flip[::3]] == [0.8, 0.98, 0.1]
    assert {(c.train_max_length, c.test_lengths, c.curriculum) for c in flip} == {
        (32, (256,), "fixed")}


@pytest.mark.parametrize("store, suites", [
    ("word_problems", ["laptop_word_problems"]),
    ("word_problems_long", ["laptop_word_problems_long"]),
    ("flip_flop", ["laptop_flip_flop_lstm", "laptop_flip_flop_transformer",
                   "laptop_flip_flop_transformer_2l"]),
])
def test_the_laptop_state_tracking_suites_are_the_committed_runs(store, suites):
    """docs/results.md's sweeps repeat (or skip) exactly the runs of their committed stores."""
    import sqlite3

    path = REPO / "results" / "laptop" / "word_problems" / f"{store}.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as connection:
        stored = {row[0] for row in connection.execute("SELECT run_id FROM runs")}
    expected = {c.run_id() for name in suites
                for c in load_suite(REPO / "tasks" / f"{name}.toml").configs()}
    assert stored == expected


def test_the_committed_flip_flop_runs_have_pooled_counts_and_the_sparse_and_dense_splits():
    """Issue 45, item 3: every flip-flop run's original evaluation has its pooled counts
    (``table --metric pooled --compare flip_flop|path``), and each run trained on FFL(0.8) was
    also evaluated on FFL(0.98) and FFL(0.1), the published sparse and dense splits."""
    import json

    from che_bench.store import ResultStore

    store = ResultStore(REPO / "results/laptop/word_problems/flip_flop.sqlite", read_only=True)
    assert store.per_length()["scored"].notna().all() and len(store.runs()) == 15
    runs = store.runs()
    trained = set(runs.loc[[json.loads(c)["task_params"]["p_ignore"] == 0.8
                            for c in runs["config"]], "run_id"])
    assert len(trained) == 9
    for p_ignore in (0.98, 0.1):
        tested = {evaluation for evaluation, protocol in
                  store.evaluations()[["evaluation", "protocol"]].itertuples(index=False)
                  if f"p_ignore={p_ignore}" in protocol}
        (evaluation,) = tested
        assert set(store.runs(None, evaluation)["run_id"]) == trained
        assert store.per_length(None, evaluation)["scored"].notna().all()
