"""The daemon needs pyfuse3 3.5.0 built with the four patches in third_party/ (the
Makefile's `make setup` / `make install` build it; docs/pyfuse3.md). A stock pyfuse3 is
refused at start with one line: the daemon has no code paths without them.

Each patch is known by what it adds to the module, which `missing` looks for on the
module it is given (the daemon's own `pyfuse3`, or a test's stand-in)."""

from __future__ import annotations

from collections.abc import Callable


def _file_info_has(*names: str) -> Callable[[object], bool]:
    def check(mod: object) -> bool:
        try:
            fi = getattr(mod, "FileInfo")()  # noqa: B009  (a module of unknown shape)
        except Exception:
            return False
        return all(hasattr(fi, n) for n in names)

    return check


def _module_has(*names: str) -> Callable[[object], bool]:
    return lambda mod: all(hasattr(mod, n) for n in names)


# patch file -> the check that the module was built with it
PATCHES: dict[str, Callable[[object], bool]] = {
    "pyfuse3-noflush.patch": _file_info_has("noflush", "cache_readdir"),
    "pyfuse3-fastread.patch": _module_has("NEXT_WAIT_NS"),
    "pyfuse3-cacheddirs.patch": _module_has("CACHED_DIR_FH", "cached_dirs_add"),
    "pyfuse3-nogilcopy.patch": _module_has("NOGIL_COPY_MIN"),
}


def missing(mod: object) -> list[str]:
    """The patches of third_party/ that `mod` (a pyfuse3 module) was built without."""
    return [name for name, has in PATCHES.items() if not has(mod)]


def refusal(mod: object) -> str | None:
    """The one-line reason not to start with `mod`, or None when it has every patch."""
    lacking = missing(mod)
    if not lacking:
        return None
    where = getattr(mod, "__file__", None) or getattr(mod, "__name__", "pyfuse3")
    return (
        f"pyfuse3 ({where}) is built without {', '.join(lacking)} from third_party/: "
        "alkfsd needs the patched build (run `make setup`, or `make install`)"
    )
