"""Shared test fixtures: where the real sparsity patterns live (../shared/data)."""

from pathlib import Path

import pytest

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The shared data folder; tests that need it skip with the reason when it is absent."""
    if not DATA_DIR.is_dir():
        pytest.skip(f"shared data folder not found at {DATA_DIR} (see DESIGN.md §5)")
    return DATA_DIR
