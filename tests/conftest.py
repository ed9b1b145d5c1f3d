import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture
def shared_data() -> Path:
    """../shared/data, or skip: a fresh clone has no ../shared."""
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip("../shared/data is not present")
    return path
