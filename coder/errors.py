"""Typed errors of speckv: every failure a caller can act on has its own class."""


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
