# Both entry points do all set-up on a fresh machine and are quick when it is done.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
APT_PKGS := fuse3 libfuse3-dev pkg-config attr git git-lfs rsync bindfs patch postgresql pgbouncer
PYFUSE3 := 3.5.0
DEMO    ?= $(CURDIR)/demo-store
MNT     ?= $(CURDIR)/mnt
# make install: a venv of its own at OPT (Debian's Python takes no pip installs), alkfs and
# alkfsd linked into PREFIX/bin (where systemd/alkfs@.service runs alkfsd), the mount
# helper into SBIN (mount(8) looks in /sbin; on Debian 12 that is /usr/sbin)
PREFIX  ?= /usr/local
BINDIR  ?= $(PREFIX)/bin
SBIN    ?= /sbin
OPT     ?= /opt/alkfs
OPT_PY  := $(OPT)/bin/python
# the venv at OPT is made from the system's Python (not one of a user's: pyenv's, say)
INSTALL_PYTHON ?= /usr/bin/python3
# what building pyfuse3 and running alkfsd need (make install)
INSTALL_APT_PKGS := fuse3 libfuse3-dev pkg-config patch gcc python3-dev python3-venv git bsdutils
HELPER  := sbin/mount_fuse_alkfs.py
# what the installed package is made of (a change in one installs it again)
SOURCES := pyproject.toml README.md $(shell find alkfs daemon -name '*.py' -not -path '*/__pycache__/*')

.PHONY: test soak run setup apt install-apt install uninstall lint check bench clean

setup: $(STAMP)

# $(call apt_get,PACKAGES): apt-get install those of them that are missing
define apt_get
	@missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi
endef

apt:
	$(call apt_get,$(APT_PKGS))

install-apt:
	$(call apt_get,$(INSTALL_APT_PKGS))

# pyfuse3 is built from its sdist with third_party/pyfuse3-noflush.patch (FileInfo.noflush:
# no FLUSH round trip when a read-only file is closed; FileInfo.cache_readdir) and
# third_party/pyfuse3-fastread.patch (a queued request is read without waiting for the
# fd first), third_party/pyfuse3-cacheddirs.patch (OPENDIR/RELEASEDIR, and READDIR of
# an empty listing, of directories whose kernel-cached listing is current answered in C)
# and third_party/pyfuse3-nogilcopy.patch (a large WRITE's data copied into its bytes
# object with the GIL released), then the project on top of it.
PATCHES := third_party/pyfuse3-noflush.patch third_party/pyfuse3-fastread.patch \
           third_party/pyfuse3-cacheddirs.patch third_party/pyfuse3-nogilcopy.patch
# $(call pyfuse3_build,PYTHON,DIR): the patched pyfuse3 built in DIR and installed into
# PYTHON's venv (make setup and make install, the same build)
define pyfuse3_build
	rm -rf $(2) && mkdir -p $(2)
	$(1) -m pip download -q --no-deps --no-binary pyfuse3 -d $(2) pyfuse3==$(PYFUSE3)
	tar xzf $(2)/pyfuse3-$(PYFUSE3).tar.gz -C $(2)
	for p in $(PATCHES); do patch -s -d $(2)/pyfuse3-$(PYFUSE3) -p1 < $$p || exit 1; done
	rm -f $(2)/pyfuse3-$(PYFUSE3)/src/pyfuse3/__init__.c
	$(1) -m pip install -q --force-reinstall --no-deps $(2)/pyfuse3-$(PYFUSE3)
endef

$(STAMP): pyproject.toml $(PATCHES) | apt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(call pyfuse3_build,$(PY),build/pyfuse3)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# make install: quick when nothing changed (two stamps in OPT: the venv with pyfuse3,
# then the project). The project is installed from a copy of the checkout (pip install
# of a directory, not -e): the install does not depend on the checkout, and its build
# leaves nothing in it. The man pages and bash completions (committed: tools/manpages.py
# writes them from the parsers) are copied under PREFIX/share.
install: $(OPT)/.alkfs-installed
	mkdir -p $(BINDIR) $(SBIN)
	ln -sfn $(OPT)/bin/alkfs $(BINDIR)/alkfs
	ln -sfn $(OPT)/bin/alkfsd $(BINDIR)/alkfsd
	ln -sfn $(OPT)/bin/mount.fuse.alkfs $(SBIN)/mount.fuse.alkfs
	install -d $(PREFIX)/share/man/man1 $(PREFIX)/share/man/man8 \
	  $(PREFIX)/share/bash-completion/completions
	install -m 644 man/alkfs.1 $(PREFIX)/share/man/man1/alkfs.1
	install -m 644 man/alkfsd.8 $(PREFIX)/share/man/man8/alkfsd.8
	install -m 644 completion/alkfs.bash $(PREFIX)/share/bash-completion/completions/alkfs
	install -m 644 completion/alkfsd.bash $(PREFIX)/share/bash-completion/completions/alkfsd

$(OPT)/.pyfuse3-installed: $(PATCHES) | install-apt
	test -x $(OPT_PY) || $(INSTALL_PYTHON) -m venv $(OPT)
	$(OPT_PY) -m pip install -q --upgrade pip
	$(call pyfuse3_build,$(OPT_PY),$(OPT)/build/pyfuse3)
	rm -rf $(OPT)/build
	touch $@

$(OPT)/.alkfs-installed: $(OPT)/.pyfuse3-installed $(SOURCES) $(HELPER)
	rm -rf $(OPT)/build && mkdir -p $(OPT)/build/src
	cp -r pyproject.toml README.md alkfs daemon $(OPT)/build/src/
	find $(OPT)/build/src -name __pycache__ -prune -exec rm -rf {} +
	$(OPT_PY) -m pip install -q $(OPT)/build/src
	rm -rf $(OPT)/build
	sed '1s|.*|#!$(OPT_PY) -I|' $(HELPER) > $(OPT)/bin/mount.fuse.alkfs.new
	chmod 755 $(OPT)/bin/mount.fuse.alkfs.new
	mv $(OPT)/bin/mount.fuse.alkfs.new $(OPT)/bin/mount.fuse.alkfs
	touch $@

# Removes what make install made: the three links (those that still point into OPT),
# the venv at OPT, the man pages and the completions.
uninstall:
	for link in $(BINDIR)/alkfs:alkfs $(BINDIR)/alkfsd:alkfsd \
	            $(SBIN)/mount.fuse.alkfs:mount.fuse.alkfs; do \
	  path=$${link%:*}; \
	  if [ "$$(readlink $$path)" = "$(OPT)/bin/$${link##*:}" ]; then rm -f $$path; fi; \
	done
	if [ -f $(OPT)/pyvenv.cfg ]; then rm -rf $(OPT); fi
	rm -f $(PREFIX)/share/man/man1/alkfs.1 $(PREFIX)/share/man/man8/alkfsd.8 \
	  $(PREFIX)/share/bash-completion/completions/alkfs \
	  $(PREFIX)/share/bash-completion/completions/alkfsd

test: apt $(STAMP)
	$(PY) -X dev -bb -m pytest -q $(PYTEST_ARGS)
	ALKFS_TEST_DATABASE=postgresql $(PY) -X dev -bb -m pytest -q $(PYTEST_ARGS) \
	  tests/daemon/test_write_objects.py tests/daemon/test_write_pins.py \
	  tests/daemon/test_write_refs.py tests/daemon/test_write_git.py \
	  tests/daemon/test_lifecycle.py tests/daemon/test_mount_basic.py \
	  tests/daemon/test_push_pins.py tests/test_cli.py \
	  tests/daemon/test_roots.py tests/daemon/test_gc_steer.py \
	  tests/daemon/test_lfs_mount.py

# The crash matrix and the other reliability tests at soak length (>= 50 rounds a case;
# the fan-out invariant's mixed git workload, tests/reliability/test_pack_invariant.py,
# for SOAK_S seconds: 40 in make test). The soak's cases run far past the suite's 600 s
# per test (100,000 model steps took 56 minutes here): each gets four hours before
# pytest-timeout calls it hung.
SOAK_S ?= 600
soak: apt $(STAMP)
	ALKFS_SOAK=1 ALKFS_SOAK_S=$(SOAK_S) $(PY) -X dev -bb -m pytest -q --timeout=14400 \
	  tests/reliability $(PYTEST_ARGS)

run: apt $(STAMP)
	mkdir -p $(MNT)
	$(VENV)/bin/alkfsd $(DEMO) $(MNT) --create --window 1h --demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The quick gate (under 2 minutes; no FUSE mount, no PostgreSQL server): the lint, then the
# tests that need neither: the library's (tests/store, tests/git), the layering rule, the
# CLI on a store, the daemon's Operations and workers called directly. tests/helpers.py,
# loaded as a plugin, marks the tests that take a mount or PostgreSQL fixture (deselected
# here) and skips one that asks for either at run time. The tests run in CHECK_JOBS
# processes (pytest-xdist; auto: one a core), each test in its own tmp_path.
CHECK_TESTS := tests/store tests/git tests/test_layers.py tests/test_cli.py \
               tests/daemon/test_ops.py tests/daemon/test_workers.py
CHECK_JOBS  ?= auto
check: lint
	PYTHONPATH=tests $(PY) -X dev -bb -m pytest -q -rfE -p helpers -n $(CHECK_JOBS) \
	  -m "not mount and not postgres and not slow" $(CHECK_TESTS) $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/store.py

clean:
	rm -rf $(VENV) demo-store build *.egg-info
