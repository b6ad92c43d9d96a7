"""The wiring every caller uses: a store with its refs and pins, both registered as liveness sources."""

from __future__ import annotations

import os

from .git.closure import RefClosure
from .git.refs import Refs
from .pins import Pins
from .store import DEFAULT_THRESHOLD, Store


class Alkfs:
    """An opened store plus its git refs (`refs`) and durable pins (`pins`)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.refs = Refs(store)
        self.closure = RefClosure(store, self.refs)
        self.pins = Pins(store, closure=self.closure)
        self._tokens = [store.register_source(self.closure), store.register_source(self.pins)]

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        mode: str | None = None,
        threshold: int | None = None,
        window_s: float | None = None,
        lock: bool = True,
    ) -> Alkfs:
        store = Store.open(path, mode=mode, threshold=threshold, window_s=window_s, lock=lock)
        try:
            return cls(store)
        except BaseException:
            store.close()
            raise

    @classmethod
    def memory(cls, threshold: int | None = None, window_s: float = 0) -> Alkfs:
        return cls(Store.memory(threshold or DEFAULT_THRESHOLD, window_s))

    def close(self) -> None:
        for token in self._tokens:
            self.store.unregister(token)
        self._tokens = []
        self.store.close()

    def __enter__(self) -> Alkfs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
