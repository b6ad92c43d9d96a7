"""Derived packs: the store's git objects of one format as real git packs, built by git.

Layout (private to the store, never reached through the mount's own files)::

    STORE/derived/<fmt>/CURRENT          "<N>\\n": the published generation (0: none)
    STORE/derived/<fmt>/gen-<N>/         one published set, immutable once renamed here
        pack/pack-<h>.pack .idx .keep    pack v2 + idx v2 (sha256 forms for git-sha256)
        pack/multi-pack-index            MIDX v1 over the set's packs
        info/commit-graphs/              a split commit-graph (chain + graph-<h>.graph)
        alkfs.json                       what the set covers (not served): its highest
                                         row id, and the kv objects of the format it
                                         left out (`left_out`, hex, up to LEFT_OUT_MAX;
                                         sqlite only: see Derived._records_left_out),
                                         and those it left out of every pack because
                                         they were staged or being deleted (`withheld`)
    STORE/derived/<fmt>/tmp-*            a build in progress (removed at open)

A build reads verified objects straight from the store's kv table (large-tier objects
stay out: git reads them loose), orders them as `git rev-list --objects` would (commits
newest first, each followed by its trees and blobs with their paths, which is what gives
`git pack-objects` good deltas), and has git write the pack: objects new since the
previous generation go in as loose files of a private bare repository whose alternate
is the previous generation (so its deltas are reused and the new objects are deltified
against everything); a first build (or one where most objects are new) writes them as one
undeltified pack that `git index-pack` checks, and `pack-objects --no-reuse-object`
deltifies. Then `.keep`, `git multi-pack-index write` and `git commit-graph write --split`;
every file's trailer checksum is verified before the set is renamed into place and CURRENT
is replaced atomically (write, fsync, rename, fsync the directory).

Intake (`build()` with nothing to exclude): objects stored since the previous set was
built (by row id), and those it withheld that are still stored and no longer staged (a
candidate whose deletion arbitration cancelled: live again), go into one small pack
beside the previous set's packs, which the new generation shares as hard links, with a
new multi-pack-index and one more commit-graph layer. That layer names only new commits
whose every ancestor a layer names already or a main pack of the set holds (checked
down to the layers: git reads an ancestor no layer names from the packs, and fails the
layer if one is in none of them), so none names a staged commit. A failed `commit-graph
write` leaves the layers as they were (logged: the set is whole without the new one).
The set is consolidated into one pack instead (the full or incremental build above) when
the intake packs would hold more than half as many objects as its largest pack
(geometric, factor 2), when it has MAX_PACKS packs, when a pack other than its staged
pack holds an object now staged for deletion, when the set recorded no `withheld` (too
many), or when objects must be excluded (a sweep's guard).

Objects staged for deletion: a full or incremental build leaves them out of its main
pack and writes them into a pack of their own (the set's staged pack, named in
alkfs.json), so that for their window they stay packed, and off the fan-out listings,
while one that is made live again needs nothing. No commit-graph layer names them.

Publishing never changes a file: a new set gets a new generation directory. A retired
generation stays on disk until `prune` is told nobody holds it (the daemon counts its open
handles; a process without a mount prunes at once).

Deletion safety: `guard_deletes` is held by the sweep once, around all of its deletions
(every candidate due when it starts, taken and deleted batch by batch under it, each
re-arbitrated at its delete). If any of those keys is in the published set, one set
without them all is published first, once a sweep however many batches it takes:
when the staged pack is the only pack that holds any of them (and no commit-graph layer
names one), the set without that pack (hard links and a new multi-pack-index: the sweep
waits for no pack rewrite; what else it held is served loose); otherwise a set built
without them (and with everything else staged in a staged pack). Builds take the same
lock, so no set published after the deletes can list a deleted object. What it left out
is withheld: one whose deletion arbitration cancels is packed again by the next intake.
If that build fails (a full disk), the packs are withdrawn (an empty generation is
published) and every object is served loose.

The package's modules, each importing (at run time) only those above it:

    sets      the layout (DERIVED_DIR, CURRENT, FORMATS, the tunables) and a published
              set's files read: PackIndex, Generation, GraphLookup, verify_trailer
    order     the object list: ordered_objects, ordered_incremental (rev-list order)
    kvread    KvRead, Derived's reads of the store's objects of its format (verified)
    gitrun    GitRun, Derived's methods that run git and write its input (raw packs,
              loose objects)
    intake    Derived's intake build (a pack beside the previous set's packs) and the
              set without its staged pack
    builder   Derived: one format of one store, its builds, publishing, verify, withdraw
    guard     derived_for (one Derived per store and format), build, shed, verify_sets,
              guard_deletes
"""

from .builder import BuildResult, Derived
from .guard import build, derived_for, guard_deletes, shed, verify_sets
from .order import ordered_incremental, ordered_objects
from .sets import (
    CURRENT,
    DERIVED_DIR,
    FORMATS,
    GRAPH_WALK_MAX,
    KEEP_TEXT,
    LEFT_OUT_MAX,
    LOOSE_NEW_MAX,
    MAX_PACKS,
    STOP_POLL_S,
    TYPE_CODES,
    Generation,
    GraphLookup,
    PackIndex,
    format_of,
    verify_trailer,
)

__all__ = [
    "CURRENT",
    "DERIVED_DIR",
    "FORMATS",
    "GRAPH_WALK_MAX",
    "KEEP_TEXT",
    "LEFT_OUT_MAX",
    "LOOSE_NEW_MAX",
    "MAX_PACKS",
    "STOP_POLL_S",
    "TYPE_CODES",
    "BuildResult",
    "Derived",
    "Generation",
    "GraphLookup",
    "PackIndex",
    "build",
    "derived_for",
    "format_of",
    "guard_deletes",
    "ordered_incremental",
    "ordered_objects",
    "shed",
    "verify_sets",
    "verify_trailer",
]
