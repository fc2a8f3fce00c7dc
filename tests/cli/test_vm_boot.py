"""scripts/vm/boot.sh, the part of 'make vm-test' that picks the accelerator, with a fake QEMU:
a KVM guest that hangs silently (as on hosts with a paravirtual KVM), one that aborts, and a
healthy one. The real guest is 'make vm-test' itself; these check only the watching and the
fallback, in seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, alive

BOOT = ROOT / "scripts" / "vm" / "boot.sh"
SILENCE_S = 2

# Stands in for qemu-system-x86_64. Each run appends "ACCEL PID" to $FAKE_LOG; KVM behaves as
# $FAKE_KVM says, TCG always boots at once: it writes the files the real guest writes.
FAKE_QEMU = r"""#!/bin/bash
accel=
while [ $# -gt 0 ]; do
    case $1 in -accel) accel=${2%%,*}; shift ;; esac
    shift
done
echo "$accel $$" >> "$FAKE_LOG"
mode=boot
[ "$accel" = kvm ] && mode=$FAKE_KVM
case $mode in
    silent)  # spins, printing nothing, as KVM does on some paravirtual hosts (bounded: 60 s)
        end=$((SECONDS + 60)); while [ $SECONDS -lt $end ]; do :; done ;;
    abort)
        echo "qemu-system-x86_64: fake: kvm run failed Invalid argument" >&2; exit 1 ;;
    slow)  # prints at once, then takes longer than the silence limit to boot
        echo "Linux version fake"; sleep $((FAKE_SILENCE + 2)) ;&
    boot)
        echo "ckpt-vm: booted fake"; echo fake > "$FAKE_OUT/booted"
        echo 0 > "$FAKE_OUT/rc"; echo "ckpt-vm: done (status 0)" ;;
    idle)  # a QEMU that boot.sh did not start
        exec sleep 60 ;;
esac
"""


@pytest.fixture
def fake(tmp_path):
    qemu = tmp_path / "qemu-system-x86_64"
    qemu.write_text(FAKE_QEMU)
    qemu.chmod(0o755)
    (tmp_path / "out").mkdir()
    (tmp_path / "logs").mkdir()
    return tmp_path


def boot(fake: Path, accels: str, kvm: str, timeout_s: int = 60,
         silence_s: int = SILENCE_S) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, CKPT_VM_QEMU=str(fake / "qemu-system-x86_64"), CKPT_VM_SILENCE=str(silence_s),
               CKPT_VM_TIMEOUT=str(timeout_s), FAKE_KVM=kvm, FAKE_SILENCE=str(silence_s),
               FAKE_LOG=str(fake / "started"), FAKE_OUT=str(fake / "out"))
    started = time.monotonic()
    proc = subprocess.run([str(BOOT), str(fake / "out"), str(fake / "logs"), accels, "--", "-m", "64"],
                          env=env, capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - started


def runs(fake: Path) -> list[tuple[str, int]]:
    return [(accel, int(pid)) for accel, pid in
            (line.split() for line in (fake / "started").read_text().splitlines())]


def test_a_silent_kvm_guest_is_stopped_and_tcg_runs_instead(fake):
    # Another QEMU on the machine, not started by boot.sh: it must survive.
    bystander = subprocess.Popen([str(fake / "qemu-system-x86_64"), "-accel", "kvm"],
                                 env=dict(os.environ, FAKE_KVM="idle", FAKE_LOG=str(fake / "bystander")))
    try:
        proc, took = boot(fake, "kvm,tcg", "silent")
        assert proc.returncode == 0, proc.stderr
        assert took < SILENCE_S + 10, f"fell back after {took:.0f} s"
        assert "guest (kvm) printed nothing on its console" in proc.stderr
        assert "falling back from KVM to TCG" in proc.stderr
        (kvm, kvm_pid), (tcg, _) = runs(fake)
        assert (kvm, tcg) == ("kvm", "tcg")
        assert not alive(kvm_pid), "the silent QEMU was left running"
        assert alive(bystander.pid), "a QEMU boot.sh did not start was stopped"
        assert "ckpt-vm: booted fake" in proc.stdout  # the console, live
        assert (fake / "logs" / "accel").read_text().strip() == "tcg"
        times = (fake / "logs" / "times").read_text()
        assert "kvm attempt (silent, did not boot)" in times and "tcg" in times
    finally:
        bystander.send_signal(signal.SIGKILL)
        bystander.wait(timeout=10)


def test_a_kvm_guest_that_aborts_falls_back_to_tcg(fake):
    proc, took = boot(fake, "kvm,tcg", "abort", silence_s=30)
    assert proc.returncode == 0, proc.stderr
    assert took < 10, f"waited {took:.0f} s on a QEMU that had exited"
    assert "guest (kvm) did not boot: QEMU exited with status 1" in proc.stderr
    assert "kvm run failed" in proc.stderr
    assert [accel for accel, _ in runs(fake)] == ["kvm", "tcg"]


def test_a_kvm_guest_that_prints_is_not_stopped(fake):
    proc, took = boot(fake, "kvm,tcg", "slow")
    assert proc.returncode == 0, proc.stderr
    assert took >= SILENCE_S + 2
    assert [accel for accel, _ in runs(fake)] == ["kvm"]
    assert "printed nothing" not in proc.stderr


def test_a_silent_kvm_guest_asked_for_fails_at_once(fake):
    # CKPT_VM_ACCEL=kvm: no fallback, but no waiting for CKPT_VM_TIMEOUT either.
    proc, took = boot(fake, "kvm", "silent", timeout_s=600)
    assert proc.returncode == 1
    assert took < SILENCE_S + 10
    assert "guest (kvm) printed nothing on its console" in proc.stderr
    (_, kvm_pid), = runs(fake)
    assert not alive(kvm_pid)


def test_a_guest_past_the_time_limit_is_stopped(fake):
    proc, took = boot(fake, "kvm", "slow", timeout_s=1)
    assert proc.returncode == 1
    assert took < SILENCE_S + 10
    assert "still running after" in proc.stderr
