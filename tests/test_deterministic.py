"""``--deterministic``: the numerics switches it selects (checked on a CPU, the CUDA ones as
flags), that it is recorded with a run but stays out of its id, and equal results twice."""

from __future__ import annotations

import json
import os
import sqlite3

import pytest
import torch

from che_bench.cli import main
from che_bench.config import make_config
from che_bench.run.runner import configure_numerics, execute_run


@pytest.fixture
def restore_numerics(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32)
    yield
    torch.use_deterministic_algorithms(False)
    (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, flash,
     torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) = saved
    torch.backends.cuda.enable_flash_sdp(flash)


def test_deterministic_mode_selects_every_deterministic_switch(restore_numerics):
    # The CUDA switches are process-wide flags: settable, and checkable, without a GPU.
    configure_numerics(tf32=False, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.backends.cuda.flash_sdp_enabled()
    configure_numerics(tf32=False, deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.deterministic and torch.backends.cuda.flash_sdp_enabled()


@pytest.mark.parametrize("pe, kernel", [("cope", None), ("random_learned", 3), ("relative", 1)])
def test_training_in_deterministic_mode_repeats_and_is_recorded(pe, kernel, restore_numerics):
    """Encodings with gather (CoPE, random learned, relative (Transformer-XL)) and the DAPE convolution
    train under torch's deterministic algorithms (no op refused) and give equal results."""
    config = make_config("reverse_string", pe, kernel, "smoke", steps=4, test_lengths="41",
                         eval_samples=4, eval_batch_size=4)
    first, second = (execute_run(config, device="cpu", progress=False, deterministic=True)
                     for _ in range(2))
    assert first.status == second.status == "complete", first.error
    assert first.details["deterministic"] is True
    assert first.per_length == second.per_length
    plain = execute_run(config, device="cpu", progress=False)
    assert "deterministic" not in plain.details and plain.run_id == first.run_id
    assert plain.per_length == first.per_length  # on a CPU the switch changes no number


def test_run_command_records_deterministic_mode(tmp_path, restore_numerics):
    store = tmp_path / "r.sqlite"
    assert main(["run", "--task", "even_pairs", "--preset", "smoke", "--steps", "3",
                 "--test-lengths", "41", "--device", "cpu", "--no-progress", "--deterministic",
                 "--store", str(store), "--no-keep-model"]) == 0
    with sqlite3.connect(store) as connection:
        (details,) = connection.execute("SELECT details FROM runs").fetchone()
    assert json.loads(details)["deterministic"] is True
