"""What ckpt prints on a real terminal (a pseudo-terminal of a given width): colours, widths, units.

No CRIU: the checkpoints here are manifests without images, enough for list and verify."""

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from datetime import datetime, timedelta, timezone

from rich.console import Console

from ckpt.store import Store
from tests.helpers import env_settings, ROOT, manifest_only_checkpoint

LONG_COMMAND = "python3 /opt/agents/summarize-the-nightly-reports.py --config /etc/agents/nightly.toml --verbose"


def run_in_terminal(argv, env, columns=80, timeout=30.0):
    """ckpt ARGV with stdin, stdout and stderr on a pseudo-terminal COLUMNS wide: (exit code, bytes shown)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in {**os.environ, **env}.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR")}
    proc = subprocess.Popen([sys.executable, "-m", "ckpt", *argv], stdin=slave, stdout=slave, stderr=slave,
                            env=env, cwd=ROOT, start_new_session=True)
    os.close(slave)
    shown = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's last writer is gone
                break
            if not chunk:
                break
            shown += chunk
        else:
            proc.kill()
            raise AssertionError(f"ckpt {' '.join(argv)} did not end within {timeout} s: {shown!r}")
        return proc.wait(timeout=10), shown
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_no_color_means_no_escape_sequence_at_all(isolated_env):
    """rich drops colours under NO_COLOR but kept the dim of 'ckpt:' (ESC [2m)."""
    store = Store.open_local(isolated_env, create=True, settings=env_settings())
    manifest_only_checkpoint(store, "agent", datetime.now(timezone.utc))
    code, shown = run_in_terminal(["verify", "latest"], {})
    assert code == 0 and b"ckpt:" in shown and b"\x1b[" in shown, shown  # styled on a terminal...
    for argv in (["verify", "latest"], ["list"], ["forget", "--keep-last", "5", "--dry-run"]):
        code, shown = run_in_terminal(argv, {"NO_COLOR": "1"})
        assert code == 0 and b"\x1b" not in shown, (argv, shown)  # ...and not at all under NO_COLOR


def test_list_fits_the_terminal_and_shortens_the_command(isolated_env):
    store = Store.open_local(isolated_env, create=True, settings=env_settings())
    now = datetime.now(timezone.utc)
    for minutes in (30, 20, 10):
        manifest_only_checkpoint(store, "nightly-report", now - timedelta(minutes=minutes), command=LONG_COMMAND)
    for columns in (80, 100):
        code, shown = run_in_terminal(["list"], {}, columns=columns)
        lines = shown.decode().replace("\r\n", "\n").splitlines()
        table = [line for line in lines if line.startswith(("ID ", "20"))]
        assert code == 0 and len(table) == 4, shown
        assert all(len(line) <= columns for line in table), "\n".join(table)
        assert all("…" in line for line in table[1:]) and "python3 /opt/agents/" in table[1], table[1]
    # Piped, a line is whole: for grep and awk.
    piped = subprocess.run([sys.executable, "-m", "ckpt", "list"], capture_output=True, text=True, cwd=ROOT,
                           timeout=30)
    assert LONG_COMMAND in piped.stdout and "…" not in piped.stdout


def test_sizes_for_people_are_in_binary_units():
    """One convention: MiB and GiB (the progress bar showed MB, `ckpt run` raw bytes)."""
    from rich.progress import Progress

    from ckpt.cli.output import human_bytes, progress_columns

    assert human_bytes(3 << 30) == "3.0 GiB" and human_bytes(1536) == "1.5 KiB"
    console = Console(file=io.StringIO(), force_terminal=True, width=120, color_system=None)
    progress = Progress(*progress_columns(), console=console, auto_refresh=False)
    task = progress.add_task("storing pages", total=3 << 30)
    progress.update(task, completed=1 << 30)
    console.print(progress.get_renderable())
    bar = console.file.getvalue()
    assert "1.0/3.0 GiB" in bar and "GB" not in bar, bar
    # Messages of the core say sizes with human_bytes, never as a count of bytes.
    raw = re.compile(r"\{[^{}]*bytes[^{}]*\} bytes")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in (ROOT / "ckpt").rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if raw.search(line)]
    assert found == []
