"""Issue 24, item 4: which scheduler `schedule add` installs for (systemd timers where systemd
runs, cron elsewhere), and add, list and check saying so when nothing will run a schedule. What
runs here is faked (systemd is not PID 1 on this machine nor on CI; systemctl is recorded, not
run); the timers of a real systemd: tests/integration/test_schedule_systemd.py in the vm-test."""

import json

import pytest

from ckpt.cli.main import main
from ckpt.schedule import book as book_module
from ckpt.system import daemons
from tests import jsonshape


def run(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.fixture
def here(tmp_path, monkeypatch):
    """What runs on the fake machine (set .systemd and .cron), and the systemctl calls made."""
    class Here:
        systemd: str | None = None
        cron: int | None = None
        calls: list[list[str]] = []
        active = 0

    def systemctl(*args, check=True):
        Here.calls.append(list(args))
        return Here.active if args[0] == "is-active" else 0

    monkeypatch.setattr(daemons, "systemd_state", lambda: Here.systemd)
    monkeypatch.setattr(daemons, "cron_daemon_pid", lambda proc=None: Here.cron)
    monkeypatch.setattr(daemons, "init_name", lambda proc=None: "systemd" if Here.systemd else "tini")
    monkeypatch.setattr(book_module, "systemctl", systemctl)
    monkeypatch.setenv("CKPT_CRON_DIR", str(tmp_path / "cron.d"))
    monkeypatch.setenv("CKPT_SYSTEMD_DIR", str(tmp_path / "systemd"))
    Here.calls = []
    return Here


ADD = ("schedule", "add", "agent", "--match", "no-such-agent-program", "--every", "5m")


def test_neither_cron_nor_systemd_runs_add_list_and_check_say_so(capsys, here, tmp_path):
    """Before: 'installed', a next run in the list, nothing from check: a schedule that never ran."""
    code, out, err = run(capsys, *ADD)
    assert code == 0, err
    assert (tmp_path / "cron.d" / "ckpt-agent").exists()  # still installed: cron may be started later
    assert ("Warning: schedule 'agent' will not run: no cron daemon runs here and systemd is not PID 1 here "
            "(PID 1 is tini): nothing runs schedules; start a cron daemon") in err

    code, out, err = run(capsys, "schedule", "list", "--json")
    rows = json.loads(out)
    jsonshape.assert_shape(rows, "schedule list")
    assert (rows[0]["scheduler"], rows[0]["installed"], rows[0]["will_run"]) == ("cron", True, False)
    assert rows[0]["problem"].startswith("no cron daemon runs here")
    code, out, err = run(capsys, "schedule", "list")
    assert code == 0 and "cron: will not run" in out
    assert "Warning: schedule 'agent' will not run: no cron daemon runs here" in err

    code, out, err = run(capsys, "check", "--json")
    found = [c for c in json.loads(out)["checks"] if c["name"] == "scheduler"]
    assert found and found[0]["ok"] is False and found[0]["required"] is False
    assert "no cron daemon runs here and systemd is not PID 1" in found[0]["detail"]
    assert found[0]["fix"].startswith("start a cron daemon")

    here.cron = 4242  # a cron daemon started: all is well
    code, out, err = run(capsys, "schedule", "list", "--json")
    assert json.loads(out)[0]["will_run"] is True and json.loads(out)[0]["problem"] is None
    code, out, err = run(capsys, "check", "--json")
    found = [c for c in json.loads(out)["checks"] if c["name"] == "scheduler"]
    assert found[0]["ok"] is True and found[0]["detail"] == "schedules run with cron: a cron daemon runs (PID 4242)"
    assert here.calls == []


def test_where_systemd_runs_a_schedule_is_a_timer(capsys, here, tmp_path):
    here.systemd = "running"
    code, out, err = run(capsys, *ADD, "--json")
    assert code == 0 and "Warning" not in err, err
    added = json.loads(out)
    jsonshape.assert_shape(added, "schedule add")
    units = tmp_path / "systemd"
    assert added["scheduler"] == "systemd" and added["will_run"] is True
    assert added["installed"] == str(units / "ckpt-agent.timer")
    assert (units / "ckpt-agent.service").exists() and not (tmp_path / "cron.d" / "ckpt-agent").exists()
    assert "OnCalendar=*-*-* *:0,5,10,15,20,25,30,35,40,45,50,55:00" in (units / "ckpt-agent.timer").read_text()
    assert here.calls == [["daemon-reload"], ["enable", "--now", "ckpt-agent.timer"],
                          ["restart", "ckpt-agent.timer"]]

    here.calls = []
    code, out, err = run(capsys, "schedule", "list", "--json")
    row = json.loads(out)[0]
    assert (row["scheduler"], row["installed"], row["will_run"]) == ("systemd", True, True)
    assert here.calls == [["is-active", "--quiet", "ckpt-agent.timer"]]
    here.active = 3  # inactive: systemctl disabled it behind ckpt's back
    code, out, err = run(capsys, "schedule", "list", "--json")
    row = json.loads(out)[0]
    assert (row["installed"], row["will_run"]) == (False, False) and "timer is not installed" in row["problem"]

    here.calls = []
    code, out, err = run(capsys, "schedule", "rm", "agent")
    assert code == 0, err
    assert here.calls == [["disable", "--now", "ckpt-agent.timer"], ["daemon-reload"]]
    assert [p for p in units.rglob("*") if not p.is_dir()] == []


def test_the_scheduler_setting_wins(capsys, here, tmp_path, monkeypatch):
    here.systemd = "degraded"
    monkeypatch.setenv("CKPT_SCHEDULER", "cron")
    code, out, err = run(capsys, *ADD)
    assert code == 0 and (tmp_path / "cron.d" / "ckpt-agent").exists() and here.calls == []
    assert "installed for cron" in err
    assert "no cron daemon runs here: nothing runs schedules installed for cron" in err
    assert "CKPT_SCHEDULER=systemd" in err

    # systemd asked for where it does not run: units written and linked for its next boot, a warning
    here.systemd = None
    here.cron = 77
    monkeypatch.setenv("CKPT_SCHEDULER", "systemd")
    code, out, err = run(capsys, *ADD, "--replace")
    assert code == 0, err
    units = tmp_path / "systemd"
    assert (units / "timers.target.wants" / "ckpt-agent.timer").is_symlink()
    assert not (tmp_path / "cron.d" / "ckpt-agent").exists(), "replaced: the cron entry went"
    assert "Warning: schedule 'agent' will not run: systemd is not PID 1 here (PID 1 is tini)" in err
    assert "set CKPT_SCHEDULER=cron (a cron daemon runs (PID 77))" in err
    code, out, err = run(capsys, "schedule", "list", "--json")
    row = json.loads(out)[0]
    assert (row["scheduler"], row["installed"], row["will_run"]) == ("systemd", True, False)

    monkeypatch.setenv("CKPT_SCHEDULER", "anacron")
    code, out, err = run(capsys, *ADD, "--replace")
    assert code == 2 and "CKPT_SCHEDULER='anacron' is not one of auto, systemd, cron" in err
