# Both entry points do all set-up on a fresh machine and are quick when it is done.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
APT_PKGS := fuse3 libfuse3-dev pkg-config attr git rsync bindfs patch postgresql pgbouncer
PYFUSE3 := 3.5.0
PYFUSE3_SRC := build/pyfuse3/pyfuse3-$(PYFUSE3)
DEMO    ?= $(CURDIR)/demo-store
MNT     ?= $(CURDIR)/mnt

.PHONY: test soak run setup apt lint bench clean

setup: $(STAMP)

apt:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

# pyfuse3 is built from its sdist with third_party/pyfuse3-noflush.patch (FileInfo.noflush:
# no FLUSH round trip when a read-only file is closed; FileInfo.cache_readdir) and
# third_party/pyfuse3-fastread.patch (a queued request is read without waiting for the
# fd first), third_party/pyfuse3-cacheddirs.patch (OPENDIR/RELEASEDIR, and READDIR of
# an empty listing, of directories whose kernel-cached listing is current answered in C)
# and third_party/pyfuse3-nogilcopy.patch (a large WRITE's data copied into its bytes
# object with the GIL released), then the project on top of it.
PATCHES := third_party/pyfuse3-noflush.patch third_party/pyfuse3-fastread.patch \
           third_party/pyfuse3-cacheddirs.patch third_party/pyfuse3-nogilcopy.patch
$(STAMP): pyproject.toml $(PATCHES) | apt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	rm -rf build/pyfuse3 && mkdir -p build/pyfuse3
	$(PY) -m pip download -q --no-deps --no-binary pyfuse3 -d build/pyfuse3 pyfuse3==$(PYFUSE3)
	tar xzf build/pyfuse3/pyfuse3-$(PYFUSE3).tar.gz -C build/pyfuse3
	for p in $(PATCHES); do patch -s -d $(PYFUSE3_SRC) -p1 < $$p || exit 1; done
	rm -f $(PYFUSE3_SRC)/src/pyfuse3/__init__.c
	$(PY) -m pip install -q --force-reinstall --no-deps $(PYFUSE3_SRC)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: apt $(STAMP)
	$(PY) -X dev -bb -m pytest -q $(PYTEST_ARGS)
	ALKFS_TEST_DATABASE=postgresql $(PY) -X dev -bb -m pytest -q $(PYTEST_ARGS) \
	  tests/daemon/test_write_objects.py tests/daemon/test_write_pins.py \
	  tests/daemon/test_write_refs.py tests/daemon/test_write_git.py \
	  tests/daemon/test_lifecycle.py tests/daemon/test_mount_basic.py \
	  tests/daemon/test_push_pins.py tests/test_cli.py

# The crash matrix and the other reliability tests at soak length (>= 50 rounds a case).
# The soak's cases run far past the suite's 600 s per test (100,000 model steps took
# 56 minutes here): each gets four hours before pytest-timeout calls it hung.
soak: apt $(STAMP)
	ALKFS_SOAK=1 $(PY) -X dev -bb -m pytest -q --timeout=14400 tests/reliability $(PYTEST_ARGS)

run: apt $(STAMP)
	mkdir -p $(MNT)
	$(VENV)/bin/alkfsd $(DEMO) $(MNT) --create --window 1h --demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) bench/store.py

clean:
	rm -rf $(VENV) demo-store build *.egg-info
