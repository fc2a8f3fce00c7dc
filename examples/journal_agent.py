#!/usr/bin/env python3
"""An agent whose every step ends in an irreversible call, made exactly once through
ckpt.journal however often the agent is killed (kill -9) and restored: docs/api.md's "The
journal of irreversible actions".

    python3 examples/counting_server.py --port 8321 --delay 0.5 &
    .venv/bin/python examples/journal_agent.py http://127.0.0.1:8321 >> /tmp/poster.log 2>&1 &
    kill -9 <its PID>; ckpt restore poster     # at any moment, as often as you like
    curl -s http://127.0.0.1:8321/counts       # in the end: each step's call counted once

Each step: the agent's own work (think), a checkpoint (after the work, before the call), then
the call, a POST of the step to the server, made through the journal. The step counter lives
in memory only: a copy restored from a checkpoint goes on from that checkpoint's step, and the
journal, kept in the store, tells it which calls were made after that checkpoint. Each line it
prints says how a step's call went: posted, skipped (done before the rollback), or reconciled
(started before it: the server is asked whether the call arrived).

The records stay in the store (`ckpt journal show poster`): run it again and it skips every
call its journal says was made. To start afresh: `ckpt journal rm poster --force` (--force:
the checkpoints of the last run, if restored, would then call again), or another --name.

Run it as root (ckpt.checkpoint() dumps it; under `ckpt run` the supervisor does), with a
Python that has ckpt: docs/api.md, "Using ckpt from your program".
"""

import argparse
import json
import sys
import time
import urllib.request

import ckpt
from ckpt import journal

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("server", help="the counting server's URL, http://127.0.0.1:PORT")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--name", default="poster", help="its checkpoints' name, and so its journal's")
parser.add_argument("--pause", type=float, default=0.0,
                    help="seconds between recording the intent and the call (a window to kill it in)")
args = parser.parse_args()
sys.stdout.reconfigure(line_buffering=True)  # no line left in a buffer that a restored copy prints again


def think(step: int) -> str:
    time.sleep(0.2)  # the agent's own work: a kill loses it, the restored copy does it again
    return f"thought {step}"


def post(step: int, thought: str) -> dict:
    """The irreversible call: a new connection each time, closed after (none is open at a
    checkpoint)."""
    request = urllib.request.Request(f"{args.server}/step/{step}", data=thought.encode(), method="POST")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)


def received(step: int) -> bool:
    """Asks the outside world whether a call of this step arrived (the journal knows only that
    it was started)."""
    with urllib.request.urlopen(f"{args.server}/step/{step}", timeout=30) as answer:
        return json.load(answer)["received"] > 0


def say(step: int, what: str) -> None:
    print(f"step {step}: {what}")


steps, name = args.steps, args.name
journal.use(agent=name)                # or CKPT_NAME: the name of its checkpoints
step = 0                               # in memory only: a restored copy goes on from its checkpoint's step
while step < steps:
    thought = think(step)              # the agent's own work
    result = ckpt.checkpoint(name=name)  # after the work, before the irreversible call
    say(step, f"{'restored from' if result.restored else 'checkpoint'} {result.id}")
    key = f"post-step-{step}"
    prior = journal.intent(key)        # durable before the call
    if prior is None:                  # nobody started it: do it
        say(step, "intent recorded, calling")
        time.sleep(args.pause)
        outcome, how = post(step, thought), "posted"
    elif prior.done:                   # done before the rollback: skip it
        outcome, how = prior.outcome, "skipped: done before"
    elif received(step):               # started, outcome unknown: ask the outside world
        outcome, how = {"reconciled": True}, "reconciled: the server had it"
    else:
        outcome, how = post(step, thought), "reconciled: the server never got it, posted"
    journal.record(key, outcome)       # durable when it returns
    say(step, f"{how} {json.dumps(outcome)}")
    step += 1
print("finished")
