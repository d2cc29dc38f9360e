"""speckv.coder: the integer coder that turns a KV cache into bits and back.

Lifecycle: the predictor (``speckv.predictor``, above this package) gives mu
for a prompt on both sidecars and a pinned checkpoint's tables and sigma; here
the residual models (``residual``) and the probability model (``model``,
``tables``) turn each scalar into rANS ops (``rans``), and the
container (``container``, FORMAT.md) frames them into self-checking chunks
(``codec`` ties it together). ``backends`` picks who runs the per-scalar
pipeline: the numpy reference, the CPU extension (``native``, built from
``kernels/``) or the CUDA kernels (``cuda``), all writing the same bytes. What the coder needs of the predictor is the
protocols of ``interfaces``; it never imports ``speckv.predictor``.

NOTE: this package must not import torch or transformers at import time; the
modules that take torch tensors import it inside functions.
"""
