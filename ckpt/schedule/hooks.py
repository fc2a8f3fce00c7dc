"""User hooks: shell commands run around dumps and restores.

Each runs with `/bin/sh -c`, with CKPT_EVENT, CKPT_PID, CKPT_ID and CKPT_NAME in its
environment, a bounded time (CKPT_HOOK_TIMEOUT seconds, default 60), and its output on ckpt's
stderr. The pre-dump hook runs before CRIU is started (the target is not frozen yet), so a
failing one aborts the dump with nothing frozen and nothing written; the post-restore hook runs
once the restored tree is running.
"""

from __future__ import annotations

import os
import subprocess

from ckpt.errors import HookFailed


def run_hook(command: str, event: str, pid: int, checkpoint_id: str, name: str | None, timeout: float) -> None:
    """Runs a hook; timeout: CKPT_HOOK_TIMEOUT."""
    env = {**os.environ, "CKPT_EVENT": event, "CKPT_PID": str(pid), "CKPT_ID": checkpoint_id,
           "CKPT_NAME": name or ""}
    try:
        proc = subprocess.run(["/bin/sh", "-c", command], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise HookFailed(f"{event} hook did not finish within {timeout:.0f} s: {command}",
                         hint="make it faster or raise CKPT_HOOK_TIMEOUT") from None
    output = proc.stdout.decode(errors="replace").strip()
    if proc.returncode != 0:
        last = output.splitlines()[-1] if output else "no output"
        raise HookFailed(f"{event} hook failed with exit code {proc.returncode}: {command} ({last})")
