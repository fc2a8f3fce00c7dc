"""The options a dump was taken with: one typed value, and its two mappings.

`DumpOptions` is what `ckpt dump` decided (from the pre-flight and the user's flags). It maps
explicitly to CRIU's options (`to_criu_dump`, `to_criu_restore`) and to the manifest's
`criu.options` object (`to_manifest`, `from_manifest`). The manifest's keys are part of the
store format (docs/design.md, "Manifest"): they are spelled out here, not derived from field
names, so that renaming a field or a CRIU option never changes what is on disk. Defaults for
manifests written before a key existed live in `from_manifest` and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import ClassVar

from ckpt.criu.client import CriuFlags, CriuOptions


@dataclass(frozen=True)
class DumpOptions(CriuFlags):
    """CRIU's flags (criu/client.py CriuFlags, where each is described) as a dump chose them:
    leave_running is False after `ckpt dump --stop`, network_lock is "skip" when the tree had no
    TCP connection, ghost_limit is None for CRIU's default."""

    # The options `ckpt dump` detects when the user does not force them (--X/--no-X).
    DETECTED: ClassVar[tuple[str, ...]] = ("shell_job", "tcp_established", "ext_unix_sk", "file_locks")

    def criu_flags(self) -> CriuFlags:
        """The same flags, as CRIU's options hold them."""
        return CriuFlags(**{f.name: getattr(self, f.name) for f in fields(CriuFlags)})

    def to_criu_dump(self, images_dir: Path, log_dir: Path, log_name: str, pid: int, parent_img: str | None,
                     external: list[str]) -> CriuOptions:
        """CRIU's options for the dump itself."""
        return CriuOptions(images_dir=images_dir, log_dir=log_dir, log_name=log_name, pid=pid,
                           parent_img=parent_img, external=external, flags=self.criu_flags())

    def to_criu_restore(self, images_dir: Path, log_dir: Path, log_name: str, inherit_stdio: bool,
                        inherit_fds: list[tuple[str, int]], extra: dict) -> CriuOptions:
        """CRIU's options for restoring what was dumped with these: the ones the tree's state
        needs back (leave_running, ghost_limit and track_mem concern the dump alone, and keep
        CRIU's defaults)."""
        flags = replace(self.criu_flags(), leave_running=True, ghost_limit=None, track_mem=False)
        return CriuOptions(images_dir=images_dir, log_dir=log_dir, log_name=log_name, flags=flags,
                           inherit_stdio=inherit_stdio, inherit_fds=inherit_fds, extra=extra)

    def to_manifest(self) -> dict:
        """The manifest's `criu.options` (docs/design.md): these keys, in this order."""
        data: dict = {
            "shell_job": self.shell_job,
            "tcp_established": self.tcp_established,
            "ext_unix_sk": self.ext_unix_sk,
            "file_locks": self.file_locks,
            "leave_running": self.leave_running,
            "network_lock": self.network_lock,
        }
        if self.ghost_limit:  # present only when CRIU was given one
            data["ghost_limit"] = self.ghost_limit
        data["track_mem"] = self.track_mem
        return data

    @classmethod
    def from_manifest(cls, data: dict) -> DumpOptions:
        """Reads `criu.options` back. A key an older ckpt did not write takes the value that ckpt
        dumped with: no such option (False), the tree left running, CRIU's default network lock
        (nftables), CRIU's ghost limit. Unknown keys are ignored (docs/design.md, "Versions")."""
        ghost_limit = data.get("ghost_limit")
        return cls(shell_job=bool(data.get("shell_job", False)),
                   tcp_established=bool(data.get("tcp_established", False)),
                   ext_unix_sk=bool(data.get("ext_unix_sk", False)),
                   file_locks=bool(data.get("file_locks", False)),
                   leave_running=bool(data.get("leave_running", True)),
                   network_lock=str(data.get("network_lock", "nftables")),
                   ghost_limit=int(ghost_limit) if ghost_limit else None,
                   track_mem=bool(data.get("track_mem", False)))
