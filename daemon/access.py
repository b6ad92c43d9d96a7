"""Who may do what on a shared mount (`--allow-other` or `--owner`,
where the kernel is not given `default_permissions` and every user's request comes in):
root and the daemon's own user may do anything a node allows; the `--owner` user too,
but for the control file (`root_only`); any other user only reads (by the mode bits the
nodes show) and sets the times of objects (`times_by_anyone`: a freshen), and is refused
every other change with EACCES (without --allow-other, with --owner only, such a user is
refused everything). No one creates a name a directory lists in `never_written` (EPERM).
Users but root have per-uid bounds: open write handles (EMFILE past
`max_write_handles`), bytes written through them (ENOSPC past `max_spool_bytes`) and
open read handles (EMFILE past `max_read_handles`); and the users other than root and the
`--owner` user together hold at most half the daemon's descriptor limit (EMFILE past
it), the rest being root's, the owner's and the daemon's own.
The dispatch (fs.py) asks here before it calls a node.
"""

from __future__ import annotations

import errno
import os
import resource
from typing import TYPE_CHECKING

from pyfuse3 import RequestContext

from .errors import fail
from .nodes.base import Node

if TYPE_CHECKING:
    from .services import Services

ROOT, OWNER, OTHER = 0, 1, 2  # who a request comes from (Access.who)


class Access:
    """The shared mount's decisions and the per-uid counts of open write handles."""

    def __init__(self, ctx: Services) -> None:
        self.ctx = ctx
        self.shared = ctx.options.shared
        self.bound: dict[int, list[int]] = {}  # fh -> [uid, bytes counted] (bounded users)
        self.open_writes: dict[int, int] = {}  # uid -> open write handles
        self.spooled: dict[int, int] = {}  # uid -> bytes counted for its open handles
        self.reading: dict[int, int] = {}  # fh -> uid (bounded users' read handles)
        self.open_reads: dict[int, int] = {}  # uid -> open read handles
        self.others: set[int] = set()  # fhs of users other than root and the owner

    # -- who may do what (a shared mount only; see the module docstring) ------------------
    def who(self, req: RequestContext) -> int:
        """ROOT, OWNER or OTHER; EACCES for a user a mount without --allow-other keeps out."""
        uid = getattr(req, "uid", None)
        if uid is None or uid == 0 or uid == self.ctx.daemon_uid:
            return ROOT
        if uid == self.ctx.options.owner_uid:
            return OWNER
        if not self.ctx.options.allow_other:
            fail(errno.EACCES, f"uid {uid}: the mount is not shared (no --allow-other)")
        return OTHER

    def seen(self, req: RequestContext) -> int:
        return self.who(req) if self.shared else ROOT

    def may_change(self, req: RequestContext, *nodes: Node) -> None:
        """EACCES unless the requester may change what is under (or is) `nodes`."""
        if not self.shared:
            return
        who = self.who(req)
        if who == ROOT:
            return
        uid = getattr(req, "uid", "?")
        if who == OTHER:
            fail(errno.EACCES, f"uid {uid} may only read (and freshen objects) here")
        for node in nodes:
            if node.root_only:
                fail(errno.EACCES, f"uid {uid}: {node.path} is root's alone")

    def may_access(self, req: RequestContext, node: Node, want: int) -> bool:
        """The mode bits the node shows, for a user but root (want: R_OK|W_OK|X_OK bits)."""
        a = node.attr()
        mode = a.st_mode
        uid, gid = getattr(req, "uid", None), getattr(req, "gid", None)
        if uid == a.st_uid:
            bits = (mode >> 6) & 7
        elif gid == a.st_gid:
            bits = (mode >> 3) & 7
        else:
            bits = mode & 7
        return want & bits == want

    def may_read(self, req: RequestContext, node: Node, want: int = os.R_OK) -> None:
        if self.shared and self.who(req) != ROOT and not self.may_access(req, node, want):
            fail(errno.EACCES, f"uid {getattr(req, 'uid', '?')}: mode bits of {node.path}")

    @staticmethod
    def refuse_never_written(parent: Node, name: bytes) -> None:
        if name in parent.never_written:
            fail(errno.EPERM, f"{parent.path}/{name.decode(errors='replace')} is never written")

    # -- per-user bounds ---------------------------------------------------------------------
    def bounded_uid(self, req: RequestContext) -> int | None:
        """The uid a new write handle counts against (None: root, or a private mount);
        EMFILE when that uid holds max_write_handles already."""
        return self._bounded(req, self.open_writes, self.ctx.options.max_write_handles, "write")

    def bounded_reader(self, req: RequestContext) -> int | None:
        """The uid a new read handle counts against (None: root, or a private mount);
        EMFILE when that uid holds max_read_handles already."""
        return self._bounded(req, self.open_reads, self.ctx.options.max_read_handles, "read")

    def _bounded(
        self, req: RequestContext, held: dict[int, int], cap: int, kind: str
    ) -> int | None:
        if not self.shared:
            return None
        who = self.who(req)
        if who == ROOT:
            return None
        uid = int(req.uid)
        if held.get(uid, 0) >= cap:
            fail(errno.EMFILE, f"uid {uid} holds {cap} open {kind} handles (the per-user bound)")
        if who == OTHER and len(self.others) >= (room := self.others_cap()):
            fail(
                errno.EMFILE,
                f"uid {uid}: the users other than root and the owner hold {room} "
                "open files (half the daemon's descriptor limit)",
            )
        return uid

    @staticmethod
    def others_cap() -> int:
        """Half the daemon's descriptor limit (as it is now: `prlimit` may change it)."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return max(32, (soft if soft != resource.RLIM_INFINITY else 1 << 20) // 2)

    def _count_other(self, fh: int, uid: int) -> None:
        if uid != self.ctx.options.owner_uid:
            self.others.add(fh)

    def count_open(self, fh: int, uid: int | None) -> None:
        if uid is not None:
            self.bound[fh] = [uid, 0]
            self.open_writes[uid] = self.open_writes.get(uid, 0) + 1
            self._count_other(fh, uid)

    def count_read(self, fh: int, uid: int | None) -> None:
        if uid is not None:
            self.reading[fh] = uid
            self.open_reads[uid] = self.open_reads.get(uid, 0) + 1
            self._count_other(fh, uid)

    def uncount_read(self, fh: int) -> None:
        uid = self.reading.pop(fh, None)
        if uid is not None:
            self.others.discard(fh)
            self.open_reads[uid] -= 1
            if not self.open_reads[uid]:
                del self.open_reads[uid]

    def count_bytes(self, fh: int, off: int, n: int) -> None:
        b = self.bound.get(fh)
        if b is None:
            return
        grow = off + n - b[1]
        if grow <= 0:
            return
        uid = b[0]
        held = self.spooled.get(uid, 0)
        cap = self.ctx.options.max_spool_bytes
        if held + grow > cap:
            fail(errno.ENOSPC, f"uid {uid}: {held} bytes in open files, bound {cap}")
        self.spooled[uid] = held + grow
        b[1] = off + n

    def uncount(self, fh: int) -> None:
        b = self.bound.pop(fh, None)
        if b is not None:
            uid = b[0]
            self.others.discard(fh)
            self.open_writes[uid] -= 1
            self.spooled[uid] = self.spooled.get(uid, 0) - b[1]
            if not self.open_writes[uid]:
                self.open_writes.pop(uid, None)
                self.spooled.pop(uid, None)
