"""What the use cases' typed results share: their --json form."""

from __future__ import annotations

from typing import Any


class JsonResult:
    """A use case's typed result. to_json() is what `--json` prints (docs/json.md: a stable
    interface). Reading it by key, as the dict it replaced, still works for callers written
    against that dict (result["removed"])."""

    def to_json(self) -> Any:
        raise NotImplementedError

    def __getitem__(self, key: Any) -> Any:
        return self.to_json()[key]
