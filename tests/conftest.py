"""Shared fixtures. Tests that read `../shared/data` use `shared_data` and skip with a reason when it is absent."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """`../shared/data` beside the checkout (CI and dev machines have it; a user's clone does not)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"third-party data folder {SHARED_DATA} is absent (only dev and CI machines have it)")
    return SHARED_DATA
