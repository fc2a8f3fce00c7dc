"""ckpt dump's request is checked before the target or the store is touched."""

import pytest

from ckpt.commands.dump import DumpRequest, dump
from ckpt.errors import CkptError, ExitCode
from ckpt.settings import Settings

NO_SUCH_PID = 4000000


@pytest.mark.parametrize("request_, words", [
    (DumpRequest(pid=0), "invalid PID 0"),
    (DumpRequest(pid=-1), "invalid PID -1"),
    (DumpRequest(pid=NO_SUCH_PID, codec="bogus"), "unknown compression 'bogus'"),
    (DumpRequest(pid=NO_SUCH_PID, name="a/b"), "invalid checkpoint name 'a/b'"),
])
def test_bad_requests_are_usage_errors_and_touch_nothing(tmp_path, request_, words):
    store = tmp_path / "store"
    with pytest.raises(CkptError, match=words) as info:
        dump(store, request_, settings=Settings())
    assert info.value.exit_code == ExitCode.USAGE
    assert not store.exists()
