#!/bin/sh
# Runs inside the test VM (started by guest-init.sh): ckpt check, then the tests that need
# dirty-page tracking. Everything it reports lands in /mnt/out, which the host reads; the
# host decides pass or fail from those files, so a guest that dies early fails loudly there.
# Not part of the image recipe: it is read from the project share at each boot.
out=/mnt/out
finish() {
    echo "$1" > "$out/rc"
    sync
    echo "ckpt-vm: done (status $1)" > /dev/console
    echo o > /proc/sysrq-trigger  # power off at once: nothing in the guest needs a clean shutdown
    sleep 30
}

# Without an init system nobody brings up loopback or loads tun; criu check needs both.
ip link set lo up
modprobe tun 2>/dev/null
modprobe nf_tables 2>/dev/null

export PATH=/opt/ckpt-venv/bin:/usr/local/sbin:/usr/sbin:/sbin:/usr/bin:/bin
export PYTHONPATH=/mnt/project PYTHONDONTWRITEBYTECODE=1 CKPT_STORE=/tmp/ckpt-store HOME=/root
export CKPT_REQUIRE_DIRTY_TRACKING=1 CKPT_TEST_FIGURES=/mnt/out/figures.jsonl
cd /mnt/project || finish 90

echo "ckpt-vm: THP $(cat /sys/kernel/mm/transparent_hugepage/enabled)"
python -m ckpt check
python -m ckpt check --json > "$out/check.json"
echo $? > "$out/check.rc"

# Extra pytest arguments come from the host through the output share (one per line).
args=$(cat "$out/pytest-args" 2>/dev/null | tr '\n' ' ')
# shellcheck disable=SC2086  # a word list on purpose
{ python -m pytest -p no:cacheprovider -v -m dirty_tracking --junitxml="$out/junit.xml" $args tests/integration
  echo $? > "$out/pytest.rc"; } 2>&1 | tee "$out/pytest.log"
finish "$(cat "$out/pytest.rc" 2>/dev/null || echo 91)"
