"""What a repository outside the store reaches, read without reading through the store.

A borrower (docs/gc.md) is a git repository whose `objects/info/alternates` names the
mount: its own object directory holds only what it made itself (unpushed commits, a
fetch's leftovers) and everything else is read from the store. What it keeps alive in
the store is every object reachable from

- its refs (loose and packed), every worktree's `HEAD`, and the pseudo-refs
  (`FETCH_HEAD`, `ORIG_HEAD`, `MERGE_HEAD`, a rebase's state ...);
- every entry of every reflog, both ids, as `git gc` keeps them;
- every index (the main one, each worktree's, a split index's shared part): the
  blobs of its entries and the trees of its cache-tree;
- every object of its own object directory (what it reaches *through its own
  objects*: an unpushed commit on top of a branch the server deleted);
- the LFS media named by the git-lfs pointers among its own blobs (`Reach.media`: a
  commit not pushed, or a file staged in its index, with `lfs.storage` in the mount).

`tips` returns the ids those name; the caller walks their closure in the store. Git
cannot do this walk itself here: `rev-list --objects` through the alternates would
read the whole closure through the mount (and a store no daemon serves has no
directory to point it at), while without them it stops at the first commit that only
the store holds (git 2.39's `--missing` does not cover commits). So the refs, logs and
indexes are read here as files, and only the listing and reading of the borrower's own
objects is left to `git cat-file`, run on a copy of its object directory that has no
alternates (symbolic links to its packs and loose fan-out directories), with a
timeout. Any file that cannot be read, or reads as something git would not have
written, is `Unreadable`: the caller must not judge the borrower from a part of it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..errors import AlkfsError, Interrupted
from .lfs_pointer import POINTER_MAX, SHA256_TAG, pointer_oid
from .objects import FORMATS

GIT_TIMEOUT_S = 600.0
STOP_POLL_S = 0.2  # how often a running git looks at the stop event
PSEUDO_REFS = (
    "HEAD",
    "ORIG_HEAD",
    "FETCH_HEAD",
    "MERGE_HEAD",
    "CHERRY_PICK_HEAD",
    "REVERT_HEAD",
    "BISECT_HEAD",
    "REBASE_HEAD",
    "AUTO_MERGE",
)
STATE_DIRS = ("rebase-merge", "rebase-apply", "sequencer")
_HEX = {20: re.compile(rb"[0-9a-f]{40}"), 32: re.compile(rb"[0-9a-f]{64}")}


class Unreadable(AlkfsError):
    """The borrower exists but cannot be read, or is not a git repository."""


class Gone(AlkfsError):
    """Nothing is at the borrower's path (deleted, or its file system not mounted)."""


@dataclass
class Layout:
    """Where a borrower's files are: `git_dir` (its own: HEAD, index, logs of HEAD)
    and `common` (refs, packed-refs, logs, objects, worktrees)."""

    git_dir: Path
    common: Path
    object_format: str = "sha1"

    @property
    def id_len(self) -> int:
        return FORMATS[self.object_format]


@dataclass
class Reach:
    """What `tips` found: raw ids (of the borrower's object format) and counts."""

    object_format: str
    ids: set[bytes] = field(default_factory=set)
    refs: int = 0
    own_objects: int = 0
    media: set[bytes] = field(default_factory=set)  # raw sha256 keys its own pointers name


def _read(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise Unreadable(f"{path}: {exc.strerror or exc}") from None


def _gitfile(path: Path) -> Path:
    """The directory a `.git` file (`gitdir: X`) points to."""
    text = _read(path).decode("utf-8", "replace").strip()
    if not text.startswith("gitdir: "):
        raise Unreadable(f"{path}: not a gitdir file")
    target = Path(text[len("gitdir: ") :])
    return target if target.is_absolute() else (path.parent / target)


def _is_git_dir(path: Path) -> bool:
    return (path / "HEAD").is_file() and (
        (path / "objects").is_dir() or (path / "commondir").is_file()
    )


def locate(path: str | os.PathLike[str]) -> Layout:
    """The layout of the repository at `path` (a work tree or a git dir). Gone when
    nothing is there; Unreadable when something is but it is not a git repository
    (or cannot be read)."""
    p = Path(path)
    try:
        os.stat(p)
    except FileNotFoundError:
        raise Gone(f"{p}: no such file or directory") from None
    except OSError as exc:
        raise Unreadable(f"{p}: {exc.strerror or exc}") from None
    try:
        dot = p / ".git"
        if dot.is_dir():
            git_dir = dot
        elif dot.is_file():
            git_dir = _gitfile(dot)
        elif _is_git_dir(p):
            git_dir = p
        else:
            if not os.access(p, os.R_OK | os.X_OK):
                raise Unreadable(f"{p}: permission denied")
            raise Unreadable(f"{p}: not a git repository")
        if not _is_git_dir(git_dir):
            raise Unreadable(f"{git_dir}: not a git repository")
        common = git_dir
        if (git_dir / "commondir").is_file():
            rel = _read(git_dir / "commondir").decode("utf-8", "replace").strip()
            common = (git_dir / rel).resolve() if not Path(rel).is_absolute() else Path(rel)
        layout = Layout(git_dir.resolve(), common.resolve())
        layout.object_format = _object_format(layout.common)
        return layout
    except FileNotFoundError as exc:
        raise Unreadable(f"{p}: {exc.filename}: vanished while read") from None
    except PermissionError as exc:
        raise Unreadable(f"{p}: {exc.filename}: permission denied") from None


def _object_format(common: Path) -> str:
    """sha1, or what `extensions.objectFormat` in the repository's config says."""
    try:
        text = _read(common / "config").decode("utf-8", "replace")
    except FileNotFoundError:
        return "sha1"
    m = re.search(r"(?im)^\s*objectformat\s*=\s*(\w+)\s*$", text)
    fmt = m.group(1).lower() if m else "sha1"
    if fmt not in FORMATS:
        raise Unreadable(f"{common}: unknown object format {fmt!r}")
    return fmt


# -- refs, logs, pseudo-refs ------------------------------------------------------------
def _walk_files(top: Path) -> Iterator[Path]:
    """Every regular file under `top` (none when it is absent); Unreadable for a
    directory that cannot be listed."""

    def fail(exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError):
            raise Unreadable(f"{exc.filename}: {exc.strerror or exc}")

    for dirpath, _dirs, files in os.walk(top, onerror=fail):
        for name in files:
            yield Path(dirpath) / name


def _ref_value(path: Path, data: bytes, n: int) -> bytes | None:
    """The raw id a loose ref file holds; None for a symbolic ref. Unreadable for
    anything git would not have written (a half-written file)."""
    line = data.rstrip(b"\n")
    if line.startswith(b"ref: "):
        return None
    if _HEX[n].fullmatch(line) is None:
        raise Unreadable(f"{path}: not a ref ({len(data)} bytes)")
    return bytes.fromhex(line.decode())


def _loose_refs(layout: Layout, reach: Reach) -> None:
    n = layout.id_len
    for path in _walk_files(layout.common / "refs"):
        if path.name.endswith(".lock"):
            continue  # (an update in progress: its old value is still the file's)
        try:
            value = _ref_value(path, _read(path), n)
        except FileNotFoundError:
            continue  # deleted while read: a ref that is gone keeps nothing
        reach.refs += 1
        if value is not None:
            reach.ids.add(value)


def _packed_refs(layout: Layout, reach: Reach) -> None:
    try:
        data = _read(layout.common / "packed-refs")
    except FileNotFoundError:
        return
    pattern = _HEX[layout.id_len]
    hexlen = 2 * layout.id_len
    for line in data.splitlines():
        if not line or line.startswith(b"#"):
            continue
        value = line[1:] if line.startswith(b"^") else line[:hexlen]
        if pattern.fullmatch(value) is None:
            raise Unreadable(f"{layout.common / 'packed-refs'}: a line is not a ref")
        reach.refs += not line.startswith(b"^")
        reach.ids.add(bytes.fromhex(value.decode()))


def _git_dirs(layout: Layout) -> list[Path]:
    """The main git dir and every linked worktree's."""
    out = [layout.common]
    if layout.git_dir != layout.common:
        out.append(layout.git_dir)
    wt = layout.common / "worktrees"
    try:
        names = sorted(os.listdir(wt))
    except FileNotFoundError:
        names = []
    except OSError as exc:
        raise Unreadable(f"{wt}: {exc.strerror or exc}") from None
    for name in names:
        d = (wt / name).resolve()
        if d.is_dir() and d not in out:
            out.append(d)
    return out


def _pseudo_refs(git_dir: Path, layout: Layout, reach: Reach) -> None:
    pattern = _HEX[layout.id_len]
    files = [git_dir / name for name in PSEUDO_REFS]
    for state in STATE_DIRS:
        files += [p for p in _walk_files(git_dir / state) if p.stat().st_size < 4096]
    for path in files:
        try:
            data = _read(path)
        except FileNotFoundError:
            continue
        # FETCH_HEAD: "<id>\t...\n" a line; the others one id (or "ref: ..."); a
        # rebase's state files hold ids among other text: every id in them counts
        for m in pattern.finditer(data):
            reach.ids.add(bytes.fromhex(m.group().decode()))


def _reflogs(git_dir: Path, layout: Layout, reach: Reach) -> None:
    n = layout.id_len
    hexlen = 2 * n
    zero = b"0" * hexlen
    pattern = _HEX[n]
    for path in _walk_files(git_dir / "logs"):
        try:
            data = _read(path)
        except FileNotFoundError:
            continue
        for line in data.splitlines():
            old, new = line[:hexlen], line[hexlen + 1 : 2 * hexlen + 1]
            for value in (old, new):
                if value == zero:
                    continue
                if pattern.fullmatch(value) is None:
                    break  # (a torn last line: git skips it too)
                reach.ids.add(bytes.fromhex(value.decode()))


# -- the index -------------------------------------------------------------------------
def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """git's offset varint (index v4 names)."""
    c = data[pos]
    pos += 1
    value = c & 0x7F
    while c & 0x80:
        c = data[pos]
        pos += 1
        value = ((value + 1) << 7) | (c & 0x7F)
    return value, pos


def index_ids(data: bytes, n: int) -> set[bytes]:
    """The ids an index file names: every entry's and every cache-tree node's.
    ValueError for a file that is not an index."""
    if len(data) < 12 + n or data[:4] != b"DIRC":
        raise ValueError("not an index file")
    version = int.from_bytes(data[4:8], "big")
    count = int.from_bytes(data[8:12], "big")
    if version not in (2, 3, 4):
        raise ValueError(f"index version {version}")
    out: set[bytes] = set()
    pos = 12
    end = len(data) - n  # the trailing checksum
    for _ in range(count):
        start = pos
        pos += 40
        out.add(data[pos : pos + n])
        pos += n
        flags = int.from_bytes(data[pos : pos + 2], "big")
        pos += 2
        if version >= 3 and flags & 0x4000:
            pos += 2
        if version == 4:
            _strip, pos = _varint(data, pos)
            nul = data.index(b"\0", pos)
            pos = nul + 1
        else:
            nul = data.index(b"\0", pos)
            pos = start + ((nul - start + 8) & ~7)  # 1-8 NULs pad the entry to 8 bytes
        if pos > end:
            raise ValueError("truncated index")
    while pos + 8 <= end:
        sig, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "big")
        body = data[pos + 8 : pos + 8 + size]
        pos += 8 + size
        if sig == b"TREE":
            out |= _cache_tree_ids(body, n)
        elif sig == b"REUC":  # (resolve-undo: git's gc keeps these blobs too)
            out |= _resolve_undo_ids(body, n)
    out.discard(b"\0" * n)
    return out


def _cache_tree_ids(body: bytes, n: int) -> set[bytes]:
    out: set[bytes] = set()
    pos = 0
    while pos < len(body):
        nul = body.index(b"\0", pos)
        nl = body.index(b"\n", nul)
        entries = int(body[nul + 1 : nl].split(b" ")[0])
        pos = nl + 1
        if entries >= 0:  # (-1: invalidated, no id)
            out.add(body[pos : pos + n])
            pos += n
    return out


def _resolve_undo_ids(body: bytes, n: int) -> set[bytes]:
    """REUC: a path, three octal modes (NUL-terminated), then an id for each mode that
    is not 0."""
    out: set[bytes] = set()
    pos = 0
    while pos < len(body):
        pos = body.index(b"\0", pos) + 1
        modes = []
        for _ in range(3):
            nul = body.index(b"\0", pos)
            modes.append(int(body[pos:nul], 8))
            pos = nul + 1
        for mode in modes:
            if mode:
                out.add(body[pos : pos + n])
                pos += n
    return out


def _indexes(git_dir: Path, layout: Layout, reach: Reach) -> None:
    files = [git_dir / "index"]
    try:
        files += [git_dir / f for f in os.listdir(git_dir) if f.startswith("sharedindex.")]
    except OSError as exc:
        raise Unreadable(f"{git_dir}: {exc.strerror or exc}") from None
    for path in files:
        try:
            data = _read(path)
        except FileNotFoundError:
            continue
        try:
            reach.ids |= index_ids(data, layout.id_len)
        except (ValueError, IndexError) as exc:
            raise Unreadable(f"{path}: not an index git wrote ({exc})") from None


# -- its own objects ------------------------------------------------------------------
def _own_odb(objects: Path, into: Path) -> None:
    """A copy of `objects` without alternates: links to its packs and fan-out dirs."""
    try:
        names = os.listdir(objects)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise Unreadable(f"{objects}: {exc.strerror or exc}") from None
    for name in names:
        if name != "info":
            os.symlink(objects / name, into / name)


def _git_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    # Run as whoever the daemon is, in a repository someone else may own: a global
    # config of our own says it is safe (git refuses "dubious ownership" otherwise)
    # and nothing of the user's config (aliases, hooks) applies.
    cfg = home / "gitconfig"
    cfg.write_text("[safe]\n\tdirectory = *\n[core]\n\tfsmonitor = false\n")
    env["GIT_CONFIG_GLOBAL"] = str(cfg)
    env["GIT_CONFIG_NOSYSTEM"] = "1"
    env["GIT_OBJECT_DIRECTORY"] = str(home / "objects")
    env["GIT_NO_REPLACE_OBJECTS"] = "1"
    env["HOME"] = str(home)
    return env


def _cat_file(
    layout: Layout,
    env: dict[str, str],
    args: list[str],
    stdin: bytes | None,
    stop: threading.Event | None = None,
) -> bytes:
    """git cat-file's output; Unreadable when it fails or takes more than GIT_TIMEOUT_S,
    Interrupted (git killed) as soon as `stop` is set."""
    cmd = ["git", "--git-dir", str(layout.common), "cat-file", *args]
    deadline = time.monotonic() + GIT_TIMEOUT_S
    # git's input from an unlinked file, not a pipe: after a timeout `communicate`
    # neither takes the input again (ValueError) nor goes on writing the rest of it
    with contextlib.ExitStack() as stack:
        source: int | IO[bytes] = subprocess.DEVNULL
        if stdin is not None:
            source = stack.enter_context(tempfile.TemporaryFile())
            source.write(stdin)
            source.seek(0)
        proc = stack.enter_context(
            subprocess.Popen(
                cmd, stdin=source, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
            )
        )
        while True:
            try:
                out, err = proc.communicate(timeout=STOP_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if stop is not None and stop.is_set():
                    proc.kill()
                    proc.communicate()
                    raise Interrupted("the store is closing: a borrower's read stopped") from None
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.communicate()
                    raise Unreadable(
                        f"{layout.common}: git cat-file took more than {GIT_TIMEOUT_S:.0f} s"
                    ) from None
    if proc.returncode != 0:
        lines = err.decode("utf-8", "replace").strip().splitlines()
        raise Unreadable(f"{layout.common}: git cat-file failed: {(lines or ['?'])[-1][:200]}")
    return out


def _own_objects(layout: Layout, reach: Reach, stop: threading.Event | None = None) -> None:
    """Every object of the borrower's own object directory, and every id they name."""
    with tempfile.TemporaryDirectory(prefix="alkfs-borrower-") as tmp:
        home = Path(tmp)
        (home / "objects").mkdir()
        _own_odb(layout.common / "objects", home / "objects")
        env = _git_env(home)
        listing = _cat_file(
            layout,
            env,
            [
                "--batch-all-objects",
                "--unordered",
                "--batch-check=%(objectname) %(objecttype) %(objectsize)",
            ],
            None,
            stop,
        )
        wanted: list[bytes] = []
        for line in listing.splitlines():
            fields = line.split(b" ")
            oid, kind = fields[0], fields[1] if len(fields) > 1 else b""
            reach.own_objects += 1
            reach.ids.add(bytes.fromhex(oid.decode()))
            # (a small blob may be an LFS pointer: a commit not pushed keeps its media;
            # an object git cannot read, "<id> missing", is asked for: Unreadable then)
            small = len(fields) == 3 and fields[2].isdigit() and int(fields[2]) < POINTER_MAX
            if kind != b"blob" or small:
                wanted.append(oid)
        if not wanted:
            return
        out = _cat_file(layout, env, ["--batch"], b"\n".join(wanted) + b"\n", stop)
        _named_by(out, layout, reach)
        shutil.rmtree(home / "objects", ignore_errors=True)


def _named_by(stream: bytes, layout: Layout, reach: Reach) -> None:
    """The ids named by the objects of a `cat-file --batch` stream."""
    n = layout.id_len
    hexlen = 2 * n
    # (entries are contiguous: each match starts at an entry's mode, never in a name)
    entry = re.compile(rb"([0-7]{5,6}) [^\0]+\0(.{%d})" % n, re.DOTALL)
    pos = 0
    while pos < len(stream):
        nl = stream.index(b"\n", pos)
        header = stream[pos:nl].split(b" ")
        if len(header) != 3:
            raise Unreadable(f"{layout.common}: git cat-file: {stream[pos:nl][:80]!r}")
        kind, size = header[1], int(header[2])
        body = stream[nl + 1 : nl + 1 + size]
        pos = nl + 1 + size + 1
        if kind == b"blob":
            media = pointer_oid(body)
            if media is not None:
                reach.media.add(SHA256_TAG + bytes.fromhex(media))
        elif kind == b"tree":
            # (a gitlink names another repository's commit)
            reach.ids.update(x for mode, x in entry.findall(body) if mode != b"160000")
        elif kind in (b"commit", b"tag"):
            head = body.split(b"\n\n", 1)[0]
            for line in head.split(b"\n"):
                name, _, value = line.partition(b" ")
                if name in (b"tree", b"parent", b"object") and len(value) == hexlen:
                    try:
                        reach.ids.add(bytes.fromhex(value.decode()))
                    except ValueError:
                        pass


def tips(path: str | os.PathLike[str], stop: threading.Event | None = None) -> Reach:
    """Every id the borrower at `path` keeps alive directly (see the module docstring);
    Gone or Unreadable as `locate`, Unreadable for any part that cannot be read."""
    layout = locate(path)
    reach = Reach(layout.object_format)
    try:
        _packed_refs(layout, reach)
        _loose_refs(layout, reach)
        for git_dir in _git_dirs(layout):
            _pseudo_refs(git_dir, layout, reach)
            _reflogs(git_dir, layout, reach)
            _indexes(git_dir, layout, reach)
        _own_objects(layout, reach, stop)
    except PermissionError as exc:
        raise Unreadable(f"{exc.filename}: permission denied") from None
    except FileNotFoundError as exc:  # (the repository went away while read)
        raise Unreadable(f"{exc.filename}: vanished while read") from None
    reach.ids.discard(b"\0" * layout.id_len)
    return reach
