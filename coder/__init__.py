"""speckv.coder: everything that turns a KV cache into bits and back.

Lifecycle: a target model (``target``) produces the exact KV of a prompt; a
pinned predictor checkpoint (``predictor``) produces mu for the same prompt on
both sidecars; calibration (``calibrate``) fixed sigma and the mixture once;
``entropy`` measures the ideal code length; the coder (rANS + container) turns
KV into chunks and back.

NOTE: this package must not import torch or transformers at import time; the
modules that need them import them inside functions.
"""
