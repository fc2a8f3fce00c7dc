"""The public API refuses arguments of the wrong type (ckpt/agent/arguments.py) before it does
anything: `ckpt.checkpoint(store=12345)` made a store `./12345` in the current directory."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckpt
from ckpt.agent import checkpoint as agent
from ckpt.agent.journal import Journal


@pytest.fixture
def taken(monkeypatch, tmp_path):
    """checkpoint() with a _take that records its call instead of dumping; run in tmp_path."""
    calls: list[tuple] = []
    monkeypatch.setattr(agent, "_callbacks", [])
    monkeypatch.setattr(agent, "_take", lambda name, store: calls.append((name, store)))
    monkeypatch.chdir(tmp_path)
    return calls


@pytest.mark.parametrize("kwargs, message", [
    ({"store": 12345}, "ckpt.checkpoint(): store must be a directory or s3:// URL (str or path), or None, not int"),
    ({"store": b"/var/ckpt"}, "store must be a directory or s3:// URL (str or path), or None, not bytes"),
    ({"store": ["/var/ckpt"]}, "not list"),
    ({"name": 7}, "ckpt.checkpoint(): name must be a str or None, not int"),
    ({"name": Path("agent")}, "name must be a str or None, not PosixPath"),
])
def test_checkpoint_refuses_arguments_of_the_wrong_type_before_anything(taken, tmp_path, kwargs, message):
    before: list[str] = []
    ckpt.before_checkpoint(lambda: before.append("ran"))
    with pytest.raises(TypeError) as raised:
        ckpt.checkpoint(**kwargs)
    assert message in str(raised.value)
    assert taken == [] and before == []
    assert list(tmp_path.iterdir()) == []  # no ./12345


def test_checkpoint_takes_a_str_or_a_path_as_store(taken, tmp_path):
    ckpt.checkpoint(name="agent", store=tmp_path / "store")
    ckpt.checkpoint(store=str(tmp_path / "store"))
    assert taken == [("agent", str(tmp_path / "store")), (None, str(tmp_path / "store"))]


@pytest.mark.parametrize("kwargs, message", [
    ({"store": 12345}, "store must be a directory or s3:// URL (str or path), or None, not int"),
    ({"agent": 3}, "agent must be a str or None, not int"),
])
def test_the_journal_refuses_arguments_of_the_wrong_type(monkeypatch, tmp_path, kwargs, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Journal().use(**kwargs)
    with pytest.raises(TypeError, match=r"Journal\(\): "):
        Journal(**kwargs)
    assert list(tmp_path.iterdir()) == []
