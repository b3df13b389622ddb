import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The CI machine has 2 cores shared by many processes: multi-threaded GEMMs spin-wait on
    descheduled threads and slow down by orders of magnitude, so engine tests use one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
