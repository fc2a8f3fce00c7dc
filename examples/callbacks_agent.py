#!/usr/bin/env python3
"""An agent that checkpoints itself, closing around each checkpoint what would not survive a
restore: docs/api.md's "Python: ckpt.checkpoint() and its callbacks".

    python3 examples/counting_server.py --port 8321 &
    .venv/bin/python examples/callbacks_agent.py http://127.0.0.1:8321 > /tmp/agent.log 2>&1 &

It counts, one a second, and posts each count to the server over one HTTP connection that it
keeps open between calls. A checkpoint should not hold that connection: a copy restored later
(or on another host) would find the server long gone from its other end. So a
before_checkpoint callback closes it and an after_restore callback opens a new one, after the
checkpoint, in the original and in every copy restored from it.

At count 5 it calls ckpt.checkpoint(name="agent"), which returns once the checkpoint is
committed and prints "checkpointed as ID"; kill it then (kill -9) and restore it (`ckpt restore
ID`, or `ckpt restore agent`): the copy returns from the same call, prints "restored from ID",
and counts on from 6 over a new connection.

Run it as root (a dump needs root; under `ckpt run` the supervisor dumps), with a Python that
has ckpt: docs/api.md, "Using ckpt from your program".
"""

import argparse
import http.client
import json
import sys
import time
from urllib.parse import urlsplit

import ckpt

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("server", help="the counting server's URL, http://127.0.0.1:PORT")
parser.add_argument("--checkpoint-at", type=int, default=5, metavar="N", help="checkpoint after the Nth count")
parser.add_argument("--interval", type=float, default=1.0, help="seconds between counts")
args = parser.parse_args()
# Each line out at once: a line still buffered at the checkpoint would be printed again by
# every copy restored from it.
sys.stdout.reconfigure(line_buffering=True)

server = urlsplit(args.server)
conn = http.client.HTTPConnection(server.hostname, server.port, timeout=30)


@ckpt.before_checkpoint
def close_connection():          # what would not survive a restore
    conn.close()
    print("before the checkpoint: connection closed")


@ckpt.after_restore
def reopen_connection():         # runs on both sides: the original and every restored copy
    conn.connect()
    print("after the checkpoint: connected again")


def post(count: int) -> None:
    # A dump from outside (a schedule, `ckpt dump`) waits until the exchange is over: no
    # checkpoint holds a request sent and its answer not read.
    with ckpt.no_checkpoint():
        conn.request("POST", f"/step/{count}", body=f"count {count}")
        answer = json.load(conn.getresponse())
    print(f"count {count}: posted (the server has had it {answer['count']} time(s))")


count = 0                        # in memory: a restored copy goes on from the checkpoint's count
while True:
    count += 1
    post(count)
    if count == args.checkpoint_at:
        result = ckpt.checkpoint(name="agent")   # returns once the checkpoint is committed
        if result.restored:
            print(f"restored from {result.id}")  # a copy restored from that checkpoint goes on here
        else:
            print(f"checkpointed as {result.id}")
    time.sleep(args.interval)
