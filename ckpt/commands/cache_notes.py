"""What every command reading a remote store through its cache tells the user about copies
that rotted on this host's disk (the store itself was intact, and the command went on)."""

from __future__ import annotations

from ckpt.reporting import Reporter
from ckpt.store import Store


def tell_copies_read_again(store: Store, reporter: Reporter) -> None:
    names = store.backend.copies_read_again()
    if not names:
        return
    shown = ", ".join(name.rpartition("/")[2][:12] for name in names[:3]) + (", ..." if len(names) > 3 else "")
    copies = f"{len(names)} copies in the local cache" if len(names) > 1 else "a copy in the local cache"
    reporter.warn(f"{copies} failed the check (damaged on this host's disk, or cut short by a crash: {shown}); "
                  "dropped and fetched again from the store, which is intact")
