"""Packed runs: a pack trains and scores what its members do alone; per-member optimizer;
resume of a killed pack; ``run --seeds --lrs``; bad packs; the randomized encodings' draws."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from che_bench import encodings
from che_bench.cli import main
from che_bench.config import group_into_packs, make_config
from che_bench.errors import CheBenchError
from che_bench.eval import evaluation
from che_bench.eval.evaluation import length_accuracies
from che_bench.model.encoder import build_model
from che_bench.model.packs import stack_members
from che_bench.run.runner import check_pack, execute_pack, execute_run
from che_bench.store import ResultStore
from che_bench.train.optimizer import PackOptimizer

SMALL = dict(steps=6, dropout=0.0, test_lengths="41,50", eval_samples=8, eval_batch_size=4,
             length_seed=0)


def cell(pe="none", kernel=None, task="reverse_string", seeds=(0, 1), lrs=(1e-3, 3e-3), **changes):
    """The configs of one table cell (seeds x learning rates) on the smoke preset."""
    settings = {**SMALL, **changes}
    return [make_config(task, pe, kernel, "smoke", seed=seed, lr=lr, **settings)
            for seed in seeds for lr in lrs]


def losses_of(configs, **options):
    """(results, per-step per-member losses) of ``execute_pack``."""
    losses: list[list[float]] = []
    results = execute_pack(configs, device="cpu", progress=False,
                           on_step=lambda step, pack_losses: losses.append(pack_losses), **options)
    return results, losses


@pytest.mark.parametrize("pe, kernel", [
    ("none", None), ("kerple", None), ("fire", None), ("rope", None), ("random_alibi", None),
    ("kerple", 1), ("alibi", 3), ("random_rope", 3),
])
def test_a_pack_trains_and_scores_what_its_members_do_alone(pe, kernel):
    configs = cell(pe, kernel)
    packed, packed_losses = losses_of(configs)
    for member, config in enumerate(configs):
        alone_losses: list[float] = []
        alone = execute_run(config, device="cpu", progress=False,
                            on_step=lambda step, loss: alone_losses.append(loss))
        assert alone.status == packed[member].status == "complete"
        np.testing.assert_allclose([step[member] for step in packed_losses], alone_losses,
                                   rtol=1e-4, atol=1e-6)
        assert packed[member].per_length == pytest.approx(alone.per_length, abs=1e-9)
        assert packed[member].score == pytest.approx(alone.score, abs=1e-9)
        assert packed[member].details["pack"]["members"] == len(configs)


def test_members_of_one_seed_start_alike_and_part_with_their_learning_rates():
    _, losses = losses_of(cell("alibi"))  # members: (seed 0, lr 1e-3), (0, 3e-3), (1, ...), ...
    first = losses[0]
    assert first[0] == first[1] and first[2] == first[3] and first[0] != first[2]
    assert all(step[0] != step[1] for step in losses[1:])


def test_a_learning_rate_of_zero_leaves_its_member_unchanged():
    configs = [dataclasses.replace(config, lr=lr)
               for config, lr in zip(cell("none", 3, lrs=(1e-2,)), (0.0, 1e-2))]
    task = configs[0].build_task()
    members = []
    for config in configs:
        torch.manual_seed(config.seed)
        members.append(build_model(task, "none", 3, **config.model_kwargs()))
    pack = stack_members(members)
    before = [p.detach().clone() for p in pack.parameters()]
    from che_bench.train.loop import train_pack

    train_pack(pack, task, configs, torch.device("cpu"), progress=False)
    after = list(pack.parameters())
    assert all(torch.equal(a[0], b[0]) for a, b in zip(after, before))
    assert any(not torch.equal(a[1], b[1]) for a, b in zip(after, before))


def test_clipping_and_adam_are_per_member_and_match_torch():
    task = make_config("even_pairs", preset="smoke").build_task()
    torch.manual_seed(0)
    members = [build_model(task, "kerple", **{"layers": 1, "dim": 8, "heads": 2, "ffn": 8})
               for _ in range(2)]
    alone = build_model(task, "kerple", layers=1, dim=8, heads=2, ffn=8)
    alone.load_state_dict(members[1].state_dict())
    pack = stack_members(members)
    optimizer = PackOptimizer(pack, [3e-3, 3e-3], (0.9, 0.999), 1e-8, max_norm=1.0)
    reference = torch.optim.Adam(alone.parameters(), lr=3e-3, betas=(0.9, 0.999), eps=1e-8)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        optimizer.zero_grad()
        reference.zero_grad()
        for packed, single in zip(pack.parameters(), alone.parameters()):
            big = torch.randn(single.shape[1:], generator=generator) * 100  # clipped
            small = torch.randn(single.shape[1:], generator=generator) * 1e-4  # not clipped
            packed.grad = torch.stack([big, small])
            single.grad = small[None].clone()
        optimizer.step()
        norms = torch.stack([torch.cat([p.grad[m].flatten() for p in pack.parameters()]).norm()
                             for m in range(2)])
        assert norms[0] > 1 and norms[1] < 1
        assert optimizer.flat_grad[0].norm() == pytest.approx(1.0, rel=1e-5)  # clipped alone
        torch.nn.utils.clip_grad_norm_(alone.parameters(), 1.0)
        reference.step()
        for packed, single in zip(pack.parameters(), alone.parameters()):
            torch.testing.assert_close(packed[1], single[0], atol=1e-7, rtol=1e-5)


def test_a_killed_pack_resumes_to_the_uninterrupted_result(tmp_path):
    configs = cell("kerple", 3, steps=8, dropout=0.1)  # dropout too: the RNG states resume
    reference, reference_losses = losses_of(configs)
    seen: list[list[float]] = []

    def stop_at_step_5(step, pack_losses):
        seen.append(pack_losses)
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute_pack(configs, device="cpu", progress=False, checkpoint_dir=tmp_path,
                     on_step=stop_at_step_5)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{c.run_id()}.pt" for c in configs)
    resumed, rest = losses_of(configs, checkpoint_dir=tmp_path)
    assert seen + rest == reference_losses
    assert [r.per_length for r in resumed] == [r.per_length for r in reference]
    assert not list(tmp_path.iterdir())  # checkpoints removed once complete


def test_members_at_different_steps_resume_as_separate_packs(tmp_path):
    configs = cell("alibi", steps=8, seeds=(0,))
    first, _ = losses_of(configs)

    def stop_at_step_3(step, pack_losses):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute_pack(configs, device="cpu", progress=False, checkpoint_dir=tmp_path,
                     on_step=stop_at_step_3)
    newcomer = cell("alibi", steps=8, seeds=(5,), lrs=(1e-3,))
    results = execute_pack(configs + newcomer, device="cpu", progress=False,
                           checkpoint_dir=tmp_path)
    assert [r.status for r in results] == ["complete"] * 3
    assert [r.per_length for r in results[:2]] == [r.per_length for r in first]


def test_bad_packs_are_refused_before_training():
    with pytest.raises(CheBenchError, match="differ in pe"):
        check_pack(cell("alibi", seeds=(0,), lrs=(1e-3,)) + cell("kerple", seeds=(1,), lrs=(1e-3,)))
    with pytest.raises(CheBenchError, match="differ in steps"):
        check_pack(cell(seeds=(0,), lrs=(1e-3,)) + cell(seeds=(1,), lrs=(1e-3,), steps=7))
    with pytest.raises(CheBenchError, match="length_seed"):
        check_pack(cell(seeds=(0, 1), lrs=(1e-3,), length_seed=None))
    with pytest.raises(CheBenchError, match="twice"):
        check_pack(cell(seeds=(0,), lrs=(1e-3,)) * 2)


def test_grouping_keeps_cells_together_and_order_stable():
    a, b = cell("alibi", seeds=(0, 1, 2), lrs=(1e-3,)), cell("kerple", seeds=(0, 1), lrs=(1e-3,))
    alone = cell("none", seeds=(0,), lrs=(1e-3,), length_seed=None)
    grid = [a[0], b[0], a[1], *alone, b[1], a[2]]
    assert group_into_packs(grid, 2) == [[a[0], a[1]], [a[2]], [b[0], b[1]], alone]
    assert group_into_packs(grid, None) == [a, b, alone]


def test_length_seed_is_left_out_of_run_ids_while_unset():
    plain = make_config("even_pairs", preset="smoke")
    assert "length_seed" not in plain.to_dict()
    assert make_config("even_pairs", preset="smoke", length_seed=0).run_id() != plain.run_id()


TINY_CLI = ["--preset", "smoke", "--steps", "4", "--test-lengths", "41", "--eval-samples", "4",
            "--eval-batch-size", "4", "--no-progress", "--device", "cpu"]


def test_run_with_seeds_and_lrs_stores_ordinary_runs(tmp_path, capsys):
    store_path = tmp_path / "store.sqlite"
    command = ["run", "--task", "reverse_string", "--pe", "kerple", "--kernel", "3", *TINY_CLI,
               "--store", str(store_path)]
    assert main([*command, "--seeds", "0:2", "--lrs", "1e-3,3e-3", "--pack", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("(in a pack of 4)") == 4 and "n=4" in out  # the cell's row: max of 4 runs
    runs = ResultStore(store_path).runs()
    assert len(runs) == 4 and set(runs["status"]) == {"complete"}
    assert sorted(zip(runs["seed"], runs["lr"])) == [(0, 1e-3), (0, 3e-3), (1, 1e-3), (1, 3e-3)]
    assert {json.loads(c)["length_seed"] for c in runs["config"]} == {0}
    assert sorted((tmp_path / "store.models").iterdir()) == sorted(
        tmp_path / "store.models" / f"{run_id}.pt" for run_id in runs["run_id"])
    # A member is the ordinary run its flags name: asked for alone, it is already complete.
    assert main([*command, "--seed", "1", "--lr", "3e-3", "--length-seed", "0"]) == 0
    assert "already complete" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [
    ["--seeds", "0:2", "--data-seed", "3"],
    ["--seeds", "5:2"],
    ["--seeds", "0:2", "--seed", "1"],
    ["--lrs", "1e-3,-1"],
    ["--lrs", "1e-3", "--lr", "1e-3"],
    ["--seeds", "0:2", "--pack", "0"],
])
def test_bad_cell_flags_are_one_line_errors(tmp_path, capsys, flags):
    store = tmp_path / "store.sqlite"
    assert main(["run", "--task", "even_pairs", *TINY_CLI, "--store", str(store), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("che-bench: error:") and err.count("\n") == 1
    assert not store.exists()


# --- randomized draws ---------------------------------------------------------------------


def recorded_draws(monkeypatch, config) -> list[torch.Tensor]:
    """Train ``config`` and return the positions its encoding drew at every step."""
    drawn: list[torch.Tensor] = []
    sample = encodings.randomized.RandomizedLayers.sample_draws

    def record(self, length, generators):
        draws = sample(self, length, generators)
        drawn.append(draws.layer(0))
        return draws

    monkeypatch.setattr(encodings.randomized.RandomizedLayers, "sample_draws", record)
    execute_run(config, device="cpu", progress=False)
    monkeypatch.undo()
    return drawn


def test_the_dropout_rate_does_not_move_the_random_positions(monkeypatch):
    low, high = (make_config("reverse_string", "random_rope", None, "smoke", steps=5,
                             dropout=rate, test_lengths="41", eval_samples=2, eval_batch_size=2)
                 for rate in (0.1, 0.3))
    first, second = recorded_draws(monkeypatch, low), recorded_draws(monkeypatch, high)
    assert len(first) == len(second) > 5
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_one_draw_per_batch_whatever_the_chunking(monkeypatch):
    config = make_config("reverse_string", "random_rope", None, "smoke", eval_samples=8,
                         eval_batch_size=4, dropout=0.0)
    task = config.build_task()
    torch.manual_seed(0)
    model = build_model(task, "random_rope", **config.model_kwargs()).eval()
    calls = []
    sample = model.sample_draws
    monkeypatch.setattr(model, "sample_draws", lambda *a, **k: calls.append(1) or sample(*a, **k))
    device = torch.device("cpu")
    whole = length_accuracies(model, task, config, 60, device)
    assert len(calls) == 2  # two sub-batches of 4
    model.set_memory_budget(1)  # one sequence and one query row at a time
    calls.clear()
    assert length_accuracies(model, task, config, 60, device) == whole
    assert len(calls) == 2  # (and out of memory: tests/test_gpu_paths.py)


def test_randomize_at_eval_off_holds_with_dropout_at_evaluation(monkeypatch):
    config = make_config("reverse_string", "random_alibi", None, "smoke", dropout_at_eval=True,
                         pe_options={"randomize_at_eval": False}, test_lengths="41",
                         eval_samples=2, eval_batch_size=2)
    task = config.build_task()
    model = build_model(task, "random_alibi", **config.model_kwargs()).train()
    assert model.sample_draws(41, evaluating=True) is None
    assert model.sample_draws(41) is not None  # in training mode, outside evaluation: drawn
    monkeypatch.setattr(model.encoding, "sample_draws",
                        lambda *a: pytest.fail("drew positions at evaluation"))
    evaluation.evaluate(model, task, config, torch.device("cpu"), progress=False)


def test_a_pack_out_of_gpu_memory_trains_as_two_narrower_packs(monkeypatch):
    from che_bench.run import runner

    real_train_pack, widths = runner.train_pack, []

    def tight_memory(model, task, configs, *args, **options):
        widths.append(len(configs))
        if len(configs) > 1:
            raise torch.cuda.OutOfMemoryError("simulated")
        return real_train_pack(model, task, configs, *args, **options)

    monkeypatch.setattr(runner, "train_pack", tight_memory)
    configs = cell("alibi")
    results = execute_pack(configs, device="cpu", progress=False)
    assert [r.status for r in results] == ["complete"] * 4
    assert [r.run_id for r in results] == [c.run_id() for c in configs]
    assert widths == [4, 2, 1, 1, 2, 1, 1]


def test_micro_batches_add_up_to_the_whole_batch(monkeypatch):
    from che_bench.run.runner import build_pack_model
    from che_bench.train.step import projected_modules, training_step

    configs = cell("random_alibi", 3)  # dropout 0; one random draw must serve every pass
    task = configs[0].build_task()
    batches = [task.sample(12, configs[0].batch_size, np.random.default_rng(c.data_seed))
               for c in configs]
    inputs = torch.from_numpy(np.stack([b.inputs for b in batches]))
    targets = torch.from_numpy(np.stack([b.targets for b in batches]))
    outcomes = []
    for micro_batches in (1, 4):
        model = build_pack_model(task, configs)
        model.seed_draws([7] * len(configs))
        optimizer = PackOptimizer(model, [c.lr for c in configs], (0.9, 0.999), 1e-8, 1.0)
        draws = []
        sample = model.sample_draws
        monkeypatch.setattr(model, "sample_draws", lambda *a, **k: draws.append(1) or sample(*a, **k))
        losses, logits = training_step(model, optimizer, inputs, targets,
                                       projected_modules(model), micro_batches)
        assert len(draws) == 1 and logits.shape[:2] == (4, configs[0].batch_size)
        outcomes.append((losses, optimizer.flat_grad.clone()))  # the (clipped) gradients
    torch.testing.assert_close(outcomes[0][0], outcomes[1][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(outcomes[0][1], outcomes[1][1], atol=1e-7, rtol=1e-4)


def test_batches_made_ahead_keep_their_order_errors_and_stop_cleanly():
    import threading

    from che_bench.train.batches import prefetched

    assert list(prefetched(iter(range(50)), 4)) == list(range(50))

    def failing():
        yield 1
        raise ValueError("made in the background")

    items = prefetched(failing(), 2)
    assert next(items) == 1
    with pytest.raises(ValueError, match="background"):
        next(items)
    endless = prefetched(iter(lambda: 0, 1), 2)  # never ends; the queue fills up
    next(endless)
    before = threading.active_count()
    endless.close()  # the producer, blocked on a full queue, stops
    assert threading.active_count() == before - 1
