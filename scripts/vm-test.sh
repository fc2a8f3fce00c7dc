#!/usr/bin/env bash
# make vm-test: runs ckpt's dirty-page-tracking tests inside a QEMU guest whose kernel has
# soft-dirty (Debian's stock kernel), because the hosts this project runs on do not.
#
#   scripts/vm-test.sh [PYTEST_ARGS...]      e.g. scripts/vm-test.sh -k restore
#
# 1. Builds the guest image once: mmdebstrap (minbase, the host's own Debian release, so the
#    host's CRIU binary and Python wheels run unchanged) + the stock kernel + CRIU's runtime
#    libraries + a virtualenv with ckpt's dependencies, written into an ext4 disk image with
#    mkfs.ext4 -d (no loop devices). Cached in $CKPT_VM_CACHE (default /var/cache/ckpt-vm)
#    under a key of everything the image is made of; a changed recipe builds a new one.
# 2. Boots it with direct kernel boot (scripts/vm/boot.sh): KVM when the host's KVM can run
#    the stock kernel, TCG otherwise. A KVM guest that aborts, or prints nothing on its console
#    within CKPT_VM_SILENCE seconds (some paravirtual KVMs spin forever), is stopped and TCG
#    runs instead. The disk is opened with -snapshot (the cached image never changes); the
#    project is shared read-only over 9p, results come back through a second share. No
#    network device at all: loopback is all the tests use.
# 3. Boots it a second time with systemd as PID 1 (init=/lib/systemd/systemd, booting the
#    target ckpt-vm.target of the image), where a schedule installed as a systemd timer must
#    fire and take a checkpoint (scripts/vm/guest-systemd.sh): the host has no systemd as PID 1.
# 4. Prints what the guests reported and how long each step took, and exits with the tests'
#    status. A guest that does not boot, or tests that did not run (none collected, any
#    skipped), fail the run.
set -euo pipefail

# All of it runs inside main, which bash reads whole before running: editing this file while
# a run is in progress cannot change what that run does.
main() {

here=$(cd "$(dirname "$0")" && pwd)
project=$(cd "$here/.." && pwd)
cache=${CKPT_VM_CACHE:-/var/cache/ckpt-vm}
timeout_s=${CKPT_VM_TIMEOUT:-900}
memory_mib=${CKPT_VM_MEMORY:-3072}

say() { echo "vm-test: $*" >&2; }
die() { echo "vm-test: error: $*" >&2; exit 1; }
# Each step's duration goes to $work/times ("SECONDS<TAB>STEP", boot.sh adds the guest's); the
# summary is printed on exit, failed runs included: the slow step is what one looks for then.
work=
step_started=$SECONDS
step_done() {  # step_done STEP: the step that began at $step_started has ended
    local took=$((SECONDS - step_started))
    [ -z "$work" ] || printf '%s\t%s\n' "$took" "$1" >> "$work/times"
    step_started=$SECONDS
}
times_summary() {
    [ -f "$work/times" ] || return 0
    say "took: $(awk -F'\t' '{printf "%s%s %d s", (NR > 1 ? ", " : ""), $2, $1}' "$work/times"); total $SECONDS s"
}

[ "$(id -u)" = 0 ] || die "run as root (mmdebstrap and the image build need it): sudo make vm-test"
[ -x "$project/.venv/bin/python" ] || die "no .venv: run 'make setup' first"
criu_bin=$(command -v criu || true)
[ -x /usr/local/sbin/criu ] && criu_bin=/usr/local/sbin/criu
[ -n "$criu_bin" ] || die "no CRIU binary: run 'make setup' first"

# ---- host packages ------------------------------------------------------------------------
need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v vagrant >/dev/null || need+=(vagrant)
dpkg -s vagrant-libvirt >/dev/null 2>&1 || need+=(vagrant-libvirt)
installed=$SECONDS
if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
        || die "could not install ${need[*]} with apt-get"
fi
installed=$((SECONDS - installed))
step_started=$SECONDS

# The Vagrantfile users start from (vagrant/README.md) must at least be valid.
(cd "$project/vagrant" && vagrant validate >/dev/null) || die "vagrant/Vagrantfile does not validate ('cd vagrant && vagrant validate')"
say "vagrant/Vagrantfile validates"

# ---- the image recipe and its key ----------------------------------------------------------
. /etc/os-release
suite=${VERSION_CODENAME:?cannot tell the Debian release from /etc/os-release}
case "$suite" in
    bookworm) guest_python=3.11 ;;
    trixie) guest_python=3.13 ;;
    *) die "no guest recipe for Debian '$suite' (known: bookworm, trixie)" ;;
esac

# The Debian packages that hold CRIU's shared libraries (dpkg knows merged-/usr paths by
# either name, so ask for both).
criu_lib_packages() {
    local lib pkg
    for lib in $(ldd "$criu_bin" | awk '/=> \// {print $3}'); do
        lib=$(readlink -f "$lib")
        pkg=$(dpkg -S "$lib" 2>/dev/null || dpkg -S "${lib#/usr}" 2>/dev/null || true)
        [ -n "$pkg" ] && echo "${pkg%%:*}"
    done | sort -u
}

work=$(mktemp -d /tmp/ckpt-vm.XXXXXX)
cleanup() {
    times_summary
    rm -rf "$work"
}
trap cleanup EXIT
printf '%s\t%s\n' "$installed" "host packages" >> "$work/times"
step_done "vagrant validate"

# The guest's Python packages: exactly what the host's venv runs, less ckpt (shared from the
# project tree) and pycriu (built from the same CRIU source as the binary).
"$project/.venv/bin/pip" freeze --exclude-editable 2>/dev/null \
    | grep -viE '^(pycriu|ckpt)( |=|@)' | grep -v '^-e ' > "$work/requirements.txt"
packages="linux-image-amd64,initramfs-tools,kmod,iproute2,procps,python3,python3-venv,tini,nftables,util-linux,systemd"
packages="$packages,$(criu_lib_packages | paste -sd, -)"
build_image() {
    local rootfs="$work/rootfs" wheels="$work/wheelhouse" staging="$cache/.building-$key"
    say "building the guest image $key (Debian $suite, about 2 minutes; cached in $cache)"
    mkdir -p "$wheels" "$cache"
    chmod 700 "$cache"
    "$project/.venv/bin/pip" download -q --no-deps --only-binary=:all: --python-version "$guest_python" \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 \
        -d "$wheels" -r "$work/requirements.txt" >"$work/pip.log" 2>&1 \
        || { tail -n 20 "$work/pip.log" >&2; die "could not download the guest's Python wheels"; }
    local criu_lib
    criu_lib=$(cat "$project/.venv/.criu-lib" 2>/dev/null) || die "no .venv/.criu-lib: run 'make setup'"
    "$project/.venv/bin/pip" wheel -q --no-deps --no-build-isolation -w "$wheels" "$criu_lib" >>"$work/pip.log" 2>&1 \
        || { tail -n 20 "$work/pip.log" >&2; die "could not build the pycriu wheel from $criu_lib"; }
    cp "$work/requirements.txt" "$wheels/"
    echo pycriu >> "$wheels/requirements.txt"
    mmdebstrap --variant=minbase --mode=root --quiet --include="$packages" \
        --customize-hook="mkdir -p \"\$1/opt/wheelhouse\" && cp -a $wheels/. \"\$1/opt/wheelhouse/\"" \
        --customize-hook="chroot \"\$1\" python3 -m venv /opt/ckpt-venv" \
        --customize-hook="chroot \"\$1\" /opt/ckpt-venv/bin/pip install -q --no-index --find-links /opt/wheelhouse -r /opt/wheelhouse/requirements.txt" \
        --customize-hook="rm -rf \"\$1/opt/wheelhouse\"" \
        --customize-hook="install -m 755 $criu_bin \"\$1/usr/local/sbin/criu\"" \
        --customize-hook="install -m 755 $here/vm/guest-init.sh \"\$1/sbin/ckpt-vm-init\"" \
        --customize-hook="printf '%s\n' '[Unit]' 'Description=ckpt vm-test with systemd as PID 1' \
            'Requires=basic.target' 'After=basic.target' 'Wants=ckpt-vm.service' 'AllowIsolate=yes' \
            > \"\$1/etc/systemd/system/ckpt-vm.target\"" \
        --customize-hook="printf '%s\n' '[Unit]' 'Description=ckpt vm-test: schedules as systemd timers' \
            'After=basic.target' '[Service]' 'ExecStart=/sbin/ckpt-vm-init systemd' \
            > \"\$1/etc/systemd/system/ckpt-vm.service\"" \
        "$suite" "$rootfs" >"$work/mmdebstrap.log" 2>&1 \
        || { tail -n 30 "$work/mmdebstrap.log" >&2; die "mmdebstrap failed (log above)"; }
    rm -rf "$staging"
    mkdir -p "$staging"
    cp "$rootfs"/boot/vmlinuz-* "$staging/vmlinuz"
    cp "$rootfs"/boot/initrd.img-* "$staging/initrd.img"
    truncate -s 4G "$staging/disk.img"
    mkfs.ext4 -q -F -L ckpt-vm -d "$rootfs" "$staging/disk.img" || die "mkfs.ext4 -d failed"
    rm -rf "$rootfs"
    # Only the newest image is worth keeping: each is about a gigabyte.
    find "$cache" -mindepth 1 -maxdepth 1 -type d ! -name "$key" ! -name ".building-$key" -exec rm -rf {} +
    mv "$staging" "$image_dir"
}

key=$( {
    echo "suite=$suite packages=$packages python=$guest_python"
    cat "$here/vm/guest-init.sh" "$work/requirements.txt"
    declare -f build_image  # the recipe itself
    sha256sum "$criu_bin" | cut -d' ' -f1
    cat "$project/.venv/.criu-lib" 2>/dev/null
} | sha256sum | cut -c1-16)
image_dir="$cache/$key"


if [ -f "$image_dir/disk.img" ]; then
    step_done "guest image (cached)"
else
    build_image
    step_done "guest image (built)"
fi
say "guest image $image_dir"

# ---- booting ------------------------------------------------------------------------------
out="$work/out"
mkdir -p "$out"
printf '%s\n' "$@" > "$out/pytest-args"

# Try KVM first when the host has it, TCG after it if the KVM guest does not boot; an accelerator
# asked for by CKPT_VM_ACCEL is the only one tried. "quiet loglevel=6": the kernel's notices
# only (its banner first, as soon as the serial console is up), so that a guest shows it runs
# within a second under KVM (boot.sh stops a silent one), and within half a minute under TCG
# instead of nothing until the guest's init; "quiet" also keeps the initramfs silent.
# (earlyprintk would print sooner, but a hung paravirtual KVM prints its first line too.)
accels=tcg
if [ -n "${CKPT_VM_ACCEL:-}" ]; then
    accels=$CKPT_VM_ACCEL
elif [ -w /dev/kvm ]; then
    accels=kvm,tcg
fi
CKPT_VM_TIMEOUT=$timeout_s "$here/vm/boot.sh" "$out" "$work" "$accels" -- \
    -smp 2 -m "$memory_mib" -nodefaults -no-reboot -display none -serial stdio -nic none \
    -kernel "$image_dir/vmlinuz" -initrd "$image_dir/initrd.img" \
    -append "root=/dev/vda rw console=ttyS0 panic=-1 quiet loglevel=6 init=/sbin/ckpt-vm-init" \
    -drive "file=$image_dir/disk.img,format=raw,if=virtio,snapshot=on" \
    -virtfs "local,path=$project,mount_tag=project,security_model=none,readonly=on" \
    -virtfs "local,path=$out,mount_tag=out,security_model=none" || true
step_started=$SECONDS
accel=$(cat "$work/accel" 2>/dev/null || echo "${accels%%,*}")

# ---- what the guest reported ----------------------------------------------------------------
results=${CKPT_VM_RESULTS:-$project/vm-results}
rm -rf "$results"
mkdir -p "$results"
cp -a "$out"/. "$results/"
cp "$work"/console-*.log "$work"/qemu-*.err "$work"/times "$results/" 2>/dev/null || true
[ -f "$out/booted" ] || { tail -n 20 "$work/qemu-$accel.err" >&2 || true
    die "the guest did not boot (console and QEMU errors: $results)"; }
[ -f "$out/rc" ] || die "the guest booted but did not finish its run (timeout ${timeout_s}s?): see $results/console-$accel.log"

"$project/.venv/bin/python" - "$out" <<'EOF' || exit 1
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
failed = []
check = json.loads((out / "check.json").read_text()) if (out / "check.json").exists() else {}
dirty = [c for c in check.get("checks", []) if c["name"] == "feature mem_dirty_track"]
print(f"vm-test: guest kernel {(out / 'booted').read_text().strip()}; ckpt check: "
      + (f"dirty-page tracking {'works' if dirty and dirty[0]['ok'] else 'MISSING'}" if dirty else "no report"))
if not (dirty and dirty[0]["ok"]):
    failed.append("ckpt check did not report working dirty-page tracking in the guest")
if not (out / "junit.xml").exists():
    failed.append("the tests did not run (no junit.xml)")
else:
    suite = ET.parse(out / "junit.xml").getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    print("vm-test: guest tests: {tests} run, {failures} failed, {errors} errors, {skipped} skipped".format(**counts))
    if counts["tests"] == 0 or counts["skipped"]:
        failed.append("some dirty-tracking tests did not run")
    if counts["failures"] or counts["errors"]:
        failed.append("guest tests failed")
figures = out / "figures.jsonl"
if figures.exists():
    for line in figures.read_text().splitlines():
        print("vm-test: figures:", line)
if failed:
    print("vm-test: FAILED: " + "; ".join(failed), file=sys.stderr)
    sys.exit(1)
EOF
rc=$(cat "$out/rc")
[ "$rc" = 0 ] || die "the guest's tests exited with status $rc (logs: $results)"

# ---- the guest with systemd as PID 1: schedules as timers -----------------------------------
# Booted with the accelerator that ran the first guest; "quiet": systemd prints only failures.
step_started=$SECONDS
sd_out="$work/out-systemd" sd_logs="$work/systemd"
mkdir -p "$sd_out" "$sd_logs"
CKPT_VM_TIMEOUT=$timeout_s "$here/vm/boot.sh" "$sd_out" "$sd_logs" "$accel" -- \
    -smp 2 -m "$memory_mib" -nodefaults -no-reboot -display none -serial stdio -nic none \
    -kernel "$image_dir/vmlinuz" -initrd "$image_dir/initrd.img" \
    -append "root=/dev/vda rw console=ttyS0 panic=-1 quiet loglevel=6 init=/lib/systemd/systemd systemd.unit=ckpt-vm.target systemd.firstboot=off" \
    -drive "file=$image_dir/disk.img,format=raw,if=virtio,snapshot=on" \
    -virtfs "local,path=$project,mount_tag=project,security_model=none,readonly=on" \
    -virtfs "local,path=$sd_out,mount_tag=out,security_model=none" || true
sed 's/\t/\t(systemd) /' "$sd_logs/times" >> "$work/times" 2>/dev/null || true
step_started=$SECONDS
mkdir -p "$results/systemd"
cp -a "$sd_out"/. "$sd_logs"/console-*.log "$sd_logs"/qemu-*.err "$results/systemd/" 2>/dev/null || true
[ -f "$sd_out/booted" ] || die "the guest did not boot with systemd (console: $results/systemd)"
[ -f "$sd_out/rc" ] || die "the guest with systemd did not finish its run: see $results/systemd/console-$accel.log"
"$project/.venv/bin/python" - "$sd_out" <<'EOF' || exit 1
import sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
if not (out / "junit.xml").exists():
    sys.exit("vm-test: FAILED: the timer tests did not run under systemd (no junit.xml)")
suite = ET.parse(out / "junit.xml").getroot()
suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
print("vm-test: guest tests with systemd: {tests} run, {failures} failed, {errors} errors, {skipped} skipped"
      .format(**counts))
if counts["tests"] == 0 or counts["skipped"] or counts["failures"] or counts["errors"]:
    sys.exit("vm-test: FAILED: the timer tests under systemd did not all run and pass")
EOF
rc=$(cat "$sd_out/rc")
[ "$rc" = 0 ] || die "the timer tests under systemd exited with status $rc (logs: $results/systemd)"
say "passed (logs: $results)"
}

main "$@"
