"""The Vagrantfile users start from must stay valid (checked where vagrant is installed:
'make vm-test' installs it and runs the same check)."""

import shutil
import subprocess

import pytest

from tests.helpers import ROOT


@pytest.mark.skipif(shutil.which("vagrant") is None, reason="vagrant is not installed ('make vm-test' installs it)")
def test_vagrantfile_validates():
    proc = subprocess.run(["vagrant", "validate"], cwd=ROOT / "vagrant", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "validated successfully" in proc.stdout
