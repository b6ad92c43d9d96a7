"""Git fixtures: real repositories built with the real `git` binary, and opened stores."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import GIT_ENV as BASE_GIT_ENV
from helpers import git_out

from alkfs.app import Alkfs
from alkfs.keys import Algorithm, Key

GIT_ENV = {**BASE_GIT_ENV, "GIT_ADVICE": "0"}


class Repo:
    """A work-tree repository driven through the git binary."""

    def __init__(self, path: Path, object_format: str = "sha1") -> None:
        self.path = path
        self.object_format = object_format
        path.mkdir(parents=True, exist_ok=True)
        self.git("init", "-q", "-b", "main", f"--object-format={object_format}")

    @property
    def gitdir(self) -> str:
        return str(self.path / ".git")

    @property
    def algo(self) -> Algorithm:
        return Algorithm.GIT_SHA1 if self.object_format == "sha1" else Algorithm.GIT_SHA256

    def git(self, *args: str, input: bytes | None = None) -> str:
        """git in this work tree, its stdout (a method: the tests call repo.git(...))."""
        return git_out(
            "-c", "advice.detachedHead=false", *args, cwd=self.path, env=GIT_ENV, input=input
        )

    def write(self, name: str, content: bytes | str, mode: int | None = None) -> None:
        p = self.path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content.encode() if isinstance(content, str) else content)
        if mode is not None:
            p.chmod(mode)

    def commit(self, message: str, *paths: str) -> str:
        self.git("add", "-A", *paths)
        self.git("commit", "-q", "--allow-empty", "-m", message)
        return self.rev("HEAD")

    def rev(self, what: str) -> str:
        return self.git("rev-parse", what).strip()

    def rev_list_keys(self, *args: str) -> set[bytes]:
        """Raw store keys of `git rev-list --objects <args>` (default: --all)."""
        out = self.git("rev-list", "--objects", *(args or ("--all",)))
        return {Key.from_hex(self.algo, line.split()[0]).raw for line in out.splitlines()}

    def all_object_keys(self) -> set[bytes]:
        out = self.git("cat-file", "--batch-all-objects", "--batch-check=%(objectname)")
        return {Key.from_hex(self.algo, line).raw for line in out.split()}

    def for_each_ref(self) -> dict[str, str]:
        out = self.git("for-each-ref", "--format=%(refname) %(objectname)")
        return dict(line.split(" ", 1) for line in out.splitlines())


@pytest.fixture
def make_repo(tmp_path: Path) -> Callable[..., Repo]:
    n = iter(range(1000))

    def make(object_format: str = "sha1", name: str | None = None) -> Repo:
        return Repo(tmp_path / (name or f"src{next(n)}"), object_format)

    return make


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Alkfs]:
    a = Alkfs.open(tmp_path / "store", window_s=0)
    yield a
    a.close()


def stored_keys(app: Alkfs) -> set[bytes]:
    return set(app.store.iter_keys())
