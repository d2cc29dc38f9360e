"""Fuzzing of the speckv parsers, codec and sidecars.

Targets (``--targets``, default all):

* ``container.header`` / ``container.chunk`` / ``container.stream``: mutated
  (bit flips, byte sets, insertions, deletions, splices, field overwrites, with
  and without recomputed CRCs), truncated and random bytes to ``unpack_header``,
  ``unpack_chunk`` (against a valid header) and ``unpack_stream``. Only
  ``FormatError`` (and its subclasses) may escape; whatever is accepted must
  re-pack to the very same bytes.
* ``codec.speckv`` / ``codec.stored``: mutated record lists (record bytes as above,
  records dropped, duplicated, swapped, split, merged, spliced from the other
  streams; wrong prompt, wrong mu) of real small BF16 and FP8 streams to
  ``Codec.decode``. Only ``SpeckvError`` may escape; a decode that succeeds must
  return exactly the original bits, and an unmutated stream must decode.
* ``decoder.transfer``: mutated valid Transfer streams (stored and speckv, BF16
  and FP8: header fields, record bytes, parts, trailer, message order) to a real
  decoder sidecar; ``decoder.transfer_random``: random TransferRequest sequences;
  ``encoder.submit``: mutated and random Submit streams to a real encoder (which
  forwards to the real decoder); ``decoder.fetch`` / ``decoder.query``: random
  FetchKV / GetTransferStatus / CancelTransfer requests (odd and huge ids, odd
  wait times), partly against real transfers, finished or still receiving;
  ``raw.bytes``: random bytes as serialized messages to every method path.
  Every call must end with a gRPC status other than UNKNOWN and INTERNAL within
  its deadline; a transfer reported OK must be fetchable and bit-exact; after
  every input both in-flight byte budgets must drain back to 0 and no sidecar may
  have logged an error; after every target both sidecars must be SERVING.

Modules: ``findings`` (what is reported, time bounds), ``mutate`` (byte, record
and list mutators, CRC fixing), ``coder_env`` / ``coder_targets`` (valid streams,
container and codec targets), ``server_env`` (the live sidecars), ``server_mutate``
(request message mutators), ``server_targets`` / ``query_targets`` (RPC targets),
``runner`` (tally, run_target, workers, table), ``cli`` (the command line of
benchmarks/fuzz.py). The tests (tests/coder/test_container_fuzz.py,
tests/server/test_fuzz.py) drive the same generators from hypothesis.
"""
