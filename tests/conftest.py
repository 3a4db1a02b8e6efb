import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different, reported seed per test: fresh random inputs, reproducible on failure.
    seed = abs(hash(request.node.nodeid)) % (2**31)
    torch.manual_seed(seed)
    yield


@pytest.fixture(autouse=True)
def _fallback_warnings_afresh():
    # The rewrites warn once per process and reason; each test sees its own first warning.
    from fastlayers.patching import fallback

    fallback.WARNED.clear()
    yield
