"""alkfs/settings.py: every `ALKFS_*` knob parsed in one place (defaults, valid values, a
bad value: the default and a warning naming the variable), the accessor following the
process's environment, docs/operations.md listing the same variables, and no other
module of alkfs/ or daemon/ reading an `ALKFS_*` variable."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest

from alkfs import settings as settings_module
from alkfs.settings import Settings, log_priorities, settings

ROOT = Path(__file__).resolve().parents[2]

# variable -> (field, its default)
DEFAULTS: dict[str, tuple[str, object]] = {
    "ALKFS_PACKS": ("packs", True),
    "ALKFS_PACK_EVERY": ("pack_every_s", 60.0),
    "ALKFS_PACK_OBJECTS": ("pack_objects", 20_000),
    "ALKFS_PACK_POLL": ("pack_poll_s", None),
    "ALKFS_PACK_RETIRE_GRACE": ("pack_retire_grace_s", 300.0),
    "ALKFS_PACK_RETIRE_HOLD": ("pack_retire_hold_s", 3600.0),
    "ALKFS_PACK_RETIRED_MAX": ("pack_retired_max", 3),
    "ALKFS_DRAIN": ("drain", True),
    "ALKFS_INTENTS": ("intents", True),
    "ALKFS_INTENTS_GATHER_S": ("intents_gather_s", 0.05),
    "ALKFS_MAX_WRITE_HANDLES": ("max_write_handles", 64),
    "ALKFS_MAX_SPOOL_BYTES": ("max_spool_bytes", 1 << 30),
    "ALKFS_MAX_READ_HANDLES": ("max_read_handles", 1024),
    "ALKFS_ROOTS_GRACE": ("roots_grace_s", 7 * 86400.0),
    "ALKFS_ROOTS_ASK_TIMEOUT": ("roots_ask_timeout_s", 60.0),
    "ALKFS_MACHINE_ID": ("machine_id", ""),
    "ALKFS_MARK": ("mark", "git"),
    "ALKFS_FLEET_TTL": ("fleet_ttl_s", 60.0),
    "ALKFS_DEBUG": ("debug", False),
    "ALKFS_LOG_PRIORITIES": ("log_priorities", False),
    "ALKFS_STORE": ("store", ""),
    "ALKFS_MOUNT": ("mount", ""),
    "ALKFS_DATABASE": ("database", ""),
}

# (variable, value, what the field becomes): today's parse of each
VALID = [
    ("ALKFS_PACKS", "off", False),
    ("ALKFS_PACKS", "0", False),
    ("ALKFS_PACKS", "NO", False),
    ("ALKFS_PACKS", "on", True),
    ("ALKFS_PACK_EVERY", "0", 0.0),
    ("ALKFS_PACK_EVERY", "3600", 3600.0),
    ("ALKFS_PACK_OBJECTS", "2", 2.0),
    ("ALKFS_PACK_POLL", "0.2", 0.2),
    ("ALKFS_PACK_RETIRE_GRACE", "0.5", 0.5),
    ("ALKFS_PACK_RETIRE_HOLD", "6", 6.0),
    ("ALKFS_PACK_RETIRED_MAX", "2", 2),
    ("ALKFS_PACK_RETIRED_MAX", "2.7", 2),
    ("ALKFS_PACK_RETIRED_MAX", "-1", 0),
    ("ALKFS_DRAIN", "0", False),
    ("ALKFS_DRAIN", "1", True),
    ("ALKFS_INTENTS", "off", False),
    ("ALKFS_INTENTS_GATHER_S", "60", 60.0),
    ("ALKFS_MAX_WRITE_HANDLES", "8", 8),
    ("ALKFS_MAX_WRITE_HANDLES", "", 64),  # (empty: the default, no warning)
    ("ALKFS_MAX_SPOOL_BYTES", "1048576", 1 << 20),
    ("ALKFS_MAX_READ_HANDLES", "80", 80),
    ("ALKFS_ROOTS_GRACE", "0", 0.0),
    ("ALKFS_ROOTS_GRACE", "3s", 3.0),
    ("ALKFS_ROOTS_GRACE", " 1h ", 3600.0),
    ("ALKFS_ROOTS_GRACE", "", 7 * 86400.0),
    ("ALKFS_ROOTS_ASK_TIMEOUT", "3", 3.0),
    ("ALKFS_ROOTS_ASK_TIMEOUT", "1h", 3600.0),
    ("ALKFS_MACHINE_ID", " machine-a ", "machine-a"),
    ("ALKFS_MACHINE_ID", "m" * 300, "m" * 200),
    ("ALKFS_MARK", "python", "python"),
    ("ALKFS_MARK", "git", "git"),
    ("ALKFS_FLEET_TTL", "2", 2.0),
    ("ALKFS_FLEET_TTL", "", 60.0),
    ("ALKFS_DEBUG", "1", True),
    ("ALKFS_DEBUG", "0", True),  # (any value: as `alkfs` always read it)
    ("ALKFS_DEBUG", "", False),
    ("ALKFS_LOG_PRIORITIES", "1", True),
    ("ALKFS_LOG_PRIORITIES", " On ", True),
    ("ALKFS_LOG_PRIORITIES", "0", False),
]

# (variable, a value it cannot read)
BAD = [
    ("ALKFS_PACKS", "maybe"),
    ("ALKFS_PACK_EVERY", "soon"),
    ("ALKFS_PACK_EVERY", ""),
    ("ALKFS_PACK_OBJECTS", "many"),
    ("ALKFS_PACK_POLL", "x"),
    ("ALKFS_PACK_RETIRE_GRACE", "5m"),
    ("ALKFS_PACK_RETIRE_HOLD", "1h"),
    ("ALKFS_PACK_RETIRED_MAX", "two"),
    ("ALKFS_PACK_RETIRED_MAX", "inf"),
    ("ALKFS_DRAIN", "off"),  # (only 0 turns it off, as before: said, not obeyed)
    ("ALKFS_INTENTS", "never"),
    ("ALKFS_INTENTS_GATHER_S", "50ms"),
    ("ALKFS_MAX_WRITE_HANDLES", "1.5"),
    ("ALKFS_MAX_SPOOL_BYTES", "1G"),
    ("ALKFS_MAX_READ_HANDLES", "lots"),
    ("ALKFS_ROOTS_GRACE", "soon"),
    ("ALKFS_ROOTS_ASK_TIMEOUT", "2h"),
    ("ALKFS_ROOTS_ASK_TIMEOUT", "later"),
    ("ALKFS_MARK", "rust"),
    ("ALKFS_FLEET_TTL", "a minute"),
    ("ALKFS_LOG_PRIORITIES", "loud"),
]


def test_an_empty_environment_gives_every_default(caplog):
    caplog.set_level(logging.WARNING)
    got = Settings.from_env({})
    assert got == Settings()
    for name, (field, default) in DEFAULTS.items():
        assert getattr(got, field) == default, name
    assert got.pack_poll_interval_s == 5.0
    assert caplog.records == []


def test_every_field_has_its_variable():
    fields = set(Settings.__dataclass_fields__)
    assert fields == {field for field, _ in DEFAULTS.values()}


@pytest.mark.parametrize(("name", "text", "value"), VALID, ids=lambda x: str(x)[:20])
def test_a_valid_value_is_parsed(caplog, name: str, text: str, value: object):
    caplog.set_level(logging.WARNING)
    got = Settings.from_env({name: text})
    field, _ = DEFAULTS[name]
    assert getattr(got, field) == value
    assert caplog.records == []
    # the other fields keep their defaults
    rest = {f: getattr(got, f) for f, _ in DEFAULTS.values() if f != field}
    assert rest == {f: d for f, d in DEFAULTS.values() if f != field}


@pytest.mark.parametrize(("name", "text"), BAD, ids=lambda x: str(x)[:20])
def test_a_bad_value_gives_the_default_and_a_warning_naming_it(caplog, name: str, text: str):
    caplog.set_level(logging.WARNING)
    got = Settings.from_env({name: text})
    field, default = DEFAULTS[name]
    assert getattr(got, field) == default
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].getMessage().startswith(f"{name}={text[:40]!r} is not ")


def test_the_roots_grace_warning_says_what_the_mount_log_shows(caplog):
    """(tests/daemon/test_roots.py looks for this line in a daemon's log.)"""
    Settings.from_env({"ALKFS_ROOTS_GRACE": "soon"})
    assert "ALKFS_ROOTS_GRACE='soon' is not a duration: using 7d" in caplog.text


def test_the_poll_defaults_to_the_build_period_up_to_5s():
    assert Settings.from_env({"ALKFS_PACK_EVERY": "0"}).pack_poll_interval_s == 0.0
    assert Settings.from_env({"ALKFS_PACK_EVERY": "3600"}).pack_poll_interval_s == 5.0
    both = {"ALKFS_PACK_EVERY": "3600", "ALKFS_PACK_POLL": "0.2"}
    assert Settings.from_env(both).pack_poll_interval_s == 0.2


def test_log_priorities_reads_its_variable_alone_and_quietly(caplog):
    caplog.set_level(logging.WARNING)
    assert log_priorities({"ALKFS_LOG_PRIORITIES": "yes", "ALKFS_PACK_EVERY": "x"})
    assert not log_priorities({"ALKFS_LOG_PRIORITIES": "loud"})
    assert caplog.records == []


def test_the_accessor_follows_the_environment(monkeypatch, caplog):
    for name in DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    first = settings()
    assert first == Settings()
    assert settings() is first  # unchanged: not parsed again
    monkeypatch.setenv("ALKFS_DRAIN", "0")
    assert settings().drain is False
    monkeypatch.setenv("ALKFS_ROOTS_GRACE", "soon")
    caplog.clear()
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        assert settings().roots_grace_s == 7 * 86400.0
    assert len(caplog.records) == 1  # one warning per change, not per read
    monkeypatch.delenv("ALKFS_DRAIN")
    monkeypatch.delenv("ALKFS_ROOTS_GRACE")
    assert settings() == Settings()


def _variables_in_docs() -> set[str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    return set(re.findall(r"^\| `(ALKFS_[A-Z0-9_]+)` \|", text, re.MULTILINE))


def test_the_operations_guide_lists_the_fields():
    text = (ROOT / "docs" / "operations.md").read_text()
    assert _variables_in_docs() == set(DEFAULTS)
    for name, (field, _) in DEFAULTS.items():
        assert f"| `{name}` | `{field}` |" in text


def test_each_field_names_its_variable_in_its_comment():
    source = Path(settings_module.__file__).read_text()
    for name, (field, _) in DEFAULTS.items():
        assert re.search(rf"^    {field}: .*  # {name}: ", source, re.MULTILINE), field


VARIABLE = re.compile(r"ALKFS_[A-Z0-9_]+")


def _names_in(path: Path) -> list[tuple[int, str]]:
    """The `ALKFS_*` names a module spells as a string of its own (`environ.get("ALKFS_X")`,
    `NAME = "ALKFS_X"`, `f"ALKFS_{x}"`): not those in docstrings or messages."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if VARIABLE.fullmatch(node.value):
                out.append((node.lineno, node.value))
        elif isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            if isinstance(head, ast.Constant) and str(head.value).startswith("ALKFS_"):
                out.append((node.lineno, f"{head.value}..."))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "getenv":
            out.append((node.lineno, "os.getenv"))
    return sorted(out)


def test_no_module_but_settings_reads_an_alkfs_variable():
    found = []
    for top in ("alkfs", "daemon"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "alkfs/settings.py":
                continue
            for line, name in _names_in(path):
                found.append(f"{rel}:{line}: {name}")
    assert found == [], "read them in alkfs/settings.py"


def test_the_scan_sees_what_it_looks_for(tmp_path: Path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        '"""ALKFS_DOC in a docstring is not a read."""\n'
        "import os\n"
        'a = os.environ.get("ALKFS_X", "1")\n'
        'B = "ALKFS_Y"\n'
        'c = os.environ[f"ALKFS_{a}"]\n'
        'd = os.getenv("HOME")\n'
        'log = "ALKFS_Z=%r is bad"\n'
    )
    assert _names_in(probe) == [(3, "ALKFS_X"), (4, "ALKFS_Y"), (5, "ALKFS_..."), (6, "os.getenv")]
