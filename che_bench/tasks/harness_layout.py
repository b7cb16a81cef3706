"""The xLSTM harness's layout of parity and modular arithmetic (Beck et al. 2024's harness,
reused by Grazzi et al. 2025; spec state_tracking.md 2.1), the task parameter
``layout="harness"`` of ``parity_check`` and ``modular_arithmetic``.

CHE's layout appends an empty token and reads a head over the answer classes there. The
harness reads the answer at the last input token (parity: the last bit; modular arithmetic:
an ``=`` after the expression), through a head over its whole vocabulary (3 ids for parity:
padding and two bits; m + 5 for modular arithmetic: padding, ``+ - * =`` and the m digits),
and trains on its sequences of 3..40 tokens counting the answer. Here ``n`` counts the tokens
the model reads (the harness's length less the answer), so that its training lengths are
n = 2..39 (the ``state_tracking`` preset's, from the task's minimum length 2) and its test
lengths 40..256 are n = 39..255 (the preset's test range). The answer is scored at the last
position only; the other positions are masked out of the loss as well (an in-place layout).
The head's classes beyond the answers are never right, as the harness's padding and symbol
ids never are: the chance level stays 1 / answers.
"""

from __future__ import annotations

import numpy as np

from che_bench.tasks.base import check_choice_param

CHE, HARNESS = "che", "harness"
LAYOUTS = (CHE, HARNESS)
#: The shortest sequence the harness trains on, in tokens the model reads (3 with the answer).
HARNESS_MIN_LENGTH = 2


def check_layout(task_name: str, layout: object) -> str:
    """``layout`` if it is one of ``LAYOUTS``, else a one-line CheBenchError."""
    return check_choice_param(task_name, "layout", layout, LAYOUTS)


def layout_params(layout: str) -> dict[str, str]:
    """The layout as a recorded task parameter: none for CHE's (run ids stay as they were)."""
    return {} if layout == CHE else {"layout": layout}


def answer_at_last(inputs: np.ndarray, classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(targets, mask) of the harness layout: one target per input position, the answer
    ``classes`` at the last, which alone is scored."""
    targets = np.zeros(inputs.shape, dtype=np.int64)
    targets[:, -1] = classes
    mask = np.zeros(inputs.shape, dtype=bool)
    mask[:, -1] = True
    return targets, mask
