"""verispec's log lines on stderr, shown by default (as vLLM does with its own logger).

The ``verispec`` logger gets one stderr handler at INFO at import: start-up phases (the first
run's GGUF conversion and kernel build), CUDA-graph captures and the vLLM-format ``SpecDecoding
metrics: ...`` line every few seconds of a long speculative run. ``VERISPEC_CONFIGURE_LOGGING=0``
leaves the logger alone (configure it, or the root logger, yourself); ``VERISPEC_LOGGING_LEVEL``
sets its level (e.g. ``WARNING`` to hide the INFO lines).
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "verispec"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is logged (it may be replaced after
    import: a notebook, a test's capture)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging() -> None:
    """Give the ``verispec`` logger a stderr handler, once, unless switched off."""
    if os.environ.get("VERISPEC_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger(LOGGER_NAME)
    if any(getattr(h, "_verispec", False) for h in logger.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("[verispec] %(message)s"))
    handler._verispec = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("VERISPEC_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False  # one copy of each line, also where the root logger prints


def warn_once(logger: logging.Logger, key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is given in this process (the keys
    seen live on the logger, the one object all callers share)."""
    seen = logger.__dict__.setdefault("_verispec_warned", set())
    if key not in seen:
        seen.add(key)
        logger.warning(message)
