"""The one error hierarchy of speckv: every failure a caller can act on has its own
class, and every class here derives from :class:`SpeckvError`. How each reaches a
gRPC caller (status code, ErrorInfo reason, in-band code) is ``speckv.status``.

Imported by every layer (client, coder, predictor, server): it imports nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import grpc


class SpeckvError(Exception):
    """Base class of every error speckv raises on purpose."""


class ModelLoadError(SpeckvError):
    """A target model or its embedded GGUF could not be found or loaded."""


class CheckpointError(SpeckvError):
    """A predictor checkpoint is missing files or is malformed."""


class PinMismatchError(CheckpointError):
    """A checkpoint's content does not hash to its manifest or to the expected pin."""


class CalibrationError(SpeckvError):
    """Calibration text is too short or yields no usable statistics."""


class CodecError(SpeckvError):
    """A stream cannot be decoded with this predictor and prompt."""


class IntegrityError(CodecError):
    """Decoded data failed its checksum or held symbols no encoder emits: corrupt stream."""


class MuMismatchError(CodecError):
    """The decoder's mu differs from the encoder's (other predictor, GPU or library build)."""


class PromptMismatchError(CodecError):
    """The prompt token ids differ from the ones the stream was encoded with."""


class FormatError(SpeckvError, ValueError):
    """The bytes (or the values to be written) do not form a valid stream."""


class UnsupportedVersionError(FormatError):
    """A stream of a format version this reader does not read (a newer writer): the
    encoder's handshake answers it with a stream of an older version."""


class TruncatedError(FormatError):
    """The input ends before the record it describes does."""


class ChecksumError(FormatError):
    """A record's CRC-32 does not match its contents."""


class RansDecodeError(SpeckvError, ValueError):
    """A rANS stream is corrupt, truncated or inconsistent."""


class TransferDigestError(IntegrityError):
    """The decoded KV as a whole does not match the encoder's whole-transfer digest."""


class BudgetExceeded(SpeckvError):
    """A single reservation larger than the whole cap: it could never be granted."""


class HoldingClosed(SpeckvError):
    """The transfer owning a holding ended (failed or cancelled) while it waited."""


class RpcError(SpeckvError):
    """A failure whose gRPC status code the raiser chose (e.g. NOT_FOUND for an
    unknown request id); ``code`` is a ``grpc.StatusCode``, ``reason`` the
    google.rpc.ErrorInfo reason (default: the code's name)."""

    def __init__(self, code: "grpc.StatusCode", message: str, reason: str = "") -> None:
        super().__init__(message)
        self.code, self.reason = code, reason


class RpcFailed(SpeckvError):
    """A sidecar call failed (client side); ``code`` is its grpc.StatusCode, ``reason``
    the ErrorInfo reason of its google.rpc.Status details ("" when it sent none)."""

    def __init__(self, code: "grpc.StatusCode", details: str, reason: str = "",
                 retry_after: float | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details, self.reason, self.retry_after = code, details, reason, retry_after
