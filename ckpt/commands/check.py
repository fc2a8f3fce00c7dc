"""Use case: can dump and restore work on this machine? Each finding carries its fix."""

from __future__ import annotations

import importlib
import os
import tempfile
from dataclasses import asdict, dataclass

from ckpt.settings import Settings, StoreLocation
from ckpt.store.password import PasswordSource
from ckpt.criu.binary import find_criu
from ckpt.criu.client import bindings_version, check_verdict, run_check
from ckpt.errors import CkptError

FEATURES = {
    # feature name for `criu check --feature`: (what it gives, fix when missing)
    "mem_dirty_track": ("incremental dumps that read only dirty pages (soft-dirty)",
                        "boot a kernel built with CONFIG_MEM_SOFT_DIRTY=y (Debian's stock kernel has it)"),
    "network_lock_nftables": ("checkpointing established TCP connections (nftables network lock)",
                              "install nftables and a CRIU built with libnftables ('make setup')"),
    "uffd-noncoop": ("lazy restore (the tree runs before its memory is back; userfaultfd)",
                     "a kernel with CONFIG_USERFAULTFD (4.11 or newer); restores are then all eager"),
    "pidfd_store": ("reliable PID reuse detection between dumps", "Linux 5.4 or newer"),
}


@dataclass
class Finding:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True
    tcp_connection: dict | None = None  # a finding about one TCP connection: it, and how it would come back


def check_readiness(store_root: StoreLocation, settings: Settings,
                    passwords: PasswordSource | None = None) -> list[Finding]:
    findings: list[Finding] = []
    root = os.geteuid() == 0
    findings.append(Finding("privileges", root, "running as root" if root else f"running as uid {os.geteuid()}",
                            "" if root else "run ckpt with sudo: CRIU needs root"))
    criu = None
    try:
        criu = find_criu(settings)
        findings.append(Finding("criu", True, f"CRIU {criu.version_text} at {criu.path}"))
        if criu.version < (4, 2) and _kernel_version() >= (6, 16):
            findings.append(Finding(
                "criu sockets", False,
                f"CRIU {criu.version_text} cannot dump TCP/UDP sockets on Linux {os.uname().release} "
                "(SO_PASSCRED is refused on inet sockets since 6.16)",
                "install CRIU 4.2 or newer ('make setup' builds it)", required=False))
    except CkptError as exc:
        findings.append(Finding("criu", False, exc.message, exc.hint or "run 'make setup'"))
    try:
        pb_version = bindings_version()  # the generated protobuf module loads
        findings.append(Finding("pycriu", True, f"pycriu importable (protobuf {pb_version})"))
    except Exception as exc:  # any import failure means the same thing to the user
        findings.append(Finding("pycriu", False, f"cannot import pycriu: {exc}",
                                "run 'make setup' (it installs pycriu from CRIU's source with protobuf < 6)"))
    findings.append(_page_hashing())
    if criu is not None and root:
        verdict, said = check_verdict(*run_check(criu))
        # A pass with warnings is a warning: not ok, not required (the features below say more).
        findings.append(Finding("criu check", verdict == "ok", said,
                                "" if verdict == "ok" else f"run '{criu.path} check' to see the details",
                                required=verdict != "warn"))
        for feature, (gives, fix) in FEATURES.items():
            ok, out = run_check(criu, feature)
            findings.append(Finding(f"feature {feature}", ok, ("works: " if ok else "missing: ") + gives,
                                    "" if ok else fix, required=False))
    findings.append(_store_writable(store_root, settings, passwords))
    findings.append(_scheduler(settings.scheduler))
    if os.getsid(0) == 0:
        # Reads 0 when the session leader is in an ancestor PID namespace (a container started
        # by a runner outside it); every child of this shell inherits that session.
        findings.append(Finding("session", False,
                                "this shell's session is led from outside its PID namespace: CRIU cannot "
                                "checkpoint programs started from it as they are",
                                "start programs to checkpoint with 'setsid PROGRAM' or under 'ckpt run'",
                                required=False))
    return findings


def check_checkpoint(store_root: StoreLocation, ref: str, settings: Settings,
                     passwords: PasswordSource | None = None) -> list[Finding]:
    """Whether the checkpoint ref names can be restored on this host: what a restore checks
    before CRIU runs (ckpt/restore/hostcheck.py), each mismatch a finding of its own, and how
    its TCP connections would come back."""
    from ckpt.restore import hostcheck
    from ckpt.store import Store
    from ckpt.store.materialize import materialize
    from ckpt.store.staging import discard

    from ckpt.criu.images import tcp_connections
    from ckpt.restore import tcppeers

    binary = find_criu(settings)
    store = Store.open(store_root, settings=settings, passwords=passwords)
    with store.lock(exclusive=False):
        manifest = store.load(store.resolve(ref))
        # Checked against the manifest, as a restore does.
        image_dir = materialize(store.objects, store.staging_area(), manifest, skip_pages=True)
        try:
            report = hostcheck.check(manifest, binary, image_dir)
            connections = tcp_connections(image_dir) if manifest.criu.get("options", {}).get("tcp_established") \
                else []
        finally:
            discard(image_dir)
    name = f"checkpoint {manifest.id}"
    where = f"taken on {manifest.host or 'an unrecorded host'}" + (", another host" if report.another_host else "")
    plans = tcppeers.plan(connections, report.another_host, None)
    if plans:
        closed = sum(p.restored == "closed" for p in plans)
        where += (f"; {closed} of its {len(plans)} TCP connection(s) would be restored closed" if closed else
                  f"; its {len(plans)} TCP connection(s) would be restored as they were")
    found = f"; {len(report.mismatches)} thing(s) differ here" if report.mismatches else \
        "; everything a restore checks matches here"
    findings = [Finding(name, not report.mismatches, where + found)]
    findings += [Finding(name, False, problem, hostcheck.fix_for(kind, manifest, report))
                 for kind, problem in zip(report.kinds, report.mismatches, strict=True)]
    findings += [Finding(name, True, warning, required=False) for warning in report.warnings]
    # A connection that would come back closed is a warning: the program will see it fail.
    findings += [Finding(name, p.restored == "established", p.describe(would=True),
                         "" if p.restored == "established" else "the program sees it fail (end of file, EPIPE) and "
                         "can reconnect; 'ckpt restore --tcp-established' restores it as it was anyway",
                         required=False, tcp_connection=p.to_json()) for p in plans]
    return findings


def _kernel_version() -> tuple[int, ...]:
    import re

    return tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])


def _page_hashing() -> Finding:
    """Whether ckpt's C extension for page ids is built: without it dumps still work, but hash
    every page from Python, one call per page (0.35-0.45 s of one core per GiB)."""
    try:
        importlib.import_module("ckpt._pagehash")
        return Finding("page hashing", True, "in C, one thread per core (ckpt._pagehash)", required=False)
    except ImportError as exc:
        return Finding("page hashing", False, f"the C extension is not built ({exc}): dumps hash pages in Python, "
                       "two to three times slower", "run 'make setup' (it needs a C compiler, Python's headers and "
                       "libxxhash-dev)", required=False)


def _scheduler(wanted: str) -> Finding:
    """Whether the scheduler `schedule add` installs for runs here (issue 24: schedules that never
    ran, silently, where no cron daemon runs)."""
    from ckpt.schedule import schedulers

    facts = schedulers.Facts.here()
    try:
        chosen = schedulers.choose(facts, wanted)
    except CkptError as exc:
        return Finding("scheduler", False, exc.message, exc.hint or "", required=False)
    label = "systemd timers" if chosen == "systemd" else "cron"
    found = schedulers.problem(chosen, facts)
    if found is None:
        return Finding("scheduler", True, f"schedules run with {label}: {facts.why(chosen)}", required=False)
    return Finding("scheduler", False, f"schedules are installed for {label}, which will not run them: {found[0]}",
                   found[1], required=False)


def _store_writable(store_root: StoreLocation, settings: Settings, passwords: PasswordSource | None) -> Finding:
    from ckpt.errors import CheckpointNotFound, CkptError
    from ckpt.store import Store

    try:
        # refuses a store another user owns or others may write
        Store.open(store_root, settings=settings, passwords=passwords)
    except CheckpointNotFound:
        pass  # none yet: the first dump makes it
    except CkptError as exc:
        return Finding("store", False, exc.message, exc.hint or "")
    if isinstance(store_root, str):
        return Finding("store", True, f"{store_root} can be opened")
    probe_dir = store_root if store_root.exists() else store_root.parent
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    try:
        with tempfile.NamedTemporaryFile(dir=probe_dir, prefix=".ckpt-probe-"):
            pass
        return Finding("store", True, f"{store_root} is writable")
    except OSError as exc:
        return Finding("store", False, f"{store_root} is not writable: {exc.strerror}",
                       "run as root or choose another store with --store / CKPT_STORE")


def ready(findings: list[Finding]) -> bool:
    return all(f.ok for f in findings if f.required)


def as_json(findings: list[Finding]) -> dict:
    checks = []
    for f in findings:
        check = asdict(f)
        if check["tcp_connection"] is None:
            del check["tcp_connection"]
        checks.append(check)
    return {"ready": ready(findings), "checks": checks}
