#!/usr/bin/env python3
"""The outside world of the examples: an HTTP server on 127.0.0.1 that counts the calls it gets.

    python3 examples/counting_server.py [--port PORT] [--delay SECONDS] [--port-file FILE] [--events FILE]

  POST /step/N   counts one call of step N (its body is kept) and answers, after DELAY seconds,
                 {"step": N, "count": <calls of step N so far>}: the delay is a window in which
                 the call has happened but its caller does not know it yet
  GET /step/N    {"step": N, "received": <calls of step N so far>}: how an agent finds out
                 whether a call it started arrived (examples/journal_agent.py reconciles so)
  GET /counts    {"N": {"count": c, "body": "<last body>"}, ...}: every step called

It answers over HTTP/1.1, so that a client may keep its connection open between calls
(examples/callbacks_agent.py does). It says where it listens on stdout; PORT 0 (the default)
lets the kernel choose, and --port-file FILE gets the port once it listens. --events FILE gets
a line "POST N" as each call is counted. Nothing of ckpt: it runs on any python3.
"""

import argparse
import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STEP = re.compile(r"^/step/(\d+)$")

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--port", type=int, default=0)
parser.add_argument("--delay", type=float, default=0.0, help="seconds between counting a call and answering it")
parser.add_argument("--port-file", help="write the port here once listening")
parser.add_argument("--events", help="append 'POST N' here as each call is counted")
args = parser.parse_args()

lock = threading.Lock()
counts: dict[int, int] = {}
bodies: dict[int, str] = {}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a connection serves call after call

    def answer(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        match = STEP.match(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode()
        if not match:
            self.send_error(404)
            return
        step = int(match.group(1))
        with lock:  # counted once the whole request is in: a call cut short never counts
            counts[step] = counts.get(step, 0) + 1
            bodies[step] = body
            count = counts[step]
            if args.events:
                with open(args.events, "a") as events:
                    events.write(f"POST {step}\n")
        time.sleep(args.delay)
        self.answer({"step": step, "count": count})

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/counts":
            with lock:
                self.answer({str(s): {"count": c, "body": bodies[s]} for s, c in sorted(counts.items())})
            return
        match = STEP.match(self.path)
        if not match:
            self.send_error(404)
            return
        step = int(match.group(1))
        with lock:
            self.answer({"step": step, "received": counts.get(step, 0)})

    def log_message(self, *_args) -> None:  # quiet: the counts are the record
        pass


server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
port = server.server_address[1]
if args.port_file:  # written whole, then renamed: a reader never sees half a number
    with open(f"{args.port_file}.tmp", "w") as f:
        f.write(str(port))
    os.rename(f"{args.port_file}.tmp", args.port_file)
print(f"counting calls on http://127.0.0.1:{port}", flush=True)
server.serve_forever()
