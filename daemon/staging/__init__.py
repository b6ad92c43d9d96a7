"""The write-state layer: what is not yet a stored object (staged writers and their
spool, git's scratch files, a push's pin sessions, ingest). Below the views, above the
framework (see alkfsd/__init__.py)."""
