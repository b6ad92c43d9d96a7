"""Scratch names inside store-backed directories (/git/<format>[/xx],
/repos/<id>/objects[/xx], /repos/<id>/objects/pack): git's temporary files and a push's
quarantine sit beside the directory's own entries.

A host directory owns a `ScratchOverlay` (composition: `self.overlay = ScratchOverlay(self,
destination)`), answers `scratch()` with it, and calls it first from its own lookup,
listing, create, link, unlink, rmdir and rename; each answers None / False when the name
is not a scratch name, so the host answers for its store-backed names as before. The
names live in the mount's write state (`ctx.writes.overlays`, by the host's identity), so
every instance of the host directory sees the same ones.
"""

from __future__ import annotations

import errno
import os

from pyfuse3 import RequestContext

from ..errors import fail
from ..nodes.base import Node
from ..nodes.handles import Handle
from .scratch import PLAIN, Destination, ScratchDir, ScratchFile, move, new_file
from .writes import RepoKey, pid_of


class ScratchOverlay:
    """The scratch names of one host directory (see the module docstring)."""

    __slots__ = ("host", "destination")

    def __init__(self, host: Node, destination: Destination = PLAIN) -> None:
        self.host = host
        self.destination = destination  # what a scratch entry moved in becomes

    def names(self) -> dict[bytes, Node]:
        return self.host.ctx.writes.overlay(self.host)

    def lookup(self, name: bytes) -> Node | None:
        return self.host.ctx.writes.peek(self.host, name)

    def entries(self) -> list[tuple[bytes, Node]]:
        names = self.host.ctx.writes.overlays.get(self.host.ident)
        return sorted(names.items()) if names else []

    async def create(
        self, name: bytes, mode: int, flags: int, req: RequestContext
    ) -> tuple[Node, Handle]:
        """A new scratch file (git's tmp_obj_*, a lock file)."""
        w = self.host.ctx.writes
        names = w.overlay(self.host)
        if name in names:
            fail(errno.EEXIST)
        node = new_file(w, self.host, name, mode)
        names[name] = node
        return node, await node.open(flags & ~os.O_TRUNC, req)

    def mkdir(
        self, name: bytes, mode: int, repo: RepoKey | None, req: RequestContext
    ) -> ScratchDir:
        """A scratch directory (a push's quarantine) in a repository's objects/."""
        host = self.host
        w = host.ctx.writes
        names = w.overlay(host)
        if name in names:
            fail(errno.EEXIST)
        w.expire()  # a killed push's quarantine goes before a new one comes
        node = ScratchDir(
            host.ctx, host, name, w.area.next_serial(), repo, pid_of(req), host, mode & 0o777
        )
        names[name] = node
        w.quarantines[node.serial] = node
        return node

    def unlink(self, name: bytes) -> bool:
        """Unlink the scratch file `name` (False: not a scratch name)."""
        w = self.host.ctx.writes
        node = w.peek(self.host, name)
        if node is None:
            return False
        if node.is_dir:
            fail(errno.EISDIR)
        del w.overlays[self.host.ident][name]
        assert isinstance(node, ScratchFile)
        node.drop_name()
        return True

    def rmdir(self, name: bytes) -> bool:
        """Remove the empty scratch directory `name` (False: not a scratch name)."""
        w = self.host.ctx.writes
        node = w.peek(self.host, name)
        if node is None:
            return False
        if not isinstance(node, ScratchDir):
            fail(errno.ENOTDIR)
        if node.entries:
            fail(errno.ENOTEMPTY)
        del w.overlays[self.host.ident][name]
        w.quarantines.pop(node.serial, None)
        return True

    async def rename(
        self, name: bytes, new_parent: Node, new_name: bytes, flags: int, req: RequestContext
    ) -> bool:
        """Move the scratch entry `name` (False: not a scratch name)."""
        w = self.host.ctx.writes
        node = w.peek(self.host, name)
        if node is None:
            return False
        await move(w.overlays[self.host.ident], name, node, new_parent, new_name, flags, req)
        return True

    async def link(self, name: bytes, node: Node) -> Node:
        """link(2) of a scratch file to another scratch name here."""
        if not isinstance(node, ScratchFile):
            fail(errno.EPERM, "only scratch files can be linked here")
        names = self.names()
        if name in names:
            fail(errno.EEXIST)
        node.names += 1
        names[name] = node
        return node
