"""Errors that carry a one-line message for the user (the CLI prints them without a traceback)."""


class VerispecError(Exception):
    """Base class: bad input that the user can fix."""


class CheckpointError(VerispecError):
    """A checkpoint directory is missing, incomplete or does not match its config."""


class ConfigError(VerispecError):
    """An invalid option or an unsupported model configuration."""


class QueueFull(VerispecError):
    """The engine's waiting queue is full: retry later."""
