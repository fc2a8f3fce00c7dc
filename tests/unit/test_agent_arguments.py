"""The public API refuses arguments of the wrong type (ckpt/agent/arguments.py) before it does
anything: `ckpt.checkpoint(store=12345)` made a store `./12345` in the current directory."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckpt
from ckpt.agent import checkpoint as agent
from ckpt.agent.journal import Journal


@pytest.fixture
def program(monkeypatch, tmp_path):
    """A Checkpointer of its own whose take records its call instead of dumping; run in tmp_path."""
    monkeypatch.chdir(tmp_path)
    calls: list[tuple] = []
    program = agent.Checkpointer(take=lambda name, store: calls.append((name, store)))
    program.taken = calls
    return program


@pytest.mark.parametrize("kwargs, message", [
    ({"store": 12345}, "ckpt.checkpoint(): store must be a directory or s3:// URL (str or path), or None, not int"),
    ({"store": b"/var/ckpt"}, "store must be a directory or s3:// URL (str or path), or None, not bytes"),
    ({"store": ["/var/ckpt"]}, "not list"),
    ({"name": 7}, "ckpt.checkpoint(): name must be a str or None, not int"),
    ({"name": Path("agent")}, "name must be a str or None, not PosixPath"),
])
def test_checkpoint_refuses_arguments_of_the_wrong_type_before_anything(program, tmp_path, kwargs, message):
    before: list[str] = []
    program.before_checkpoint(lambda: before.append("ran"))
    with pytest.raises(TypeError) as raised:
        program.checkpoint(**kwargs)
    assert message in str(raised.value)
    assert program.taken == [] and before == []
    with pytest.raises(TypeError, match=r"^ckpt\.checkpoint\(\): "):
        ckpt.checkpoint(**kwargs)  # the program's own Checkpointer: refused before it takes anything
    assert list(tmp_path.iterdir()) == []  # no ./12345


def test_checkpoint_takes_a_str_or_a_path_as_store(program, tmp_path):
    program.checkpoint(name="agent", store=tmp_path / "store")
    program.checkpoint(store=str(tmp_path / "store"))
    assert program.taken == [("agent", str(tmp_path / "store")), (None, str(tmp_path / "store"))]


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
