"""/pins: every durable pin, and a tree of them to back files up into (docs/decisions.md).

Its entries (nodes/pintree.py): a pin made by `ln -s`, setfattr or the CLI is a symbolic
link `<name> -> ../objects/<algo>/<hex>` (one `../` more per directory level); a pin
written as a file is a regular file with its object's size and the mode, time, owner and
group its writer gave; a directory of pins is a directory with its own (an owner or
group never set is the mount's; root gives any, an owner only its own groups:
`pintree.owner_change`). Pins come and go (setfattr on an
object, the command line, another daemon of a fleet), so entries and attributes expire
after a second.

A directory's listing is read a page at a time (`Pins.children`: a range of the
primary key), never held whole; a lookup is one probe of it (or none: `Misses`).

Writing, with any file name as a component (not `.`/`..`, at most 255 bytes;
at most 4,096 bytes in all: ENAMETOOLONG, nothing changed):
- `mkdir` makes a directory of pins; `rmdir` removes an empty one (ENOTEMPTY).
- A new regular file is a PinFile: on close its content is stored (sha256) and pinned
  under its path with its mode and time, in one transaction (a refused name stores
  nothing); `chmod`/`touch` before or after set them. `.x.ABCDEF` (rsync's temporary)
  is a name like any other: kept durably, then renamed.
- `ln -s ../objects/<algo>/<hex> NAME` pins (EINVAL: a target that is not an object
  path, an object not stored; EEXIST: the name is taken); `ln` of a pin pins its object
  again under the new name.
- `rm NAME` unpins (so `rm -r` of a directory unpins everything in it); `mv` renames a
  pin, a file being written or a directory with everything below it, replacing an entry
  of the same kind (rename(2)'s rules: EISDIR, ENOTDIR, ENOTEMPTY); RENAME_EXCHANGE and
  RENAME_WHITEOUT are EINVAL; only within /pins (EXDEV).
- One writer per name: a create of a name being written (or pinned, or acknowledged
  and not committed yet) is EEXIST, and so is a second write open of a file being
  written (it would truncate or interleave with the first writer's bytes).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import re
import stat
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import pyfuse3
from pyfuse3 import RequestContext

from alkfs.errors import Invalid, Missing, NotEmpty
from alkfs.keys import Algorithm, Key
from alkfs.pins import (
    PATH_MAX,
    Entry,
    PinDir,
    PinRecord,
    TooLong,
    intent_name,
    path_bytes,
    path_text,
)
from alkfs.store import ObjectStat, PutResult

from ..errors import clip, fail
from .base import DYNAMIC_TIMEOUT, FIRST_OFFSET, Dir, Emit, File, Node, SetattrFields
from .handles import DirHandle, Handle
from .objfile import ObjectFile
from .pintree import PinFile, PinFileEntry, PinLink, Tree, leaf_of, set_owned_attrs, show_owner
from .policy import noop_setattr

if TYPE_CHECKING:
    from ..context import Context

# `../objects/<algo>/<hex>` with any number of `../` (one per level is what `ls` shows)
LINK_TARGET = re.compile(rb"(?:\.\./)+objects/([a-z0-9-]+)/([0-9a-f]+)\Z")
PAGE = 256  # entries a listing reads at a time


def _shown(name: bytes) -> str:
    return clip(repr(name), 160)


def _rebased(name: str, old: str, new: str) -> str:
    """`name` (at or below `old`) after `old` was renamed `new`."""
    return new + name[len(old) :]


# Where a listing of a directory of /pins resumes: ("db", the last name given; None: from
# the start), or ("staged", how many of the files being written here were given).
Mark = tuple[str, str | int | None]


class TreeDir(Dir):
    """/pins or one of its directories: `raw` is its path below /pins (b"": /pins),
    `prefix` the names of its entries start with ("" or its name and `/`)."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ("tree", "raw", "prefix")

    def _place(self, tree: Tree, raw: bytes) -> None:
        self.tree = tree
        self.raw = raw
        self.prefix = path_text(raw) + "/" if raw else ""

    def path_of(self, name: bytes) -> bytes:
        return self.raw + b"/" + name if self.raw else name

    # -- finding entries -------------------------------------------------------------------
    def _find(self, path: bytes) -> Entry | None:
        """The pin or directory at `path` (None: none). The last path found empty is
        remembered until any pin changes: cp's stat, the kernel's O_EXCL lookup, the
        create and the close each ask for the same new name."""
        tree = self.tree
        misses = self.ctx.pins.misses
        epoch = misses.before_query()
        if path == tree.unpinned and epoch == tree.unpinned_epoch:
            return None
        if len(path) > PATH_MAX:
            return None
        found = self.ctx.pins.entry(path_text(path))
        if found is None and misses.steady(epoch):
            tree.unpinned, tree.unpinned_epoch = path, epoch
        return found

    def _node(self, found: Entry) -> Node:
        if isinstance(found, PinDir):
            return PinSubdir(self.ctx, self, self.tree, found)
        if found.mode is not None:
            return PinFileEntry(self.ctx, self, found)
        return PinLink(self.ctx, self, found)

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        path = self.path_of(name)
        staged = self.tree.staged.get(path)
        if staged is not None:
            return staged
        found = self._find(path)
        if found is None:
            fail(errno.ENOENT)
        return self._node(found)

    # -- listing -------------------------------------------------------------------------------
    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        """The entries in name order, a page at a time, then the files being written
        here. Offsets count the entries; each one this open gave in its last two
        replies resumes after its entry's name (a name, not a position: entries made or
        removed meanwhile shift nothing); another offset (a seekdir) counts from the
        start."""
        state = dh.state
        marks = cast(dict[int, Mark], state.setdefault("marks", {}))
        if start < FIRST_OFFSET:
            resume: Mark = ("db", None)
            state["staged"] = None
            offset = FIRST_OFFSET
        elif start in marks:
            resume, offset = marks[start], start + 1
        else:  # (a seek to an offset not given lately: count entries from the start)
            state["staged"] = None
            resume, offset = ("db", None), FIRST_OFFSET
            for mark, _, _ in self._walk(resume, state):
                resume, offset = mark, offset + 1
                if offset > start:
                    break
        for old in cast(
            set[int], state.get("before", ())
        ):  # (only the last two replies' marks stay)
            marks.pop(old, None)
        state["before"] = state.get("last", ())
        state["last"] = now = set()
        for mark, name, node in self._walk(resume, state):
            if not emit(name, node, offset):
                return
            marks[offset] = mark
            now.add(offset)
            offset += 1

    def _walk(self, resume: Mark, state: dict[str, object]) -> Iterator[tuple[Mark, bytes, Node]]:
        """(mark to resume after it, name, node) of every entry after `resume`."""
        phase, at = resume
        cut = len(self.prefix)
        if phase == "db":
            pins = self.ctx.pins
            while True:
                page = pins.children(self.prefix, cast(str | None, at), PAGE)
                for found in page:
                    yield ("db", found.name), path_bytes(found.name[cut:]), self._node(found)
                if len(page) < PAGE:
                    break
                at = page[-1].name
            at = 0
        staged = cast(list[tuple[bytes, Node]] | None, state.get("staged"))
        if staged is None:
            staged = state["staged"] = self._staged_here()
        for i in range(cast(int, at), len(staged)):
            yield ("staged", i + 1), staged[i][0], staged[i][1]

    def _staged_here(self) -> list[tuple[bytes, Node]]:
        """The files being written in this directory that the database does not list."""
        out = []
        for path, node in self.tree.staged.items():
            cut = path.rfind(b"/")
            if (path[:cut] if cut >= 0 else b"") != self.raw:
                continue
            if self.ctx.pins.entry(path_text(path)) is None:
                out.append((path[cut + 1 :], node))
        return sorted(out, key=lambda e: e[0])

    # -- new entries -----------------------------------------------------------------------
    def _new(self, name: bytes) -> tuple[bytes, str]:
        """The path and pin name of a new entry `name` here (ENAMETOOLONG past PATH_MAX
        bytes in all: nothing is made)."""
        path = self.path_of(name)
        if len(path) > PATH_MAX:
            fail(errno.ENAMETOOLONG, f"/pins/{_shown(path[:64])}...: {len(path)} bytes")
        if not name or name in (b".", b"..") or b"\0" in name or b"/" in name:
            fail(errno.EINVAL, f"{_shown(name)} is no file name")
        return path, path_text(path)

    def _taken(self, path: bytes) -> bool:
        tree = self.tree
        if path in tree.staged:
            return True
        return self._find(path) is not None

    async def create(
        self, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[Node, Handle]:
        path, _ = self._new(name)
        if self._taken(path):
            fail(errno.EEXIST, f"/pins/{_shown(path)} exists")
        node = PinFile(self.ctx, self, self, name, path, mode)
        self.tree.staged[path] = node
        return node, node.new_handle(flags)

    async def mkdir(self, name: bytes, mode: int, req: RequestContext) -> Node:
        path, text = self._new(name)
        if self._taken(path):
            fail(errno.EEXIST, f"/pins/{_shown(path)} exists")
        made = await self.ctx.run_sync(self.ctx.pins.mkdir, text, mode)
        return PinSubdir(self.ctx, self, self.tree, made)

    async def symlink(self, name: bytes, link: bytes, req: RequestContext) -> Node:
        path, text = self._new(name)
        if self._taken(path):
            fail(errno.EEXIST, f"/pins/{_shown(path)} exists")
        key = self._target_key(link)
        if not self.ctx.store.has(key):
            fail(errno.EINVAL, f"{key} is not in the store")
        try:
            rec = await self.ctx.run_sync(
                functools.partial(self.ctx.pins.pin, text, key, tree=True)
            )
        except Missing as exc:
            fail(errno.EINVAL if not self.ctx.store.has(key) else errno.ENOENT, str(exc))
        return PinLink(self.ctx, self, rec)

    def _target_key(self, link: bytes) -> Key:
        """The object a link target names: `../objects/<algo>/<hex>` (or the same path
        through this mount, absolute)."""
        mnt = self.ctx.mountpoint
        if mnt is not None and link.startswith(mnt.encode() + b"/objects/"):
            link = b"../" + link[len(mnt) + 1 :]
        m = LINK_TARGET.match(link)
        if m is None:
            fail(errno.EINVAL, f"{_shown(link)} is not ../objects/<algo>/<hex>")
        try:
            algo = Algorithm.from_label(m.group(1).decode())
            return Key.from_hex(algo, m.group(2).decode())
        except Invalid:
            fail(errno.EINVAL, f"{_shown(link)} does not name an object")

    async def link(self, name: bytes, node: Node, req: RequestContext) -> Node:
        """`ln PIN NAME` (tar's and cp -a's hard links): the same object pinned again
        under NAME, with the same attributes, owner and group (another row: its own
        inode)."""
        if not isinstance(node, (PinFileEntry, PinLink)):
            fail(errno.EPERM, "only a pin can be linked in /pins")
        path, text = self._new(name)
        if self._taken(path):
            fail(errno.EEXIST, f"/pins/{_shown(path)} exists")
        rec = node.record
        made = await self.ctx.run_sync(
            functools.partial(self.ctx.pins.pin, text, rec.key, attrs=rec.attrs, tree=True)
        )
        return self._node(made)

    # -- files written here (the StagingParent of their PinFile) --------------------------
    @staticmethod
    def _pin_name(node: PinFile) -> str | None:
        """The pin a file written here makes at close (None: it was unlinked)."""
        return None if node.unlinked else node.pin_name

    def store_ahead(self, node: PinFile, data: bytes) -> PutResult | None:
        """A first commit of a name no pin took meanwhile (an object's pin xattr): its
        intent logged, it is acknowledged (alkfs/writebehind.py)."""
        text = self._pin_name(node)
        if text is None or node.key is not None or self._find(node.pin_path) is not None:
            return None
        intent = intent_name(text, node.file_attrs(len(data)))
        return self.ctx.pending.put(intent, node.writer.algo, data, None)

    def store_small(self, node: PinFile, data: bytes) -> PutResult | None:
        """The object and its pin in one transaction (a refused name stores nothing)."""
        text = self._pin_name(node)
        if text is None:
            return None
        attrs = node.file_attrs(len(data))
        replace = node.key or False  # (what this file stored before is replaced)
        result, _ = self.ctx.pins.put_pinned(text, data, replace=replace, attrs=attrs, tree=True)
        return result

    def publish_in_thread(self, node: PinFile, result: PutResult) -> None:
        """After the put (content that was spooled): pinned under its path, then the
        in-process pin goes (after the pin row committed); EEXIST if the name is
        another object's now. (Only a worker thread pins here.)"""
        text = self._pin_name(node)
        if text is None:
            return
        st = self.ctx.store.stat(result.key)
        size = st.size if st is not None else node.writer.size
        attrs = node.file_attrs(size)
        self.ctx.pins.pin(text, result.key, replace=node.key or False, attrs=attrs, tree=True)
        result.pin.release()

    def stored_file(self, st: ObjectStat) -> File:
        return ObjectFile(self.ctx, self, st)

    async def publish(self, node: PinFile, result: PutResult) -> None:
        result.pin.release()  # (pinned under its path already: a second release is a no-op)
        self._forget(node)

    async def closed(self, node: PinFile) -> None:
        self._forget(node)

    def _forget(self, node: PinFile) -> None:
        # (no kernel invalidation needed: a StagedFile's entry timeout is 0, so the next
        # use of the name asks again and finds the pin, or nothing)
        staged, path = self.tree.staged, node.pin_path
        if staged.get(path) is node:
            del staged[path]

    def _drop(self, path: bytes) -> bool:
        """Remove a file being written: nothing of it is kept."""
        node = self.tree.staged.pop(path, None)
        if node is None:
            return False
        node.unlinked = True
        return True

    # -- removing and renaming -------------------------------------------------------------
    async def _settle(self, path: bytes) -> PinFile | None:
        """The file being written at `path`, once no commit of it is under way (None:
        none, or it is pinned there now)."""
        writing = self.tree.staged.get(path)
        if writing is None:
            return None
        await writing.settled()
        if self.tree.staged.get(path) is writing:
            return writing
        return None

    async def unlink(self, name: bytes, req: RequestContext) -> None:
        path = self.path_of(name)
        await self._settle(path)
        if self._drop(path):
            return
        found = self._find(path)
        if found is None:
            fail(errno.ENOENT)
        if isinstance(found, PinDir):
            fail(errno.EISDIR, f"/pins/{found.name} is a directory")
        try:
            await self.ctx.run_sync(self.ctx.pins.unpin, found.name)
        except Missing:
            fail(errno.ENOENT)

    async def rmdir(self, name: bytes, req: RequestContext) -> None:
        path = self.path_of(name)
        if path in self.tree.staged:
            fail(errno.ENOTDIR)
        found = self._find(path)
        if found is None:
            fail(errno.ENOENT)
        if not isinstance(found, PinDir):
            fail(errno.ENOTDIR, f"/pins/{found.name} is no directory")
        if any(p.startswith(path + b"/") for p in self.tree.staged):
            fail(errno.ENOTEMPTY, f"/pins/{found.name}: a file is being written in it")
        await self.ctx.run_sync(self.ctx.pins.rmdir, found.name)

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, req: RequestContext
    ) -> None:
        if flags & pyfuse3.RENAME_EXCHANGE:
            fail(errno.EINVAL, "pins cannot be exchanged")
        if not isinstance(new_parent, TreeDir):
            fail(errno.EXDEV, "an entry of /pins can only be renamed within /pins")
        tree = self.tree
        old = self.path_of(name)
        new, new_text = new_parent._new(new_name)
        writer = tree.staged.get(old)  # (its commit may be under way: wait for it)
        staged = await self._settle(old)
        moving = None if staged is not None else self._find(old)
        if staged is None and moving is None:
            fail(errno.ENOENT)
        if old == new:
            return
        over_staged = new in tree.staged
        over = None if over_staged else new_parent._find(new)
        if flags & pyfuse3.RENAME_NOREPLACE and (over_staged or over is not None):
            fail(errno.EEXIST, f"/pins/{_shown(new)} exists")
        is_dir = isinstance(moving, PinDir)
        if is_dir and (over_staged or isinstance(over, PinRecord)):
            fail(errno.ENOTDIR, f"/pins/{_shown(new)} is no directory")
        if not is_dir and isinstance(over, PinDir):
            fail(errno.EISDIR, f"/pins/{_shown(new)} is a directory")
        if is_dir and new.startswith(old + b"/"):
            fail(errno.EINVAL, "a directory cannot move into itself")
        if is_dir and any(p.startswith(new + b"/") for p in tree.staged):
            fail(errno.ENOTEMPTY, f"/pins/{_shown(new)}: a file is being written in it")
        if over_staged:
            self._drop(new)
        if staged is not None:
            # still being written: pinned at close under its new name (replacing a pin)
            if over is not None:
                try:
                    await self.ctx.run_sync(self.ctx.pins.unpin, new_text)
                except Missing:
                    pass
            del tree.staged[old]
            staged.name, staged.parent, staged.pin_path = new_name, new_parent, new
            tree.staged[new] = staged
            self.ctx.invalidator.submit(new_parent.ino, new_name, 0)
            return
        assert moving is not None
        try:
            moved = await self.ctx.run_sync(
                functools.partial(self.ctx.pins.move, moving.name, new_text, replace=True)
            )
        except TooLong as exc:
            fail(errno.ENAMETOOLONG, str(exc))
        except NotEmpty as exc:
            fail(errno.ENOTEMPTY, str(exc))
        if isinstance(moved, PinDir):
            self._moved_dir(moving.name, moved, new_parent)
        else:
            self._moved_pin(moved, new_parent)
            if writer is not None and writer.pin_path == old:  # (pinned, still open)
                writer.name, writer.parent, writer.pin_path = new_name, new_parent, new
        self.ctx.invalidator.submit(new_parent.ino, new_name, 0)

    def _moved_pin(self, rec: PinRecord, parent: Node) -> None:
        """The kernel keeps the renamed entry's inode under the new name: that inode
        now stands for it."""
        for kind in ("pin", "pinfile"):
            node = self.ctx.inodes.known((kind, rec.created_ns, rec.key.raw))
            if isinstance(node, (PinLink, PinFileEntry)):
                node.moved(parent, rec)

    def _moved_dir(self, old: str, moved: PinDir, parent: Node) -> None:
        """A directory was renamed: what the kernel holds of it and below it, and the
        files being written below it, now stand for their new paths."""
        new = moved.name
        old_raw, new_raw = path_bytes(old) + b"/", path_bytes(new) + b"/"
        staged = self.tree.staged
        for path in [p for p in staged if p.startswith(old_raw)]:
            writing = staged.pop(path)
            writing.pin_path = new_raw + path[len(old_raw) :]
            staged[writing.pin_path] = writing
        below = old + "/"
        for node in self.ctx.inodes.nodes():
            if isinstance(node, PinSubdir):
                rec = node.record
                if rec.created_ns == moved.created_ns:
                    node.moved(parent, moved)
                elif rec.name.startswith(below):
                    name = _rebased(rec.name, old, new)
                    node.moved(node.parent, dataclasses.replace(rec, name=name))
            elif isinstance(node, (PinLink, PinFileEntry)):
                rec2 = node.record
                if rec2.name.startswith(below):
                    name = _rebased(rec2.name, old, new)
                    node.moved(node.parent, dataclasses.replace(rec2, name=name))


class PinsDir(TreeDir):
    """/pins: the pins and directories of its top, then the files being written there."""

    __slots__ = ()

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("dir", "/pins"), parent, b"pins")
        self._place(Tree(), b"")

    async def setattr(
        self,
        attr: pyfuse3.EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> pyfuse3.EntryAttributes:
        noop_setattr(self, attr, fields)  # times are accepted and ignored (rsync -a, cp -rp)
        return self.attr()


class PinSubdir(TreeDir):
    """A directory of pins: the mode, time, owner and group it was given (its row keeps
    them)."""

    __slots__ = ("record",)

    def __init__(self, ctx: Context, parent: Node, tree: Tree, rec: PinDir) -> None:
        super().__init__(ctx, ("pindir", rec.created_ns), parent, leaf_of(rec.name))
        self.record = rec
        self._place(tree, path_bytes(rec.name))

    def moved(self, parent: Node | None, rec: PinDir) -> None:
        self.record, self.parent, self.name = rec, parent, leaf_of(rec.name)
        self._place(self.tree, path_bytes(rec.name))

    def mode(self) -> int:
        return stat.S_IFDIR | stat.S_IMODE(self.record.mode)

    def mtime_ns(self) -> int:
        return self.record.mtime_ns

    def attr(self) -> pyfuse3.EntryAttributes:
        return show_owner(self.ctx, super().attr(), self.record)

    async def getattr(self, req: RequestContext) -> pyfuse3.EntryAttributes:
        found = self.ctx.pins.entry(self.record.name)
        if not isinstance(found, PinDir) or found.created_ns != self.record.created_ns:
            fail(errno.ENOENT, f"/pins/{self.record.name} is gone")
        self.record = found
        return self.attr()

    async def setattr(
        self,
        attr: pyfuse3.EntryAttributes,
        fields: SetattrFields,
        handle: Handle | None,
        req: RequestContext,
    ) -> pyfuse3.EntryAttributes:
        a = self.attr()
        if fields.update_size:
            fail(errno.EISDIR, f"/pins/{self.record.name} is a directory")
        got = await set_owned_attrs(self.ctx, self.record, a, attr, fields, req)
        if got is not None:
            assert isinstance(got, PinDir)
            self.record = got
        return self.attr()
