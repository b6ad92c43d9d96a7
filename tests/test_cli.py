"""The `alkfs` command line on real store directories, run as the installed console script."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from helpers import git, git_out

from alkfs.db.uri import redact
from alkfs.durations import format_duration, parse_duration
from alkfs.store import Store

ALKFS = str(Path(sys.executable).with_name("alkfs"))
ISO_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00\Z")

# store_database (tests/conftest.py) for this test: under ALKFS_TEST_DATABASE=postgresql each
# store directory's PostgreSQL database, which `run` gives the command as $ALKFS_DATABASE
database_for = None


@pytest.fixture(autouse=True)
def _store_databases(store_database):
    global database_for
    database_for = store_database
    yield
    database_for = None


def target_store(args, env: dict) -> str | None:
    """The store directory a command runs on: `--store DIR`, else $ALKFS_STORE."""
    args = list(map(str, args))
    for i, arg in enumerate(args[:-1]):
        if arg == "--store":
            return args[i + 1]
    return env.get("ALKFS_STORE")


def env_for(args: tuple[str | os.PathLike[str], ...], env: dict | None = None) -> dict:
    """The environment a command runs in: no ALKFS_* of the test run's, `env`, and the
    store's PostgreSQL database if it has one."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ALKFS_")}
    full_env.update(env or {})
    store = target_store(args, full_env)
    database = None if store is None or database_for is None else database_for(store)
    if database is not None and "ALKFS_DATABASE" not in full_env:
        full_env["ALKFS_DATABASE"] = database
    return full_env


def run(*args: str | os.PathLike[str], stdin: bytes | None = None, env: dict | None = None):
    return subprocess.run(
        [ALKFS, *map(str, args)],
        input=stdin,
        capture_output=True,
        env=env_for(args, env),
        timeout=60,
        check=False,
    )


UNPINNED = re.compile(
    rb"alkfs: \S+ is not pinned: nothing keeps it, so a sweep deletes it once the window has "
    rb"passed \(alkfs pin NAME KEY, or put --pin NAME\)\n"
)


def ok(*args: str | os.PathLike[str], **kw) -> str:
    """stdout of a command that must succeed with nothing on stderr (but `put`'s one
    warning a file put without --pin)."""
    done = run(*args, **kw)
    assert done.returncode == 0, done.stderr.decode()
    err = done.stderr
    if "put" in args and "--pin" not in args:
        assert len(UNPINNED.findall(err)) == done.stdout.count(b"\n"), err
        err = UNPINNED.sub(b"", err)
    assert err == b""
    return done.stdout.decode()


def refused(*args: str | os.PathLike[str], **kw) -> str:
    """The one stderr line of a command that must exit 1, with nothing on stdout."""
    done = run(*args, **kw)
    assert done.returncode == 1, (done.returncode, done.stderr)
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def usage_error(*args: str | os.PathLike[str], **kw) -> str:
    done = run(*args, **kw)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stdout == b""
    return done.stderr.decode().splitlines()[-1]


def sha256sum(path: Path) -> str:
    out = subprocess.run(["sha256sum", str(path)], capture_output=True, check=True).stdout
    return out.split()[0].decode()


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    small = tmp_path / "small.txt"
    small.write_bytes(b"hello alkfs\n")
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(300_000))  # over the default 131072 threshold: the large tier
    return {"small": small, "big": big}


# -- put / get / stat ------------------------------------------------------------------------


def test_put_prints_the_sha256_key_of_each_file_as_sha256sum_computes_it(store, files):
    out = ok("put", "--store", store, files["small"], files["big"])
    assert out == f"sha256/{sha256sum(files['small'])}\nsha256/{sha256sum(files['big'])}\n"


def test_get_gives_back_the_exact_bytes_of_small_and_large_objects(store, files, tmp_path):
    keys = ok("--store", store, "put", files["small"], files["big"]).split()
    for key, name in zip(keys, ("small", "big"), strict=True):
        out = tmp_path / f"{name}.out"
        assert ok("--store", store, "get", key, "-o", out) == ""
        assert sha256sum(out) == sha256sum(files[name])
        assert out.read_bytes() == files[name].read_bytes()
        done = run("--store", store, "get", key)
        assert done.returncode == 0 and done.stdout == files[name].read_bytes()


def test_get_accepts_a_bare_sha256_hex(store, files):
    ok("--store", store, "put", files["small"])
    assert run("--store", store, "get", sha256sum(files["small"])).stdout == b"hello alkfs\n"


@pytest.mark.parametrize("algo", ["sha256", "blake3"])
def test_put_with_an_algorithm_names_the_object_by_that_digest(store, files, algo):
    key = ok("--store", store, "put", "--algo", algo, files["small"]).strip()
    h = hashlib.sha256() if algo == "sha256" else __import__("blake3").blake3()
    h.update(b"hello alkfs\n")
    assert key == f"{algo}/{h.hexdigest()}"
    assert run("--store", store, "get", key).stdout == b"hello alkfs\n"


def test_put_of_a_git_object_as_git_sha1_matches_git_hash_object(store, tmp_path):
    body = b"a blob body\n"
    canonical = tmp_path / "obj"
    canonical.write_bytes(b"blob %d\0" % len(body) + body)
    blob = tmp_path / "body"
    blob.write_bytes(body)
    oid = git_out("hash-object", str(blob)).strip()
    assert ok("--store", store, "put", "--algo", "git-sha1", canonical) == f"git-sha1/{oid}\n"
    assert run("--store", store, "get", oid).stdout == canonical.read_bytes()


def test_put_of_non_git_bytes_as_git_sha1_is_refused_and_stores_nothing(store, files):
    line = refused("--store", store, "put", "--algo", "git-sha1", files["small"])
    assert line == f"alkfs put: {files['small']}: not a git object: no header"
    status = json.loads(ok("--store", store, "status"))
    assert status["objects"]["git-sha1"]["count"] == 0


def test_put_reads_stdin_for_a_dash(store):
    key = ok("--store", store, "put", "-", stdin=b"from stdin").strip()
    assert key == "sha256/" + hashlib.sha256(b"from stdin").hexdigest()


def test_stat_reports_key_algorithm_size_tier_time_and_pins(store, files):
    small, big = ok("--store", store, "put", files["small"], files["big"]).split()
    ok("--store", store, "pin", "keep", small)
    s = json.loads(ok("--store", store, "stat", small))
    assert ISO_UTC.match(s.pop("stored_at"))
    assert s == {"key": small, "algorithm": "sha256", "size": 12, "tier": "kv", "pins": ["keep"]}
    b = json.loads(ok("--store", store, "stat", big))
    b.pop("stored_at")
    assert b == {"key": big, "algorithm": "sha256", "size": 300_000, "tier": "large", "pins": []}


def test_get_and_stat_of_an_absent_object_fail_naming_it(store, files):
    ok("--store", store, "put", files["small"])  # the store exists but lacks this key
    key = "sha256/" + "0" * 64
    assert refused("--store", store, "get", key) == f"alkfs get: {key}: no such object"
    assert refused("--store", store, "stat", key) == f"alkfs stat: {key}: no such object"


def test_get_of_a_corrupt_large_object_fails_and_writes_no_output_file(store, files, tmp_path):
    key = ok("--store", store, "put", files["big"]).strip()
    hexd = key.split("/")[1]
    backing = store / "large" / "sha256" / hexd[:2] / hexd
    data = bytearray(backing.read_bytes())
    data[1000] ^= 0xFF
    backing.write_bytes(bytes(data))
    out = tmp_path / "out"
    line = refused("--store", store, "get", key, "-o", out)
    assert line == f"alkfs get: {key}: stored bytes do not hash to the key"
    assert not out.exists()
    assert list(tmp_path.glob(".out.*")) == []


def test_put_over_the_threshold_on_a_kv_only_store_is_refused(store, files):
    Store.open(store, mode="kv-only", database=database_for(store)).close()
    line = refused("--store", store, "put", files["big"])
    assert line == f"alkfs put: {files['big']}: over the kv-only threshold 131072"
    assert json.loads(ok("--store", store, "status"))["objects"]["sha256"]["count"] == 0


# -- pins ---------------------------------------------------------------------------------------


def test_pin_lists_and_unpin_removes(store, files):
    small, big = ok("--store", store, "put", files["small"], files["big"]).split()
    assert ok("--store", store, "pin", "b-1", big) == ""
    assert ok("--store", store, "pin", "a.2", small) == ""
    assert ok("--store", store, "pins") == f"a.2 {small}\nb-1 {big}\n"
    assert ok("--store", store, "unpin", "a.2") == f"{small}\n"  # (the key it released)
    assert ok("--store", store, "pins") == f"b-1 {big}\n"


def test_put_with_pin_stores_and_pins_in_one_command(store, files):
    key = ok("--store", store, "put", "--pin", "backup", files["big"]).strip()
    assert ok("--store", store, "pins") == f"backup {key}\n"


def test_pin_refusals_name_the_reason(store, files):
    small, big = ok("--store", store, "put", files["small"], files["big"]).split()
    ok("--store", store, "pin", "taken", small)
    assert (
        refused("--store", store, "pin", "taken", big)
        == "alkfs pin: the pin 'taken' names another object"
    )
    absent = "sha256/" + "1" * 64
    assert refused("--store", store, "pin", "x", absent) == f"alkfs pin: {absent}: no such object"
    assert refused("--store", store, "pin", ".dot", small) == "alkfs pin: invalid pin name '.dot'"
    assert refused("--store", store, "unpin", "nope") == "alkfs unpin: no pin 'nope'"


# -- repositories and import ------------------------------------------------------------------


def test_repo_create_list_and_rm(store):
    ok("--store", store, "repo", "create", "alpha")
    ok("--store", store, "repo", "create", "beta", "--object-format", "sha256")
    assert ok("--store", store, "repo", "list") == "alpha sha1\nbeta sha256\n"
    ok("--store", store, "repo", "rm", "alpha")
    assert ok("--store", store, "repo", "list") == "beta sha256\n"


def test_repo_refusals_name_the_reason(store):
    ok("--store", store, "repo", "create", "alpha")
    assert (
        refused("--store", store, "repo", "create", "alpha")
        == "alkfs repo create: repository 'alpha' exists"
    )
    assert (
        refused("--store", store, "repo", "create", ".dot")
        == "alkfs repo create: invalid repository id '.dot'"
    )
    assert refused("--store", store, "repo", "rm", "nope") == "alkfs repo rm: no repository 'nope'"


def make_git_repo(path: Path) -> tuple[int, str]:
    """A small repository (two commits on main, a branch, an annotated tag): (objects, main)."""
    git("init", "-q", "-b", "main", str(path))
    (path / "a.txt").write_text("one\n")
    git("add", "a.txt", cwd=path)
    git("commit", "-q", "-m", "first", cwd=path)
    (path / "d").mkdir()
    (path / "d" / "b.txt").write_text("two\n")
    git("add", "d", cwd=path)
    git("commit", "-q", "-m", "second", cwd=path)
    git("branch", "side", "HEAD~1", cwd=path)
    git("tag", "-a", "-m", "v1", "v1", cwd=path)
    listing = git_out("cat-file", "--batch-all-objects", "--batch-check", cwd=path)
    return len(listing.splitlines()), git_out("rev-parse", "main", cwd=path).strip()


def test_git_import_stores_every_object_and_the_refs_keep_them_through_sweeps(store, tmp_path):
    count, main = make_git_repo(tmp_path / "src")
    src = tmp_path / "src" / ".git"
    said = ok("--store", store, "git", "import", src, "--repo", "src")
    refs = len(git_out("for-each-ref", cwd=tmp_path / "src").splitlines())
    assert re.fullmatch(  # (one summary line)
        rf"imported {re.escape(str(src))} as src: {refs} refs, {count} objects \({count} stored, "
        r"0 already present\) in \d+\.\d s\n",
        said,
    ), said
    assert ok("--store", store, "repo", "list") == "src sha1\n"
    commit = json.loads(ok("--store", store, "stat", main))
    assert (commit["key"], commit["algorithm"]) == (f"git-sha1/{main}", "git-sha1")
    for _ in range(2):
        report = json.loads(ok("--store", store, "sweep", "--window", "0"))
        assert (report["scanned"], report["live"]) == (count, count)
        assert (report["candidates_staged"], report["deleted"]) == (0, 0)


def test_git_import_of_a_missing_directory_fails(store, tmp_path):
    missing = tmp_path / "nope"
    line = refused("--store", store, "git", "import", missing, "--repo", "x")
    assert line == f"alkfs git import: {missing}: no such directory"


# -- sweep, verify, status ----------------------------------------------------------------------


def test_sweep_with_window_0_stages_an_orphan_then_deletes_it(store, files):
    orphan, kept = ok("--store", store, "put", files["big"], files["small"]).split()
    ok("--store", store, "pin", "kept", kept)
    first = json.loads(ok("--store", store, "sweep", "--window", "0"))
    assert first["aborted"] is None
    assert {k: first[k] for k in ("candidates_staged", "deleted", "live", "scanned")} == {
        "candidates_staged": 1,
        "deleted": 0,
        "live": 1,
        "scanned": 2,
    }
    second = json.loads(ok("--store", store, "sweep", "--window", "0"))
    assert {k: second[k] for k in ("candidates_staged", "deleted", "bytes_freed", "live")} == {
        "candidates_staged": 0,
        "deleted": 1,
        "bytes_freed": 300_000,
        "live": 1,
    }
    assert refused("--store", store, "get", orphan) == f"alkfs get: {orphan}: no such object"
    assert run("--store", store, "get", kept).stdout == b"hello alkfs\n"


def test_sweep_with_the_default_window_stages_but_does_not_delete(store, files):
    ok("--store", store, "put", files["small"])
    for staged in (1, 0):
        report = json.loads(ok("--store", store, "sweep"))
        assert (report["candidates_staged"], report["deleted"]) == (staged, 0)


def test_a_dry_run_lists_what_would_be_staged_and_changes_nothing(store, files):
    small, big = ok("--store", store, "put", files["small"], files["big"]).split()
    ok("--store", store, "pin", "kept", big)
    for _ in range(2):  # (nothing staged by the first: the second sees the same)
        out = json.loads(ok("--store", store, "sweep", "--dry-run"))
        assert (out["dry_run"], out["aborted"], out["candidates_staged"]) == (True, None, 0)
        assert (out["would_stage"], out["more"], out["scanned"], out["live"]) == (1, 0, 2, 1)
        assert out["candidates"] == [{"key": small, "size": 12, "why": "no pin names it"}]
        assert out["would_stage_bytes"] == 12
    assert ok("--store", store, "staged") == ""
    usage = run("--store", store, "sweep", "--dry-run", "--window", "0")
    assert usage.returncode == 1 and b"neither --window nor --expire-now" in usage.stderr


def test_staged_lists_deadlines_and_expire_now_deletes_them_at_once(store, files):
    small, big = ok("--store", store, "put", files["small"], files["big"]).split()
    before = time.time()
    report = json.loads(ok("--store", store, "sweep"))  # (the store's window: 1 h)
    assert report["candidates_staged"] == 2
    lines = ok("--store", store, "staged").splitlines()
    assert [line.split()[:2] for line in lines] == sorted([[small, "12"], [big, "300000"]])
    for line in lines:
        deadline = datetime.fromisoformat(line.split()[2]).timestamp()
        assert before + 3600 - 1 <= deadline <= time.time() + 3600 + 1
    status = json.loads(ok("--store", store, "status"))
    assert (status["staged"]["count"], status["staged"]["bytes"]) == (2, 300_012)
    assert json.loads(ok("--store", store, "sweep"))["deleted"] == 0  # (not due yet)
    ok("--store", store, "pin", "saved", small)  # (re-arbitrated: a pin keeps it)
    report = json.loads(ok("--store", store, "sweep", "--expire-now"))
    assert (report["taken"], report["deleted"], report["cancelled_by_arbitration"]) == (2, 1, 1)
    assert report["bytes_freed"] == 300_000
    assert ok("--store", store, "staged") == ""
    assert ok("--store", store, "get", small).encode() == files["small"].read_bytes()
    assert json.loads(ok("--store", store, "status"))["staged"] == {
        "count": 0,
        "bytes": 0,
        "next_deadline": None,
    }


def test_verify_passes_a_clean_store_and_fails_listing_a_corrupt_object(store, files):
    key = ok("--store", store, "put", files["big"], files["small"]).split()[0]
    assert json.loads(ok("--store", store, "verify")) == {"corrupt": []}
    hexd = key.split("/")[1]
    backing = store / "large" / "sha256" / hexd[:2] / hexd
    data = backing.read_bytes()
    backing.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # always a changed byte
    done = run("--store", store, "verify")
    assert done.returncode == 1
    assert json.loads(done.stdout) == {"corrupt": [key]}
    assert done.stderr == b"alkfs verify: 1 corrupt object\n"


def test_status_has_the_spec_shape_with_exact_counts(store, files):
    ok("--store", store, "put", files["small"], files["big"])
    ok("--store", store, "put", "--algo", "blake3", files["small"])
    ok("--store", store, "pin", "p", f"sha256/{sha256sum(files['small'])}")
    ok("--store", store, "repo", "create", "r")
    status = json.loads(ok("--store", store, "status"))
    empty = {"count": 0, "bytes": 0, "kv": 0, "large": 0, "kv_bytes": 0, "large_bytes": 0}
    uri = database_for(store)
    if uri is None:
        database, fleet = {"engine": "sqlite", "name": str(store / "store.db")}, None
    else:  # the CLI on a PostgreSQL store is a fleet member, its only one here (README)
        database, fleet = {"engine": "postgresql", "name": redact(uri)}, status["fleet"]
        assert [node["id"] for node in fleet["nodes"]] == [fleet["self"]]
    disk = status["disk"]  # (bytes on disk: the database's vary with sqlite's pages)
    if uri is None:
        assert disk["database"] >= (store / "store.db").stat().st_size > 0
        assert disk["database_free"] >= 0
    else:
        assert (disk["database"], disk["database_free"]) == (None, None)
    assert (disk["large"], disk["packs"]) == (300_000, 0)
    assert status == {
        "version": "0.1.0",
        "store": {
            "path": str(store.resolve()),
            "mode": "dual-tier",
            "threshold": 131072,
            "window_s": 3600,
        },
        "database": database,
        "fleet": fleet,
        "objects": {
            "sha256": {
                "count": 2,
                "bytes": 300_012,
                "kv": 1,
                "large": 1,
                "kv_bytes": 12,
                "large_bytes": 300_000,
            },
            "blake3": {
                "count": 1,
                "bytes": 12,
                "kv": 1,
                "large": 0,
                "kv_bytes": 12,
                "large_bytes": 0,
            },
            "git-sha1": empty,
            "git-sha256": empty,
        },
        "disk": disk,
        "pins": 1,
        "repos": 1,
        "roots": 0,
        "staged": {"count": 0, "bytes": 0, "next_deadline": None},
        "sweeping": False,
        "last_sweep": None,
        "corrupt": [],
    }


# -- targets, the lock, usage ---------------------------------------------------------------------


@pytest.mark.not_on_postgres("the sqlite store's exclusive lock: a PostgreSQL store admits a fleet")
def test_a_store_held_by_another_process_is_refused_naming_the_lock(store, files):
    ok("--store", store, "put", files["small"])
    with Store.open(store, database=database_for(store)):
        line = refused("--store", store, "pins")
    assert line == (
        f"alkfs pins: the store {store} is held by another process (pid {os.getpid()}); "
        f"lock {store / 'alkfs.lock'}; work through its mount with --mount"
    )
    assert ok("--store", store, "pins") == ""  # released: usable again


def test_alkfs_store_in_the_environment_is_the_default_target(store, files):
    key = ok("put", files["small"], env={"ALKFS_STORE": str(store)}).strip()
    assert ok("--store", store, "stat", key)


def test_a_read_command_on_a_missing_store_fails_without_creating_it(tmp_path):
    missing = tmp_path / "nothing"
    assert refused("--store", missing, "pins") == f"alkfs pins: no store at {missing}"
    assert not missing.exists()


def test_a_mount_target_that_is_not_an_alkfs_mount_is_refused(tmp_path):
    assert (
        refused("--mount", tmp_path, "status")
        == f"alkfs status: {tmp_path} is not an alkfs mount (no .alkfs/status)"
    )


@pytest.mark.parametrize(
    ("args", "last_line"),
    [
        ((), "alkfs: error: the following arguments are required: COMMAND"),
        (("status",), "alkfs: error: status: no target: give --mount MNT or --store DIR"),
        (("--store", "s", "--mount", "m", "status"), "alkfs: error: status: give --mount or"),
        (("--store", "s", "frobnicate"), "alkfs: error: argument COMMAND: invalid choice"),
        (("--store", "s", "get", "sha256/ABC"), "alkfs get: error: argument KEY: not a key"),
        (("--store", "s", "sweep", "--window", "5y"), "alkfs sweep: error: argument --window"),
        (("--store", "s", "put", "--algo", "md5", "f"), "alkfs put: error: argument --algo"),
        (("--store", "s", "put", "--pin", "n", "a", "b"), "alkfs: error: put: --pin names one"),
        (("--store", "s", "repo", "create", "r", "--object-format", "md5"), "alkfs repo create"),
        (
            ("--store", "s", "git", "import", "d"),
            "alkfs git import: error: the following arguments",
        ),
    ],
)
def test_bad_usage_exits_2_with_the_reason(tmp_path, args, last_line):
    done = subprocess.run(
        [ALKFS, *args],
        cwd=tmp_path,
        capture_output=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("ALKFS_")},
        check=False,
    )
    assert done.returncode == 2
    assert done.stdout == b""
    assert done.stderr.decode().splitlines()[-1].startswith(last_line)
    assert not (tmp_path / "s").exists()  # bad usage touches nothing


# -- durations --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("0", 0), ("45", 45), ("90s", 90), ("15m", 900), ("1h", 3600), ("2d", 172800),
     ("1h30m", 5400), ("1w", 604800), ("0.5h", 1800), (" 10M ", 600)],
)  # fmt: skip
def test_durations_parse_to_seconds(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "-1s", "1y", "1h1h", "1h30", "1 h", "1.h", "s1"])
def test_malformed_durations_are_refused(text):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize("seconds", [0, 1, 59, 60, 3600, 5400, 86400 + 61, 604800, 2.5])
def test_formatted_durations_read_back_as_the_same_seconds(seconds):
    assert parse_duration(format_duration(seconds)) == seconds


def test_every_command_s_help_has_an_example_and_the_key_formats():
    """`--help` of each (sub)command ends with one example and how keys, durations and
    the target are written."""
    from alkfs.cli import build_parser

    def leaves(parser, path=()):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or path == ("roots",):
            yield path, parser
        for action in subs:
            for name, child in action.choices.items():
                yield from leaves(child, (*path, name))

    seen = []
    for path, parser in leaves(build_parser()):
        if not path:
            continue
        text = parser.format_help()
        assert "example:\n  alkfs " in text, path
        assert f" {' '.join(path)}" in text.split("example:")[1], path
        assert "KEY is <algo>/<hex>" in text, path
        seen.append(" ".join(path))
    assert len(seen) >= 18 and "roots add" in seen and "git import" in seen


@pytest.mark.parametrize(
    ("sig", "code", "line"),
    [(signal.SIGINT, 130, b"interrupted"), (signal.SIGTERM, 143, b"stopped (SIGTERM)")],
)
def test_ctrl_c_and_sigterm_end_a_command_with_one_line_and_128_plus_the_signal(
    tmp_path, sig, code, line
):
    """A command interrupted while it waits (here, reading a FIFO nobody writes) ends with
    one line on stderr, no traceback, and 130 (Ctrl-C) or 143 (SIGTERM); nothing more is
    stored."""
    store, fifo, first = tmp_path / "s", tmp_path / "fifo", tmp_path / "first"
    first.write_bytes(b"the store exists: the command below only waits\n")
    ok("--store", store, "put", "--pin", "first", first)
    os.mkfifo(fifo)
    args = ("--store", store, "put", fifo)
    proc = subprocess.Popen(
        [ALKFS, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env_for(args),
        start_new_session=True,
    )
    time.sleep(1.0)  # (any moment while it waits: it cannot finish without a writer)
    assert proc.poll() is None
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out, err) == (code, b"", b"alkfs put: " + line + b"\n")
    assert json.loads(ok("--store", store, "status"))["objects"]["sha256"]["count"] == 1
