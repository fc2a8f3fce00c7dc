"""numpy, loaded without OpenBLAS's pool of threads, and what ckpt does with it faster than numpy.

numpy loads OpenBLAS, which starts a thread per core that spins waiting for work: importing
numpy cost 0.2 s of CPU here against 0.1 s with OPENBLAS_NUM_THREADS=1, and a dump or a
restore shares its two cores with CRIU, a page server and an S3 server. ckpt does no linear
algebra. The variable is set only while numpy loads (OpenBLAS reads it then): the programs
ckpt starts (`ckpt run`, hooks) get the environment they were given.
"""

from __future__ import annotations

import os

_VARIABLE = "OPENBLAS_NUM_THREADS"
_given = os.environ.get(_VARIABLE)
os.environ[_VARIABLE] = _given or "1"
try:
    import numpy as np
finally:
    if _given is None:
        os.environ.pop(_VARIABLE, None)
    else:
        os.environ[_VARIABLE] = _given  # (an empty value too)

__all__ = ["distinct", "np"]


def distinct(values) -> np.ndarray:
    """np.unique(values) of integers (any shape, flattened): each value once, in order; found
    by sorting. numpy 2.4's np.unique finds them by hashing unless asked for counts or
    positions, and that is 15-30 times slower here on arrays of mostly distinct values: the
    263,800 page locations of a 1 GiB restore took 62 ms against 2 ms, the page server's
    before its first fetch from S3."""
    ordered = np.sort(np.asarray(values), axis=None)
    if len(ordered) < 2:
        return ordered
    first = np.empty(len(ordered), dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return ordered[first]
