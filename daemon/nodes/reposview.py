"""What /repos keeps in memory for the mount's life: one `ReposView`, owned by the /repos
directory (a permanent node) and handed down to the repository nodes made at each lookup.

- `packed_refs`: each repository's last rendered packed-refs, (repo key) -> (refs version,
  content, made_ns); a new generation is rendered when the refs' version moved.
- `ingested_packs`: the stems of packs git moved into `objects/pack` whose objects are
  stored, by repository: their files still resolve by name but are no longer listed.

Keys are `(repo id, created_ns)`, so a repository made again under the same id starts
empty; `forget` drops a deleted one's."""

from __future__ import annotations

from ..staging.writes import RepoKey


class ReposView:
    __slots__ = ("ingested_packs", "packed_refs")

    def __init__(self) -> None:
        self.packed_refs: dict[RepoKey, tuple[int, bytes, int]] = {}
        self.ingested_packs: dict[RepoKey, set[bytes]] = {}

    def forget(self, key: RepoKey) -> None:
        """A repository was deleted: what was kept for it goes."""
        self.packed_refs.pop(key, None)
        self.ingested_packs.pop(key, None)
