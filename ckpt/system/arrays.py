"""numpy, loaded without OpenBLAS's pool of threads.

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

__all__ = ["np"]
