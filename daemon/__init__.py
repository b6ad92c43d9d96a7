"""alkfsd: the FUSE daemon.

Its modules form layers, each importing only from its own layer or below (and from the
library, `alkfs`, which never imports the daemon): the framework (the one errno map,
inodes, the node contract, the listings the kernel caches, workers, access, the dispatch),
the write state (staging/, the derived packs served, and at its top context), the views
(one module or a few per subtree of the mount) and main (the command line and the mount's
assembly). Every module's rank, and the rule in full, are declared once in layers.toml at
the repository root; tests/test_layers.py checks the imports against it.
"""
