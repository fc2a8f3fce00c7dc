"""ckpt/system/arrays.py: numpy without OpenBLAS's spinning threads, and nothing left in the
environment of the programs ckpt starts."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import os
from ckpt.system.arrays import np
assert np.arange(3).sum() == 3
print(len(os.listdir("/proc/self/task")), os.environ.get("OPENBLAS_NUM_THREADS", "None"))
"""


def test_numpy_loads_with_no_thread_of_its_own_and_the_environment_is_left_as_given():
    env_without = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env_without, capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    assert out == ["1", "None"]
    for given in ("2", ""):
        out = subprocess.run([sys.executable, "-c", PROBE], env={**env_without, "OPENBLAS_NUM_THREADS": given},
                             capture_output=True, text=True, check=True, timeout=60).stdout
        assert out.split("\n")[0].split(" ")[1:] == [given or ""], "a value the user set is kept as it was"
