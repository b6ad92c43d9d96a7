"""Real mounts on a store kept in PostgreSQL (`alkfsd STORE MNT --database URI`, a throwaway
server from tests/pgserver.py): reads and writes of both tiers, git pushes and clones, refs
CAS, sweeps, restarts, a server outage mid-mount (EIO, the daemon lives on, nothing lost),
a second daemon on the same store (the fleet), the starts the daemon refuses, and a
password that is never shown.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import cat, cp, git, pin_target, put, sha, status, sweep

ALKFSD = str(Path(sys.executable).with_name("alkfsd"))
SMALL = b"a small object kept in PostgreSQL\n"
LARGE = bytes(range(256)) * 4096 + b"tail"  # 1 MiB + 4 bytes: above the 128 KiB threshold


def small_repo(path: Path) -> Path:
    """A real non-bare repository made by git: three commits on main, a tag."""
    git("init", "-q", "-b", "main", path)
    for i in range(3):
        (path / f"f{i}.txt").write_text(f"file {i}\n" * (i + 1))
        git("-C", path, "add", ".")
        git("-C", path, "commit", "-q", "-m", f"commit {i}")
    git("-C", path, "tag", "-a", "-m", "first", "v1", "HEAD~1")
    return path


def run_alkfsd(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run(
        [ALKFSD, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# -- 1. reads and writes ----------------------------------------------------------------------
def test_small_and_large_files_go_in_and_come_back_byte_identical(pg_mount, tmp_path):
    m = pg_mount
    assert status(m)["database"]["engine"] == "postgresql"
    small, large = tmp_path / "small", tmp_path / "large"
    small.write_bytes(SMALL)
    large.write_bytes(LARGE)
    cp(small, m.path("pins", "small-one"))
    cp(large, m.path("objects", "sha256", "anything"))
    assert cat(m.path("pins", "small-one")) == SMALL
    assert cat(m.path("objects", "sha256", sha(SMALL))) == SMALL
    assert cat(m.path("objects", "sha256", sha(LARGE))) == LARGE
    assert pin_target(m.path("pins", "small-one")) == f"../objects/sha256/{sha(SMALL)}"
    assert sorted(os.listdir(m.path("objects", "sha256"))) == sorted([sha(SMALL), sha(LARGE)])
    assert os.getxattr(m.path("objects", "sha256", sha(LARGE)), "user.alkfs.tier") == b"large"
    assert os.getxattr(m.path("objects", "sha256", sha(SMALL)), "user.alkfs.tier") == b"kv"
    counts = status(m)["objects"]["sha256"]
    assert (counts["count"], counts["kv"], counts["large"]) == (2, 1, 1)
    assert counts["bytes"] == len(SMALL) + len(LARGE)
    assert m.tracebacks() == []


# -- 2. git -----------------------------------------------------------------------------------
def test_a_push_clones_back_fsck_clean_and_refs_are_compare_and_swap(pg_mount, tmp_path):
    m = pg_mount
    src = small_repo(tmp_path / "src")
    os.mkdir(m.path("repos", "r1"))
    git("-C", src, "push", "-q", m.path("repos", "r1"), "main", "--tags")
    gitdir = m.path("repos", "r1")
    git(f"--git-dir={gitdir}", "fsck", "--full", "--no-dangling")

    clone = tmp_path / "clone"
    git("clone", "-q", "--no-local", gitdir, clone)
    git("-C", clone, "fsck", "--full")
    head = git("-C", src, "rev-parse", "main").stdout.decode().strip()
    assert git("-C", clone, "rev-parse", "HEAD").stdout.decode().strip() == head
    assert git("-C", clone, "log", "--format=%s").stdout.decode().split("\n")[:3] == [
        "commit 2",
        "commit 1",
        "commit 0",
    ]
    tags = git("-C", clone, "for-each-ref", "--format=%(objectname)", "refs/tags").stdout
    assert tags.decode().strip() == git("-C", src, "rev-parse", "v1").stdout.decode().strip()

    # compare-and-swap: a wrong old value fails and changes nothing; the right one moves it
    first = git("-C", src, "rev-parse", "main~2").stdout.decode().strip()
    wrong = git("-C", src, "rev-parse", "main~1").stdout.decode().strip()
    done = git(f"--git-dir={gitdir}", "update-ref", "refs/heads/main", first, wrong, check=False)
    assert done.returncode != 0
    assert (gitdir / "refs" / "heads" / "main").read_text() == f"{head}\n"
    git(f"--git-dir={gitdir}", "update-ref", "refs/heads/main", first, head)
    assert (gitdir / "refs" / "heads" / "main").read_text() == f"{first}\n"
    assert m.tracebacks() == []


# -- 3. sweeps --------------------------------------------------------------------------------
def test_two_sweeps_with_window_0_delete_the_unreferenced_and_keep_pins_and_refs(
    pg_mount, tmp_path
):
    m = pg_mount
    src = small_repo(tmp_path / "src")
    os.mkdir(m.path("repos", "r1"))
    git("-C", src, "push", "-q", m.path("repos", "r1"), "main")
    (tmp_path / "kept").write_bytes(b"pinned, so kept\n")
    cp(tmp_path / "kept", m.path("pins", "kept"))
    dead = put(m, b"nobody keeps this one\n")
    dead_large = put(m, b"L" * 300_000)
    oids = git("-C", src, "rev-list", "--objects", "main").stdout.decode().split()
    oids = [o for o in oids if len(o) == 40]

    sweep(m)
    report = sweep(m)
    assert report is not None
    for hexd in (dead, dead_large):
        with pytest.raises(OSError) as caught:
            os.stat(m.path("objects", "sha256", hexd))
        assert caught.value.errno == errno.ENOENT
    assert cat(m.path("pins", "kept")) == b"pinned, so kept\n"
    gitdir = m.path("repos", "r1")
    for oid in oids:
        git(f"--git-dir={gitdir}", "cat-file", "-e", oid)
    git(f"--git-dir={gitdir}", "fsck", "--full", "--no-dangling")
    assert status(m)["objects"]["sha256"]["count"] == 1
    assert m.tracebacks() == []


# -- 4. restart durability --------------------------------------------------------------------
def test_a_restart_on_the_same_store_and_database_finds_everything(pg_mount, tmp_path):
    m = pg_mount
    src = small_repo(tmp_path / "src")
    os.mkdir(m.path("repos", "r1"))
    git("-C", src, "push", "-q", m.path("repos", "r1"), "main", "--tags")
    (tmp_path / "large").write_bytes(LARGE)
    cp(tmp_path / "large", m.path("pins", "big"))
    small = put(m, SMALL)
    refs = git(f"--git-dir={m.path('repos', 'r1')}", "for-each-ref").stdout
    before = status(m)

    m.restart()
    assert m.database is not None
    after = status(m)
    assert after["objects"] == before["objects"]
    assert (after["pins"], after["repos"]) == (before["pins"], before["repos"]) == (1, 1)
    assert after["database"] == before["database"]
    assert git(f"--git-dir={m.path('repos', 'r1')}", "for-each-ref").stdout == refs
    git(f"--git-dir={m.path('repos', 'r1')}", "fsck", "--full", "--no-dangling")
    assert cat(m.path("pins", "big")) == LARGE
    assert cat(m.path("objects", "sha256", small)) == SMALL
    assert m.tracebacks() == []


# -- 5. server outage -------------------------------------------------------------------------
def test_a_server_outage_is_eio_the_daemon_lives_and_recovers_with_nothing_lost(
    start_pg_mount, pg_server, tmp_path
):
    # the derived packs' intake polls every 0.2 s: it meets the outage many times
    m = start_pg_mount(env={"ALKFS_PACK_POLL": "0.2"})
    unread_small = put(m, b"written before the outage, never read\n")
    unread_large = put(m, b"G" * 400_000)
    kept = put(m, SMALL)
    assert cat(m.path("objects", "sha256", kept)) == SMALL
    before = status(m)["objects"]

    pg_server.stop_now()
    try:
        timings = {}
        for name, hexd in (("small", unread_small), ("large", unread_large)):
            t0 = time.monotonic()
            with (
                pytest.raises(OSError) as caught,
                open(m.path("objects", "sha256", hexd), "rb") as f,
            ):
                f.read()
            timings[f"read {name}"] = time.monotonic() - t0
            assert caught.value.errno == errno.EIO, (name, caught.value)
        t0 = time.monotonic()
        with pytest.raises(OSError) as caught:
            put(m, b"written during the outage\n")
        timings["write"] = time.monotonic() - t0
        assert caught.value.errno == errno.EIO, caught.value
        time.sleep(1.0)  # the background tasks (packs intake) meet the outage too
        os.kill(m.pid, 0)  # the daemon lives
        assert m.mounted()
        assert m.proc.poll() is None
        os.stat(m.mnt)
        print(f"outage timings (s): { {k: round(v, 2) for k, v in timings.items()} }")
    finally:
        pg_server.start_again()

    assert (
        cat(m.path("objects", "sha256", unread_small)) == b"written before the outage, never read\n"
    )
    assert cat(m.path("objects", "sha256", unread_large)) == b"G" * 400_000
    after_write = put(m, b"written after the outage\n")
    assert cat(m.path("objects", "sha256", after_write)) == b"written after the outage\n"
    now = status(m)["objects"]["sha256"]
    assert now["count"] == before["sha256"]["count"] + 1
    assert m.proc.poll() is None
    assert m.tracebacks() == []


# -- 6. refused starts ------------------------------------------------------------------------
def refused(done: subprocess.CompletedProcess, mnt: Path, code: int = 1) -> str:
    """The one-line message of a start refused with `code`, nothing mounted at `mnt`."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code, done.stderr
    assert len(lines) == 1 and lines[0].startswith("alkfsd: "), done.stderr
    assert not os.path.ismount(mnt)
    from alkfsd.main import mounted_at

    assert mounted_at(str(mnt)) is None
    return lines[0]


def test_a_postgresql_store_started_without_database_is_refused(start_pg_mount, tmp_path):
    m = start_pg_mount(tmp_path / "store")
    assert m.stop() == 0
    mnt = tmp_path / "other"
    mnt.mkdir()
    env = {"ALKFS_DATABASE": ""}
    msg = refused(run_alkfsd(str(m.store_path), str(mnt), "--window", "0", env=env), mnt)
    assert "--database" in msg and "PostgreSQL" in msg, msg


def test_a_sqlite_store_started_with_database_is_refused(populate, pg_uri, tmp_path):
    store = tmp_path / "store"
    populate(store, [b"kept in sqlite"])
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    msg = refused(run_alkfsd(str(store), str(mnt), "--create", "--database", pg_uri), mnt)
    assert "sqlite" in msg.lower() or "migrate" in msg, msg


def test_a_second_daemon_is_welcome_on_the_same_store_refused_on_another(
    pg_mount, start_pg_mount, tmp_path
):
    """The fleet (docs/operations.md, "Several daemons on one store"): a second daemon on
    the same database and STORE directory mounts and serves; one on the same database with
    another STORE directory is refused by the binding."""
    uri = pg_mount.database
    second = start_pg_mount(pg_mount.store_path, "--window", "0", database=uri)
    hexd = put(pg_mount, SMALL)
    assert cat(second.path("objects", "sha256", hexd)) == SMALL
    nodes = json.loads(cat(second.path(".alkfs", "status")))["fleet"]["nodes"]
    assert sorted(n["pid"] for n in nodes) == sorted([pg_mount.pid, second.pid])

    mnt = tmp_path / "third"
    mnt.mkdir()
    store = tmp_path / "another-store"
    msg = refused(run_alkfsd(str(store), str(mnt), "--create", "--database", uri), mnt)
    assert "is not its directory" in msg, msg
    assert pg_mount.proc.poll() is None and second.proc.poll() is None
    assert cat(pg_mount.path(".alkfs", "status"))
    assert second.stop() == 0
    assert cat(pg_mount.path("objects", "sha256", hexd)) == SMALL
    assert pg_mount.tracebacks() == [] and second.tracebacks() == []


@pytest.fixture
def bouncer(pg_server):
    """bouncer(mode) -> a PgBouncer (tests/pgserver.py) in `mode` before the session's
    server, stopped after the test."""
    from pgserver import PgBouncer, PgNotInstalled

    made = []

    def start(mode: str):
        try:
            b = PgBouncer(pg_server, mode)
        except PgNotInstalled as e:
            if os.environ.get("CI") == "true":
                raise
            pytest.skip(str(e))
        made.append(b)
        b.start()
        return b

    yield start
    for b in made:
        b.stop()


def dbname(uri: str) -> str:
    from psycopg.conninfo import conninfo_to_dict

    return str(conninfo_to_dict(uri)["dbname"])


def public_tables(uri: str) -> int:
    import psycopg

    with psycopg.connect(uri, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
        return int(row.fetchone()[0])


def test_a_pooler_in_transaction_mode_is_refused_at_start_and_changes_nothing(
    bouncer, pg_uri, tmp_path
):
    """Through PgBouncer in transaction mode the store's lock (and the fleet's lease and
    LISTEN) would belong to a server session this daemon no longer talks to: refused with
    one line, before any table is made."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    through = bouncer("transaction").uri(dbname(pg_uri))
    msg = refused(
        run_alkfsd(str(tmp_path / "store"), str(mnt), "--create", "--database", through), mnt
    )
    assert "connection pooler in transaction or statement mode" in msg, msg
    assert "session mode" in msg, msg
    assert public_tables(pg_uri) == 0


def test_a_pooler_in_session_mode_serves(bouncer, start_pg_mount, pg_uri, tmp_path):
    through = bouncer("session").uri(dbname(pg_uri))
    m = start_pg_mount(tmp_path / "store", database=through)
    hexd = put(m, SMALL)
    assert cat(m.path("objects", "sha256", hexd)) == SMALL
    assert public_tables(pg_uri) > 0
    assert m.stop() == 0


def test_the_servers_connection_limit_is_named_in_the_refusal(pg_server, pg_uri, tmp_path):
    """A role allowed one connection: the daemon needs more (the lock's, the pool's), and
    the refusal says it is the connection limit and how many a daemon uses."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(pg_server.uri("postgres"), autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'alk_one'").fetchone():
            conn.execute("CREATE ROLE alk_one LOGIN CONNECTION LIMIT 1")
        conn.execute(
            sql.SQL("ALTER DATABASE {} OWNER TO alk_one").format(sql.Identifier(dbname(pg_uri)))
        )
    uri = pg_uri.replace("postgresql://postgres@", "postgresql://alk_one@", 1)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    msg = refused(run_alkfsd(str(tmp_path / "store"), str(mnt), "--create", "--database", uri), mnt)
    assert "too many connections for role" in msg, msg
    assert "the server's connection limit: each alkfsd uses up to 27 connections" in msg, msg
    assert public_tables(pg_uri) == 0


def test_the_connection_limit_met_while_mounted_is_eio_named_in_the_log_and_passes(
    pg_server, start_pg_mount, pg_uri, tmp_path
):
    """Mounted as a role whose CONNECTION LIMIT is then cut below what the daemon holds, and
    its sessions ended: reads of unread objects fail with EIO, the log line says it is the
    connection limit, the daemon lives; with the limit raised again, everything is served."""
    import psycopg
    from psycopg import sql

    admin = pg_server.uri("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'alk_lim'").fetchone():
            conn.execute("CREATE ROLE alk_lim LOGIN")
        conn.execute("ALTER ROLE alk_lim CONNECTION LIMIT -1")
        conn.execute(
            sql.SQL("ALTER DATABASE {} OWNER TO alk_lim").format(sql.Identifier(dbname(pg_uri)))
        )
    m = start_pg_mount(database=pg_uri.replace("postgresql://postgres@", "postgresql://alk_lim@"))
    unread = put(m, b"stored before the limit, not read since\n")
    try:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("ALTER ROLE alk_lim CONNECTION LIMIT 0")
        assert pg_server.terminate(dbname(pg_uri)) >= 2
        with pytest.raises(OSError) as caught, open(m.path("objects", "sha256", unread), "rb") as f:
            f.read()
        assert caught.value.errno == errno.EIO
        assert m.proc.poll() is None and m.mounted()
        # (a log line quotes the start of a reason: the connection limit comes first)
        said = [line for line in m.log().splitlines() if "the server's connection limit" in line]
        assert said and "each alkfsd uses up to 27 connections" in said[0], m.log()[-2000:]
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("ALTER ROLE alk_lim CONNECTION LIMIT -1")
    assert cat(m.path("objects", "sha256", unread)) == b"stored before the limit, not read since\n"
    assert m.tracebacks() == [], m.all_logs()[-6000:]


UNREACHABLE = "postgresql://someone:hunter2-secret@/nodb?host=/nonexistent/socket-dir"


def test_an_unreachable_database_is_refused_naming_the_uri_without_its_password(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    t0 = time.monotonic()
    done = run_alkfsd(str(tmp_path / "store"), str(mnt), "--create", "--database", UNREACHABLE)
    took = time.monotonic() - t0
    print(f"unreachable database refused in {took:.2f} s")
    assert "hunter2" not in done.stderr + done.stdout
    msg = refused(done, mnt)
    assert msg.startswith("alkfsd: cannot open the store "), msg
    assert "postgresql://someone@/nodb?host=/nonexistent/socket-dir" in msg, msg


# -- 7. a password is never shown -------------------------------------------------------------
PASSWORD = "sekr3t-pw"


@pytest.fixture
def alk_uri(pg_server, pg_uri) -> str:
    """pg_uri's database owned by a role `alk` with a password, as a URI holding it (trust
    auth: the password is accepted, never checked)."""
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict

    dbname = str(conninfo_to_dict(pg_uri)["dbname"])
    with psycopg.connect(pg_server.uri("postgres"), autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'alk'").fetchone()
        if not exists:
            conn.execute(f"CREATE ROLE alk LOGIN PASSWORD '{PASSWORD}'")
        conn.execute(sql.SQL("ALTER DATABASE {} OWNER TO alk").format(sql.Identifier(dbname)))
    return pg_uri.replace("postgresql://postgres@", f"postgresql://alk:{PASSWORD}@", 1)


def assert_no_password(m) -> None:
    cmdline = Path(f"/proc/{m.pid}/cmdline").read_bytes()
    assert b"postgresql://" not in cmdline, cmdline  # re-executed with the URI in the environment
    assert PASSWORD.encode() not in cmdline
    assert PASSWORD not in m.all_logs()
    st = m.path(".alkfs", "status").read_text()
    assert PASSWORD not in st
    assert json.loads(st)["database"]["engine"] == "postgresql"
    assert PASSWORD not in m.path(".alkfs", "metrics").read_text()
    binding = (m.store_path / "database").read_text()
    assert PASSWORD not in binding and "alk@" in binding, binding


def test_a_password_on_the_command_line_is_never_shown(start_pg_mount, alk_uri, tmp_path):
    m = start_pg_mount(database=alk_uri)
    assert f"--database={alk_uri}" not in m.command()  # (it was given: --database URI)
    assert alk_uri in m.command()
    put(m, SMALL)
    assert cat(m.path("objects", "sha256", sha(SMALL))) == SMALL
    assert_no_password(m)
    m.restart()
    assert_no_password(m)
    assert cat(m.path("objects", "sha256", sha(SMALL))) == SMALL
    assert m.stop() == 0
    assert PASSWORD not in m.all_logs()


def test_a_config_holding_a_password_must_be_private(start_mount, alk_uri, tmp_path):
    store, mnt = tmp_path / "store", tmp_path / "mnt"
    mnt.mkdir()
    cfg = tmp_path / "alkfsd.toml"
    cfg.write_text(f'store = "{store}"\nmountpoint = "{mnt}"\ndatabase = "{alk_uri}"\n')
    os.chmod(cfg, 0o644)
    done = run_alkfsd("--config", str(cfg))
    msg = refused(done, mnt, code=2)
    assert f"chmod 600 {cfg}" in msg, msg
    assert PASSWORD not in done.stderr
    assert not store.exists()

    os.chmod(cfg, 0o600)
    m = start_mount(store, "--window", "0", "--config", str(cfg), mnt=mnt)
    assert_no_password(m)
    put(m, SMALL)
    assert cat(m.path("objects", "sha256", sha(SMALL))) == SMALL
