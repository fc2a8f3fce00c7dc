"""Use case: the checkpoints in the store, oldest first, with the lazy restores of each that
failed (each also said as a warning)."""

from __future__ import annotations

from ckpt.reporting import NullReporter, Reporter
from ckpt.restore.lazywatch import describe, failures
from ckpt.store import Store
from ckpt.store.repository import did_you_mean


def list_checkpoints(store: Store, name: str | None = None, reporter: Reporter = NullReporter()) -> list[dict]:
    """One row a checkpoint, in the shape of `ckpt list --json` (docs/json.md). A manifest that
    cannot be read, and a lazy restore whose page server died, are reported as warnings."""
    manifests = store.manifests(on_damaged=lambda _id, error: reporter.warn(str(error)))
    if name:
        manifests = [m for m in manifests if m.name == name]
    lost = {m.id: failures(store.logs_root / m.id) for m in manifests}
    for records in lost.values():
        for failure in records:
            reporter.warn(f"{describe(failure)} ({failure.get('time', '?')})")
    return [{
        "id": m.id, "name": m.name, "origin": m.origin.to_json() if m.origin else None,
        "created": m.created, "pid": m.pid, "command": m.command,
        "processes": len(m.processes), "bytes_total": m.bytes_total, "bytes_stored": m.bytes_stored,
        "lazy_restore_failures": len(lost[m.id]),
    } for m in manifests]


def absent_name(store: Store, name: str, shown: int = 10) -> str:
    """Why `ckpt list --name NAME` found nothing, in words: what the store holds instead (its
    checkpoints, their names, those NAME may be a typo of)."""
    manifests = store.manifests()
    if not manifests:
        return "no checkpoints in the store yet: create one with 'ckpt dump PID'"
    names = sorted({m.name for m in manifests if m.name})
    listed = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
    hint = did_you_mean(name, names)
    return (f"no checkpoint named '{name}' (the store holds {len(manifests)}; "
            + (f"names: {listed}" if names else "none has a name") + ")"
            + (f"; {hint}" if hint.startswith("did you mean") else ""))
