"""`criu check --feature` results are remembered per boot and per CRIU binary."""

import json
import os

import pytest

from ckpt.criu.binary import CriuBinary
from ckpt.criu.client import has_feature


@pytest.fixture
def fake_criu(tmp_path):
    """A `criu` that counts its runs and passes only the feature 'present'."""
    calls = tmp_path / "calls"
    script = tmp_path / "criu"
    script.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n[ \"$3\" = present ]\n")
    script.chmod(0o755)
    binary = CriuBinary(str(script), (4, 2, 1), "4.2.1", feature_cache=tmp_path / "run" / "features.json")
    return binary, calls, tmp_path / "run" / "features.json"


def runs(calls) -> list[str]:
    return calls.read_text().splitlines() if calls.exists() else []


def test_each_answer_is_checked_once(fake_criu):
    binary, calls, cache = fake_criu
    assert has_feature(binary, "present") is True
    assert has_feature(binary, "absent") is False
    assert has_feature(binary, "present") is True
    assert has_feature(binary, "absent") is False
    assert runs(calls) == ["check --feature present", "check --feature absent"]
    assert oct(cache.stat().st_mode & 0o777) == "0o600"


def test_another_binary_or_boot_checks_again(fake_criu):
    binary, calls, cache = fake_criu
    has_feature(binary, "present")
    stat = os.stat(binary.path)
    os.utime(binary.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # CRIU upgraded in place
    has_feature(binary, "present")
    data = json.loads(cache.read_text())
    data["boot_id"] = "another boot"
    cache.write_text(json.dumps(data))
    has_feature(binary, "present")
    assert len(runs(calls)) == 3


@pytest.mark.parametrize("content", ["", "{not json", "[]", '{"boot_id": 1, "features": []}', "BOOT [1, 2]",
                                     'BOOT {"x": 1}', "BOOT null"])
def test_a_damaged_cache_is_ignored(fake_criu, content):
    binary, calls, cache = fake_criu
    cache.parent.mkdir()
    if content.startswith("BOOT "):  # this boot's id, damaged features
        boot_id = open("/proc/sys/kernel/random/boot_id").read().strip()
        content = json.dumps({"boot_id": boot_id, "features": json.loads(content[5:])})
    cache.write_text(content)
    assert has_feature(binary, "present") is True
    assert has_feature(binary, "present") is True
    assert len(runs(calls)) == 1
