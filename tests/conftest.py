import os

import pytest

from tests.helpers import Processes

PASSED_TO_TESTS = {"CKPT_LAZY_MIN_MIB"}


@pytest.fixture(autouse=True)
def isolated_env(tmp_path, monkeypatch):
    """Every test gets its own store and no CKPT_* settings from the caller's environment, but
    for the ones that choose how a whole run restores (CKPT_LAZY_MIN_MIB=0: every restore that
    can be lazy is)."""
    for key in list(os.environ):
        if key.startswith("CKPT_") and key not in PASSED_TO_TESTS:
            monkeypatch.delenv(key)
    store = tmp_path / "store"
    monkeypatch.setenv("CKPT_STORE", str(store))
    return store


@pytest.fixture
def procs(tmp_path):
    processes = Processes(tmp_path)
    yield processes
    processes.cleanup()


def pytest_collection_modifyitems(config, items):
    # Only a non-root run skips them; as root a missing CRIU must fail loudly, not skip.
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="integration tests need root ('sudo make test')")
    for item in items:
        if "integration" in item.keywords:
            item.add_marker(skip)
