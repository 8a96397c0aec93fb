"""Shared test setup.

Without a CUDA device the Triton kernels run in Triton's CPU interpreter; the variable must be set
before anything imports triton, hence here. ``VERISPEC_TEST_DEVICE`` (default ``cpu``) selects the
device that device-generic tests (the statistical suite, parity) run on.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device(os.environ.get("VERISPEC_TEST_DEVICE", "cpu"))
