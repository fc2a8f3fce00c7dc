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


def test_distinct_is_np_unique():
    from ckpt.system.arrays import distinct, np

    rng = np.random.default_rng(28)
    cases = [np.empty(0, dtype=np.int64), np.array([7], dtype=np.int64), np.array([3, 3, 3], dtype=np.int64),
             rng.integers(0, 50, 10_000), rng.integers(-(1 << 40), 1 << 40, 10_000),
             rng.integers(0, 1 << 63, 5_000, dtype=np.uint64), rng.integers(0, 9, (40, 30))]
    for values in cases:
        found = distinct(values)
        assert found.dtype == values.dtype
        assert np.array_equal(found, np.unique(values))


def test_ckpt_asks_numpy_for_distinct_values_by_sorting_only():
    """A plain np.unique (no counts, positions or inverse) hashes in numpy 2.4: 15-30 times
    slower than distinct() on arrays of mostly distinct values (see ckpt/system/arrays.py)."""
    import ast
    from pathlib import Path

    plain = []
    for path in sorted((Path(__file__).resolve().parents[2] / "ckpt").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "unique"
                    and not any(k.arg and (k.arg.startswith("return_") or k.arg == "axis") for k in node.keywords)):
                plain.append(f"{path.name}:{node.lineno}")
    assert plain == [], f"use ckpt.system.arrays.distinct instead of np.unique at {plain}"
