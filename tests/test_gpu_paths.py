"""The GPU branches, run on a CPU: out-of-memory splits and fallbacks, budgets from (faked)
CUDA memory readings, device checks, numerics flags, copies and checkpoints' RNG states.
Each test names the defect of issue 13 it covers."""

from __future__ import annotations

import weakref

import pytest
import torch

from che_bench import device_memory
from che_bench.cli import main
from che_bench.config import make_config
from che_bench.device_memory import free_gpu_memory
from che_bench.errors import CheBenchError
from che_bench.eval import evaluation
from che_bench.eval.evaluation import evaluation_budget, length_accuracies
from che_bench.model.encoder import build_model
from che_bench.run import device, packing, runner
from che_bench.run.device import resolve_device
from che_bench.run.runner import build_pack_model, execute_pack
from che_bench.store import ResultStore
from che_bench.train import checkpoints
from che_bench.train import loop as training
from che_bench.train.batches import BatchStream, on_device
from che_bench.train.history import TrainingHistory
from che_bench.train.loop import train_pack
from tests.run_helpers import fake_cuda_memory

GIB = 1 << 30


def cell(pe="none", kernel=None, members=4, **changes):
    settings = {**dict(steps=4, dropout=0.0, test_lengths="41", eval_samples=4,
                       eval_batch_size=4, length_seed=0), **changes}
    return [make_config("reverse_string", pe, kernel, "smoke", seed=member, lr=1e-3, **settings)
            for member in range(members)]


def test_a_pack_out_of_memory_is_freed_before_its_halves_start(monkeypatch, tmp_path):
    """Defect 1: the failed pack's weights and Adam state are gone when its halves start."""
    created: list[weakref.ref] = []
    real_optimizer = training.PackOptimizer

    class Recorded(real_optimizer):
        def __init__(self, model, *args, **kwargs):
            super().__init__(model, *args, **kwargs)
            created.extend(weakref.ref(t) for t in (model, self, self.flat, self.exp_avg))

    real_train_pack, alive_at_start = runner.train_pack, []

    def out_of_memory_when_wide(model, task, configs, *args, **options):
        alive_at_start.append(sum(ref() is not None for ref in created))
        if len(configs) == 1:
            return real_train_pack(model, task, configs, *args, **options)

        def fail_after_a_step(step, losses):  # after real activations and Adam state exist
            raise torch.cuda.OutOfMemoryError("simulated")

        options["on_step"] = fail_after_a_step
        return real_train_pack(model, task, configs, *args, **options)

    monkeypatch.setattr(training, "PackOptimizer", Recorded)
    monkeypatch.setattr(runner, "train_pack", out_of_memory_when_wide)
    configs = cell(members=2)
    results = execute_pack(configs, device="cpu", progress=False, checkpoint_dir=tmp_path)
    assert [r.status for r in results] == ["complete"] * 2
    assert alive_at_start == [0, 0, 0]  # the pack of 2, then each half: nothing left over


def largest_maps(monkeypatch, model, limit):
    """Record the elements of every attention map ([M, B, H, rows, T]) the model builds, and
    fail (a simulated out-of-memory) any larger than ``limit``."""
    sizes: list[int] = []
    for block in model.blocks:
        attend = block.attention._attend

        def bounded(q, k, v, rows, ctx, attend=attend):
            members, batch, heads = q.shape[:3]
            sizes.append(members * batch * heads * (rows.stop - rows.start) * k.shape[-2])
            if sizes[-1] > limit:
                raise torch.cuda.OutOfMemoryError("simulated")
            return attend(q, k, v, rows, ctx)

        monkeypatch.setattr(block.attention, "_attend", bounded)
    return sizes


def test_evaluation_out_of_memory_shrinks_the_maps_until_they_fit(monkeypatch):
    """Defect 2: the fallback reduces the largest map (not just the sub-batch), frees memory
    outside the except block and gives the same numbers with the same random draws."""
    config = make_config("reverse_string", "random_rope", None, "smoke", eval_samples=8,
                         eval_batch_size=4, dropout=0.0)
    task = config.build_task()
    torch.manual_seed(0)
    model = build_model(task, "random_rope", **config.model_kwargs()).eval()
    device = torch.device("cpu")
    whole = length_accuracies(model, task, config, 60, device)
    unbounded = largest_maps(monkeypatch, model, limit=float("inf"))
    length_accuracies(model, task, config, 60, device)
    limit = max(unbounded) // 8
    bounded = largest_maps(monkeypatch, model, limit)
    draws, released = [], []
    sample = model.sample_draws
    monkeypatch.setattr(model, "sample_draws", lambda *a, **k: draws.append(1) or sample(*a, **k))
    monkeypatch.setattr(evaluation, "release_memory", released.append)
    assert length_accuracies(model, task, config, 60, device) == whole
    assert len(draws) == 2  # one per sub-batch, however often it was retried
    assert released and max(size for size in bounded if size <= limit) <= limit
    assert model.memory_budget_bytes < (1 << 30)


def test_evaluation_out_of_memory_at_one_row_is_raised(monkeypatch):
    """Defect 2: once a single query row of one sequence does not fit, the error stands."""
    config = make_config("reverse_string", "none", None, "smoke", eval_samples=2,
                         eval_batch_size=2, dropout=0.0)
    task = config.build_task()
    model = build_model(task, "none", **config.model_kwargs()).eval()
    largest_maps(monkeypatch, model, limit=0)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        length_accuracies(model, task, config, 41, torch.device("cpu"))


@pytest.fixture
def two_gpus(monkeypatch):
    """A CPU machine that claims two CUDA GPUs (only the queries resolve_device makes)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.parametrize("device", ["cuda:2", "cuda:99"])
def test_a_gpu_index_beyond_the_visible_ones_is_refused(two_gpus, device):
    """Defect 3: ``cuda:N`` must name a GPU that exists."""
    with pytest.raises(CheBenchError, match="does not exist"):
        resolve_device(device)


def test_visible_gpu_indices_are_accepted(two_gpus):
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda")


def test_run_on_a_missing_gpu_writes_nothing(two_gpus, tmp_path, capsys):
    """Defect 3: refused before the store marks anything started."""
    store = tmp_path / "store.sqlite"
    assert main(["run", "--task", "even_pairs", "--preset", "smoke", "--device", "cuda:99",
                 "--store", str(store)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not store.exists()


@pytest.fixture
def caching_allocator(monkeypatch):
    """Faked CUDA memory: 2 GiB free says the driver; the caching allocator of this process
    holds 6 GiB, 1 GiB of it allocated."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * GIB)


def test_free_memory_counts_the_allocators_reserved_but_unused_blocks(caching_allocator):
    """Defect 5."""
    cuda = torch.device("cuda")
    assert free_gpu_memory(cuda) == 7 * GIB
    assert evaluation_budget(cuda) == int(7 * GIB * evaluation.GPU_BUDGET_SHARE)


def test_workers_sharing_a_gpu_split_its_free_memory(caching_allocator, monkeypatch):
    """Defect 5: two workers on one GPU each plan for half the driver's free memory (and
    all of their own cache), not both for all of it."""
    monkeypatch.setattr(device_memory, "_gpu_share", device_memory.Fraction(1))
    device_memory.share_gpu_among(2)
    assert free_gpu_memory(torch.device("cuda")) == 1 * GIB + 5 * GIB


def test_a_ray_task_budgets_its_fraction_of_the_gpu(caching_allocator, monkeypatch):
    """Issue 19, item 4: a 0.25-GPU Ray task plans for a quarter of the driver's free memory
    (plus its own cache), not all of it; a task with a whole GPU for all of it."""
    from che_bench.run import ray_backend

    monkeypatch.setattr(device_memory, "_gpu_share", device_memory.Fraction(1))
    monkeypatch.setattr(device_memory, "_cpu_allowance", None)  # the task sets its own
    seen = []
    monkeypatch.setattr(ray_backend, "execute_runs", lambda configs, options, pack: seen.append(
        free_gpu_memory(torch.device("cuda"))) or [])
    torch_threads = torch.get_num_threads()
    try:
        ray_backend._run_in_ray_task([], 1, None, 1, 0.25)
        ray_backend._run_in_ray_task([], 1, None, 1, 1.0)
    finally:
        torch.set_num_threads(torch_threads)
    assert seen == [GIB // 2 + 5 * GIB, 2 * GIB + 5 * GIB]


def test_pack_auto_sizes_from_what_the_process_can_fill(caching_allocator, monkeypatch):
    """Defect 5: 7 GiB usable x 0.7 / 1 GiB per member = 4 members (the driver's 2 GiB: 1)."""
    monkeypatch.setattr(packing, "training_bytes_per_member", lambda config, device: GIB)
    assert packing.resolve_width("auto", cell()[0], torch.device("cuda")) == 4


def test_re_evaluation_applies_the_runs_numerics(tmp_path):
    """Defect 7: ``che-bench evaluate`` turns TF32 off (cuDNN's default is on) for runs
    trained without it."""
    store = tmp_path / "store.sqlite"
    assert main(["run", "--task", "even_pairs", "--preset", "smoke", "--device", "cpu",
                 "--store", str(store), "--no-progress"]) == 0
    run_id = ResultStore(store).runs()["run_id"].iloc[0]
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert main(["evaluate", run_id, "--store", str(store), "--device", "cpu",
                     "--no-progress"]) == 0
        assert not torch.backends.cudnn.allow_tf32
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def test_evaluation_copies_its_batches_without_waiting(monkeypatch):
    """Defect 9: every host-to-device copy of an evaluation is non-blocking."""
    config = make_config("reverse_string", "none", None, "smoke", eval_samples=4,
                         eval_batch_size=2, dropout=0.0)
    task = config.build_task()
    model = build_model(task, "none", **config.model_kwargs()).eval()
    copies = []
    real_to = torch.Tensor.to

    def recorded(tensor, *args, **kwargs):
        copies.append(kwargs.get("non_blocking", False))
        return real_to(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recorded)
    length_accuracies(model, task, config, 41, torch.device("cpu"))
    assert len(copies) >= 6 and all(copies)  # inputs, targets, mask per sub-batch


def test_prefetched_batches_equal_the_stream(monkeypatch):
    """The GPU's prefetching thread, selected on a CPU, yields the stream in order."""
    configs = cell(members=2)
    task = configs[0].build_task()
    direct = on_device(iter(BatchStream(task, configs)), torch.device("cpu"), prefetch=False)
    ahead = on_device(iter(BatchStream(task, configs)), torch.device("cpu"), prefetch=True)
    for _ in range(5):
        a, b = next(direct), next(ahead)
        assert a.length == b.length and torch.equal(a.inputs, b.inputs)
    direct.close(), ahead.close()


def test_training_with_the_gpu_loop_equals_the_cpu_loop():
    """Prefetching and reading the device every N steps (the GPU's loop) change nothing."""
    configs = cell(members=2, steps=7)
    task = configs[0].build_task()
    finals = []
    for options in ({}, {"prefetch": True, "sync_every": 3}):
        model = build_pack_model(task, configs)
        outcome = train_pack(model, task, configs, torch.device("cpu"), progress=False, **options)
        finals.append((outcome.final_losses, [p.detach().clone() for p in model.parameters()]))
    assert finals[0][0] == finals[1][0]
    assert all(torch.equal(a, b) for a, b in zip(finals[0][1], finals[1][1]))


def test_a_checkpoint_keeps_only_the_training_gpus_rng_state(two_gpus, monkeypatch, tmp_path):
    """Defect 11: a checkpoint written with two GPUs visible resumes where only one is."""
    states = {index: torch.full((16,), index, dtype=torch.uint8) for index in (0, 1)}
    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(states.values()))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[device.index])
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device="cuda": restored.append((device, state)))

    def fewer_gpus(new_states):
        raise RuntimeError("invalid device ordinal")  # what torch says with one GPU left

    monkeypatch.setattr(torch.cuda, "set_rng_state_all", fewer_gpus)
    configs = cell(members=1, steps=2)
    task = configs[0].build_task()
    paths = [tmp_path / "member.pt"]
    model = build_pack_model(task, configs)
    checkpoints.save_checkpoints(paths, configs, training.PackOptimizer(
        model, [1e-3], (0.9, 0.999), 1e-8, 1.0), BatchStream(task, configs, model=model).states(),
        2, 0.0, TrainingHistory([1e-3], 1, 2), torch.device("cuda", 1))
    saved = torch.load(paths[0], weights_only=True)
    assert torch.equal(saved["device_rng"], states[1]) and "cuda_rng" not in saved
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    model = build_pack_model(task, configs)
    checkpoints.load_checkpoints(paths, configs, training.PackOptimizer(
        model, [1e-3], (0.9, 0.999), 1e-8, 1.0), BatchStream(task, configs, model=model),
        TrainingHistory([1e-3], 1, 2), torch.device("cuda", 0))
    assert [(device.index, state[0].item()) for device, state in restored] == [(0, 1)]


def test_cpu_training_saves_no_gpu_rng_state(two_gpus, monkeypatch, tmp_path):
    """Defect 11: training on the CPU of a GPU machine keeps no GPU's RNG state."""
    monkeypatch.setattr(torch.cuda, "get_rng_state_all",
                        lambda: pytest.fail("read every GPU's RNG state"))
    configs = cell(members=1, steps=2)
    task = configs[0].build_task()
    path = tmp_path / "member.pt"
    train_pack(build_pack_model(task, configs), task, configs, torch.device("cpu"),
               checkpoints=[path], progress=False)
    assert torch.load(path, weights_only=True)["device_rng"] is None



def test_a_members_training_memory_is_its_peak_above_the_weights(monkeypatch):
    """The measurement behind ``--pack auto`` (CUDA's memory queries faked): the peak of one
    step of a pack of two above what was allocated before it, per member."""
    fake_cuda_memory(monkeypatch, [100, 100 + 5000])
    torch.manual_seed(5)
    expected = torch.rand(1)
    torch.manual_seed(5)
    assert packing.training_bytes_per_member(cell()[0], torch.device("cpu")) == 5000 // 2
    assert torch.equal(torch.rand(1), expected)  # the global RNG is left as it was


def test_a_gpu_is_described_by_its_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    assert device.describe_device(torch.device("cuda", 0)) == "cuda:0 (Fake GPU)"


def test_dape_convolutions_evaluate_as_the_chunked_filter():
    """The GPU's DAPE filter (grouped convolutions), selected on a CPU, in an evaluation
    split into row chunks: the same accuracies as the CPU's filter."""
    configs = cell("kerple", 3, members=2)
    task = configs[0].build_task()
    accuracies = []
    for implementation in ("chunks", "convolution"):
        model = build_pack_model(task, configs).eval()
        for block in model.blocks:
            block.attention.dape.implementation = implementation
        model.set_memory_budget(1 << 16)  # several row chunks per sub-batch
        accuracies.append(length_accuracies(model, task, configs[0], 60, torch.device("cpu")))
    assert accuracies[0] == pytest.approx(accuracies[1], abs=1e-9)


def test_dropout_at_evaluation_does_not_depend_on_the_memory_budget():
    """Issue 19, item 7: with --dropout-at-eval, a budget that splits each sub-batch into
    single sequences gives the numbers of the unsplit pass (one draw per sequence)."""
    config = cell("kerple", members=1, dropout=0.3, dropout_at_eval=True, eval_samples=6,
                  eval_batch_size=6, test_lengths="41,60")[0]
    task = config.build_task()
    torch.manual_seed(0)
    model = build_model(task, "kerple", None, **config.model_kwargs())
    model.train(True)
    scores = []
    for budget in (1 << 40, 1):  # all at once; one sequence at a time
        model.set_memory_budget(budget)
        scores.append([length_accuracies(model, task, config, n, torch.device("cpu"))
                       for n in config.test_lengths])
    assert scores[0] == scores[1]
    # Dropout is on: another seed per sequence gives other numbers.
    model.set_memory_budget(1 << 40)
    torch.manual_seed(1)
    other = model(torch.zeros(2, 41, dtype=torch.long), evaluating=True,
                  dropout_seeds=model.sample_dropout_seeds(2))
    again = model(torch.zeros(2, 41, dtype=torch.long), evaluating=True,
                  dropout_seeds=model.sample_dropout_seeds(2))
    assert not torch.equal(other, again)
