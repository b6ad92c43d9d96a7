"""alkfsd: the FUSE daemon."""
