"""ckpt.settings: every CKPT_* value checked, defaults as documented, the settings table of docs/commands.md in step."""

import re
from pathlib import Path

import pytest

from ckpt import settings
from ckpt.errors import ExitCode, UsageError
from ckpt.settings import Settings
from tests.helpers import ROOT


def test_defaults_when_unset_or_empty():
    built = Settings.from_environment({"CKPT_LOCK_TIMEOUT": "", "CKPT_STAGING": ""})
    assert built.lock_timeout == 60.0 and built.staging == "auto" and built.criu_log_level == 3
    assert built.lazy_min_bytes == 64 << 20 and built.hook_timeout == 60.0 and built.schedule_wait == 60.0
    assert built.tracking_dir == Path("/run/ckpt/tracking") and built.lazy_dir == Path("/run/ckpt/lazy")
    assert built.cron_dir == Path("/etc/cron.d") and built.criu is None and built.debug is False
    assert built.store == settings.default_store_path({})


def test_values_are_read_and_paths_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    built = Settings.from_environment({
        "CKPT_STORE": "rel-store", "CKPT_LOCK_TIMEOUT": "2.5", "CKPT_STAGING": "ram", "CKPT_LAZY_MIN_MIB": "0",
        "CKPT_CRIU_LOG_LEVEL": "4", "CKPT_DEBUG": "yes", "CKPT_CRON_DIR": "cron"})
    assert built.store == tmp_path / "rel-store" and built.cron_dir == tmp_path / "cron"
    assert (built.lock_timeout, built.staging, built.lazy_min_bytes, built.criu_log_level, built.debug) == (
        2.5, "ram", 0, 4, True)


@pytest.mark.parametrize("variable, value, message", [
    ("CKPT_LOCK_TIMEOUT", "abc", "CKPT_LOCK_TIMEOUT='abc' is not a number of seconds; unset it or set e.g. 60"),
    ("CKPT_LOCK_TIMEOUT", "-1", "CKPT_LOCK_TIMEOUT='-1' is not 0 or more seconds"),
    ("CKPT_LOCK_TIMEOUT", "nan", "is not a number of seconds"),
    ("CKPT_HOOK_TIMEOUT", "0", "CKPT_HOOK_TIMEOUT='0' is not a number of seconds above 0"),
    ("CKPT_SCHEDULE_WAIT", "soon", "CKPT_SCHEDULE_WAIT='soon' is not a number of seconds"),
    ("CKPT_STAGING", "bogus", "CKPT_STAGING='bogus' is not one of auto, disk, ram; unset it or set e.g. ram"),
    ("CKPT_LAZY_MIN_MIB", "x", "CKPT_LAZY_MIN_MIB='x' is not a whole number of MiB; unset it or set e.g. 64"),
    ("CKPT_LAZY_MIN_MIB", "-1", "CKPT_LAZY_MIN_MIB='-1' is not a whole number of MiB"),
    ("CKPT_LAZY_MIN_MIB", "1.5", "CKPT_LAZY_MIN_MIB='1.5' is not a whole number of MiB"),
    ("CKPT_CRIU_LOG_LEVEL", "9", "CKPT_CRIU_LOG_LEVEL='9' is not a log level from 0 to 4"),
    ("CKPT_CRIU_LOG_LEVEL", "debug", "CKPT_CRIU_LOG_LEVEL='debug' is not a log level from 0 to 4"),
    ("CKPT_DEBUG", "maybe", "CKPT_DEBUG='maybe' is not 1 or 0"),
])
def test_a_bad_value_is_a_usage_error_naming_it(variable, value, message):
    with pytest.raises(UsageError) as info:
        Settings.from_environment({variable: value})
    assert message in str(info.value) and info.value.exit_code == ExitCode.USAGE
    assert "\n" not in str(info.value)


def test_a_run_of_the_cli_builds_its_settings_once_with_its_flags(monkeypatch, tmp_path):
    """The CLI's settings: from the environment, with --password-file over CKPT_PASSWORD, built
    when the command first asks and the same object from then on (nothing installs or changes
    settings behind the core's back)."""
    from ckpt.cli import options

    monkeypatch.setenv("CKPT_LOCK_TIMEOUT", "7")
    monkeypatch.setenv("CKPT_PASSWORD", "from the environment")
    try:
        options.begin(Settings.from_environment(), None)
        options.use_password_file(str(tmp_path / "pw"))
        built = options.cli_settings()
        assert (built.lock_timeout, built.password, built.password_file) == (7.0, None, tmp_path / "pw")
        monkeypatch.setenv("CKPT_LOCK_TIMEOUT", "8")
        assert options.cli_settings() is built
        assert options.invocation().passwords().password_file == tmp_path / "pw"
        options.begin(Settings.from_environment(), None)  # the next run reads the environment again
        assert options.cli_settings().lock_timeout == 8.0 and options.cli_settings().password_file is None
    finally:
        options.end()


def test_an_empty_store_flag_is_refused():
    with pytest.raises(UsageError, match="--store '' names no directory"):
        settings.store_from_flag("")


SETTINGS_PAGE = ROOT / "docs" / "commands.md"


def documented_settings_table() -> list[str]:
    """The variables in the table of settings of docs/commands.md (the one whose header starts
    '| variable | default |')."""
    lines = SETTINGS_PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*variable\s*\|\s*default\s*\|", line))
    names = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        match = re.match(r"\|\s*`(CKPT_[A-Z0-9_]+)`\s*\|", line)
        assert match, f"a row of the settings table of docs/commands.md names no CKPT_* variable: {line}"
        names.append(match.group(1))
    return names


def test_the_docs_document_every_setting_and_nothing_else():
    documented = documented_settings_table()
    assert len(documented) == len(set(documented)), "a variable is documented twice"
    assert set(documented) == set(settings.variables()), (
        f"missing from docs/commands.md: {sorted(set(settings.variables()) - set(documented))}; "
        f"documented but not a setting: {sorted(set(documented) - set(settings.variables()))}")


def test_no_module_reads_the_environment_but_settings():
    """hooks.py passes ckpt's environment on to the hooks it runs, run.py on to the command it
    supervises (with CKPT_SOCKET, CKPT_NAME and CKPT_STORE added), phases.py reads the test-only
    pause variables (not settings: see its docstring), cli/output.py honours NO_COLOR (the
    convention of every terminal program, no-color.org: not a ckpt setting), and system/arrays.py
    sets OpenBLAS's thread count while numpy loads, then puts back what was there (a library's
    variable, not a ckpt setting); nothing else reads it."""
    readers = []
    for path in sorted((ROOT / "ckpt").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("ckpt/settings.py", "ckpt/schedule/hooks.py", "ckpt/phases.py", "ckpt/commands/run.py",
                   "ckpt/cli/output.py", "ckpt/system/arrays.py"):
            continue
        text = path.read_text()
        if re.search(r"os\.environ|getenv\(|environ\.get\(", text):
            readers.append(rel)
    assert readers == []
