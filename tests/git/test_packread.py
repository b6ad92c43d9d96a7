"""Git objects read from packs (alkfs/git/packread.py), compared byte for byte with what
`git cat-file --batch` gives for packs git wrote: OFS_DELTA and REF_DELTA chains, both
object formats, 64-bit offsets, a REF_DELTA base in another pack; damaged packs reported
(at open, or at the read of exactly the objects a damaged entry affects)."""

from __future__ import annotations

import hashlib
import random
import re
import shutil
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import git, git_out

from alkfs.errors import Corrupt, Invalid
from alkfs.git import packread
from alkfs.git.packread import BaseCache, PackFile, PackSet, apply_delta

HLEN = {"sha1": 20, "sha256": 32}
COMMITS = 150
SIDE_FROM, SIDE_COMMITS, MERGE_AT, TAG_AT = 90, 6, 100, 120
OLD = 40  # the thin pack: main~OLD..main


# -- a history of realistic shape, written by git fast-import ----------------------------------
def _lines(rng: random.Random, n: int, what: str) -> list[bytes]:
    words = ["store", "pack", "delta", "object", "tree", "mount", "verify", "read", "index"]
    return [
        f"{what} {i}: {' '.join(rng.choice(words) for _ in range(rng.randint(3, 12)))}\n".encode()
        for i in range(n)
    ]


def history_stream(commits: int = COMMITS) -> bytes:
    """A fast-import stream: a few text files edited a few lines at a time, binary-ish
    blobs edited in place (40 KB often, 1.5 MB and 5 MB a few times), new files now and
    then, a side branch merged back, an annotated tag."""
    rng = random.Random(20240601)
    text = {
        "README.md": _lines(rng, 80, "readme"),
        "src/alkfs/core.py": _lines(rng, 300, "    core"),
        "src/alkfs/util.py": _lines(rng, 120, "    util"),
        "docs/guide/intro.txt": _lines(rng, 60, "intro"),
    }
    binary = {
        "assets/logo.bin": bytearray(rng.randbytes(40_000)),
        "assets/big.bin": bytearray(rng.randbytes(1_500_000)),
        "assets/huge.bin": bytearray(rng.randbytes(5 << 20)),
    }
    out = bytearray()

    def data(b: bytes) -> None:
        out.extend(b"data %d\n%s\n" % (len(b), b))

    def commit(ref: str, mark: int, parent: int | None, merge: int | None, files: dict) -> None:
        out.extend(b"commit %s\nmark :%d\n" % (ref.encode(), mark))
        out.extend(b"committer C O Mitter <c@example.com> %d +0000\n" % (1700000000 + mark))
        data(f"change {mark}\n\nedits {', '.join(sorted(files))}\n".encode())
        if parent is not None:
            out.extend(b"from :%d\n" % parent)
        if merge is not None:
            out.extend(b"merge :%d\n" % merge)
        for path, body in sorted(files.items()):
            out.extend(b"M 100644 inline %s\n" % path.encode())
            data(bytes(body))

    def edit_text(name: str) -> None:
        lines = text[name]
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(lines))
            if rng.random() < 0.3:
                lines.insert(i, _lines(rng, 1, f"new {name}")[0])
            else:
                lines[i] = _lines(rng, 1, f"edited {i}")[0]

    def edit_binary(name: str) -> None:
        b = binary[name]
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(b) - 64)
            b[at : at + 64] = rng.randbytes(64)
        at = rng.randrange(len(b))
        b[at:at] = rng.randbytes(100)

    side_tip = None
    side_notes: list[bytes] = []
    for i in range(1, commits + 1):
        files: dict[str, bytes] = {}
        if i == 1:
            files = {k: b"".join(v) for k, v in text.items()}
            files.update({k: bytes(v) for k, v in binary.items()})
        else:
            for name in rng.sample(sorted(text), rng.randint(1, 2)):
                edit_text(name)
                files[name] = b"".join(text[name])
            if i % 5 == 0:
                edit_binary("assets/logo.bin")
                files["assets/logo.bin"] = bytes(binary["assets/logo.bin"])
            if i in (20, 60, 110):
                edit_binary("assets/big.bin")
                files["assets/big.bin"] = bytes(binary["assets/big.bin"])
            if i in (50, 130):
                edit_binary("assets/huge.bin")
                files["assets/huge.bin"] = bytes(binary["assets/huge.bin"])
            if i % 10 == 0:
                files[f"src/alkfs/mod{i}.py"] = b"".join(_lines(rng, 40, f"    mod{i}"))
        merge = None
        if i == MERGE_AT:
            merge = side_tip
            files["side/notes.txt"] = b"".join(side_notes)
        commit("refs/heads/main", i, i - 1 if i > 1 else None, merge, files)
        if i == SIDE_FROM:  # a side branch of a few commits, merged at MERGE_AT
            side_notes = _lines(rng, 30, "side")
            parent = i
            for j in range(SIDE_COMMITS):
                side_notes[rng.randrange(30)] = _lines(rng, 1, f"side edit {j}")[0]
                mark = 1000 + j
                commit(
                    "refs/heads/side", mark, parent, None, {"side/notes.txt": b"".join(side_notes)}
                )
                parent = mark
            side_tip = parent
    out.extend(b"tag v1\nfrom :%d\n" % TAG_AT)
    out.extend(b"tagger T Agger <t@example.com> 1700000000 +0000\n")
    data(b"release v1\n")
    return bytes(out)


@dataclass
class Hist:
    """A bare repository holding one pack (`git repack -adf --depth=50 --window=50`)."""

    path: Path
    fmt: str
    pack: Path
    expected: dict[bytes, tuple[bytes, bytes]]  # id -> (type, body), from git cat-file

    @property
    def idx(self) -> Path:
        return self.pack.with_suffix(".idx")


def cat_file_all(repo: Path) -> dict[bytes, tuple[bytes, bytes]]:
    """Every object of the repository: its ids from `--batch-all-objects --batch-check`,
    each one's type and body from `git cat-file --batch`."""
    ids = git_out("cat-file", "--batch-all-objects", "--batch-check=%(objectname)", cwd=repo)
    out = git("cat-file", "--batch", cwd=repo, input=ids.encode()).stdout
    got: dict[bytes, tuple[bytes, bytes]] = {}
    i = 0
    while i < len(out):
        nl = out.index(b"\n", i)
        name, kind, size = out[i:nl].split()
        body = out[nl + 1 : nl + 1 + int(size)]
        assert len(body) == int(size) and out[nl + 1 + int(size)] == ord("\n")
        got[bytes.fromhex(name.decode())] = (kind, body)
        i = nl + 1 + int(size) + 1
    assert len(got) == len(ids.split())
    return got


def make_history(root: Path, fmt: str) -> Hist:
    repo = root / f"hist-{fmt}.git"
    git("init", "-q", "--bare", "-b", "main", f"--object-format={fmt}", repo)
    git("fast-import", "--quiet", cwd=repo, input=history_stream())
    git("repack", "-adf", "--depth=50", "--window=50", cwd=repo)
    (pack,) = (repo / "objects" / "pack").glob("pack-*.pack")
    return Hist(repo, fmt, pack, cat_file_all(repo))


@pytest.fixture(scope="module")
def hist(tmp_path_factory) -> Hist:
    return make_history(tmp_path_factory.mktemp("packread"), "sha1")


@pytest.fixture(scope="module")
def hist256(tmp_path_factory) -> Hist:
    return make_history(tmp_path_factory.mktemp("packread256"), "sha256")


@dataclass
class Entry:
    """One line of `git verify-pack -v`."""

    kind: str
    size: int
    in_pack: int
    offset: int
    depth: int
    base: bytes | None


def verify_pack(repo: Path, idx: Path) -> dict[bytes, Entry]:
    out = git_out("verify-pack", "-v", idx, cwd=repo)
    got = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 5 and re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", f[0]):
            base = bytes.fromhex(f[6]) if len(f) == 7 else None
            depth = int(f[5]) if len(f) == 7 else 0
            got[bytes.fromhex(f[0])] = Entry(f[1], int(f[2]), int(f[3]), int(f[4]), depth, base)
    return got


def on_chains_through(info: dict[bytes, Entry], bases: set[bytes]) -> set[bytes]:
    """`bases` and every object whose delta chain (per verify-pack) goes through one."""
    users: dict[bytes, set[bytes]] = {}
    for name, e in info.items():
        if e.base is not None:
            users.setdefault(e.base, set()).add(name)
    out, todo = set(bases), list(bases)
    while todo:
        for user in users.get(todo.pop(), ()):
            if user not in out:
                out.add(user)
                todo.append(user)
    return out


def entry_type(pack: bytes, offset: int) -> int:
    """The type code in the first byte of the entry at `offset` (6 OFS_DELTA, 7 REF_DELTA)."""
    return (pack[offset] >> 4) & 7


def read_all(ps: PackSet | PackFile, ids) -> dict[bytes, tuple[bytes, bytes] | None]:
    return {d: ps.read(d) for d in ids}


def copy_pack(h: Hist, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(h.pack, dest / h.pack.name)
    shutil.copy(h.idx, dest / h.idx.name)
    return dest / h.pack.name


# -- packs git wrote ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_every_object_of_a_deltified_pack_reads_as_git_gives_it(
    fmt: str, request: pytest.FixtureRequest
) -> None:
    h: Hist = request.getfixturevalue("hist" if fmt == "sha1" else "hist256")
    info = verify_pack(h.path, h.idx)
    raw = h.pack.read_bytes()
    # the pack is what the test means: deep OFS_DELTA chains, a tag, a merge, big blobs
    assert set(info) == set(h.expected)
    deltas = [e for e in info.values() if e.base is not None]
    assert len(deltas) > 300 and max(e.depth for e in deltas) >= 20
    assert {entry_type(raw, e.offset) for e in deltas} == {6}
    assert {t for t, _ in h.expected.values()} == {b"commit", b"tree", b"blob", b"tag"}
    assert any(t == b"commit" and body.count(b"\nparent ") == 2 for t, body in h.expected.values())
    assert max(len(b) for _, b in h.expected.values()) > packread.CACHE_ITEM_MAX

    with PackSet.of_directory(h.path / "objects" / "pack", fmt) as ps:
        assert read_all(ps, h.expected) == h.expected
        assert {d: ps.stat(d) for d in h.expected} == {
            d: (t, len(b)) for d, (t, b) in h.expected.items()
        }
        assert ps.cache.bytes <= packread.CACHE_BYTES
        assert len(ps.cache) > 0


def test_a_pack_of_ref_deltas_reads_as_git_gives_it(hist: Hist, tmp_path: Path) -> None:
    """`git pack-objects --no-delta-base-offset`: every delta names its base by id."""
    out = tmp_path / "ref"
    out.mkdir()
    name = git_out(
        "pack-objects",
        "--revs",
        "--all",
        "--no-delta-base-offset",
        "--window=50",
        "--depth=50",
        out / "pack",
        cwd=hist.path,
        input=b"",
    ).strip()
    pack = out / f"pack-{name}.pack"
    info = verify_pack(hist.path, pack.with_suffix(".idx"))
    raw = pack.read_bytes()
    deltas = [e for e in info.values() if e.base is not None]
    assert len(deltas) > 300
    assert {entry_type(raw, e.offset) for e in deltas} == {7}
    ids = set(info)
    assert len(ids) > 0.95 * len(hist.expected)
    with PackSet([pack], "sha1") as ps:
        assert read_all(ps, ids) == {d: hist.expected[d] for d in ids}
        assert {d: ps.stat(d) for d in ids} == {
            d: (hist.expected[d][0], len(hist.expected[d][1])) for d in ids
        }


def test_64_bit_offsets_are_read(hist: Hist, tmp_path: Path) -> None:
    """`git index-pack --index-version=2,1000`: every object past offset 1000 is found
    through the idx's 8-byte offset table."""
    pack = copy_pack(hist, tmp_path / "big")
    idx = pack.with_suffix(".idx")
    idx.unlink()
    git("index-pack", "--index-version=2,1000", "-o", idx, pack, cwd=hist.path)
    info = verify_pack(hist.path, idx)
    large = sum(1 for e in info.values() if e.offset > 1000)
    n = len(info)
    assert large > 0.9 * n
    assert idx.stat().st_size == 8 + 1024 + n * 28 + 40 + 8 * large
    with PackFile(pack, idx, "sha1") as pf:
        assert read_all(pf, hist.expected) == hist.expected


def write_idx(path: Path, fmt: str, rows: list[tuple[bytes, int, int]], trailer: bytes) -> None:
    """An idx v2 file: rows of (id, crc32, offset < 2**31), the pack's trailer."""
    rows = sorted(rows)
    fan = [0] * 256
    for name, _, _ in rows:
        fan[name[0]] += 1
    body = b"\xfftOc\x00\x00\x00\x02"
    total = 0
    for n in fan:
        total += n
        body += total.to_bytes(4, "big")
    body += b"".join(name for name, _, _ in rows)
    body += b"".join(crc.to_bytes(4, "big") for _, crc, _ in rows)
    body += b"".join(off.to_bytes(4, "big") for _, _, off in rows)
    body += trailer
    path.write_bytes(body + hashlib.new(fmt, body).digest())


def test_ref_delta_bases_in_another_pack_are_read_across_the_set(
    hist: Hist, tmp_path: Path
) -> None:
    """Pack A: everything main~OLD reaches. Pack B: `git pack-objects --thin` of
    main~OLD..main, kept thin (git never keeps such a pack: `index-pack --fix-thin` appends
    the missing bases to it; its idx here is the fixed pack's idx less those appended
    bases, whose entries start at the same offsets). B's deltas on objects of A name them
    by id (REF_DELTA), and read through the set as git gives them."""
    d = tmp_path / "two"
    d.mkdir()
    a = git_out(
        "pack-objects",
        "--revs",
        "--delta-base-offset",
        d / "pack",
        cwd=hist.path,
        input=b"main~%d\n" % OLD,
    ).strip()
    thin = git(
        "pack-objects",
        "--no-use-bitmap-index",  # (else the bitmap pack reuse: no thin deltas)
        "--revs",
        "--thin",
        "--delta-base-offset",
        "--stdout",
        cwd=hist.path,
        input=b"main\n^main~%d\n" % OLD,
    ).stdout
    fixed = tmp_path / "fixed.pack"
    git("index-pack", "--stdin", "--fix-thin", fixed, cwd=hist.path, input=thin)
    shown = git("show-index", cwd=hist.path, input=fixed.with_suffix(".idx").read_bytes())
    rows = []
    for line in shown.stdout.decode().splitlines():
        off, name, crc = line.split()
        rows.append((bytes.fromhex(name), int(crc.strip("()"), 16), int(off)))
    end = len(thin) - 20
    kept = [r for r in rows if r[2] < end]
    assert len(kept) == int.from_bytes(thin[8:12], "big") < len(rows)
    b = d / "pack-thin.pack"
    b.write_bytes(thin)
    write_idx(b.with_suffix(".idx"), "sha1", kept, thin[-20:])

    info = verify_pack(hist.path, fixed.with_suffix(".idx"))
    in_b = {name for name, _, _ in kept}
    across = {name for name in in_b if info[name].base is not None and info[name].base not in in_b}
    assert len(across) >= 5
    assert {entry_type(thin, info[name].offset) for name in across} == {7}
    a_info = verify_pack(hist.path, d / f"pack-{a}.idx")
    in_a = set(a_info)
    assert all(info[name].base in in_a for name in across)
    # a chain that goes on in A, on an OFS_DELTA there
    assert any(a_info[info[name].base].base is not None for name in across)
    reached = {
        bytes.fromhex(line.split()[0])
        for line in git_out("rev-list", "--objects", "main", cwd=hist.path).splitlines()
    }
    assert in_a | in_b == reached and not in_a & in_b

    with PackSet.of_directory(d, "sha1") as ps:
        assert len(ps.packs) == 2
        assert read_all(ps, reached) == {x: hist.expected[x] for x in reached}
        assert {x: ps.stat(x) for x in across} == {
            x: (hist.expected[x][0], len(hist.expected[x][1])) for x in across
        }
    with PackFile(b, b.with_suffix(".idx"), "sha1") as alone:
        for x in across:
            with pytest.raises(Corrupt, match=f"{re.escape(str(b))}: object {x.hex()}: .*"):
                alone.read(x)
        needing_a = on_chains_through(info, across)
        assert len(needing_a) > len(across)
        assert alone.check(in_b) == needing_a
        good = in_b - needing_a
        assert read_all(alone, good) == {x: hist.expected[x] for x in good}


# -- damage ------------------------------------------------------------------------------------
def test_a_damaged_base_is_reported_with_every_object_it_affects(
    hist: Hist, tmp_path: Path
) -> None:
    """One byte flipped inside the zlib stream of an undeltified object that deltas are
    made on: it and exactly the objects whose chains go through it fail, naming the pack
    and themselves; everything else reads as git gives it."""
    info = verify_pack(hist.path, hist.idx)

    def affected(base: bytes) -> set[bytes]:
        return on_chains_through(info, {base})

    made_on = {e.base for e in info.values()}
    roots = [n for n, e in info.items() if e.base is None and n in made_on and e.in_pack >= 64]
    victim = max(roots, key=lambda n: (len(affected(n)), n))
    expected_bad = affected(victim)
    assert len(expected_bad) >= 5
    assert any(info[x].depth >= 2 for x in expected_bad)

    pack = copy_pack(hist, tmp_path / "bad")
    raw = bytearray(pack.read_bytes())
    e = info[victim]
    raw[e.offset + e.in_pack // 2] ^= 0xFF
    pack.write_bytes(raw)

    with PackSet([pack], "sha1") as ps:
        assert ps.check(hist.expected) == expected_bad
    with PackSet([pack], "sha1") as ps:
        for x in sorted(expected_bad):
            with pytest.raises(Corrupt) as caught:
                ps.read(x)
            assert str(caught.value).startswith(f"{pack}: object {x.hex()}: ")
        good = set(hist.expected) - expected_bad
        assert read_all(ps, good) == {x: hist.expected[x] for x in good}


def test_the_inflated_object_is_checked_against_its_name(tmp_path: Path) -> None:
    """An entry that inflates cleanly to something else than the idx names it is Corrupt."""
    body = b"what the entry holds\n"
    other = packread.git_hash("sha1", b"blob", b"what the idx says\n")
    pack = write_pack(tmp_path / "pack-x.pack", [(other, whole(3, body))])
    with PackSet([pack], "sha1") as ps:
        with pytest.raises(Corrupt, match=f"object {other.hex()}: .* named "):
            ps.read(other)
        assert ps.stat(other) == (b"blob", len(body))  # headers only: stat does not inflate
        assert ps.check([other]) == {other}


def damaged(h: Hist, tmp_path: Path, what: str) -> tuple[Path, Path]:
    """A copy of the pack with one defect; the file the error must name."""
    pack = copy_pack(h, tmp_path / what)
    idx = pack.with_suffix(".idx")
    p, i = bytearray(pack.read_bytes()), bytearray(idx.read_bytes())
    n = len(h.expected)
    blamed = pack
    if what == "pack-truncated":
        p = p[:-1]
    elif what == "pack-tiny":
        p = p[:20]
    elif what == "pack-empty":
        p = bytearray()
    elif what == "pack-signature":
        p[0:4] = b"KCAP"
    elif what == "pack-version":
        p[4:8] = (4).to_bytes(4, "big")
    elif what == "pack-count":
        p[8:12] = (n + 1).to_bytes(4, "big")
    elif what == "pack-trailer":
        p[-1] ^= 1
    else:
        blamed = idx
        if what == "idx-truncated":
            i = i[:-8]
        elif what == "idx-tiny":
            i = i[:100]
        elif what == "idx-magic":
            i[0:4] = b"\x00\x00\x00\x02"
        elif what == "idx-version":
            i[4:8] = (3).to_bytes(4, "big")
        elif what == "idx-fanout":
            i[8 + 4 * 100 : 8 + 4 * 101] = (n).to_bytes(4, "big")  # then fan[101] < fan[100]
        elif what == "idx-extra-offset":
            i[-40:-40] = (1 << 40).to_bytes(8, "big")
        else:
            raise AssertionError(what)
    pack.write_bytes(p)
    idx.write_bytes(i)
    return pack, blamed


@pytest.mark.parametrize(
    "what",
    [
        "pack-truncated",
        "pack-tiny",
        "pack-empty",
        "pack-signature",
        "pack-version",
        "pack-count",
        "pack-trailer",
        "idx-truncated",
        "idx-tiny",
        "idx-magic",
        "idx-version",
        "idx-fanout",
        "idx-extra-offset",
    ],
)
def test_a_damaged_pack_or_idx_is_refused_at_open(hist: Hist, tmp_path: Path, what: str) -> None:
    pack, blamed = damaged(hist, tmp_path, what)
    with pytest.raises(Corrupt, match=f"^{re.escape(str(blamed))}: "):
        PackSet([pack], "sha1")
    with pytest.raises(Corrupt, match=f"^{re.escape(str(blamed))}: "):
        PackFile(pack, pack.with_suffix(".idx"), "sha1")


def test_the_undamaged_copy_opens(hist: Hist, tmp_path: Path) -> None:
    """(The damage tests' copy, undamaged, opens and reads: what they refuse is the defect.)"""
    pack = copy_pack(hist, tmp_path / "fine")
    with PackSet([pack], "sha1") as ps:
        some = sorted(hist.expected)[::50]
        assert read_all(ps, some) == {x: hist.expected[x] for x in some}


def test_a_64_bit_offset_past_its_table_is_corrupt(hist: Hist, tmp_path: Path) -> None:
    pack = copy_pack(hist, tmp_path / "big")
    idx = pack.with_suffix(".idx")
    idx.unlink()
    git("index-pack", "--index-version=2,0", "-o", idx, pack, cwd=hist.path)
    n = len(hist.expected)
    raw = bytearray(idx.read_bytes())
    at = 8 + 1024 + n * 24  # the first 4-byte offset: an index into the 8-byte table
    assert raw[at] & 0x80
    raw[at : at + 4] = (0x80000000 | n).to_bytes(4, "big")
    idx.write_bytes(raw)
    first = sorted(hist.expected)[0]
    with PackFile(pack, idx, "sha1") as pf:
        with pytest.raises(Corrupt, match=f"^{re.escape(str(idx))}: a 64-bit offset index {n} "):
            pf.read(first)
        second = sorted(hist.expected)[1]
        assert pf.read(second) == hist.expected[second]


def test_an_absent_id_is_none(hist: Hist) -> None:
    absent = hashlib.sha1(b"no such object").digest()
    assert absent not in hist.expected
    with PackSet.of_directory(hist.path / "objects" / "pack", "sha1") as ps:
        assert ps.read(absent) is None
        assert ps.stat(absent) is None
        assert absent not in ps
        assert ps.check([absent]) == set()
        some = next(iter(hist.expected))
        assert some in ps
        with pytest.raises(Invalid):
            ps.read(absent[:10])
    with PackSet([], "sha1") as empty:
        assert empty.read(absent) is None


# -- crafted packs: what git never writes --------------------------------------------------------
def header(kind: int, size: int) -> bytes:
    out = bytearray([(kind << 4) | (size & 15)])
    size >>= 4
    while size:
        out[-1] |= 0x80
        out.append(size & 0x7F)
        size >>= 7
    return bytes(out)


def whole(kind: int, body: bytes, stated: int | None = None) -> bytes:
    return header(kind, len(body) if stated is None else stated) + zlib.compress(body)


def ref_delta(base: bytes, delta: bytes) -> bytes:
    return header(7, len(delta)) + base + zlib.compress(delta)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append(n & 0x7F | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def write_pack(path: Path, entries: list[tuple[bytes, bytes]], fmt: str = "sha1") -> Path:
    """A pack of raw entries (id the idx gives it, entry bytes), and its idx."""
    body = b"PACK" + (2).to_bytes(4, "big") + len(entries).to_bytes(4, "big")
    rows = []
    for name, entry in entries:
        rows.append((name, zlib.crc32(entry), len(body)))
        body += entry
    trailer = hashlib.new(fmt, body).digest()
    path.write_bytes(body + trailer)
    write_idx(path.with_suffix(".idx"), fmt, rows, trailer)
    return path


def test_crafted_entries_that_cannot_give_their_object_are_corrupt(tmp_path: Path) -> None:
    a, b, c, d, e, f = (hashlib.sha1(bytes([i])).digest() for i in range(6))
    good = b"a blob\n"
    g = packread.git_hash("sha1", b"blob", good)
    to_self = varint(len(good)) + varint(len(good)) + bytes([0x90, len(good)])
    pack = write_pack(
        tmp_path / "pack-c.pack",
        [
            (a, ref_delta(b, to_self)),  # a -> b -> a: a cycle
            (b, ref_delta(a, to_self)),
            (c, whole(3, good, stated=len(good) - 1)),  # inflates past its stated size
            (d, whole(3, good, stated=len(good) + 1)),  # short of it
            (e, header(5, 3) + zlib.compress(b"abc")),  # type 5 does not exist
            (g, whole(3, good)),
            (f, header(3, len(good)) + zlib.compress(good)[:-3]),  # cut by the pack's end
        ],
    )
    with PackFile(pack, pack.with_suffix(".idx"), "sha1") as pf:
        for name, why in [
            (a, "a delta chain longer than 10000 links"),
            (c, f"inflates to more than the {len(good) - 1} bytes"),
            (d, f"inflates to {len(good)} bytes, its header says {len(good) + 1}"),
            (e, "an entry of unknown type 5"),
            (f, "a zlib stream runs past the pack's entries"),
        ]:
            with pytest.raises(
                Corrupt, match=f"^{re.escape(str(pack))}: object {name.hex()}: {why}"
            ):
                pf.read(name)
        with pytest.raises(Corrupt, match="a delta chain longer than 10000 links"):
            pf.stat(a)
        assert pf.read(g) == (b"blob", good)
        assert pf.check([a, b, c, d, e, f, g]) == {a, b, c, d, e, f}


def test_a_cycle_across_packs_is_corrupt(tmp_path: Path) -> None:
    a, b = hashlib.sha1(b"a").digest(), hashlib.sha1(b"b").digest()
    delta = varint(3) + varint(3) + bytes([0x90, 3])
    one = write_pack(tmp_path / "pack-1.pack", [(a, ref_delta(b, delta))])
    two = write_pack(tmp_path / "pack-2.pack", [(b, ref_delta(a, delta))])
    with PackSet([one, two], "sha1") as ps:
        with pytest.raises(Corrupt, match="delta bases across packs nest deeper than 64"):
            ps.read(a)
        assert ps.check([a, b]) == {a, b}


def test_git_deltas_are_applied_by_the_rules() -> None:
    base = bytes(range(256)) * 300  # 76800 bytes: a copy of size 0 means 0x10000
    copy_all = bytes([0x80 | 0x10 | 0x20, 0, 0])  # offset 0, size 0 -> 0x10000
    copy_tail = bytes([0x80 | 0x01 | 0x02 | 0x10, 0x00, 0x2C, 0x10])  # 16 bytes at 0x2c00
    insert = bytes([5]) + b"hello"
    target = base[:0x10000] + base[0x2C00 : 0x2C00 + 16] + b"hello"
    delta = varint(len(base)) + varint(len(target)) + copy_all + copy_tail + insert
    assert apply_delta(base, delta) == target
    assert packread.delta_sizes(delta) == (len(base), len(target))
    for bad, why in [
        (varint(len(base) + 1) + delta[3:], "applied to a base of 76800"),
        (varint(len(base)) + varint(len(target) + 1) + delta[6:], "delta makes 65557 bytes"),
        (varint(len(base)) + varint(len(target) - 1) + delta[6:], "more than its 65556 bytes"),
        (varint(len(base)) + varint(1) + bytes([0]), "opcode 0"),
        (
            varint(len(base)) + varint(16) + bytes([0xB3, 255, 255, 255, 255]),
            "copies 65535 bytes at 65535",
        ),
        (varint(len(base)) + varint(9) + bytes([9]) + b"short", "insert cut short"),
        (varint(len(base)) + varint(9) + bytes([0x93, 1]), "copy cut short"),
        (b"\x80\x80", "delta header cut short"),
    ]:
        with pytest.raises(Corrupt, match=why):
            apply_delta(base, bad)


def test_the_base_cache_is_bounded_by_bytes_least_recently_used_out() -> None:
    cache = BaseCache(limit=100, item_max=40)
    for i in range(3):
        cache.put((1, i), (b"blob", bytes(30)))
    cache.put((1, 9), (b"blob", bytes(41)))  # over item_max: never kept
    assert cache.keys() == [(1, 0), (1, 1), (1, 2)] and cache.bytes == 90
    assert cache.get((1, 0)) == (b"blob", bytes(30))  # now the most recently used
    cache.put((2, 0), (b"tree", bytes(20)))  # 110 > 100: (1, 1) goes
    assert cache.keys() == [(1, 2), (1, 0), (2, 0)] and cache.bytes == 80
    assert cache.get((1, 1)) is None and cache.get((1, 9)) is None


# -- threads -----------------------------------------------------------------------------------
def test_eight_threads_reading_every_object_at_once_get_what_git_gives(hist: Hist) -> None:
    """One set (a cache small enough to be evicted from all the time), eight threads, each
    reading every object in its own order."""
    ids = sorted(hist.expected)
    results: list[dict | BaseException] = [{} for _ in range(8)]
    start = threading.Barrier(8)
    with PackSet.of_directory(hist.path / "objects" / "pack", "sha1", cache_bytes=1 << 20) as ps:

        def reader(n: int) -> None:
            order = list(ids)
            random.Random(n).shuffle(order)
            start.wait()
            try:
                results[n] = {d: (ps.read(d), ps.stat(d)) for d in order}
            except BaseException as e:  # reported below
                results[n] = e

        threads = [threading.Thread(target=reader, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    want = {d: ((t, b), (t, len(b))) for d, (t, b) in hist.expected.items()}
    for got in results:
        assert got == want
