"""Where xlatrain's messages go: the ``xlatrain`` logger, and a console handler for it.

Library code logs (``logging.getLogger("xlatrain")``, rank 0 only for progress); it never prints.
The ``xlatrain`` command installs the console handler. A Python program whose logging does not
show xlatrain's INFO lines gets the same handler the first time a Trainer runs, so its epoch
lines show as they would on the command line; a program that routes them itself (a handler on
the ``xlatrain`` logger, or root handlers at INFO) keeps full control.
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "xlatrain"
_HANDLER_NAME = "xlatrain-console"


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is at the time of each message (it may be swapped)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001
        pass


def get_logger(name: str = LOGGER_NAME) -> logging.Logger:
    return logging.getLogger(name)


def install_console_handler(level: int = logging.INFO) -> logging.Handler:
    """Send ``xlatrain`` messages at ``level`` and above to stdout as bare lines (idempotent)."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in logger.handlers:
        if handler.get_name() == _HANDLER_NAME:
            return handler
    handler = _StdoutHandler()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    # This handler is the output: a root handler that a library installed (torch_xla calls
    # logging.basicConfig() at import) must not print every line a second time.
    logger.propagate = False
    return handler


def has_console_handler() -> bool:
    """True when :func:`install_console_handler` has put xlatrain's handler in place."""
    return any(h.get_name() == _HANDLER_NAME for h in logging.getLogger(LOGGER_NAME).handlers)


def remove_console_handler() -> None:
    """Undo :func:`install_console_handler` (tests restore logging between cases)."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        if handler.get_name() == _HANDLER_NAME:
            logger.removeHandler(handler)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)


def ensure_console() -> None:
    """Install the console handler unless logging was configured to show xlatrain's lines: a
    handler on the ``xlatrain`` logger, or root handlers at a level that lets INFO through.

    A bare ``logging.basicConfig()`` (root at WARNING) is not such a choice: torch_xla calls it
    at import, which would otherwise silence every epoch line of a torch_xla run.
    """
    logger = logging.getLogger(LOGGER_NAME)
    if logger.handlers:
        return
    root = logging.getLogger()
    if root.handlers and logger.getEffectiveLevel() <= logging.INFO:
        return
    install_console_handler()
