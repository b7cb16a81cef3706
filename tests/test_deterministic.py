"""``--deterministic``: the numerics switches it selects (checked on a CPU, the CUDA ones as
flags), that it is recorded with a run but stays out of its id, equal results twice, and
CoPE's counts, mLSTM's and the delta rule's sums without the float ``cumsum`` that CUDA refuses
there on older torch versions."""

from __future__ import annotations

import json
import os
import sqlite3

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from che_bench.cli import main
from che_bench.config import make_config
from che_bench.encodings import build_encoding
from che_bench.encodings.common import running_sum
from che_bench.run.device import configure_numerics
from che_bench.model.state_tracking import delta_rule
from che_bench.run.runner import execute_run
from tests.model_helpers import inputs_for, tiny


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
    # On a CPU the switch changes no number but CoPE's counts (float rounding: not one answer).
    assert plain.per_length == first.per_length


def test_run_command_records_deterministic_mode(tmp_path, restore_numerics):
    store = tmp_path / "r.sqlite"
    assert main(["run", "--task", "even_pairs", "--preset", "smoke", "--steps", "3",
                 "--test-lengths", "41", "--device", "cpu", "--no-progress", "--deterministic",
                 "--store", str(store), "--no-keep-model"]) == 0
    with sqlite3.connect(store) as connection:
        (details,) = connection.execute("SELECT details FROM runs").fetchone()
    assert json.loads(details)["deterministic"] is True


class FloatCumsums(TorchDispatchMode):
    """Counts the float ``cumsum`` ops dispatched inside it, those of backward passes too."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.cumsum and args[0].is_floating_point():
            self.count += 1
        return func(*args, **(kwargs or {}))


def cope_scores(hook, q, k):
    """CoPE's scores of every row and the gradients of their sum with respect to q, k."""
    scores = hook.scores(q, k, slice(0, q.shape[-2]), None)
    return (scores, *torch.autograd.grad(scores.sum(), (q, k)))


def test_deterministic_cope_counts_without_float_cumsum_and_alike(restore_numerics):
    # CUDA's float cumsum is refused under deterministic algorithms by older torch versions.
    torch.manual_seed(0)
    encoding = build_encoding("cope", dim=32, heads=4, layers=1, train_max_tokens=60)
    hook = encoding.hooks[0]
    for table in (hook.left, hook.right):
        torch.nn.init.normal_(table)
    q, k = (torch.randn(2, 3, 4, 50, 8, requires_grad=True) for _ in range(2))
    with FloatCumsums() as plain_mode:
        plain = cope_scores(hook, q, k)
    assert plain_mode.count > 0  # the spy sees cumsum where it runs
    torch.use_deterministic_algorithms(True)
    with FloatCumsums() as deterministic_mode:
        deterministic = cope_scores(hook, q, k)
    assert deterministic_mode.count == 0
    for got, expected in zip(deterministic, plain):  # scores, then gradients summed over rows
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("from_the_right", [False, True])
def test_deterministic_running_sum_equals_cumsum(from_the_right, restore_numerics):
    values = torch.rand(2, 3, 7, 200, dtype=torch.float32)
    expected = values.flip(-1).cumsum(-1).flip(-1) if from_the_right else values.cumsum(-1)
    torch.use_deterministic_algorithms(True)
    torch.testing.assert_close(running_sum(values, from_the_right), expected)


def test_cublas_workspace_is_set_before_the_first_cuda_work(restore_numerics, monkeypatch):
    """Issue 19, item 6: cuBLAS reads its workspace setting once, when it starts; a
    deterministic run sets it before the ``--pack auto`` probe (its first CUDA work), and the
    self-test before its first check."""
    from che_bench.checks import selftest
    from che_bench.run import packing, runner

    seen = {}

    class Stop(Exception):
        pass

    def probe(name):
        def record(*args, **kwargs):
            seen[name] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
            raise Stop
        return record

    config = make_config("parity_check", "none", None, "smoke")
    monkeypatch.setattr(packing, "resolve_width", probe("pack probe"))
    with pytest.raises(Stop):
        runner.execute_runs([config], device="cpu", deterministic=True, pack="auto")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.setattr(selftest, "CHECKS", (("a", "agreement", probe("selftest (a)")),))
    with pytest.raises(Stop):
        selftest.run_selftest(torch.device("cpu"), quick=True)
    assert seen == {"pack probe": ":4096:8", "selftest (a)": ":4096:8"}


def logits_and_gradients(model, inputs):
    """A model's logits and the gradients of their sum with respect to its parameters."""
    logits = model(inputs)
    return (logits, *torch.autograd.grad(logits.sum(), list(model.parameters())))


@pytest.mark.parametrize("name", ["mlstm", "gated_deltanet", "deltaproduct"])
def test_deterministic_state_tracking_models_sum_without_float_cumsum_and_alike(
    name, restore_numerics, monkeypatch
):
    """Issue 44: mLSTM's summed log-forget gates and the delta rule's in-chunk gate prefixes
    took CUDA's float cumsum, which torch before 2.6 refuses under deterministic algorithms;
    they take CoPE's running sum there. The chunkwise delta rule (the GPU's) on 70 tokens, two
    chunks."""
    monkeypatch.setattr(delta_rule, "native_delta_rule", lambda: None)
    model = tiny(name, members=2)
    inputs = inputs_for("parity_check", 70)
    with FloatCumsums() as plain_mode:
        plain = logits_and_gradients(model, inputs)
    assert plain_mode.count > 0  # the spy sees cumsum where it runs
    torch.use_deterministic_algorithms(True)
    with FloatCumsums() as deterministic_mode:
        deterministic = logits_and_gradients(model, inputs)
    assert deterministic_mode.count == 0
    for got, expected in zip(deterministic, plain, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
