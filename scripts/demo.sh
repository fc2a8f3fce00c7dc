#!/usr/bin/env bash
# A small stateful process is checkpointed, ended, restored, and shown to carry on where it was.
set -euo pipefail
cd "$(dirname "$0")/.."
CKPT=".venv/bin/ckpt"
work=$(mktemp -d /tmp/ckpt-demo.XXXXXX)
export CKPT_STORE="$work/store"
out="$work/counter.txt"
pid=""
cleanup() { [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true; }
trap cleanup EXIT

# The counter keeps its count only in memory and appends it to a file twice a second.
setsid .venv/bin/python tests/fixtures/counter.py "$out" 0.5 </dev/null >/dev/null 2>&1 &
pid=$!
disown "$pid"
sleep 3
echo "== counter (PID $pid) has counted to $(tail -n1 "$out")"

id=$("$CKPT" dump "$pid" --stop --name demo)
last=$(tail -n1 "$out")
echo "== checkpoint $id taken with --stop: the process is gone at $last"
sleep 2
echo "== two seconds later the file still ends at $(tail -n1 "$out")"
"$CKPT" list

pid=$("$CKPT" restore demo)
echo "== restored as PID $pid; waiting..."
sleep 2
echo "== the counter went on from $last: $(tail -n 5 "$out" | tr '\n' ' ')"
first_after=$(awk -v l="$last" 'NR == l + 1 { print; exit }' "$out")
if [ "$first_after" = "$((last + 1))" ]; then
  echo "== OK: after the restore it wrote $first_after, the next value, not 1"
else
  echo "== FAILED: expected $((last + 1)) after the restore, got '$first_after'" >&2
  exit 1
fi
"$CKPT" show demo | head -n 12
rm -rf "$work"
