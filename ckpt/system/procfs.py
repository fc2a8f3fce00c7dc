"""Raw facts from /proc, each read in one place. Cheap to import (no psutil): the lazy restore's
watcher and `ckpt list` use it."""

from __future__ import annotations

import os
from pathlib import Path


def stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name: [0] is the state, [6] the flags,
    [19] the start time in clock ticks. Raises OSError when there is no such process. PID
    "self" is the calling process, whatever PID namespace it is in (its getpid() may name
    another process in this /proc)."""
    data = Path(f"/proc/{pid}/stat").read_text()
    # comm may contain spaces and parentheses: split after the last ')'.
    return data[data.rindex(")") + 2:].split()


def pid_exists(pid: int) -> bool:
    """Whether a process of that PID exists (a zombie counts until it is reaped), ours or not."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def start_ticks(pid: int | str) -> int:
    """When the process started, in clock ticks since boot: with the boot id and the PID, it
    names one incarnation of a process (a PID is reused, the three together are not)."""
    return int(stat_fields(pid)[19])


def is_running(pid: int, start: int) -> bool:
    """Whether process PID still is the one that started at `start` (clock ticks since boot):
    a PID alone may be another process's by the time it is looked at. A zombie does not count:
    it has ended (what watches it must act, not wait for whoever reaps it)."""
    try:
        fields = stat_fields(pid) if pid > 0 else []
        return bool(fields) and int(fields[19]) == start and fields[0] not in ("Z", "X")
    except (OSError, ValueError, IndexError):
        return False


def boot_id() -> str:
    """This boot's random id: what was true of processes and the kernel before a reboot is not."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def machine_id() -> str:
    """The installation's id (systemd's /etc/machine-id; empty where there is none): unlike the
    host name it survives renaming, and unlike the boot id it survives reboots."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value:
            return value
    return ""


# x86 cpuinfo flags naming instructions user code may use (glibc, numpy, a JIT pick their code
# by them when the process starts, and a restored process keeps that choice): only these are
# compared, not facts like "hypervisor" or "constant_tsc" that differ between hosts harmlessly.
X86_INSTRUCTION_FLAGS = frozenset({
    "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "fma4", "f16c", "bmi1",
    "bmi2", "adx", "abm", "aes", "pclmulqdq", "sha_ni", "vaes", "vpclmulqdq", "gfni", "movbe", "rdrand", "rdseed",
    "xsave", "xsavec", "xsaveopt", "clflushopt", "clwb", "avx_vnni", "avx_vnni_int8", "avx_ifma", "avx_ne_convert",
    "movdiri", "movdir64b", "serialize", "cx16", "lahf_lm", "lzcnt",
    # TSX: glibc's *_rtm string functions end with xtest, which faults where RTM is off (a host
    # with TSX disabled by microcode or tsx=off).
    "rtm", "hle",
})
# Not compared although they name instructions: sse4a (AMD only, and no runtime dispatches on
# it: every AMD checkpoint would be refused on Intel).


def cpu_instruction_flags() -> list[str]:
    """The instruction-set extensions of this machine's CPU: on x86 the cpuinfo flags that name
    instructions (X86_INSTRUCTION_FLAGS, and every avx512* and amx*), on arm64 its Features
    (all name instructions); empty where /proc/cpuinfo says neither."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags":
            return sorted(flag for flag in value.split()
                          if flag in X86_INSTRUCTION_FLAGS or flag.startswith(("avx512", "amx")))
        if key == "Features":
            return sorted(value.split())
    return []


def host_facts() -> dict:
    """What a checkpoint records of the system it was taken on (the manifest's `system`), for a
    restore to tell another host and what must match there (docs/design.md, "Manifest")."""
    import os

    uname = os.uname()
    return {"machine_id": machine_id(), "kernel": uname.release, "arch": uname.machine,
            "cpu_flags": cpu_instruction_flags()}
