"""Fixtures for shadow tests; puts this directory on sys.path for ``shadow_testkit``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture
def store_url(tmp_path) -> str:
    return f"file://{tmp_path / 'shadow'}"
