"""Errors that carry a message meant for the user (CLI prints it, server maps it to 4xx)."""


class NanojaxError(Exception):
    """Base class: the message names the problem."""


class ConfigError(NanojaxError):
    pass


class CheckpointError(NanojaxError):
    """Missing, truncated or corrupt files, or weights that do not match the config."""


class UnsupportedError(NanojaxError):
    """A valid input that nanojax does not handle (quant type, architecture, tokenizer)."""


class EngineDeadError(RuntimeError):
    """A step failed: the engine's state (pages, steps in flight) can no longer be trusted,
    so it takes no more work and says why (vLLM's EngineDeadError)."""
