#!/usr/bin/env python3
"""A counter that keeps its count in memory only: the program `ckpt run` supervises in the
README ("Try it") and docs/schedules.md. It knows nothing of ckpt; killed (kill -9) and
restored from its newest checkpoint, it goes on from the count it had then, not from 1.

    python3 examples/counter.py [FILE] [--interval SECONDS]

Counts 1, 2, 3..., one every SECONDS (default 1), appending each to FILE (opened for that line
and closed again), or printing it when no FILE is given. Under `ckpt run`:

    ckpt run --every 2s --name counter-run --output /tmp/counter.out -- python3 examples/counter.py /tmp/count.txt
    kill -9 <the counter's PID>       # from another shell: ckpt run restores it
    tail /tmp/count.txt               # ... 7 8 9 6 7 8 ...: on from its last checkpoint
"""

import argparse
import time

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("file", nargs="?", help="append each count here (default: print it)")
parser.add_argument("--interval", type=float, default=1.0, help="seconds between counts")
args = parser.parse_args()

i = 0  # in memory only: nothing on disk it could start again from
while True:
    i += 1
    if args.file:
        with open(args.file, "a") as out:
            out.write(f"{i}\n")
    else:
        # flush: a line still in Python's buffer at a checkpoint would be printed again by
        # every copy restored from it
        print(i, flush=True)
    time.sleep(args.interval)
