"""alkfs: a content-addressed store with git refs as GC roots (the library; no FUSE)."""

__version__ = "0.1.0"
