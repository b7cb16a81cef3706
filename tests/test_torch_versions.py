"""What che-bench asks of torch and of the build: the torch APIs newer than the declared
minimum have fallbacks that compute the same (tested here with the API taken away), and the
package installs with the setuptools its build requirement allows (issue 44, item 12)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from che_bench.encodings.common import autocast_off, running_sum
from che_bench.model.state_tracking.delta_rule import delta_product
from che_bench.model.state_tracking.layers import MemberRMSNorm
from tests.test_delta_rule import rule_inputs

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_rms_norm_without_torch_s_fused_one_is_the_same(monkeypatch):
    """``F.rms_norm`` came with torch 2.4."""
    norm = MemberRMSNorm(2, 6)
    x = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    fused = norm(x)
    monkeypatch.delattr(F, "rms_norm", raising=False)
    torch.testing.assert_close(norm(x), fused)


def test_autocast_is_switched_off_without_torch_s_availability_check(monkeypatch):
    """``torch.amp.is_autocast_available`` came with torch 2.4: without it, autocast is off
    on a CPU and the meta device (which has none) still runs the delta rule and the
    deterministic running sum."""
    monkeypatch.delattr(torch.amp, "is_autocast_available", raising=False)
    with torch.autocast("cpu", dtype=torch.bfloat16), autocast_off("cpu"):
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32
    args = [None if x is None else x.to("meta") for x in rule_inputs(70, 1, gated=True)]
    assert delta_product(*args, chunk=64).shape == (2, 2, 70, 4)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert running_sum(torch.ones(3, 9, device="meta"), from_the_right=True).shape == (3, 9)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def test_the_build_takes_setuptools_before_77():
    """setuptools before 77 refuses an SPDX string as ``project.license`` (``pip install
    --no-deps -e .`` failed there); the table form installs from 64 on (verified with 64.0.0,
    68.2.2 and 75.8.0 without build isolation, and 80.9.0, 84.2.1: docs/install.md)."""
    pyproject = tomllib.loads(PYPROJECT.read_text())
    assert pyproject["project"]["license"] == {"text": "Apache-2.0"}
    assert pyproject["build-system"]["requires"] == ["setuptools>=64"]

