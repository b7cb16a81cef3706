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

f has two implementations, equal up to rounding (tested):

* ``chunks`` (the CPU default): for each member, f runs over chunks of (sequences, rows)
  whose hidden map (D_DAPE channels, the largest tensor) fits a core's cache. Each chunk is
  turned channel-major, ``[C, b*r*T]``, so that a key-axis convolution over the whole chunk
  is one plain matrix product: the first convolution multiplies ``[D, k*C]`` by the im2col
  matrix of its narrow input (k shifted copies); the second multiplies once by all k taps
  ``[k*H, D]`` and adds the k shifted narrow outputs. The batch-free bias channels go
  through the first convolution once and are broadcast over the batch, never tiled. f's
  output is added in place into the freshly built residual map, with a hand-written
  backward (``score_filter.ScoreFilter``). Where a C compiler built the native kernel
  (``native``: both convolutions and the activation of a query row at a time in compiled C),
  it trains DAPE V2 instead on rows of more than two of its vectors
  (``native_training``: the forward and the backward row by row, the weights' gradients as
  dot products over the rows they wrote), equal to the chunks within float32 rounding.
  Without gradients (evaluation) the
  attention goes through these chunks as cache tiles: it computes a tile's scores,
  ``DapeProcessor.tile_filter`` turns them into its probabilities in place
  (``inference.TileFilter``), and the attention finishes the tile while it is in cache. A
  tile's filter is the native kernel in its own, faster order (with the softmax; equal
  within float32 rounding), else the chunks' own arithmetic in the same order (the training
  path's logits bit for bit).
* ``convolution`` (the GPU default): one grouped ``conv2d`` per convolution for the whole
  pack (members are the groups), so a layer's filter is two cuDNN calls instead of dozens
  of cache-sized products; autograd does the backward.
"""

from che_bench.model.dape.processor import (
    IMPLEMENTATIONS,
    VARIANTS,
    DapeProcessor,
    check_kernel,
    check_variant,
)

__all__ = ["IMPLEMENTATIONS", "VARIANTS", "DapeProcessor", "check_kernel", "check_variant"]
