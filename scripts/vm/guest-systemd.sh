#!/bin/sh
# Runs inside the second test VM, the one that boots systemd as PID 1 (ckpt-vm.service starts
# /sbin/ckpt-vm-init systemd, which mounts the shares and runs this): schedules installed as
# systemd timers, fired for real (tests/integration/test_schedule_systemd.py). Reports through
# /mnt/out as guest-run.sh does; the host decides pass or fail from those files.
# Not part of the image recipe: it is read from the project share at each boot.
out=/mnt/out
finish() {
    echo "$1" > "$out/rc"
    sync
    echo "ckpt-vm: done (status $1)" > /dev/console
    echo o > /proc/sysrq-trigger  # power off at once: nothing in the guest needs a clean shutdown
    sleep 30
}

export PATH=/opt/ckpt-venv/bin:/usr/local/sbin:/usr/sbin:/sbin:/usr/bin:/bin
export PYTHONPATH=/mnt/project PYTHONDONTWRITEBYTECODE=1 CKPT_STORE=/tmp/ckpt-store HOME=/root
cd /mnt/project || finish 90
# The timers run `python -m ckpt` with the environment of their unit, which has no PYTHONPATH:
# ckpt is made importable from the venv, as an installed ckpt would be.
python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' | {
    read -r site && echo /mnt/project > "$site/ckpt-project.pth"; }

echo "ckpt-vm: systemd $(systemctl is-system-running)" > /dev/console
python -m ckpt check --json > "$out/check.json"
{ python -m pytest -p no:cacheprovider -v -m systemd_timers --junitxml="$out/junit.xml" \
      tests/integration/test_schedule_systemd.py
  echo $? > "$out/pytest.rc"; } 2>&1 | tee "$out/pytest.log" > /dev/console
finish "$(cat "$out/pytest.rc" 2>/dev/null || echo 91)"
