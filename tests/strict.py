"""What a test does when it cannot run as written.

Outside CI it skips with the reason (the test command shows reasons with ``-rs``). Under CI
(``CI=true``) it fails: a suite that passes by skipping or by quietly testing something weaker tells
a maintainer nothing. Only tests that need CUDA may skip in CI: their skip reason starts with
``CUDA_REASON_PREFIX``, and ``conftest.py`` fails a CI run in which anything else skipped.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

CUDA_REASON_PREFIX = "needs CUDA"


def allowed_in_ci(reason: str) -> bool:
    """Whether a test may skip for ``reason`` under CI: only one that needs CUDA may."""
    return reason.startswith(CUDA_REASON_PREFIX)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str) -> NoReturn:
    """This test cannot run as written here: skip outside CI, fail under CI."""
    if in_ci():
        pytest.fail(f"cannot run as written under CI: {reason}", pytrace=False)
    pytest.skip(reason)
