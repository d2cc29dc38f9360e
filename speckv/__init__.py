"""speckv: lossless, compressed transfer of LLM KV caches (speculative KV coding).

Importing ``speckv`` is cheap: it never imports torch, transformers or cupy.
Subpackages:

- ``speckv.coder``: target model, predictor checkpoint, probability model,
  rANS coder, container format, codec.
- ``speckv.server``: encoder and decoder sidecars.
- ``speckv.client``: Python client, CLI, demo.
"""

__version__ = "0.1.0"
