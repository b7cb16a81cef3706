"""DAPE and DAPE V2: learned processors of the pre-softmax attention scores.

Given the scaled scores ``S`` ``[M, B, H, R, T]`` of ``R`` query rows (``M`` members of a
pack, see ``che_bench.members``) and, for encodings that carry one, the additive positional
bias ``Bias`` ``[M or 1, 1, H, R, T]``, the processor returns the logits that go into the
softmax (variant ``concat_residual``, the default)::

    logits = S + Bias + f([S; Bias])
    f(Z)   = Conv_{D->H}( LeakyReLU( Conv_{C->D}(Z) ) )

Both convolutions have a ``1 x k`` kernel along the KEY axis (zero "same" padding, with
biases), so query rows never mix and chunking over rows is exact. ``k = 1`` is DAPE (a
two-layer MLP over the score channels at every (i, j)); odd ``k >= 3`` is DAPE V2, whose
output at (i, j) sees keys ``j-(k-1) .. j+(k-1)`` of row i. Every member has its own f.

f has three implementations, equal up to rounding (tested):

* ``chunks`` (the CPU filter without a compiler): for each member, f runs over chunks of
  (sequences, rows) whose hidden map (D_DAPE channels, the largest tensor) fits a core's
  cache. Each chunk is turned channel-major, ``[C, b*r*T]``, so that a key-axis convolution
  over the whole chunk is one plain matrix product: the first convolution multiplies
  ``[D, k*C]`` by the im2col matrix of its narrow input (k shifted copies); the second
  multiplies once by all k taps ``[k*H, D]`` and adds the k shifted narrow outputs. The
  batch-free bias channels go through the first convolution once and are broadcast over the
  batch, never tiled. f's output is added in place into the freshly built residual map, with
  a hand-written backward (``score_filter.ScoreFilter``).
* ``native`` (the CPU default where a C compiler built it): both convolutions and the
  activation of a query row at a time in compiled C, in an order of its own, so equal to the
  chunks within float32 rounding. It trains DAPE V2 (``native_training``: the forward row
  by row; the backward recomputes each row's hidden map, takes the gradients through it
  and writes zero-padded rows, over which the weights' gradients are dot products); DAPE
  k = 1 trains with the chunks.
* ``convolution`` (the GPU default): one grouped ``conv2d`` per convolution for the whole
  pack (members are the groups), so a layer's filter is two cuDNN calls instead of dozens
  of cache-sized products; autograd does the backward.

Without gradients (evaluation) the attention goes through the chunks as cache tiles: it
computes a tile's scores, ``DapeProcessor.tile_filter`` turns them into its probabilities
in place (``inference.TileFilter``), and the attention finishes the tile while it is in
cache. A tile's filter is the native kernel (with the softmax), else the chunks' own
arithmetic; where training takes the same one, with the scores as f's content (the concat
variants without ``tril``), the logits are the training path's bit for bit.
"""

from che_bench.model.dape.processor import (
    IMPLEMENTATIONS,
    VARIANTS,
    DapeProcessor,
    check_kernel,
    check_variant,
)

__all__ = ["IMPLEMENTATIONS", "VARIANTS", "DapeProcessor", "check_kernel", "check_variant"]
