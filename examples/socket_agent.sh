#!/bin/bash
# A shell script that takes part in its own checkpoints under `ckpt run`, over the socket that
# ckpt run names in CKPT_SOCKET (docs/api.md, "Any language: CKPT_SOCKET under ckpt run"): it sends
# a report that no checkpoint may cut in two (a critical section), asks for a checkpoint right
# after it, learns on which side of that checkpoint it runs, then goes on with its work.
#
#   ckpt run --every 10m --first-after 10m --name reporter --output /tmp/reporter.out \
#       -- examples/socket_agent.sh /tmp/reports.txt
#   tail -f /tmp/reporter.out    # "checkpoint ID taken; going on", then "working 1", "working 2"...
#   kill -9 <the script's PID>   # ckpt run restores it from that checkpoint, after the report:
#                                # "restored from ID after a crash: the report was sent already"
#
# (--first-after 10m: ckpt run takes no checkpoint of its own before the kill, so the one it
# restores is the one the script asked for; a later one would restore it into its work.)
#
# REPORTS (default /tmp/reports.txt) gets one line per report sent. Needs socat (`make setup`
# installs it; `nc -U -N` works too) and nothing of ckpt's.
set -u
reports=${1:-/tmp/reports.txt}

ckpt_say() {   # one request, one reply; asks again while a dump is under way
  local reply i
  for i in $(seq 600); do
    reply=$(printf '%s\n' "$1" | socat -t 5 - "UNIX-CONNECT:$CKPT_SOCKET" 2>/dev/null)
    case $reply in ''|BUSY|PENDING) sleep 0.1 ;; *) echo "$reply"; return 0 ;; esac
  done
  return 1
}

send_the_report() {   # the part that must not be done twice, nor cut in two by a checkpoint
  echo "report from PID $$ at $(date -u +%Y-%m-%dT%H:%M:%SZ)" >> "$reports"
  sleep 1             # (a real one takes a while)
}

token=$(ckpt_say "BEGIN $$"); token=${token#SECTION }
send_the_report                             # no checkpoint cuts this in two
ckpt_say "END $token" > /dev/null

reply=$(ckpt_say "CHECKPOINT after-report"); id=${reply#OK }
case $(ckpt_say "RESULT $id") in
  "CHECKPOINTED $id") echo "checkpoint $id taken; going on" ;;
  "RESTORED $id")     echo "restored from $id after a crash: the report was sent already" ;;
  *)                  echo "no checkpoint this time" ;;
esac

for i in $(seq 3600); do   # the rest of its work
  echo "working $i"
  sleep 1
done
