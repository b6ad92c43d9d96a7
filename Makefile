# Both entry points do all set-up on a fresh machine and are quick when it is done.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
APT_PKGS := fuse3 libfuse3-dev pkg-config attr git rsync bindfs
DEMO    ?= $(CURDIR)/demo-store
MNT     ?= $(CURDIR)/mnt

.PHONY: test run setup apt lint bench clean

setup: $(STAMP)

apt:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

$(STAMP): pyproject.toml | apt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: apt $(STAMP)
	$(PY) -X dev -bb -m pytest -q $(PYTEST_ARGS)

run: apt $(STAMP)
	mkdir -p $(MNT)
	$(VENV)/bin/alkfsd $(DEMO) $(MNT) --window 1h --demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) bench/store.py

clean:
	rm -rf $(VENV) demo-store build *.egg-info
