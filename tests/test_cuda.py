"""On a CUDA GPU (``-m cuda``; skipped with a reason where torch sees none): the device agrees
with the CPU for every encoding x kernel, the evaluation's memory budget holds at n = 500, a
pack that runs out of memory under a cap splits and completes, deterministic mode repeats, a
one-member LSTM trains with cuDNN's kernel (no weight copy) as the batched loop does.

None of these has run on a GPU yet: no GPU was lent to this project's work."""

from __future__ import annotations

import pytest
import torch

from che_bench.checks import selftest, training_checks
from che_bench.config import make_config
from che_bench.encodings import list_encodings
from che_bench.model.encoder import build_model
from che_bench.run.device import configure_numerics
from che_bench.run.packing import training_bytes_per_member
from che_bench.run.runner import execute_pack, execute_run

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)"),
]
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def tf32_off():
    configure_numerics(tf32=False)
    yield
    configure_numerics(tf32=False)


@pytest.mark.parametrize("kernel", selftest.KERNELS)
@pytest.mark.parametrize("pe", [encoding.name for encoding in list_encodings()])
def test_cuda_agrees_with_the_cpu(pe, kernel):
    cases = selftest.agreement_cases(pe, kernel, CUDA, quick=False)
    assert all(case.passed for case in cases), cases


def test_the_evaluation_memory_budget_holds_at_500():
    budget = 256 << 20
    config = make_config("duplicate_string", "kerple", 3, "paper")
    task = config.build_task()
    model = build_model(task, "kerple", 3, **config.model_kwargs()).to(CUDA).eval()
    model.set_memory_budget(budget)
    inputs = torch.randint(0, task.input_size, (64, 500), device=CUDA)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model(inputs)
    torch.cuda.synchronize()
    # The row chunks' maps fill the budget; what the budget does not cover is accounted for
    # as if it were all alive at once (an upper bound): per token, the residual stream and its
    # normalised copy, q, k, v, the attention output (each dim floats) and the FFN's hidden
    # layer (ffn floats), plus the logits: 235 MiB here. One unchunked layer's scores alone
    # would take 4.3 GiB.
    tokens = 64 * task.model_length(500)
    options = config.model_options
    outside = 4 * tokens * (6 * options["dim"] + options["ffn"] + task.output_size)
    assert torch.cuda.max_memory_allocated() - baseline <= budget + outside


def test_a_pack_out_of_memory_under_a_cap_splits_and_completes():
    configs = [make_config("reverse_string", "kerple", None, "paper", seed=seed, length_seed=0,
                           steps=20, test_lengths="41", eval_samples=64) for seed in range(8)]
    per_member = training_bytes_per_member(configs[0], CUDA)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(CUDA).total_memory
    # Room for about three members' training step besides what is already allocated.
    cap = torch.cuda.memory_allocated() + 3 * per_member + (64 << 20)
    torch.cuda.set_per_process_memory_fraction(cap / total, CUDA)
    try:
        results = execute_pack(configs, device="cuda", progress=False)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, CUDA)
    assert [result.status for result in results] == ["complete"] * 8, results[0].error
    widths = {result.details.get("pack", {}).get("members", 1) for result in results}
    assert max(widths) < 8


def test_deterministic_mode_repeats_on_cuda():
    assert all(case.passed for case in training_checks.check_determinism(CUDA, quick=False))
    config = make_config("reverse_string", "cope", 3, "smoke", steps=30, test_lengths="41,60")
    first, second = (execute_run(config, device="cuda", progress=False, deterministic=True)
                     for _ in range(2))
    assert first.status == second.status == "complete", first.error
    assert first.per_length == second.per_length
    assert first.details["deterministic"] is True and first.details["tf32"] is False


def test_the_selftest_passes_on_cuda(tmp_path):
    from che_bench.cli import main

    assert main(["selftest", "--device", "cuda", "--json", str(tmp_path / "selftest.json")]) == 0


def test_a_one_member_lstm_trains_with_cudnn_in_place():
    """Issue 26, items 1 and 4: the fused call's backward runs (training mode), its weights
    reach cuDNN without a per-call copy (no warning), its gradients are the loop's."""
    import warnings

    import numpy as np

    from che_bench.model.recurrent import build_recurrent
    from che_bench.tasks import get_task

    task = get_task("reverse_string")
    torch.manual_seed(0)
    fused = build_recurrent("lstm", task, hidden_size=32).to(CUDA)
    looped = build_recurrent("lstm", task, hidden_size=32, fused=False).to(CUDA)
    looped.load_state_dict(fused.state_dict())
    sample = task.sample(20, 8, np.random.default_rng(0))
    inputs = torch.from_numpy(sample.inputs.copy()).to(CUDA)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for model in (fused, looped):
            model(inputs).square().sum().backward()
    for (name, a), b in zip(fused.named_parameters(), looped.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-5, msg=name)
