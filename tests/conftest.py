import os

import pytest
import torch


def pytest_configure(config):
    # pytest-xdist workers share the machine's cores. torch's default, one intra-op thread per
    # core in every worker, oversubscribes them, and the small parallel CPU ops the tests run
    # (the RMSNorm recognisers' probes at 4,096-8,192 columns) then wait on spinning thread
    # teams: a probe took 10x longer with four 2-thread processes on two cores, and such tests
    # took 60-80 s each on the 16-core GPU machine with 14 workers. Each worker takes its share
    # of the cores instead (the README's command runs without xdist: torch's own thread count,
    # so the CPU kernels' parallel paths stay covered).
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) // int(workers)))


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
