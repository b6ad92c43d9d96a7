"""alkfsd: the FUSE daemon.

Its modules form three layers, each importing only from its own layer or below (and from
the library, `alkfs`, which never imports the daemon). tests/test_layers.py ranks every
module and fails on an upward import, and on an import of a daemon module inside a
function (the way a cycle is hidden); a name needed only for types is imported under
`if TYPE_CHECKING:`.

    framework    errors (the one errno map), inodes, invalidate, deathguard (the
                 connection aborted when the daemon dies), nodes.handles and
                 nodes.base (the node contract), nodes.listing, nodes.policy,
                 nodes.root (the top-level registry: its entries are named, resolved
                 when the root is listed), listings (the listings the kernel caches),
                 workers (the mount's background tasks), access (who may do what),
                 requests (the bounds every request keeps), fs (the dispatch)
    write state  staging.spool, staging.pending (small files acknowledged ahead of their
                 commit), staging.writes, staging.writer, staging.staged,
                 staging.scratch, staging.overlay, staging.ingest, packs (the derived
                 packs served), and at its top context (it owns the write state; the
                 framework names it for types only)
    views        one module (or a few) per subtree: status, nodes.pinning,
                 nodes.largefile, nodes.objfile, nodes.objects (/objects), nodes.loose
                 and nodes.gitview (/git), nodes.refwrites, nodes.refdir,
                 nodes.repoobjects and nodes.repos (/repos), nodes.pins (/pins),
                 nodes.control (/.alkfs)
    main         config (the command line) and main (the mount's assembly)
"""
