"""ckpt/commands/check.py: the findings of `ckpt check` and the verdict drawn from them."""

import os
from dataclasses import replace

import pytest

from ckpt.commands.check import Finding, as_json, check_checkpoint, ready
from ckpt.errors import CheckpointNotFound, CkptError
from ckpt.store import Store
from tests.unit.test_store import fake_dump
from tests.helpers import env_settings


def test_only_required_findings_decide_readiness():
    findings = [Finding("criu", True, "CRIU 4.2"), Finding("feature lazy-pages", False, "missing", required=False)]
    assert ready(findings)
    assert not ready([*findings, Finding("privileges", False, "uid 1000", "run with sudo")])
    checks = as_json(findings)["checks"]
    assert as_json(findings)["ready"] is True and "tcp_connection" not in checks[0]
    assert checks[1] == {"name": "feature lazy-pages", "ok": False, "detail": "missing", "fix": "",
                         "required": False}


@pytest.fixture
def local_store(isolated_env) -> Store:
    return Store.open_local(isolated_env, create=True, settings=replace(env_settings(), staging="disk"))


def criu_here() -> None:
    from ckpt.criu.binary import find_criu

    try:
        find_criu(env_settings())
    except CkptError as exc:
        pytest.skip(f"check_checkpoint looks at CRIU itself: {exc.message}")


def test_a_checkpoint_of_this_host_matches_it(local_store):
    criu_here()
    made = fake_dump(local_store, {"core-4242.img": b"core"}, name="web")
    (finding, *more) = check_checkpoint(local_store.root, "web", local_store.settings)
    assert finding.name == f"checkpoint {made.id}" and finding.ok, finding
    assert "everything a restore checks matches here" in finding.detail
    assert all(f.ok or not f.required for f in more)
    assert not os.listdir(local_store.tmp_dir), "the images read for check were left behind"


def test_an_unknown_checkpoint_is_not_found(local_store):
    criu_here()
    fake_dump(local_store, {"core-4242.img": b"core"}, name="web")
    with pytest.raises(CheckpointNotFound, match="'wbe'"):
        check_checkpoint(local_store.root, "wbe", local_store.settings)
