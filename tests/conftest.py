import os

import pytest

from tests.helpers import Processes
from tests.s3server import WeedServer

PASSED_TO_TESTS = {"CKPT_LAZY_MIN_MIB"}


@pytest.fixture(autouse=True)
def isolated_env(tmp_path, monkeypatch):
    """Every test gets its own store and no CKPT_* settings from the caller's environment, but
    for the ones that choose how a whole run restores (CKPT_LAZY_MIN_MIB=0: every restore that
    can be lazy is)."""
    for key in list(os.environ):
        if (key.startswith("CKPT_") and key not in PASSED_TO_TESTS) or key.startswith("AWS_"):
            monkeypatch.delenv(key)
    # No AWS settings but the tests' own (s3_env): not the caller's ~/.aws, and never the
    # instance metadata service (an address off this machine) when credentials are missing.
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = tmp_path / "store"
    monkeypatch.setenv("CKPT_STORE", str(store))
    monkeypatch.setenv("CKPT_CACHE", str(tmp_path / "cache"))
    return store


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS S3 server for the session (about 3 s to start); tests use their own
    prefix of its bucket (s3_store)."""
    server = WeedServer(tmp_path_factory.mktemp("weed")).start()
    server.client().create_bucket(Bucket=S3_BUCKET)
    yield server
    server.stop()


S3_BUCKET = "ckpt-tests"


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The AWS variables that point boto3's default session at the test server."""
    for key, value in s3_server.environment().items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture
def s3_url(s3_env, tmp_path):
    """s3://BUCKET/PREFIX of a prefix no other test uses."""
    return f"s3://{S3_BUCKET}/t-{os.getpid()}-{tmp_path.name}"


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
