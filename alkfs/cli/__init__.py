"""`alkfs`, the command line: the same commands on a running mount (`--mount`) or on a
store no daemon holds (`--store`).

Through a mount every command uses only the mount's files (objects, extended attributes,
pin symlinks, repository directories, the control and status files), so it works for any
user the mount lets in. On a store it opens the library directly and holds the store lock
for the command's duration, so it never races a daemon.

Exit status: 0 done, 1 refused or failed (one line on stderr saying why), 2 bad usage.
"""

from .parser import build_parser, main

__all__ = ["build_parser", "main"]
