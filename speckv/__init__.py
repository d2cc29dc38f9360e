"""speckv: lossless, compressed transfer of LLM KV caches (speculative KV coding).

Importing ``speckv`` is cheap: it never imports torch, transformers or cupy.
Layers, bottom to top (README, "Layout"; ``tests/test_layers.py``):

- the vocabulary, modules of this package: ``errors`` (the one hierarchy),
  ``status`` (the one status table), ``wire``, ``kv``, ``digests``, ``paths``;
  ``speckv.v1``, the generated gRPC stubs;
- ``speckv.coder``: the integer coder (rANS, tables, residual models,
  container format, codec);
- ``speckv.predictor``: target model, predictor checkpoint, ladder,
  calibration, entropy (torch);
- ``speckv.server``: encoder and decoder sidecars;
- ``speckv.cli``: the ``speckv`` command, demo, bench;

and ``speckv.client``, the SDK and engine adapters, on the vocabulary alone.
"""

__version__ = "0.1.0"
