"""Where verispec keeps what it builds for a user: converted models and compiled CPU kernels."""

from __future__ import annotations

import os


def cache_root() -> str:
    """``$VERISPEC_CACHE``, else ``$XDG_CACHE_HOME/verispec`` (``~/.cache/verispec``)."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                           "verispec")
    return os.environ.get("VERISPEC_CACHE", default)
