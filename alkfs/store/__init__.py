"""The store facade: routing by length, verified reads, the put paths, stat, list, GC entry points.

Thread-safe and synchronous: the daemon calls it from worker threads.

`Store` (core.py: construction, opening, closing) is made of parts, each a mixin over the
state its constructor sets up (state.py): the puts (puts.py), the batched puts and the
git import's fast path (batches.py), metadata and listing (listing.py), verified reads
and verify (reads.py), deletions and the sweep (deletes.py).
"""

from .core import DB_NAME, DEFAULT_THRESHOLD, DEFAULT_WINDOW_S, LOCK_NAME, Store
from .deletes import INERT_GRACE_NS
from .listing import GIT_TAGS, ObjectStat
from .puts import BEHIND_PUT_MAX, PutResult, Source
from .state import CHUNK, LARGE_DIR, MODES, PackedTier

__all__ = [
    "CHUNK",
    "DB_NAME",
    "DEFAULT_THRESHOLD",
    "DEFAULT_WINDOW_S",
    "GIT_TAGS",
    "INERT_GRACE_NS",
    "LARGE_DIR",
    "LOCK_NAME",
    "MODES",
    "BEHIND_PUT_MAX",
    "ObjectStat",
    "PackedTier",
    "PutResult",
    "Source",
    "Store",
]
