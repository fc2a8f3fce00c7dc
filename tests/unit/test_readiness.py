"""`ckpt check` says whether pages are hashed in C, and what to do when they are not."""

import importlib

from ckpt.commands import check as readiness


def test_page_hashing_in_c_is_reported():
    finding = readiness._page_hashing()
    assert finding.ok and not finding.required and "in C" in finding.detail


def test_page_hashing_without_the_extension_says_how_to_build_it(monkeypatch):
    real = importlib.import_module

    def without_extension(name, *args):
        if name == "ckpt._pagehash":
            raise ImportError("No module named 'ckpt._pagehash'")
        return real(name, *args)

    monkeypatch.setattr(readiness.importlib, "import_module", without_extension)
    finding = readiness._page_hashing()
    assert not finding.ok and not finding.required
    assert "slower" in finding.detail and "make setup" in finding.fix
    assert readiness.ready([finding]), "a missing extension does not make the machine unready"
