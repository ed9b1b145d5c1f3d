import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global RNG state, so runs are repeatable."""
    torch.manual_seed(0)


@pytest.fixture
def shared_data() -> Path:
    """../shared/data, or skip: a fresh clone has no ../shared."""
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip("../shared/data is not present")
    return path


@pytest.fixture
def one_thread():
    """One intra-op thread for batch-1 decoding and tiny training runs: extra threads only add
    synchronisation there, and on a machine where another process holds a core two threads make
    these tests tens of times slower. Results are also independent of the core count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
