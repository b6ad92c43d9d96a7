"""The figures behind /.alkfs/status (JSON) and /.alkfs/metrics (Prometheus), both
listed in docs/operations.md.

`figures()` reads the store (a GROUP BY and a walk of the large tier): call it
in a worker thread.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, TypedDict

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from alkfs.app import Status, Verifying

from .requests_stats import BOUNDS_S

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from alkfs.gc.sweep import SweepProgressFigures

    from .context import Context, PackFigures
    from .requests_stats import StatsSnapshot


class MountFigures(TypedDict):
    path: str | None
    read_only: bool
    pid: int


class ReserveFigures(TypedDict):
    size: int
    held: bool
    free_bytes: int


class Figures(Status):
    """The status JSON (docs/operations.md): the library's, and the mount's own."""

    mount: MountFigures
    next_sweep: str | None
    next_sweep_ts: float | None
    verifying: Verifying | None
    sweep_progress: SweepProgressFigures | None
    packs: dict[str, PackFigures]
    listings: dict[str, int | bool]
    intents: dict[str, int]
    disk_full: bool
    reserve: ReserveFigures | None


def figures(ctx: Context) -> Figures:
    """The status: the library's (Alkfs.status) plus where it is mounted and the daemon's
    own parts."""
    status = ctx.app.status()
    mount: MountFigures = {"path": ctx.mountpoint, "read_only": ctx.read_only, "pid": os.getpid()}
    # the periodic sweeps (--sweep-every): when the next one runs (None: none scheduled)
    nxt = ctx.next_sweep_ts
    # long work running now (`alkfs verify` and `alkfs sweep` through the mount show it as
    # they wait): a verify's objects looked at of those stored, a sweep's phase and figures
    # (alkfs/gc/sweep.py SweepProgress); null when none runs
    store = ctx.app.store
    done = store.verifying
    total = sum(c["count"] for c in status["objects"].values())
    progress = store.sweep_progress
    # the full-disk state of the store's reserve (alkfs/reserve.py): entered and left with
    # one log line each; `reserve` is None for a store that keeps none (a memory store)
    reserve = ctx.app.store.reserve
    return {
        **status,
        "mount": mount,
        "next_sweep": None
        if nxt is None
        else datetime.fromtimestamp(nxt, UTC).isoformat(timespec="seconds"),
        "next_sweep_ts": nxt,
        "verifying": None if done is None else {"done": done, "total": max(done, total)},
        "sweep_progress": None if progress is None else progress.copy(),
        # the git views' derived packs (daemon/packs.py keeps them on the context once
        # started): per format, the published generation, its object and pack counts,
        # bytes, build time
        "packs": ctx.packs_status(),
        # the directory listings the kernel caches (daemon/listings.py): opens decided in
        # Python, and the directories whose opens are answered in C (pyfuse3-cacheddirs.patch)
        "listings": ctx.listings.status(),
        # small files acknowledged ahead of their commit (alkfs/writebehind.py): this
        # file's open waited for them, so `pending` is what arrived since; `applied` counts
        "intents": ctx.pending.status(),
        "disk_full": reserve is not None and reserve.full,
        "reserve": None
        if reserve is None
        else {"size": reserve.size, "held": reserve.have, "free_bytes": reserve.free()},
    }


def status_json(ctx: Context) -> bytes:
    return (json.dumps(figures(ctx), indent=2) + "\n").encode()


class _Figures:
    """A prometheus_client collector over one snapshot of the figures."""

    def __init__(
        self, fig: Figures, errors: dict[tuple[str, int], int], stats: StatsSnapshot
    ) -> None:
        self.fig = fig
        self.errors = errors
        self.stats = stats

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        fig = self.fig
        count = GaugeMetricFamily("alkfs_objects", "Objects stored", labels=["algo", "tier"])
        size = GaugeMetricFamily("alkfs_object_bytes", "Bytes stored", labels=["algo"])
        for algo, c in fig["objects"].items():
            count.add_metric([algo, "kv"], c["kv"])
            count.add_metric([algo, "large"], c["large"])
            if "packs" in c:  # (git objects kept in their packs alone)
                count.add_metric([algo, "packs"], c["packs"])
            size.add_metric([algo], c["bytes"])
        yield count
        yield size
        disk = GaugeMetricFamily(
            "alkfs_disk_bytes", "Bytes on disk by part of the store", labels=["part"]
        )
        for part, value in fig["disk"].items():
            if value is not None:
                disk.add_metric([part], value)
        yield disk
        pack_objects = GaugeMetricFamily(
            "alkfs_pack_objects", "Objects in the published packs", labels=["format"]
        )
        pack_bytes = GaugeMetricFamily(
            "alkfs_pack_bytes", "Bytes of the published packs' files", labels=["format"]
        )
        pack_gen = GaugeMetricFamily(
            "alkfs_pack_generation", "The published pack set's generation", labels=["format"]
        )
        for fmt, p in (fig.get("packs") or {}).items():
            pack_objects.add_metric([fmt], p["objects"])
            pack_bytes.add_metric([fmt], p["bytes"])
            pack_gen.add_metric([fmt], p["generation"] or 0)
        yield pack_objects
        yield pack_bytes
        yield pack_gen
        yield GaugeMetricFamily("alkfs_pins", "Durable pins", value=fig["pins"])
        yield GaugeMetricFamily("alkfs_repos", "Repositories", value=fig["repos"])
        yield GaugeMetricFamily("alkfs_roots", "Registered borrowers", value=fig["roots"])
        yield GaugeMetricFamily(
            "alkfs_staged_objects", "Candidates in the delete window", fig["staged"]["count"]
        )
        yield GaugeMetricFamily(
            "alkfs_staged_bytes", "Bytes of the candidates in the window", fig["staged"]["bytes"]
        )
        if fig.get("next_sweep_ts") is not None:
            yield GaugeMetricFamily(
                "alkfs_next_sweep_timestamp_seconds",
                "When the next periodic sweep runs (Unix time)",
                fig["next_sweep_ts"],
            )
        yield GaugeMetricFamily(
            "alkfs_corrupt_objects", "Objects whose bytes do not hash", value=len(fig["corrupt"])
        )
        yield GaugeMetricFamily(
            "alkfs_sweeping", "1 while a sweep runs", value=int(fig["sweeping"])
        )
        yield GaugeMetricFamily(
            "alkfs_disk_full", "1 while the store's disk is full", value=int(fig["disk_full"])
        )
        held = fig["reserve"]["size"] if fig["reserve"] and fig["reserve"]["held"] else 0
        yield GaugeMetricFamily("alkfs_reserve_bytes", "Bytes the reserve holds", value=held)
        st = fig["store"]
        yield GaugeMetricFamily("alkfs_threshold_bytes", "kv/large threshold", st["threshold"])
        yield GaugeMetricFamily("alkfs_window_seconds", "Sweep delete window", st["window_s"])
        last = fig["last_sweep"]
        if last is not None:
            for field in (
                "candidates_staged",
                "deleted",
                "cancelled_by_arbitration",
                "live",
                "scanned",
                "bytes_freed",
            ):
                yield GaugeMetricFamily(
                    f"alkfs_last_sweep_{field}", f"Last sweep: {field}", value=last[field]
                )
            yield GaugeMetricFamily(
                "alkfs_last_sweep_duration_seconds", "Last sweep: duration", last["duration_s"]
            )
            yield GaugeMetricFamily(
                "alkfs_last_sweep_aborted",
                "Last sweep aborted (1) or ran (0)",
                int(bool(last["aborted"])),
            )
        fleet = fig.get("fleet")
        if fleet is not None:
            nodes = fleet["nodes"]
            yield GaugeMetricFamily(
                "alkfs_fleet_members", "Live daemons of the fleet", sum(n["live"] for n in nodes)
            )
            rows = GaugeMetricFamily(
                "alkfs_fleet_pin_rows", "Pin rows a member holds", labels=["node", "host", "pid"]
            )
            lease = GaugeMetricFamily(
                "alkfs_fleet_sweep_lease",
                "1 for the member holding the sweep lease",
                labels=["node"],
            )
            for n in nodes:
                rows.add_metric([n["id"], n["host"], str(n["pid"])], n["pins"])
                lease.add_metric([n["id"]], int(n["sweeping"]))
            yield rows
            yield lease
        errs = CounterMetricFamily(
            "alkfs_fuse_errors", "FUSE requests answered with an error", labels=["op", "errno"]
        )
        for (op, code), times in sorted(self.errors.items()):
            errs.add_metric([op, errno.errorcode.get(code, str(code))], times)
        yield errs
        yield from _requests(self.stats)


def _requests(stats: StatsSnapshot) -> Iterator[Metric]:
    """The FUSE requests that reached Python (daemon/requests_stats.py)."""
    hist = HistogramMetricFamily(
        "alkfs_fuse_request_seconds",
        "FUSE requests answered in Python, by operation, and how long they took",
        labels=["op"],
    )
    for op, (_count, seconds, buckets) in sorted(stats["ops"].items()):
        cumulative, running = [], 0
        for bound, n in zip((*BOUNDS_S, float("inf")), buckets, strict=True):
            running += n
            cumulative.append(("+Inf" if bound == float("inf") else repr(bound), running))
        hist.add_metric([op], cumulative, sum_value=seconds)
    yield hist
    yield CounterMetricFamily(
        "alkfs_fuse_read_bytes", "Bytes answered to READ requests", value=stats["read_bytes"]
    )
    yield CounterMetricFamily(
        "alkfs_fuse_written_bytes", "Bytes taken by WRITE requests", value=stats["written_bytes"]
    )


def metrics_text(
    ctx: Context, errors: dict[tuple[str, int], int], stats: StatsSnapshot | None = None
) -> bytes:
    """Prometheus text; `errors` is a copy of ctx.errors, `stats` a snapshot of
    ctx.stats, taken on the trio thread."""
    registry = CollectorRegistry(auto_describe=False)
    snap = stats if stats is not None else ctx.stats.snapshot()
    registry.register(_Figures(figures(ctx), errors, snap))
    return generate_latest(registry)


class _Scrape:
    """The collector the HTTP listener serves: a fresh snapshot at every scrape (in the
    listener's thread: the store is read there, never on the trio thread)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        ctx = self.ctx
        for _ in range(3):
            try:
                errors = dict(ctx.errors)  # (the trio thread may add a key meanwhile)
                break
            except RuntimeError:
                continue
        else:
            errors = {}
        yield from _Figures(figures(ctx), errors, ctx.stats.snapshot()).collect()


def serve_metrics(ctx: Context, listen: str) -> tuple[WSGIServer, threading.Thread]:
    """Start the HTTP listener of `--metrics-listen HOST:PORT` (prometheus_client's, a
    thread of its own): (server, thread); `server.shutdown()` ends it."""
    host, _, port = listen.rpartition(":")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Scrape(ctx))
    return start_http_server(int(port), addr=host.strip("[]") or "127.0.0.1", registry=registry)
