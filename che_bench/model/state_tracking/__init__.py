"""The state-tracking models today's CHE users test: Mamba, DeltaNet, Gated DeltaNet,
DeltaProduct, mLSTM and sLSTM (spec state_tracking.md section 1), with the negative-eigenvalue
switch of Grazzi et al. (ICLR 2025) where the literature extends the model. Each module holds
one model's fast form; its plain recurrence, the tests' oracle, sits beside it
(``*_recurrent.py``). ``MODELS`` lists the built-ins ``che_bench.model.architectures``
registers.
"""

from __future__ import annotations

from che_bench.model.state_tracking.deltanet import DeltaNet, DeltaProduct, GatedDeltaNet
from che_bench.model.state_tracking.mamba import Mamba
from che_bench.model.state_tracking.mlstm import MLSTM
from che_bench.model.state_tracking.slstm import SLSTM
from che_bench.model.state_tracking.stack import StateTrackingModel

MODELS: tuple[type[StateTrackingModel], ...] = (
    Mamba,
    DeltaNet,
    GatedDeltaNet,
    DeltaProduct,
    MLSTM,
    SLSTM,
)

__all__ = ["MODELS", "StateTrackingModel"]
