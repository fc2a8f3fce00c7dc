#!/bin/sh
# PID 1 of the test VM (installed as /sbin/ckpt-vm-init; the kernel runs it with init=).
# Mounts what a minimal system needs, mounts the two 9p shares (the project, read-only, and
# the output directory), then hands over to the run script that the project ships. tini
# stays PID 1 so that the orphans of restored trees are reaped as on a real system.
# With the argument "systemd" it is instead the service ckpt-vm.service of a guest booted with
# systemd as PID 1, which has mounted the rest: it mounts the shares and runs guest-systemd.sh.
# Part of the image recipe: changing this file rebuilds the guest image.
if [ "${1:-}" = systemd ]; then
    modprobe 9pnet_virtio
    modprobe 9p
    mkdir -p /mnt/project /mnt/out
    mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288 project /mnt/project
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 out /mnt/out
    echo "ckpt-vm: booted $(uname -r) with systemd" > /dev/console
    echo "$(uname -r)" > /mnt/out/booted
    exec /bin/sh /mnt/project/scripts/vm/guest-systemd.sh
fi
mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=755 tmpfs /run
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
hostname ckpt-vm
modprobe 9pnet_virtio
modprobe 9p
mkdir -p /mnt/project /mnt/out
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288 project /mnt/project
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 out /mnt/out
echo "ckpt-vm: booted $(uname -r)" > /dev/console
echo "$(uname -r)" > /mnt/out/booted
# setsid: as on a real system, the run gets a session of its own (PID 1 has none, and CRIU
# cannot dump a tree whose session is led from outside). PID 1 leads no process group, so
# setsid does not fork and tini stays PID 1.
exec setsid /usr/bin/tini -s -- /bin/sh /mnt/project/scripts/vm/guest-run.sh
