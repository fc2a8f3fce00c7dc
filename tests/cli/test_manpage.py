"""ckpt(1) is generated from the CLI (ckpt/cli/manpage.py): every command is in it, with its
options, and man renders it without warnings."""

import shutil
import subprocess
import sys

import pytest
import typer.main

from ckpt.cli.main import app
from tests.helpers import ROOT


def test_the_man_page_has_every_command_and_renders(tmp_path):
    page = subprocess.run([sys.executable, "-m", "ckpt.cli.manpage"], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, check=True).stdout
    root = typer.main.get_command(app)
    for name, command in root.commands.items():
        if not getattr(command, "hidden", False):
            roff = name.replace("-", "\\-")  # a dash in a name is roff's \- (copy-info)
            assert f".SS ckpt {roff}\n" in page, f"ckpt {name} is missing from the man page"
    assert ".B \\-\\-store" in page and "ckpt dump 4242 \\-\\-name agent" in page
    if shutil.which("groff") is None:
        pytest.skip("groff is not installed")
    (tmp_path / "ckpt.1").write_text(page)
    rendered = subprocess.run(["groff", "-man", "-Tutf8", "-ww", str(tmp_path / "ckpt.1")], capture_output=True,
                              text=True, timeout=60)
    assert rendered.returncode == 0 and rendered.stderr == "", rendered.stderr
    assert "ckpt restore" in rendered.stdout
