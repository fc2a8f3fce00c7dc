"""Where an encrypted store's password comes from (ckpt/store/password.py): the password file
must be the caller's own and unreadable by others (docs/stores.md: "a file others cannot read")."""

import os
import pwd

import pytest

from ckpt.errors import UsageError
from ckpt.settings import Settings
from ckpt.store.password import PasswordSource, read_password_file

NOBODY = pwd.getpwnam("nobody")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")


def password_file(tmp_path, mode=0o600):
    path = tmp_path / "password"
    path.write_text("correct horse\nsecond line\n")
    os.chmod(path, mode)
    return path


def test_the_first_line_of_a_private_file_of_ones_own_is_the_password(tmp_path, monkeypatch):
    path = password_file(tmp_path)
    assert read_password_file(path) == b"correct horse"
    monkeypatch.setenv("CKPT_PASSWORD_FILE", str(path))
    assert PasswordSource.from_settings(Settings.from_environment()).password_for("somewhere") == b"correct horse"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_password_file_others_can_read_is_refused(tmp_path, mode):
    path = password_file(tmp_path, mode)
    with pytest.raises(UsageError, match="can be read by others") as info:
        read_password_file(path)
    assert f"chmod 600 {path}" in str(info.value) and "\n" not in str(info.value)


@needs_root
def test_a_password_file_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    """Issue 23: a 0600 file of another user was accepted; its owner can read the password (or
    put one they know there before `ckpt init`)."""
    path = password_file(tmp_path)
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    me = pwd.getpwuid(os.geteuid()).pw_name
    with pytest.raises(UsageError, match=f"belongs to {NOBODY.pw_name}, not to {me}") as info:
        read_password_file(path)
    message = str(info.value)
    assert f"chown {me} {path}" in message and "\n" not in message and "correct horse" not in message
    with pytest.raises(UsageError, match="belongs to"):
        PasswordSource(password_file=path).password_for("somewhere")


# ---- a password source passed in (no environment needed) ---------------------------------

def test_a_password_source_tries_the_password_then_the_file_then_the_prompt(tmp_path):
    from ckpt.errors import PasswordNeeded
    from ckpt.store.password import PasswordSource

    asked = []

    def ask(question, confirm):
        asked.append((question, confirm))
        return "typed"

    path = password_file(tmp_path)
    assert PasswordSource("given", path, ask).password_for("here") == b"given"
    assert PasswordSource(None, path, ask).password_for("here") == b"correct horse"
    assert PasswordSource(None, None, ask).password_for("here", confirm=True) == b"typed"
    assert asked == [("password of the store at here", True)]
    with pytest.raises(UsageError, match="an empty password"):
        PasswordSource(ask=lambda question, confirm: "").password_for("here")
    with pytest.raises(PasswordNeeded, match="the store at here is encrypted"):
        PasswordSource().password_for("here")
    assert "given" not in repr(PasswordSource("given"))
