"""A migration's decision (docs/design.md, "Migration"): migrations/<checkpoint id>.json,
written once by `ckpt migrate` after CRIU ended the source tree and before the destination's
tree runs. A destination agent that loses its coordinator reads it: present, the source is gone
and the destination's tree is the only copy (it runs); absent, the source lives (it is ended)."""

from __future__ import annotations

import json
import time

from ckpt.errors import StoreError
from ckpt.store import ids
from ckpt.store.backends import Backend, BlobExists, BlobNotFound

MIGRATIONS_PREFIX = "migrations/"
DECISION_FORMAT = 1


class Decisions:
    """The decisions of a store's migrations (Store.migrations), through its backend."""

    def __init__(self, backend: Backend):
        self.backend = backend

    @staticmethod
    def blob_name(checkpoint_id: str) -> str:
        return f"{MIGRATIONS_PREFIX}{ids.check_id(checkpoint_id)}.json"

    def decide(self, checkpoint_id: str, source_host: str, source_pid: int, destination: str) -> None:
        """Records that the destination's tree is the only copy now (written once)."""
        record = {"format": DECISION_FORMAT, "checkpoint": checkpoint_id, "source_host": source_host,
                  "source_pid": source_pid, "destination": destination, "decided_at": time.time()}
        try:
            self.backend.put_if_absent(self.blob_name(checkpoint_id), json.dumps(record).encode() + b"\n")
        except BlobExists:
            raise StoreError(f"checkpoint {checkpoint_id} was migrated already",
                             hint="each migration takes a checkpoint of its own; this is a bug") from None

    def decided(self, checkpoint_id: str) -> bool:
        try:
            self.backend.get(self.blob_name(checkpoint_id))
        except BlobNotFound:
            return False
        return True

    def forget(self, checkpoint_id: str) -> None:
        """Once the destination's tree runs and its agent is done, the decision is of no use."""
        self.backend.delete([self.blob_name(checkpoint_id)])
