"""A complete che-bench plugin in one module (the documentation's snippet; tests/test_plugins.py
checks that ``che-bench check-encoding my_pe`` and ``check-task every_other`` pass it).

From this folder: ``che-bench --plugin my_plugin check-encoding my_pe --pe-option power=0.5``.
"""

import numpy as np
import torch
from torch import nn

from che_bench.encodings import AttentionHook, PositionalEncoding, register
from che_bench.errors import CheBenchError
from che_bench.tasks import Batch, Task, register_task


class DistancePenalty(AttentionHook):
    """bias[m, 0, h, i, j] = -slope[m, h] * |i - j| ** power, a learned slope per head."""

    def __init__(self, heads, members, power):
        super().__init__()
        self.power = power
        # Every parameter leads with the member axis M: a pack trains M models side by side.
        self.slope = nn.Parameter(torch.full((members, heads), 0.5))

    def bias(self, rows, length, ctx):
        # Only the query rows asked for (evaluation goes over chunks of rows), all the keys.
        positions = torch.arange(length, device=self.slope.device)
        distance = (positions[rows, None] - positions[None, :]).abs().float()
        # [M, 1, H, R, T]: a member axis of M (learned per member), 1 if shared by all.
        return -self.slope[:, None, :, None, None] * distance**self.power

    def reference_bias(self, query, key, ctx):
        # The same bias for one query and one key, [M, 1, H], straight from the formula:
        # check-encoding compares bias() with it at every (query, key).
        return -self.slope[:, None, :] * abs(query - key) ** self.power


@register("my_alias")  # a name already taken is an error
class MyEncoding(PositionalEncoding):
    name, kind, description = "my_pe", "relative", "learned penalty on |i - j| ** power"
    carries_bias = True  # set on the encoding class: che-bench reads it (DAPE sees 2H channels)

    def __init__(self, *, power=1.0, **shape):
        # The model's shape (dim, heads, layers, train_max_tokens, members) is passed on and
        # kept as attributes: self.heads, self.layers, ...
        super().__init__(**shape)
        # --pe-option values arrive typed (JSON): power=2 is an int, 0.5 a float, true a bool,
        # anything else a string. A CheBenchError is the one-line usage error (exit 2).
        if isinstance(power, bool) or not isinstance(power, (int, float)) or not 0 < power <= 2:
            raise CheBenchError(f"encoding 'my_pe': power must be in (0, 2], got {power!r}")
        self.hooks = nn.ModuleList(DistancePenalty(self.heads, self.members, float(power))
                                   for _ in range(self.layers))
        self.resolved_options = {"power": float(power)}  # recorded with every run


@register_task
class EveryOther(Task):
    """Copy the tokens at even positions: ``2 0 1 1 3`` -> ``2 1 3``."""

    name, level = "every_other", "regular"
    output_length_formula = "ceil(n/2)"  # shown by `che-bench tasks`

    def __init__(self, vocab_size=4):  # task parameters: --param vocab_size=3
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise CheBenchError(f"task 'every_other': vocab_size must be an integer >= 2, "
                                f"got {vocab_size!r}")
        self.input_size = self.output_size = vocab_size

    def params(self):
        return {"vocab_size": self.input_size}  # recorded with every run

    def output_length(self, n):
        return (n + 1) // 2  # the model appends this many placeholders and reads them

    def _sample(self, n, batch_size, rng):  # n is already checked
        inputs = rng.integers(0, self.input_size, size=(batch_size, n))
        targets = inputs[:, ::2]
        return Batch(inputs, targets, np.ones(targets.shape, dtype=bool))  # mask: what counts

    def _solve(self, inputs):  # the oracle, recomputed from the inputs alone
        targets = np.stack([row[np.arange(len(row)) % 2 == 0] for row in inputs])
        return targets, np.ones(targets.shape, dtype=bool)
