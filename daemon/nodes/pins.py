"""/pins: every durable pin as a symbolic link `<name> -> ../objects/<algo>/<hex>`.

Pins come and go (setfattr on an object, the command line), so entries and
attributes expire after a second. A link's identity includes the object it
names: a name pinned again to another object is another inode.

Writing (SPEC 3.5):
- `ln -s ../objects/<algo>/<hex> NAME` pins (EINVAL: a target that is not an object
  path, an object not stored, a bad name; EEXIST: the name is taken).
- `rm NAME` unpins; `mv A B` renames, replacing a pin B (as rename does).
- A new regular file NAME is a StagedFile: on close its content is stored (sha256)
  and pinned as NAME, and the entry becomes the symlink. A file named as rsync names
  its temporary for NAME (`.NAME.XXXXXX`: a dot, a valid pin name, a dot, 1-16 letters
  or digits) is a temporary: on close its content is stored and held by an in-process
  pin while the file stays listed; renaming it to a valid NAME pins it as NAME
  (replacing a pin NAME), unlinking it releases it (nothing durable was made). The
  in-process pin is released only after the durable pin row has committed, so a sweep
  never finds the object unprotected.
- Any other name is EINVAL at create (and as a rename target), so no tool reports
  success for a file that would never be pinned (SPEC 3.5).
- One writer per name: a create of a name being written (or stored under a temporary
  name, or pinned) is EEXIST, and so is a second write open of a file being written
  (it would truncate or interleave with the first writer's bytes).
"""

from __future__ import annotations

import errno
import re
from typing import TYPE_CHECKING, Any

import pyfuse3
from pyfuse3 import RequestContext

from alkfs.errors import Invalid, Missing, WouldWait
from alkfs.keys import Algorithm, Key
from alkfs.pins import PinRecord, valid_pin_name
from alkfs.store import ObjectStat, PutResult

from ..errors import clip, fail
from ..staging.staged import StagedFile
from . import pinning
from .base import DYNAMIC_TIMEOUT, Dir, Emit, File, Node, Symlink
from .handles import DirHandle, Handle, wants_write
from .listing import readdir_snapshot
from .listing import text_of as _text
from .objfile import ObjectFile
from .policy import noop_setattr

if TYPE_CHECKING:
    from ..context import Context

LINK_TARGET = re.compile(rb"\.\./objects/([a-z0-9-]+)/([0-9a-f]+)\Z")
# rsync's temporary for NAME is `.NAME.XXXXXX`; any short suffix of letters and digits
TEMPORARY = re.compile(r"\.([A-Za-z0-9][A-Za-z0-9._-]{0,127})\.[A-Za-z0-9]{1,16}\Z")


def target(rec: PinRecord) -> bytes:
    return f"../objects/{rec.key.algo.label}/{rec.key.hex}".encode()


def is_temporary(text: str | None) -> bool:
    """`.NAME.XXXXXX` for a valid pin NAME (what rsync writes before renaming to NAME)."""
    if text is None:
        return False
    m = TEMPORARY.match(text)
    return m is not None and valid_pin_name(m.group(1))


def _writable_name(name: bytes) -> bool:
    """A name a new file in /pins may have: a pin name or a temporary of one."""
    text = _text(name)
    return text is not None and (valid_pin_name(text) or is_temporary(text))


def _shown(name: bytes) -> str:
    return clip(repr(name), 160)


class PinsDir(Dir):
    """/pins: the pins in name order, then the files being written here."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ("staged", "unpinned", "unpinned_epoch")

    def __init__(self, ctx: Context, parent: Node) -> None:
        super().__init__(ctx, ("dir", "/pins"), parent, b"pins")
        self.staged: dict[bytes, StagedFile] = {}
        self.unpinned = b""  # the last name found unpinned (`_pin`), at this pins epoch
        self.unpinned_epoch = -1

    def passes_intents(self, name: bytes | None) -> bool:
        # (cp's lookups and creates of new names; a pending name waits for its commit)
        return name is not None and not self.ctx.pending.pending_name(name)

    async def lookup(self, name: bytes, req: RequestContext) -> Node:
        staged = self.staged.get(name)
        if staged is not None:
            return staged
        rec = self._pin(name)
        if rec is None:
            fail(errno.ENOENT)
        return PinLink(self.ctx, self, rec)

    def _pin(self, name: bytes) -> PinRecord | None:
        """The pin `name` names (None: none, or not a pin name). The last name found
        unpinned is remembered until any pin changes: cp's stat, the kernel's O_EXCL
        lookup, the create and the close each ask for the same new name."""
        misses = self.ctx.pins.misses
        epoch = misses.before_query()
        if name == self.unpinned and epoch == self.unpinned_epoch:
            return None
        text = _text(name)
        if text is None or not valid_pin_name(text):
            return None
        rec = self.ctx.pins.get(text)
        if rec is None and misses.steady(epoch):
            self.unpinned, self.unpinned_epoch = name, epoch
        return rec

    async def readdir(self, dh: DirHandle, start: int, emit: Emit) -> None:
        def entries() -> list[tuple[bytes, Node]]:
            records = self.ctx.pins.list()
            out: list[tuple[bytes, Node]] = [
                (r.name.encode(), PinLink(self.ctx, self, r)) for r in records
            ]
            taken = {name for name, _ in out}
            out += sorted((n, f) for n, f in self.staged.items() if n not in taken)
            return out

        await readdir_snapshot(dh, start, emit, entries)

    async def setattr(
        self, attr: Any, fields: Any, handle: Handle | None, req: RequestContext
    ) -> Any:
        noop_setattr(self, attr, fields)  # times are accepted and ignored (rsync -a, cp -rp)
        return self.attr()

    # -- new pins --------------------------------------------------------------------------
    def _taken(self, name: bytes) -> bool:
        if name in self.staged or self.ctx.pending.pending_name(name):
            return True
        return self._pin(name) is not None

    async def create(
        self, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[Node, Handle]:
        if not _writable_name(name):
            fail(
                errno.EINVAL,
                f"{_shown(name)} is not a pin name ([A-Za-z0-9][A-Za-z0-9._-]{{0,127}}) "
                "nor a temporary .NAME.XXXXXX of one: it would never be pinned",
            )
        if self._taken(name):
            fail(errno.EEXIST, f"/pins/{clip(name.decode(errors='replace'))} exists")
        node = PinFile(self.ctx, self, name, Algorithm.SHA256, mode=mode)
        self.staged[name] = node
        return node, node.new_handle(flags)

    async def symlink(self, name: bytes, link: bytes, req: RequestContext) -> Node:
        pins = self.ctx.pins
        text = _text(name)
        if text is None or not valid_pin_name(text):
            fail(errno.EINVAL, f"invalid pin name {_shown(name)}")
        if self._taken(name):
            fail(errno.EEXIST, f"/pins/{text} exists")
        key = self._target_key(link)
        try:
            rec = await self.ctx.run_sync(pinning.pin, pins, text, key)
        except Missing:
            fail(errno.EINVAL, f"{key} is not in the store")
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

    # -- files written here ---------------------------------------------------------------
    @staticmethod
    def _pin_name(node: StagedFile) -> str | None:
        """The pin a file written here makes at close: None for a temporary (held
        in-process until renamed) or a file unlinked while open."""
        text = _text(node.name)
        if node.unlinked or text is None or not valid_pin_name(text):
            return None
        return text

    def store_small(self, node: StagedFile, data: bytes, wait: bool) -> PutResult | None:
        """A pin name: the object and its pin in one transaction (a refused name stores
        nothing); otherwise the plain put."""
        text = self._pin_name(node)
        if text is None:
            return None
        # A first commit of a name no pin took meanwhile (an object's pin xattr): its
        # intent logged, it is acknowledged (staging/pending.py).
        if not wait and node.key is None and self._pin(node.name) is None:
            ahead = self.ctx.pending.put(text, node.writer.algo, data, None)
            if ahead is not None:
                return ahead
        return pinning.put_pinned(self.ctx.pins, text, data, node.key, wait)

    def publish_in_thread(self, node: StagedFile, result: PutResult, wait: bool) -> None:
        """After the put (content that was spooled): a pin name is pinned, then the
        in-process pin goes (after the pin row committed); EEXIST if the name is
        another object's now. (Only a worker thread pins here: store_small pins a
        small file's name.)"""
        text = self._pin_name(node)
        if text is None:
            return
        if not wait:
            raise WouldWait("a pin is written from a worker thread")
        pinning.pin(self.ctx.pins, text, result.key, node.key)
        result.pin.release()

    def stored_file(self, st: ObjectStat) -> File:
        return ObjectFile(self.ctx, self, st)

    async def publish(self, node: StagedFile, result: PutResult) -> None:
        if node.unlinked:
            result.pin.release()
            return
        if not result.pin.held:  # pinned under its name: the entry is the symlink now
            self._forget(node)
            return
        # a temporary: stored, held in-process until renamed or unlinked
        held, node.extra = node.extra, result.pin
        if held is not None:
            held.release()

    async def closed(self, node: StagedFile) -> None:
        if node.extra is None:  # nothing stored to keep under a temporary name
            self._forget(node)

    def _forget(self, node: StagedFile) -> None:
        # (no kernel invalidation needed: a StagedFile's entry timeout is 0, so the next
        # use of the name asks again and finds the link, or nothing)
        if self.staged.get(node.name) is node:
            del self.staged[node.name]

    def _drop(self, name: bytes) -> bool:
        """Remove a file being written (or a stored temporary): nothing durable stays."""
        node = self.staged.pop(name, None)
        if node is None:
            return False
        node.unlinked = True
        held, node.extra = node.extra, None
        if held is not None:
            held.release()
        return True

    # -- removing and renaming ----------------------------------------------------------------
    async def unlink(self, name: bytes, req: RequestContext) -> None:
        if self._drop(name):
            return
        pins = self.ctx.pins
        text = _text(name)
        if text is None or not valid_pin_name(text):
            fail(errno.ENOENT)
        await self.ctx.run_sync(pinning.unpin, pins, text)

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, req: RequestContext
    ) -> None:
        if flags & pyfuse3.RENAME_EXCHANGE:
            fail(errno.EINVAL, "pins cannot be exchanged")
        if new_parent is not self:
            fail(errno.EXDEV, "a pin can only be renamed within /pins")
        pins = self.ctx.pins
        staged = self.staged.get(name)
        text = _text(name)
        is_pin = (
            staged is None
            and text is not None
            and valid_pin_name(text)
            and pins.get(text) is not None
        )
        if staged is None and not is_pin:
            fail(errno.ENOENT)
        if name == new_name:
            return
        new_text = _text(new_name)
        new_valid = new_text is not None and valid_pin_name(new_text)
        if not new_valid and (is_pin or not is_temporary(new_text)):
            # a pin renames to a pin name; a file being written also to a temporary name
            fail(errno.EINVAL, f"invalid pin name {_shown(new_name)}")
        if flags & pyfuse3.RENAME_NOREPLACE and self._taken(new_name):
            fail(errno.EEXIST, f"/pins/{new_name.decode(errors='replace')} exists")
        if is_pin:
            assert text is not None
            self._drop(new_name)
            rec = await self.ctx.run_sync(pinning.rename_over, pins, text, new_text)
            self._renamed_link(text, rec)
            pinning.changed(self.ctx, text, rec.name)
            return
        assert staged is not None
        if staged.extra is not None and new_valid:
            # a stored temporary becomes the pin NAME, replacing one; then its
            # in-process pin goes (after the pin row committed)
            assert staged.key is not None and new_text is not None
            self._drop_other(new_name, staged)
            await self.ctx.run_sync(pinning.pin_over, pins, new_text, staged.key)
            held, staged.extra = staged.extra, None
            held.release()
            if self.staged.get(name) is staged:
                del self.staged[name]
            staged.name = new_name
            pinning.changed(self.ctx, new_text)
            return
        # still being written (pinned at close under its new name), or a temporary
        # renamed to another temporary name
        self._drop_other(new_name, staged)
        if new_valid:
            assert new_text is not None
            try:
                await self.ctx.run_sync(pinning.unpin, pins, new_text)
            except Missing:
                pass
        if self.staged.get(name) is staged:
            del self.staged[name]
        staged.name = new_name
        self.staged[new_name] = staged
        self.ctx.invalidator.submit(self.ino, new_name, 0)

    def _drop_other(self, name: bytes, keep: StagedFile) -> None:
        other = self.staged.get(name)
        if other is not None and other is not keep:
            self._drop(name)

    def _renamed_link(self, old: str, rec: PinRecord) -> None:
        """The kernel keeps the renamed link's inode under the new name until it asks
        again: that inode now stands for the new name."""
        node = self.ctx.inodes.known(("pin", old.encode(), rec.key.raw))
        if isinstance(node, PinLink):
            node.record = rec
            node.name = rec.name.encode()


class PinFile(StagedFile):
    """A new file in /pins: one writer only (a second write open would truncate or
    interleave with the first writer's bytes, and the last close would win)."""

    __slots__ = ()

    async def open(self, flags: int, req: RequestContext) -> Handle:
        if wants_write(flags) and self.opens > 0 and not self.writer.closed:
            fail(errno.EEXIST, f"{self.path} is being written by another open file")
        return await super().open(flags, req)


class PinLink(Symlink):
    """One pin; its time is the pin's creation time."""

    entry_timeout = DYNAMIC_TIMEOUT
    attr_timeout = DYNAMIC_TIMEOUT
    __slots__ = ("record",)

    def __init__(self, ctx: Context, parent: Node, rec: PinRecord) -> None:
        name = rec.name.encode()
        super().__init__(ctx, ("pin", name, rec.key.raw), parent, name, target(rec))
        self.record = rec

    def mtime_ns(self) -> int:
        return self.record.created_ns

    async def readlink(self, req: RequestContext) -> bytes:
        rec = self.ctx.pins.get(self.record.name)
        if rec is None or rec.key != self.record.key:
            fail(errno.ENOENT, f"the pin {self.record.name} is gone")
        return self.target

    async def setattr(
        self, attr: Any, fields: Any, handle: Handle | None, req: RequestContext
    ) -> Any:
        # `touch -h`: freshens the object; a chmod/chown to what it is is a no-op
        if noop_setattr(self, attr, fields):
            await self.ctx.run_sync(self.ctx.store.freshen, self.record.key)
        return self.attr()
