"""The options a dump was taken with: one typed value, and its two mappings.

`DumpOptions` is what `ckpt dump` decided (from the pre-flight and the user's flags). It maps
explicitly to CRIU's options (`to_criu_dump`, `to_criu_restore`) and to the manifest's
`criu.options` object (`to_manifest`, `from_manifest`). The manifest's keys are part of the
store format (docs/design.md, "Manifest"): they are spelled out here, not derived from field
names, so that renaming a field or a CRIU option never changes what is on disk. Defaults for
manifests written before a key existed live in `from_manifest` and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ckpt.criu.client import CriuOptions


@dataclass(frozen=True)
class DumpOptions:
    # A job of a terminal session it does not lead (CRIU's --shell-job).
    shell_job: bool = False
    # Established TCP connections are saved (--tcp-established).
    tcp_established: bool = False
    # UNIX datagram sockets sending outside the tree are saved and connected again (--ext-unix-sk).
    ext_unix_sk: bool = False
    # File locks are saved (--file-locks).
    file_locks: bool = False
    # The tree kept running after the dump (False: `ckpt dump --stop` ended it).
    leave_running: bool = True
    # How CRIU kept TCP connections quiet: "nftables", or "skip" when there were none.
    network_lock: str = "nftables"
    # The size up to which CRIU saved deleted files (None: CRIU's default of 1 MiB).
    ghost_limit: int | None = None
    # The dump used the kernel's dirty-page tracking (--track-mem).
    track_mem: bool = False

    # The options `ckpt dump` detects when the user does not force them (--X/--no-X).
    DETECTED: ClassVar[tuple[str, ...]] = ("shell_job", "tcp_established", "ext_unix_sk", "file_locks")

    def to_criu_dump(self, images_dir: Path, log_dir: Path, log_name: str, pid: int, parent_img: str | None,
                     external: list[str]) -> CriuOptions:
        """CRIU's options for the dump itself."""
        return CriuOptions(images_dir=images_dir, log_dir=log_dir, log_name=log_name, pid=pid,
                           parent_img=parent_img, external=external,
                           shell_job=self.shell_job, tcp_established=self.tcp_established,
                           ext_unix_sk=self.ext_unix_sk, file_locks=self.file_locks,
                           leave_running=self.leave_running, network_lock=self.network_lock,
                           ghost_limit=self.ghost_limit, track_mem=self.track_mem)

    def to_criu_restore(self, images_dir: Path, log_dir: Path, log_name: str, inherit_stdio: bool,
                        inherit_fds: list[tuple[str, int]], extra: dict) -> CriuOptions:
        """CRIU's options for restoring what was dumped with these: the ones the tree's state
        needs back (leave_running, ghost_limit and track_mem concern the dump alone)."""
        return CriuOptions(images_dir=images_dir, log_dir=log_dir, log_name=log_name,
                           shell_job=self.shell_job, tcp_established=self.tcp_established,
                           ext_unix_sk=self.ext_unix_sk, file_locks=self.file_locks,
                           network_lock=self.network_lock, inherit_stdio=inherit_stdio, inherit_fds=inherit_fds,
                           extra=extra)

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
