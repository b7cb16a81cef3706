"""The Ray backend end to end on a real local Ray instance (skipped without the ray extra)."""

from __future__ import annotations

import textwrap

import pytest

ray = pytest.importorskip("ray")

from che_bench.cli import main  # noqa: E402
from che_bench.run.ray_backend import RayBackend  # noqa: E402
from che_bench.run.suites import load_suite  # noqa: E402
from che_bench.store import ResultStore  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def test_ray_sweep_end_to_end_on_a_local_instance(tmp_path, local_ray, capsys):
    suite = tmp_path / "tiny.toml"
    suite.write_text(textwrap.dedent("""
        preset = "smoke"
        tasks = ["even_pairs", "parity_check"]
        encodings = ["none"]
        kernels = ["none", 3]
        [overrides]
        steps = 5
        test_lengths = "41"
        eval_samples = 8
        [resources]
        num_cpus = 1
    """))
    store_path = tmp_path / "store.sqlite"
    args = ["sweep", str(suite), "--backend", "ray", "--store", str(store_path), "--no-progress"]
    assert main(args) == 0
    ids = {c.run_id() for c in load_suite(suite).configs()}
    runs = ResultStore(store_path).runs()
    assert set(runs["run_id"]) == ids and set(runs["status"]) == {"complete"}
    assert "4 completed now" in capsys.readouterr().out
    assert ray.is_initialized()  # the sweep joined the caller's instance and left it running

    assert main(args) == 0  # resumable: nothing left to do
    assert "4 already complete, 0 completed now" in capsys.readouterr().out


def test_ray_backend_sizes_runs_to_the_cluster(local_ray):
    backend = RayBackend(run_cpus=1)
    assert backend.capacity() == 2 and backend.run_gpus == 0 and backend.options.device == "cpu"
    assert RayBackend(run_cpus=0.5).capacity() == 4
    assert RayBackend(run_cpus=1, max_in_flight=7).capacity() == 7


def test_ray_tasks_compute_in_the_portable_cpu_mode(local_ray):
    """The mode's settings reach a Ray worker before it imports torch (its runtime environment),
    and the run records the mode (issue 26, item 16)."""
    from che_bench.config import make_config
    from che_bench.run.options import RuntimeOptions

    backend = RayBackend(run_cpus=1, options=RuntimeOptions(device="cpu", portable_cpu=True))
    config = make_config("parity_check", preset="smoke", steps=2, test_lengths="41",
                         eval_samples=2, eval_batch_size=2)
    ((_, results),) = backend.wait([backend.submit([config], 1)])
    assert not isinstance(results, BaseException), results
    assert results[0].status == "complete", results[0].error
    assert results[0].details["portable_cpu"] is True
    assert results[0].versions["cpu_capability"] == "AVX2"


@pytest.mark.parametrize("device", ["cuda:1", "cuda:3"])
def test_a_gpu_index_is_refused_before_ray_starts(device, monkeypatch):
    """Issue 44: each Ray task sees only the GPU Ray grants it, as cuda:0; ``--device cuda:1``
    was passed to the tasks unchanged, naming a GPU they cannot see."""
    from che_bench.errors import CheBenchError
    from che_bench.run import ray_backend
    from che_bench.run.options import RuntimeOptions

    monkeypatch.setattr(ray_backend, "import_ray", lambda: pytest.fail("Ray was started"))
    with pytest.raises(CheBenchError, match=f"--device {device} names one GPU") as caught:
        RayBackend(options=RuntimeOptions(device=device))
    assert "\n" not in str(caught.value)
    for accepted in ("cuda", "cuda:0", "auto", "cpu"):
        ray_backend.check_ray_device(accepted)
