"""The man pages (man/) and bash completions (completion/) that tools/manpages.py writes from
the argparse parsers: the committed ones are what the generator writes now (never stale),
the pages render without a warning and name every command and long option, the
completions load and complete, and `make install` / `make uninstall` put them in place
and take them away (with a stand-in OPT whose stamps say the venv is built: only the
install recipe itself runs)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alkfs.cli import build_parser
from alkfsd.config import parser as daemon_parser

ROOT = Path(__file__).resolve().parents[1]
GENERATOR = ROOT / "tools" / "manpages.py"
PAGES = {"alkfs": ("man/alkfs.1", build_parser()), "alkfsd": ("man/alkfsd.8", daemon_parser())}
INSTALLED = {  # under PREFIX
    "man/alkfs.1": "share/man/man1/alkfs.1",
    "man/alkfsd.8": "share/man/man8/alkfsd.8",
    "completion/alkfs.bash": "share/bash-completion/completions/alkfs",
    "completion/alkfsd.bash": "share/bash-completion/completions/alkfsd",
}


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) of the parser and every subcommand's, nested ones too."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, (*path, name))


def roff(text: str) -> str:
    return text.replace("-", "\\-")


def test_the_committed_files_are_what_the_generator_writes(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, str(GENERATOR), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(INSTALLED)
    stale = [rel for rel in written if (tmp_path / rel).read_text() != (ROOT / rel).read_text()]
    assert stale == [], f"stale: run {sys.executable} tools/manpages.py and commit {stale}"
    check = subprocess.run([sys.executable, str(GENERATOR), "--check"], check=False)
    assert check.returncode == 0


@pytest.mark.parametrize("prog", sorted(PAGES))
def test_every_command_and_long_option_is_in_the_page(prog: str):
    page, parser = PAGES[prog]
    text = (ROOT / page).read_text()
    paths = [path for path, _ in walk(parser)]
    assert len(paths) > 1 or prog == "alkfsd"
    for path in paths[1:]:
        assert f'.SS "{roff(" ".join(path))}"' in text, path
    for _, p in walk(parser):
        for action in p._actions:
            for opt in action.option_strings:
                if opt.startswith("--"):
                    assert roff(opt) in text, (prog, opt)
            if action.help and not isinstance(action, argparse._SubParsersAction):
                assert roff(action.help) in text, (prog, action.help)


def renderer() -> list[str] | None:
    if shutil.which("groff"):
        return ["groff", "-man", "-Tutf8", "-ww", "-z"]
    if shutil.which("man"):
        return ["man", "--warnings", "-E", "UTF-8", "-l", "-P", "cat"]
    return None


@pytest.mark.parametrize("page", ["man/alkfs.1", "man/alkfsd.8"])
def test_the_pages_render_without_warnings(page: str):
    cmd = renderer()
    if cmd is None:
        pytest.skip("neither groff nor man is installed")
    env = {**os.environ, "LC_ALL": "C.UTF-8", "MANWIDTH": "80"}
    done = subprocess.run(
        [*cmd, str(ROOT / page)], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    if shutil.which("man"):  # what a reader sees
        shown = subprocess.run(
            ["man", "-l", "-P", "cat", str(ROOT / page)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        ).stdout
        assert "SYNOPSIS" in shown and "--help" in shown.replace("\u2010", "-")


def complete(prog: str, *words: str) -> list[str]:
    """What the completion of `prog` offers for the last of `words` (the cursor's)."""
    script = (
        f"source {ROOT / 'completion' / (prog + '.bash')}\n"
        f'COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); _{prog}; printf "%s\\n" "${{COMPREPLY[@]}}"'
    )
    done = subprocess.run(
        ["bash", "-uc", script, "bash", prog, *words], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return [w for w in done.stdout.split("\n") if w]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_completions_load_and_complete():
    for prog in ("alkfs", "alkfsd"):
        done = subprocess.run(
            ["bash", "-c", f"source completion/{prog}.bash; complete -p {prog}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"complete -o default -F _{prog} {prog}"
    commands = [name for path, _ in walk(build_parser()) if len(path) == 1 for name in path]
    assert complete("alkfs", "") == commands
    assert complete("alkfs", "rep") == ["repo"]
    assert complete("alkfs", "repo", "") == ["create", "rm", "list"]
    assert complete("alkfs", "--mount", "put", "g") == ["get", "git"]  # (put: --mount's value)
    assert complete("alkfs", "put", "--al") == ["--algo"]
    assert complete("alkfs", "put", "--algo", "git") == ["git-sha1", "git-sha256"]
    assert complete("alkfs", "put", "--algo", "=", "b") == ["blake3"]  # (--algo=b)
    assert complete("alkfs", "put", "--pin", "") == []  # (file names: -o default)
    assert complete("alkfs", "sweep", "--e") == ["--expire-now"]
    assert complete("alkfsd", "--log-level", "") == ["debug", "info", "warning", "error"]
    assert complete("alkfsd", "--kv") == ["--kv-only"]


def make(target: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-C", str(ROOT), target, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_install_and_uninstall_place_them(tmp_path: Path):
    """The stand-in OPT's stamps are from the future: nothing of the venv is built (and
    INSTALL_APT_PKGS= asks apt for nothing), only the install recipe runs."""
    opt, prefix = tmp_path / "opt", tmp_path / "prefix"
    opt.mkdir()
    future = time.time() + 3600
    for stamp in (".pyfuse3-installed", ".alkfs-installed"):
        (opt / stamp).touch()
        os.utime(opt / stamp, (future, future))
    args = [f"OPT={opt}", f"PREFIX={prefix}", f"SBIN={tmp_path / 'sbin'}", "INSTALL_APT_PKGS="]
    done = make("install", *args)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "pip" not in done.stdout, done.stdout  # (only the install recipe ran)
    for src, dest in INSTALLED.items():
        path = prefix / dest
        assert path.read_bytes() == (ROOT / src).read_bytes(), dest
        assert path.stat().st_mode & 0o777 == 0o644, dest
    done = make("uninstall", *args)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert [d for d in INSTALLED.values() if os.path.lexists(prefix / d)] == []
    assert opt.exists()  # (no pyvenv.cfg: not a venv make install made, so left alone)
