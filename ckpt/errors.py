"""Typed errors. Each carries a one-line message meant for users and an exit code.

The CLI's single top-level handler turns a CkptError into `Error: <message>` on stderr and its
exit code; anything else is a bug and is reported as an internal error.
"""

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1  # generic failure
    USAGE = 2  # bad arguments (typer/click also uses 2)
    NOT_FOUND = 3  # unknown process or checkpoint
    PERMISSION = 4  # not root, store not writable
    CRIU = 5  # CRIU missing, too old, or the dump/restore itself failed
    DAMAGED = 6  # verification failed
    BUSY = 7  # lock not obtained, PID in use
    NOT_READY = 8  # `ckpt check` found a blocking problem
    UNREACHABLE = 9  # the store's server cannot be reached or keeps refusing for now (retry later)
    HOST_MISMATCH = 10  # this host lacks what a checkpoint needs (files, CRIU version, architecture)
    MEMBER_LOST = 11  # a group member on another host stopped answering (ssh lost, its agent died)
    INTERNAL = 70


class CkptError(Exception):
    exit_code = ExitCode.ERROR

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}; {self.hint}"


class UsageError(CkptError):
    exit_code = ExitCode.USAGE


class ProcessNotFound(CkptError):
    exit_code = ExitCode.NOT_FOUND


class TargetRefused(CkptError):
    """The PID exists but ckpt must not or cannot checkpoint it (PID 1, kernel thread, itself)."""

    exit_code = ExitCode.USAGE


class CheckpointNotFound(CkptError):
    exit_code = ExitCode.NOT_FOUND


class JournalRecordNotFound(CkptError):
    """No record of that action (or none at all) in an agent's journal (`ckpt journal`)."""

    exit_code = ExitCode.NOT_FOUND


class InvalidReference(CkptError):
    """An ID or name that is malformed or could escape the store."""

    exit_code = ExitCode.USAGE


class PermissionProblem(CkptError):
    exit_code = ExitCode.PERMISSION


class StoreError(CkptError):
    exit_code = ExitCode.ERROR


class StoreBusy(CkptError):
    exit_code = ExitCode.BUSY


class StoreNotFound(CkptError):
    """A remote store's bucket does not exist."""

    exit_code = ExitCode.NOT_FOUND


class StoreAccessDenied(PermissionProblem):
    """The store's server refused ckpt's credentials (or found none)."""


class PasswordNeeded(PermissionProblem):
    """The store is encrypted and no password was given (CKPT_PASSWORD, CKPT_PASSWORD_FILE, a terminal)."""


class StoreUnreachable(CkptError):
    """The store's server could not be reached, or kept answering "slow down" or "unavailable",
    after the retries: a later run may succeed."""

    exit_code = ExitCode.UNREACHABLE


class DiskFull(StoreError):
    pass


DISK_FULL_HINT = "free some space or remove old checkpoints with 'ckpt rm' (which works on a full disk)"


class ImageUnreadable(StoreError):
    """A CRIU image ckpt must read is truncated or malformed (as CRIU leaves one it could not
    finish writing on a full disk)."""


class DamagedCheckpoint(CkptError):
    exit_code = ExitCode.DAMAGED


class DamagedBlob(DamagedCheckpoint):
    """A blob of an encrypted store failed authentication (a flipped byte, cut short, moved
    from another name, or not this repository's): the store treats it as damaged data, as it
    does a segment failing its checksum. name is the blob's (logical) name."""

    def __init__(self, message: str, *, hint: str | None = None, name: str | None = None):
        super().__init__(message, hint=hint)
        self.name = name


class WrongPassword(CkptError):
    """No key file of an encrypted store opens with the password given."""

    exit_code = ExitCode.PERMISSION


class KeyNotFound(CkptError):
    """No key file of that id in an encrypted store."""

    exit_code = ExitCode.NOT_FOUND


class CriuUnavailable(CkptError):
    exit_code = ExitCode.CRIU


class CriuFailed(CkptError):
    """CRIU ran and failed. Carries the relevant lines of its log and where the full log is."""

    exit_code = ExitCode.CRIU

    def __init__(self, message: str, *, log_path: str | None = None, log_lines: list[str] | None = None,
                 hint: str | None = None):
        super().__init__(message, hint=hint)
        self.log_path = log_path
        self.log_lines = log_lines or []


class PageStreamFailed(CkptError):
    """ckpt could not receive the pages CRIU streamed to it (ckpt/dump/pagestream.py): CRIU's
    dump fails with it, and the tree runs on."""

    exit_code = ExitCode.CRIU


class HostMismatch(CkptError):
    """A restore would fail on this host: files the tree had open or mapped are missing or
    differ, CRIU is older, the architecture differs. Raised before CRIU runs, naming them all."""

    exit_code = ExitCode.HOST_MISMATCH


class PidInUse(CkptError):
    exit_code = ExitCode.BUSY


class SectionTimeout(CkptError):
    """A process of the tree stayed inside a no_checkpoint() section longer than the dump's
    section timeout: nothing was frozen (a schedule records a skip)."""

    exit_code = ExitCode.BUSY


class CopyNetworkFailed(CkptError):
    """A copy's network namespace, veth, addresses or the host's masquerade could not be set up
    (restore/copynet.py): what `ip` or `nft` said is the message."""

    exit_code = ExitCode.ERROR


class HookFailed(CkptError):
    exit_code = ExitCode.ERROR


class OutcomeUnknown(CkptError):
    """journal.once() found an intent without an outcome (the action was started before a
    rollback or a crash) and was given no reconcile function to find out what came of it."""

    exit_code = ExitCode.ERROR


class SessionAborted(CkptError):
    """A coordinator (a group checkpoint, a migration) aborted a dump or a restore while it held
    the tree (frozen and dumped, or restored and not yet running), or held it past its limit:
    CRIU thawed the dumped tree, or ended the restored one, and the session failed."""

    exit_code = ExitCode.ERROR


class GroupFailed(CkptError):
    """A group checkpoint or restore failed in one member (or a member did not answer in time):
    every member was aborted (dump: every tree runs on, nothing committed; restore: none runs).
    The exit code is the failing member's."""

    exit_code = ExitCode.ERROR

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int | None = None):
        super().__init__(message, hint=hint)
        if exit_code is not None:
            self.exit_code = ExitCode(exit_code)


class CloneFailed(CkptError):
    """A clone (`ckpt clone REF --copies N`) failed in one copy: every copy was ended (those
    already running killed), none runs. The exit code is the failing copy's."""

    exit_code = ExitCode.ERROR

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int | None = None):
        super().__init__(message, hint=hint)
        if exit_code is not None:
            self.exit_code = ExitCode(exit_code)


class MemberLost(CkptError):
    """A member of a group checkpoint on another host stopped answering: its ssh channel
    ended (the connection was lost, ssh or the member agent died) or it did not answer within
    the phase's timeout. The coordinator aborts every member: nothing is committed, every tree
    runs on (dump) or none runs (restore)."""

    exit_code = ExitCode.MEMBER_LOST


class MigrationFailed(CkptError):
    """A migration whose destination failed after the source tree was ended, and whose
    checkpoint could not be restored at the source either: nothing runs, the checkpoint holds it."""

    exit_code = ExitCode.CRIU


class CheckpointCancelled(CkptError):
    """ckpt.checkpoint(): a before_checkpoint callback raised (the exception is the __cause__).
    Nothing was frozen or written; the after_restore callbacks of the layers whose
    before-callback had run did run."""

    exit_code = ExitCode.ERROR


class CheckpointFailed(CkptError):
    """ckpt.checkpoint(): the dump failed or its dumper ended without saying. The message is
    the dump's own error; exit_code is the dumper's (5 for CRIU, 4 for not root...); log_path,
    when there is one, is the dumper's output (kept on failure)."""

    exit_code = ExitCode.ERROR

    def __init__(self, message: str, *, hint: str | None = None, log_path: str | None = None):
        super().__init__(message, hint=hint)
        self.log_path = log_path


def to_record(exc: CkptError) -> dict:
    """The error as JSON, for a forked child to report to its parent (from_record rebuilds it):
    the parent must exit with the child's documented exit code, not a generic one."""
    return {"error_type": type(exc).__name__, "message": exc.message, "hint": exc.hint,
            "exit_code": int(exc.exit_code), "log_path": getattr(exc, "log_path", None),
            "log_lines": getattr(exc, "log_lines", None)}


def _error_classes(base: type[CkptError] = CkptError) -> dict[str, type[CkptError]]:
    found: dict[str, type[CkptError]] = {base.__name__: base}
    for sub in base.__subclasses__():
        found.update(_error_classes(sub))
    return found


def from_record(record: dict) -> CkptError:
    """The error a child reported with to_record: of its class where this process knows it,
    else a CkptError; with its message, hint, exit code and CRIU log either way."""
    cls = _error_classes().get(record.get("error_type", ""), CkptError)
    message, hint = str(record.get("message", "")), record.get("hint")
    if issubclass(cls, CriuFailed):
        exc: CkptError = cls(message, hint=hint, log_path=record.get("log_path"), log_lines=record.get("log_lines"))
    else:
        try:
            exc = cls(message, hint=hint)
        except TypeError:  # a subclass with a constructor of its own
            exc = CkptError(message, hint=hint)
    try:
        exc.exit_code = ExitCode(int(record.get("exit_code", exc.exit_code)))
    except ValueError:
        pass
    return exc
