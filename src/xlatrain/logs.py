"""Where xlatrain's messages go: the ``xlatrain`` logger, and a console handler for it.

Library code logs (``logging.getLogger("xlatrain")``, rank 0 only for progress); it never prints.
The ``xlatrain`` command installs the console handler. A Python program whose logging is not
configured (or only by a bare ``logging.basicConfig()``, as torch_xla's import does) gets the
same handler the first time a Trainer runs, so its epoch lines show as they would on the command
line; a program that configures logging itself keeps full control.
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


def remove_console_handler() -> None:
    """Undo :func:`install_console_handler` (tests restore logging between cases)."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        if handler.get_name() == _HANDLER_NAME:
            logger.removeHandler(handler)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)


def ensure_console() -> None:
    """Install the console handler unless logging was configured: handlers on the ``xlatrain``
    logger or on the root logger.

    A bare ``logging.basicConfig()`` (one stderr handler, the default format, root at WARNING)
    does not count: torch_xla calls it at import, which would otherwise silence every epoch line
    of a torch_xla run.
    """
    logger = logging.getLogger(LOGGER_NAME)
    if logger.handlers:
        return
    root = logging.getLogger()
    if root.handlers and not _bare_basic_config(root):
        return
    install_console_handler()


def _bare_basic_config(root: logging.Logger) -> bool:
    if len(root.handlers) != 1 or root.level != logging.WARNING:
        return False
    handler = root.handlers[0]
    return (
        type(handler) is logging.StreamHandler
        and getattr(handler, "stream", None) in (sys.stderr, sys.__stderr__)
        and handler.formatter is not None
        and handler.formatter._fmt == logging.BASIC_FORMAT
    )
