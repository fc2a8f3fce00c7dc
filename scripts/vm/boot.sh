#!/usr/bin/env bash
# Host side of make vm-test (called by scripts/vm-test.sh): runs the guest to its end, trying
# accelerators in order until a guest boots.
#
#   scripts/vm/boot.sh OUT LOGS ACCELS -- QEMU_ARGS...     e.g. ACCELS=kvm,tcg
#
# OUT is the guest's output share: the guest writes OUT/booted once it is up (guest-init.sh).
# LOGS receives console-ACCEL.log, qemu-ACCEL.err, "accel" (the last accelerator run) and
# "times" (one "SECONDS<TAB>STEP" line per step, for the summary of vm-test.sh).
#
# The next accelerator is tried when a guest did not boot: QEMU aborted (KVM refusing the
# guest), or a KVM guest printed nothing on its console within CKPT_VM_SILENCE seconds. The
# paravirtual KVM of some hosts neither runs the stock kernel nor fails: QEMU spins at 100%
# CPU with an empty console until someone kills it (seen for 113 s before a kill by hand).
# The guest's first line is the kernel's banner (vm-test.sh boots it with loglevel=6), printed
# once the kernel is decompressed and its serial console up: a moment under a working KVM,
# 28 s under TCG on a busy 2-core host (decompression, emulated), so a KVM guest silent for 30 s
# is hung. TCG guests are bounded only by CKPT_VM_TIMEOUT: emulation is slow, not stuck.
#
# Environment: CKPT_VM_QEMU (default qemu-system-x86_64), CKPT_VM_SILENCE (s, default 30),
# CKPT_VM_TIMEOUT (s per guest, default 900). Only the QEMU this script started is ever
# stopped, by its PID.
set -euo pipefail

main() {

[ $# -ge 3 ] || { echo "usage: $0 OUT LOGS ACCELS -- QEMU_ARGS..." >&2; exit 2; }
out=$1 logs=$2 accels=$3
shift 3
[ "${1:-}" = -- ] && shift
qemu=${CKPT_VM_QEMU:-qemu-system-x86_64}
silence_s=${CKPT_VM_SILENCE:-30}
timeout_s=${CKPT_VM_TIMEOUT:-900}

say() { echo "vm-test: $*" >&2; }
took() { printf '%s\t%s\n' "$1" "$2" >> "$logs/times"; }

qemu_pid= tail_pid=
stop() {  # stop PID: SIGTERM, then SIGKILL if it is still there 10 s later
    local pid=$1 i
    kill -TERM "$pid" 2>/dev/null || return 0
    for i in $(seq 20); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.5
    done
    kill -KILL "$pid" 2>/dev/null || true
}
cleanup() {
    [ -z "$qemu_pid" ] || stop "$qemu_pid"
    [ -z "$tail_pid" ] || kill "$tail_pid" 2>/dev/null || true
}
# Background commands of a script ignore SIGINT: without this, ^C would leave QEMU running.
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Whole seconds since $1 (a now_us): $SECONDS is rounded to the second it began, which would
# make a 30 s limit anything from 29 to 30 s.
now_us() { local t=${EPOCHREALTIME//[!0-9]/}; echo "${t#0}"; }
since() { echo $(( ($(now_us) - $1) / 1000000 )); }

cpu_percent() {  # cpu_percent PID SECONDS: the share of one CPU PID used over its life so far
    local stat ticks
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || { echo "?"; return; }
    stat=${stat##*) }  # after the command name, which may hold spaces
    ticks=$(echo "$stat" | awk '{print $12 + $13}')  # utime + stime of all its threads
    echo $(( ticks * 100 / $(getconf CLK_TCK) / ($2 > 0 ? $2 : 1) ))
}

# run ACCEL QEMU_ARGS...: one guest, watched four times a second. Sets $ended to how it ended:
# done (QEMU exited), silent (stopped: nothing on the console) or timeout (stopped).
run() {
    local accel=$1 cpu=max console="$logs/console-$1.log" elapsed booted_at= status=0
    shift
    [ "$accel" = kvm ] && cpu=host
    rm -f "$out/booted" "$out/rc"
    : > "$console"
    echo "$accel" > "$logs/accel"
    local started
    started=$(now_us)
    # QEMU's own PID (no timeout(1) or pipe in between): it is what gets stopped.
    "$qemu" -accel "$accel$([ "$accel" = tcg ] && echo ,thread=multi)" -cpu "$cpu" "$@" \
        </dev/null >"$console" 2>"$logs/qemu-$accel.err" &
    qemu_pid=$!
    tail -n +1 -f -s 0.25 --pid="$qemu_pid" "$console" &  # the console, live, for whoever watches
    tail_pid=$!
    ended=done
    while kill -0 "$qemu_pid" 2>/dev/null; do
        elapsed=$(since "$started")
        if [ -z "$booted_at" ] && [ -f "$out/booted" ]; then
            booted_at=$elapsed
            say "guest ($accel) booted in $elapsed s"
            took "$elapsed" "boot ($accel)"
        fi
        if [ "$accel" = kvm ] && [ "$elapsed" -ge "$silence_s" ] && [ ! -s "$console" ]; then
            say "guest (kvm) printed nothing on its console in $elapsed s (QEMU, pid $qemu_pid, at $(cpu_percent "$qemu_pid" "$elapsed")% CPU): KVM hangs on this machine; stopping it"
            ended=silent
            stop "$qemu_pid"
            break
        fi
        if [ "$elapsed" -ge "$timeout_s" ]; then
            say "guest ($accel) still running after $elapsed s (CKPT_VM_TIMEOUT=$timeout_s): stopping it"
            ended=timeout
            stop "$qemu_pid"
            break
        fi
        sleep 0.25
    done
    wait "$qemu_pid" || status=$?
    qemu_pid=
    wait "$tail_pid" 2>/dev/null || true
    tail_pid=
    elapsed=$(since "$started")
    if [ -n "$booted_at" ]; then
        say "guest ($accel) ran its tests in $((elapsed - booted_at)) s"
        took "$((elapsed - booted_at))" "tests ($accel)"
    elif [ "$ended" = done ] && [ -f "$out/booted" ]; then  # booted and ended within one poll
        took "$elapsed" "boot and tests ($accel)"
    else
        [ "$ended" = done ] && say "guest ($accel) did not boot: QEMU exited with status $status after $elapsed s ($(tail -n 1 "$logs/qemu-$accel.err" 2>/dev/null))"
        took "$elapsed" "$accel attempt ($([ "$ended" = done ] && echo "QEMU exited $status" || echo "$ended"), did not boot)"
    fi
}

IFS=, read -ra tries <<< "$accels"
for i in "${!tries[@]}"; do
    run "${tries[$i]}" "$@"
    [ -f "$out/booted" ] && exit 0
    next=${tries[$((i + 1))]:-}
    if [ -n "$next" ]; then
        say "falling back from ${tries[$i]^^} to ${next^^}"
    fi
done
exit 1
}

main "$@"
