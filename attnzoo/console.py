"""Logging for the command lines: one stderr line per message, whoever logs it."""
from __future__ import annotations

import logging
import sys


def setup_logging(level: int) -> None:
    """Like ``logging.basicConfig(level=..., format="%(message)s")`` (nothing added where the root logger has
    a handler already), except that a record a library prints through its own handler (huggingface_hub and
    datasets install one and still propagate) is not printed a second time by the root's."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(_not_printed_below)
        root.addHandler(handler)
    root.setLevel(level)


def _not_printed_below(record: logging.LogRecord) -> bool:
    logger = logging.getLogger(record.name)
    while logger.parent is not None:  # up to, not including, the root
        if logger.handlers:
            return False
        if not logger.propagate:
            break
        logger = logger.parent
    return True
