"""Errors raised when the hardware a user asked for is not there."""


class BackendUnavailableError(RuntimeError):
    """The requested accelerator is absent; the message says what was found and what to do."""
