"""Model-based fuzzing of one real mount: hypothesis picks a sequence of writes
(/objects/<algo>, /pins, git objects through a repository and through /git/sha1's loose
path), pins (xattr, symlink, written file), unpins (rm, xattr removal), pin renames,
ref creates/updates/deletes (plain writes and git's lockfile protocol), HEAD rewrites,
repository creates and deletes, touches and window-0 sweeps; after every step the mount
must agree with a model of what is live (docs/gc.md, "What keeps an object"):

- every live object (pinned, in a pinned git object's closure, or reachable from a ref)
  reads back byte-identical through /objects/<algo>/<hex>;
- /pins lists exactly the model's pins, each naming its object: one written as a
  file is a regular file of the object's size (its key in user.alkfs.key), one made by
  `ln -s` or setxattr a symlink to it;
- every ref and HEAD reads its model value, packed-refs lists exactly the model's refs,
  /repos lists the model's repositories, and `status` counts them;
- no operation fails with an errno the model did not expect.

A dead object may be gone after a sweep; it must be gone after two back-to-back sweeps (the
first stages it, the second deletes it) unless it could still be held by an in-process push
pin (objects written through /repos/<id>/objects, docs/gc.md "Push safety").

One daemon serves the whole run (`--window 0`); every hypothesis example uses names of
its own (a prefix per example) and compares only what it made. 1,000 steps by default,
100,000 with ALKFS_SOAK=1 (ALKFS_MODEL_STEPS=N for any other count), 100 an example.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import stat
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import git, git_out, pin_target
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

_daemon = sys.modules["alkfs_tests_daemon_conftest"]  # loaded by tests/reliability/conftest.py

SOAK = os.environ.get("ALKFS_SOAK") == "1"
TOTAL_STEPS = int(os.environ.get("ALKFS_MODEL_STEPS", 100_000 if SOAK else 1_000))
STEPS_PER_EXAMPLE = 100  # short enough that hypothesis varies which rules an example uses
PIN_POOL = 6
REPO_POOL = 3
REF_POOL = ("refs/heads/main", "refs/heads/topic", "refs/tags/v1")
HEADS = ("ref: refs/heads/main\n", "ref: refs/heads/topic\n", "ref: refs/heads/other\n")
PIN_X = "user.alkfs.pin."
LARGE = 140_000  # over the default threshold (131072): the large tier

try:
    import blake3 as _blake3
except ImportError:  # the project depends on it; only the blake3 writes need it here
    _blake3 = None

ALGOS = ("sha256", "blake3") if _blake3 is not None else ("sha256",)


def digest(algo: str, data: bytes) -> str:
    if algo == "sha256":
        return hashlib.sha256(data).hexdigest()
    if algo == "blake3":
        return _blake3.blake3(data).hexdigest()
    assert algo == "git-sha1"
    return hashlib.sha1(data).hexdigest()


def git_object(kind: str, body: bytes) -> bytes:
    return b"%s %d\0" % (kind.encode(), len(body)) + body


def commit_body(tree: str, parent: str | None, msg: str) -> bytes:
    lines = [f"tree {tree}"]
    if parent is not None:
        lines.append(f"parent {parent}")
    lines += [
        "author A U Thor <author@example.com> 1700000000 +0000",
        "committer C O Mitter <committer@example.com> 1700000000 +0000",
        "",
        msg,
        "",
    ]
    return "\n".join(lines).encode()


@dataclass
class Obj:
    algo: str  # the name in paths: sha256, blake3, git-sha1
    hex: str
    data: bytes  # the stored bytes (a git object with its header)
    children: tuple[str, ...] = ()  # git objects it refers to (git-sha1 hexes)
    push_pinned: bool = False  # written through /repos/<id>/objects: maybe held in-process
    staged: bool = False  # dead at the last sweep and not written or touched since
    maybe_gone: bool = False  # a sweep may have deleted it

    @property
    def ident(self) -> tuple[str, str]:
        return (self.algo, self.hex)

    @property
    def link(self) -> str:
        return f"../objects/{self.algo}/{self.hex}"


@dataclass
class Repo:
    refs: dict[str, str] = field(default_factory=dict)  # ref -> commit hex
    head: str = "ref: refs/heads/main\n"


def errno_of(fn, *args) -> int | None:
    try:
        fn(*args)
    except OSError as exc:
        return exc.errno
    return None


def write_new(path: Path | str, data: bytes, flags: int = os.O_EXCL) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def status(mnt: Path) -> dict:
    return json.loads((mnt / ".alkfs" / "status").read_text())


@pytest.fixture(scope="module")
def model_mount(tmp_path_factory):
    if not (os.geteuid() == 0 and os.path.exists("/dev/fuse")):
        pytest.skip("real mounts need root and /dev/fuse")
    tmp = tmp_path_factory.mktemp("model")
    mnt = tmp / "mnt"
    mnt.mkdir()
    m = _daemon.Mount(tmp / "store", mnt, ("--window", "0"), tmp)
    try:
        m.start()
        yield m
    finally:
        m.cleanup()


class MountModel(RuleBasedStateMachine):
    mount = None  # set on the subclass made per test run
    examples = itertools.count()
    steps = 0  # steps run, over every example
    counts: dict[str, int] = {}  # steps run per rule

    def __init__(self) -> None:
        super().__init__()
        m = type(self).mount
        self.m = m
        self.mnt: Path = m.mnt
        self.prefix = f"e{next(type(self).examples)}"
        self.pin_names = [f"{self.prefix}-p{i}" for i in range(PIN_POOL)]
        self.repo_ids = [f"{self.prefix}-r{i}" for i in range(REPO_POOL)]
        self.counter = itertools.count()
        self.objects: dict[tuple[str, str], Obj] = {}
        self.pins: dict[str, tuple[str, str]] = {}  # name -> object ident
        self.pin_files: set[str] = set()  # the pins written as files (the others: links)
        self.repos: dict[str, Repo] = {}
        s = status(self.mnt)
        self.base_pins, self.base_repos = s["pins"], s["repos"]

    def teardown(self) -> None:
        """The example's pins and repositories go (checked), so the store a long run
        leaves to the next examples stays the size of one: otherwise every example
        adds its survivors, and each sweep's mark and each status read grow with the
        run (3,000 steps ran at half the rate of 300). Their objects are then dead,
        and the next examples' sweeps collect them."""
        for pin in sorted(self.pins):
            os.unlink(self.mnt / "pins" / pin)
        for repo in sorted(self.repos):
            done = subprocess.run(["rm", "-r", str(self.mnt / "repos" / repo)], capture_output=True)
            assert (done.returncode, done.stderr) == (0, b"")
        self.pins.clear()
        self.pin_files.clear()
        self.repos.clear()
        s = status(self.mnt)
        assert (s["pins"], s["repos"]) == (self.base_pins, self.base_repos)

    # -- the model ------------------------------------------------------------------
    def fresh(self, what: str, large: bool = False) -> bytes:
        """Unique bytes: a few sizes in the kv tier, or one over the threshold (large)."""
        line = f"{self.prefix} {what} {next(self.counter)}\n".encode()
        return line * ((LARGE // len(line) + 1) if large else 1 + next(self.counter) % 7)

    def git_closure(self, hexes) -> set[tuple[str, str]]:
        out: set[tuple[str, str]] = set()
        todo = list(hexes)
        while todo:
            h = todo.pop()
            ident = ("git-sha1", h)
            if ident in out:
                continue
            out.add(ident)
            todo.extend(self.objects[ident].children)
        return out

    def live(self) -> set[tuple[str, str]]:
        live: set[tuple[str, str]] = set()
        for ident in self.pins.values():
            if ident[0] == "git-sha1":
                live |= self.git_closure([ident[1]])
            else:
                live.add(ident)
        tips = [h for repo in self.repos.values() for h in repo.refs.values()]
        return live | self.git_closure(tips)

    def present(self, ident: tuple[str, str]) -> bool:
        """Known to be in the store (never deleted by a sweep since it was last written)."""
        obj = self.objects[ident]
        if obj.maybe_gone:
            return False
        if obj.algo == "git-sha1":  # a ref or pin on it makes its whole closure live
            return not any(self.objects[i].maybe_gone for i in self.git_closure([obj.hex]))
        return True

    def present_objects(self) -> list[Obj]:
        # in the order they were made: a digest order would change with each example's
        # prefix, and hypothesis replays an example's choices against the same objects
        return [o for o in self.objects.values() if self.present(o.ident)]

    def commits(self) -> list[str]:
        return [
            o.hex
            for o in self.present_objects()
            if o.algo == "git-sha1" and o.data[:7] == b"commit "
        ]

    def freshened(self, obj: Obj) -> None:
        obj.staged = False
        obj.maybe_gone = False

    def add(self, obj: Obj) -> Obj:
        old = self.objects.get(obj.ident)
        if old is not None:  # written again: freshened (or stored afresh)
            old.push_pinned |= obj.push_pinned
            self.freshened(old)
            return old
        self.objects[obj.ident] = obj
        return obj

    def opath(self, obj: Obj) -> Path:
        return self.mnt / "objects" / obj.algo / obj.hex

    def ref_path(self, repo: str, ref: str) -> Path:
        return self.mnt / "repos" / repo / ref

    def step(self, what: str) -> None:
        type(self).steps += 1
        type(self).counts[what] = type(self).counts.get(what, 0) + 1
        if SOAK and type(self).steps % 5000 == 0:  # (a soak runs for hours: show it moves)
            print(f"mount model: {type(self).steps} steps", file=sys.__stderr__, flush=True)

    # -- writes ---------------------------------------------------------------------
    @rule(algo=st.sampled_from(ALGOS), exclusive=st.booleans(), large=st.booleans())
    def write_object(self, algo: str, exclusive: bool, large: bool = False) -> None:
        self.step("write_object")
        data = self.fresh("object", large)
        tmp = self.mnt / "objects" / algo / f"{self.prefix}-tmp{next(self.counter)}"
        write_new(tmp, data, os.O_EXCL if exclusive else os.O_TRUNC)
        obj = self.add(Obj(algo, digest(algo, data), data))
        assert errno_of(os.lstat, tmp) == errno.ENOENT  # the name is gone, the digest is there
        assert self.opath(obj).read_bytes() == data

    @rule(data=st.data())
    def write_again(self, data) -> None:
        """Write the bytes of a known object again (it may have been swept): dedup or a
        fresh store, either way it is there afterwards and freshened."""
        self.step("write_again")
        plain = [o for o in self.objects.values() if o.algo != "git-sha1"]
        if not plain:
            return
        obj = data.draw(st.sampled_from(plain))
        write_new(self.mnt / "objects" / obj.algo / f"{self.prefix}-again", obj.data)
        self.freshened(obj)

    @rule(name=st.integers(0, PIN_POOL - 1), large=st.booleans())
    def write_pin(self, name: int, large: bool) -> None:
        self.step("write_pin")
        pin = self.pin_names[name]
        data = self.fresh("pinned", large)
        path = self.mnt / "pins" / pin
        if pin in self.pins:
            # a pin is written once: a pin written as a file is immutable and a link
            # reaches the object (EPERM), or an exclusive create finds the name taken
            # (EEXIST); nothing changes
            assert errno_of(write_new, path, data, os.O_TRUNC) == errno.EPERM
            assert errno_of(write_new, path, data) == errno.EEXIST
            return
        write_new(path, data)
        obj = self.add(Obj("sha256", digest("sha256", data), data))
        self.pins[pin] = obj.ident
        self.pin_files.add(pin)  # shown as a regular file

    @rule(data=st.data(), parent=st.booleans(), ref=st.sampled_from((None, *REF_POOL)))
    def loose_commit(self, data, parent: bool, ref: str | None) -> None:
        """A blob, a tree and a commit written the way git writes loose objects into an
        alternate: a temporary file, then link or rename to xx/<38 hex>."""
        self.step("loose_commit")
        self.write_loose_commit(data, parent, ref)

    def write_loose_commit(self, data=None, parent: bool = False, ref: str | None = None) -> str:
        parents = self.commits()
        p = parents[-1] if parent and parents else None
        blob = git_object("blob", self.fresh("blob"))
        bhex = digest("git-sha1", blob)
        tree = git_object("tree", b"100644 f\0" + bytes.fromhex(bhex))
        thex = digest("git-sha1", tree)
        commit = git_object("commit", commit_body(thex, p, self.fresh("commit").decode()))
        chex = digest("git-sha1", commit)
        for n, (raw, h, kids) in enumerate(
            ((blob, bhex, ()), (tree, thex, (bhex,)), (commit, chex, (thex,) + ((p,) if p else ())))
        ):
            fan = self.mnt / "git" / "sha1" / h[:2]
            tmp = (fan if n % 2 else self.mnt / "git" / "sha1") / f"tmp_obj_{self.prefix}{n}"
            write_new(tmp, zlib.compress(raw))
            if n % 2:
                os.link(tmp, fan / h[2:])
                os.unlink(tmp)
            else:
                os.rename(tmp, fan / h[2:])
            self.add(Obj("git-sha1", h, raw, kids))
        assert (self.mnt / "objects" / "git-sha1" / chex).read_bytes() == commit
        if ref is not None and self.repos and data is not None:
            repo = data.draw(st.sampled_from(sorted(self.repos)))
            self.point(repo, ref, chex, "write")
        return chex

    @precondition(lambda self: self.repos)
    @rule(data=st.data(), parent=st.booleans(), ref=st.sampled_from((None, *REF_POOL)))
    def git_commit(self, data, parent: bool, ref: str | None) -> None:
        """The same through a repository, by git itself (hash-object, mktree, commit-tree)."""
        self.step("git_commit")
        repo = data.draw(st.sampled_from(sorted(self.repos)))
        env = {"GIT_DIR": str(self.mnt / "repos" / repo)}
        body = self.fresh("git blob")
        bhex = git_out("hash-object", "-w", "--stdin", input=body, env=env).strip()
        thex = git_out("mktree", input=b"100644 blob %s\tf\n" % bhex.encode(), env=env).strip()
        parents = self.commits()
        p = parents[0] if parent and parents else None
        msg = self.fresh("git commit")
        chex = git_out("commit-tree", thex, *(("-p", p) if p else ()), input=msg, env=env).strip()
        raw_commit = (self.mnt / "objects" / "git-sha1" / chex).read_bytes()
        assert raw_commit.startswith(b"commit ") and f"tree {thex}".encode() in raw_commit
        self.add(Obj("git-sha1", bhex, git_object("blob", body), (), True))
        tree = git_object("tree", b"100644 f\0" + bytes.fromhex(bhex))
        self.add(Obj("git-sha1", thex, tree, (bhex,), True))
        self.add(Obj("git-sha1", chex, raw_commit, (thex,) + ((p,) if p else ()), True))
        if ref is not None:  # git's own lockfile protocol, in the repository it wrote to
            git("update-ref", ref, chex, input=b"", env=env)
            self.repos[repo].refs[ref] = chex

    # -- pins -----------------------------------------------------------------------
    @rule(data=st.data(), name=st.integers(0, PIN_POOL - 1), how=st.sampled_from(["xattr", "ln"]))
    def pin(self, data, name: int, how: str) -> None:
        self.step("pin")
        if not self.present_objects():
            self.write_object("sha256", True)
        obj = data.draw(st.sampled_from(self.present_objects()))
        pin = self.pin_names[name]
        taken = self.pins.get(pin)
        if how == "xattr":
            call = (os.setxattr, self.opath(obj), PIN_X + pin, b"")
        else:
            call = (os.symlink, obj.link, self.mnt / "pins" / pin)
        if taken is not None and (how == "ln" or taken != obj.ident):
            assert errno_of(*call) == errno.EEXIST  # the name belongs to a pin already
            return
        call[0](*call[1:])
        self.pins[pin] = obj.ident  # (a staged delete is cancelled only if still pinned then)
        # a new pin is a link; the xattr form on a pin of the same object changes nothing

    @precondition(lambda self: self.pins)
    @rule(data=st.data(), how=st.sampled_from(["rm", "xattr"]))
    def unpin(self, data, how: str) -> None:
        self.step("unpin")
        pin = data.draw(st.sampled_from(sorted(self.pins)))
        if how == "rm":
            os.unlink(self.mnt / "pins" / pin)
        else:
            os.removexattr(self.opath(self.objects[self.pins[pin]]), PIN_X + pin)
        del self.pins[pin]
        self.pin_files.discard(pin)

    @precondition(lambda self: self.pins)
    @rule(data=st.data(), new=st.integers(0, PIN_POOL - 1))
    def rename_pin(self, data, new: int) -> None:
        self.step("rename_pin")
        old = data.draw(st.sampled_from(sorted(self.pins)))
        target = self.pin_names[new]
        os.rename(self.mnt / "pins" / old, self.mnt / "pins" / target)
        self.pins[target] = self.pins.pop(old)  # over an existing pin: replaces it
        was_file = old in self.pin_files  # (the entry moves: a file stays a file)
        self.pin_files -= {old, target}
        if was_file:
            self.pin_files.add(target)

    # -- repositories and refs ------------------------------------------------------
    @rule(i=st.integers(0, REPO_POOL - 1))
    def make_repo(self, i: int) -> None:
        self.step("make_repo")
        repo = self.repo_ids[i]
        if repo in self.repos:
            assert errno_of(os.mkdir, self.mnt / "repos" / repo) == errno.EEXIST
            return
        os.mkdir(self.mnt / "repos" / repo)
        self.repos[repo] = Repo()

    @precondition(lambda self: self.repos)
    @rule(data=st.data())
    def delete_repo(self, data) -> None:
        """`rm -r /repos/<id>` (docs/git.md: it lists packed-refs and refs/ before its
        plumbing, so the refs go first)."""
        self.step("delete_repo")
        repo = data.draw(st.sampled_from(sorted(self.repos)))
        path = self.mnt / "repos" / repo
        if self.repos[repo].refs:
            assert errno_of(os.rmdir, path) == errno.ENOTEMPTY
        done = subprocess.run(["rm", "-r", str(path)], capture_output=True)
        assert (done.returncode, done.stderr) == (0, b"")
        del self.repos[repo]

    @precondition(lambda self: self.repos)
    @rule(data=st.data(), ref=st.sampled_from(REF_POOL), how=st.sampled_from(["write", "lock"]))
    def set_ref(self, data, ref: str, how: str) -> None:
        self.step("set_ref")
        if not self.commits():
            self.write_loose_commit()
        repo = data.draw(st.sampled_from(sorted(self.repos)))
        target = data.draw(st.sampled_from(self.commits()))
        self.point(repo, ref, target, how)

    def point(self, repo: str, ref: str, target: str, how: str) -> None:
        path = self.ref_path(repo, ref)
        line = f"{target}\n".encode()
        if how == "write":
            write_new(path, line, os.O_TRUNC)
        else:  # git's lockfile protocol
            write_new(f"{path}.lock", line)
            os.rename(f"{path}.lock", path)
        self.repos[repo].refs[ref] = target

    @precondition(lambda self: self.repos)
    @rule(data=st.data(), ref=st.sampled_from(REF_POOL))
    def delete_ref(self, data, ref: str) -> None:
        self.step("delete_ref")
        repo = data.draw(st.sampled_from(sorted(self.repos)))
        path = self.ref_path(repo, ref)
        if ref not in self.repos[repo].refs:
            assert errno_of(os.unlink, path) == errno.ENOENT
            return
        os.unlink(path)
        del self.repos[repo].refs[ref]

    @precondition(lambda self: self.repos)
    @rule(data=st.data(), head=st.sampled_from(HEADS))
    def set_head(self, data, head: str) -> None:
        self.step("set_head")
        repo = data.draw(st.sampled_from(sorted(self.repos)))
        write_new(self.mnt / "repos" / repo / "HEAD", head.encode(), os.O_TRUNC)
        self.repos[repo].head = head

    # -- touches and sweeps ---------------------------------------------------------
    @rule(data=st.data(), view=st.sampled_from(["objects", "pin", "loose"]))
    def touch(self, data, view: str) -> None:
        self.step("touch")
        objs = self.present_objects()
        if not objs:
            return
        obj = data.draw(st.sampled_from(objs))
        path = self.opath(obj)
        if view == "pin":
            # utime follows a link (a pin written as a file takes the time as its own)
            names = sorted(
                n for n, i in self.pins.items() if i == obj.ident and n not in self.pin_files
            )
            if names:
                path = self.mnt / "pins" / names[0]
        elif view == "loose" and obj.algo == "git-sha1":
            path = self.mnt / "git" / "sha1" / obj.hex[:2] / obj.hex[2:]
        os.utime(path)
        self.freshened(obj)

    def model_sweep(self) -> None:
        live = self.live()
        for obj in self.objects.values():
            if obj.ident in live:
                obj.staged = False
            elif obj.staged:  # staged by the last sweep and untouched since: due now
                obj.maybe_gone = True
            else:
                obj.staged = True
        (self.mnt / ".alkfs" / "control").write_text("sweep\n")
        report = status(self.mnt)["last_sweep"]
        assert report["aborted"] is None, report
        assert report["deleted"] + report["cancelled_by_arbitration"] == report["taken"]

    @rule()
    def sweep(self) -> None:
        self.step("sweep")
        self.model_sweep()

    @rule()
    def sweep_twice(self) -> None:
        """Two sweeps with nothing between them: every dead object is gone after them,
        except what an in-process push pin may still hold (and what it reaches)."""
        self.step("sweep_twice")
        self.model_sweep()
        self.model_sweep()
        held = self.git_closure(o.hex for o in self.objects.values() if o.push_pinned)
        live = self.live()
        for obj in list(self.objects.values()):
            if obj.ident in live or obj.ident in held:
                continue
            assert errno_of(os.lstat, self.opath(obj)) == errno.ENOENT, obj.ident
            del self.objects[obj.ident]
            type(self).counts["(objects seen gone)"] = (
                type(self).counts.get("(objects seen gone)", 0) + 1
            )

    # -- invariants -----------------------------------------------------------------
    @invariant()
    def live_objects_read_back(self) -> None:
        for ident in sorted(self.live()):
            obj = self.objects[ident]
            with open(self.opath(obj), "rb") as f:
                assert f.read() == obj.data, ident

    @invariant()
    def pins_are_listed_with_their_targets(self) -> None:
        listed = sorted(n for n in os.listdir(self.mnt / "pins") if n.startswith(self.prefix + "-"))
        assert listed == sorted(self.pins)
        for name, ident in self.pins.items():
            path = self.mnt / "pins" / name
            got = os.lstat(path)
            if name in self.pin_files:
                assert stat.S_ISREG(got.st_mode), (name, got)
                assert got.st_size == len(self.objects[ident].data), (name, got)
            else:
                assert stat.S_ISLNK(got.st_mode), (name, got)
            assert pin_target(path) == self.objects[ident].link, name

    @invariant()
    def refs_and_repos_read_their_model_values(self) -> None:
        listed = sorted(
            n for n in os.listdir(self.mnt / "repos") if n.startswith(self.prefix + "-")
        )
        assert listed == sorted(self.repos)
        for repo_id, repo in self.repos.items():
            assert (self.mnt / "repos" / repo_id / "HEAD").read_text() == repo.head
            packed = (self.mnt / "repos" / repo_id / "packed-refs").read_text().splitlines()
            assert packed[0].startswith("# pack-refs with:"), packed
            assert dict(reversed(line.split(" ", 1)) for line in packed[1:]) == repo.refs
            for ref in REF_POOL:
                path = self.ref_path(repo_id, ref)
                if ref in repo.refs:
                    assert path.read_text() == f"{repo.refs[ref]}\n", (repo_id, ref)
                else:
                    assert errno_of(os.lstat, path) == errno.ENOENT, (repo_id, ref)
        s = status(self.mnt)
        assert (s["pins"], s["repos"]) == (
            self.base_pins + len(self.pins),
            self.base_repos + len(self.repos),
        )


def test_the_mount_matches_the_model_for_any_sequence(model_mount):
    machine = type("MountModelRun", (MountModel,), {"mount": model_mount, "steps": 0, "counts": {}})
    started = time.monotonic()
    runs = 0
    while machine.steps < TOTAL_STEPS:  # hypothesis may end an example early: run on
        runs += 1
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=-(-(TOTAL_STEPS - machine.steps) // STEPS_PER_EXAMPLE),
                stateful_step_count=STEPS_PER_EXAMPLE,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
    print(
        f"\nmount model: {machine.steps} steps in {runs} runs, "
        f"{time.monotonic() - started:.1f} s: {sorted(machine.counts.items())}"
    )
    assert model_mount.tracebacks() == []
