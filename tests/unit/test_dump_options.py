"""A dump's options: the manifest's `criu.options` is the store format (docs/design.md), and a
restore of an older checkpoint gets the CRIU options it always got."""

import re
from pathlib import Path

import pytest

from ckpt.criu.client import CriuFlags, CriuOptions
from ckpt.dump.dump_options import DumpOptions

DESIGN = Path(__file__).parent.parent.parent / "docs" / "design.md"
WHERE = dict(images_dir=Path("/i"), log_dir=Path("/l"), log_name="x.log")


def documented_keys() -> list[str]:
    """The keys of the `criu.options` table in docs/design.md, in its order."""
    text = DESIGN.read_text()
    section = text[text.index("- `criu.options`:"):]
    table = section[section.index("| key |"):section.index("\n\n", section.index("| key |"))]
    return re.findall(r"^\s*\| `(\w+)` \|", table, re.M)


def test_the_manifest_keys_are_the_ones_design_md_documents_in_its_order():
    keys = documented_keys()
    assert keys == list(DumpOptions(ghost_limit=2 << 20).to_manifest())
    assert "ghost_limit" not in DumpOptions().to_manifest(), "written only when CRIU was given one"


@pytest.mark.parametrize("written", [
    # as ckpt writes them today (a running tree; --stop with TCP and a large deleted file)
    {"shell_job": False, "tcp_established": False, "ext_unix_sk": False, "file_locks": False,
     "leave_running": True, "network_lock": "skip", "track_mem": False},
    {"shell_job": True, "tcp_established": True, "ext_unix_sk": True, "file_locks": True,
     "leave_running": False, "network_lock": "nftables", "ghost_limit": 8 << 20, "track_mem": True},
])
def test_what_is_read_back_is_written_again_unchanged(written):
    options = DumpOptions.from_manifest(written)
    assert options.to_manifest() == written
    assert list(options.to_manifest()) == list(written), "same key order as on disk"


def test_unknown_keys_are_ignored():
    assert DumpOptions.from_manifest({"shell_job": True, "from_the_future": 1}) == DumpOptions(shell_job=True)


@pytest.mark.parametrize("old, expected", [
    # the restore's CRIU options for manifests missing keys, as restore.py built them before
    # DumpOptions: bool() of each flag, network_lock defaulting to nftables
    ({}, CriuOptions(**WHERE)),
    ({"shell_job": True, "tcp_established": True, "ext_unix_sk": False, "file_locks": True, "leave_running": False},
     CriuOptions(**WHERE, flags=CriuFlags(shell_job=True, tcp_established=True, file_locks=True,
                                          network_lock="nftables"))),
    ({"tcp_established": False, "network_lock": "skip", "track_mem": True, "ghost_limit": 4 << 20},
     CriuOptions(**WHERE, flags=CriuFlags(network_lock="skip"))),
])
def test_a_restore_of_an_older_manifest_gets_the_criu_options_it_always_got(old, expected):
    got = DumpOptions.from_manifest(old).to_criu_restore(**WHERE, inherit_stdio=False, inherit_fds=[], extra={})
    assert got == expected
    assert got.flags.leave_running is True and got.flags.track_mem is False and got.flags.ghost_limit is None, \
        "dump-only options stay out of a restore"


def test_every_option_reaches_criu_on_dump():
    options = DumpOptions(shell_job=True, tcp_established=True, ext_unix_sk=True, file_locks=True,
                          leave_running=False, network_lock="nftables", ghost_limit=4 << 20, track_mem=True)
    got = options.to_criu_dump(**WHERE, pid=42, parent_img="../parent", external=["unix[7]"])
    assert got == CriuOptions(**WHERE, pid=42, parent_img="../parent", external=["unix[7]"],
                              flags=CriuFlags(shell_job=True, tcp_established=True, ext_unix_sk=True,
                                              file_locks=True, leave_running=False, network_lock="nftables",
                                              ghost_limit=4 << 20, track_mem=True))
