"""ckpt: checkpoint and restore running Linux process trees with CRIU.

What a program imports (docs/api.md):

    ckpt.checkpoint(name=None, store=None) -> CheckpointResult(id, restored, name, copy)
    ckpt.copy_info()        which copy of a clone this is (a dict), or None
    ckpt.before_checkpoint(fn), ckpt.after_restore(fn)
    ckpt.no_checkpoint()    a critical section no dump freezes
    ckpt.journal            a durable record of irreversible actions

`import ckpt` imports nothing else: each name is imported from ckpt.agent on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# name -> the module of ckpt.agent that defines it
_API = {
    "checkpoint": "ckpt.agent.checkpoint",
    "before_checkpoint": "ckpt.agent.checkpoint",
    "after_restore": "ckpt.agent.checkpoint",
    "CheckpointResult": "ckpt.agent.checkpoint",
    "copy_info": "ckpt.agent.checkpoint",
    "no_checkpoint": "ckpt.agent.sections",
    "journal": "ckpt.agent.journal",
}


def __getattr__(name: str) -> Any:
    if name in _API:
        import importlib

        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value  # once: later lookups find it directly
        return value
    raise AttributeError(f"module 'ckpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
