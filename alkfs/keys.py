"""Algorithms and keys: a key is one algorithm byte followed by the digest."""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import blake3

from .errors import Invalid


class Hasher(Protocol):
    def update(self, data: bytes, /) -> object: ...
    def digest(self) -> bytes: ...


class Algorithm(enum.Enum):
    """The four digest algorithms; value is the key's first byte."""

    SHA256 = 1
    BLAKE3 = 2
    GIT_SHA1 = 3
    GIT_SHA256 = 4

    @property
    def label(self) -> str:
        return _LABELS[self]

    @property
    def hex_len(self) -> int:
        return 40 if self is Algorithm.GIT_SHA1 else 64

    @property
    def digest_len(self) -> int:
        return self.hex_len // 2

    @property
    def is_git(self) -> bool:
        return self in (Algorithm.GIT_SHA1, Algorithm.GIT_SHA256)

    def hasher(self) -> Hasher:
        if self is Algorithm.BLAKE3:
            return blake3.blake3()
        if self is Algorithm.GIT_SHA1:
            return hashlib.sha1()
        return hashlib.sha256()

    @classmethod
    def from_label(cls, label: str) -> Algorithm:
        try:
            return _BY_LABEL[label]
        except KeyError:
            raise Invalid(f"unknown algorithm {label!r}") from None

    @classmethod
    def from_byte(cls, byte: int) -> Algorithm:
        try:
            return cls(byte)
        except ValueError:
            raise Invalid(f"unknown algorithm byte {byte:#x}") from None


_LABELS = {
    Algorithm.SHA256: "sha256",
    Algorithm.BLAKE3: "blake3",
    Algorithm.GIT_SHA1: "git-sha1",
    Algorithm.GIT_SHA256: "git-sha256",
}
_BY_LABEL = {v: k for k, v in _LABELS.items()}
HASH_OF: dict[int, Callable[[bytes], Hasher]] = {  # the byte's hash, taking the data
    Algorithm.SHA256.value: hashlib.sha256,
    Algorithm.BLAKE3.value: blake3.blake3,
    Algorithm.GIT_SHA1.value: hashlib.sha1,
    Algorithm.GIT_SHA256.value: hashlib.sha256,
}
ALGORITHMS = tuple(Algorithm)
_TAGS = {a: bytes([a.value]) for a in Algorithm}
_KEY_SIZE = {a.value: 1 + a.digest_len for a in Algorithm}  # a key's length by its first byte
_PREFIX = {a: bytes([a.value]) for a in Algorithm}
_HEX = re.compile(r"[0-9a-f]+\Z")


def is_hex(text: str, length: int) -> bool:
    """Strict lowercase hex of exactly `length` digits."""
    return len(text) == length and _HEX.match(text) is not None


@dataclass(frozen=True, order=True, slots=True)
class Key:
    """An object's name: the algorithm byte plus the digest (`raw`)."""

    raw: bytes

    def __post_init__(self) -> None:
        # (a table lookup, not Algorithm(byte): keys are made per object listed or read)
        raw = self.raw
        if not raw:
            raise Invalid("empty key")
        size = _KEY_SIZE.get(raw[0])
        if size is None:
            Algorithm.from_byte(raw[0])  # (raises Invalid)
        if len(raw) != size:
            raise Invalid("key has the wrong digest length")

    @classmethod
    def of(cls, algo: Algorithm, digest: bytes) -> Key:
        return cls(_PREFIX[algo] + digest)

    @classmethod
    def from_hex(cls, algo: Algorithm, hexdigest: str) -> Key:
        if not is_hex(hexdigest, algo.hex_len):
            raise Invalid(f"not a {algo.label} digest: {hexdigest!r}")
        return cls.of(algo, bytes.fromhex(hexdigest))

    @classmethod
    def parse(cls, text: str) -> Key:
        """`<algo>/<hex>`, or a bare hex: 64 digits is sha256, 40 is git-sha1."""
        if "/" in text:
            label, _, hexdigest = text.partition("/")
            return cls.from_hex(Algorithm.from_label(label), hexdigest)
        if len(text) == 40:
            return cls.from_hex(Algorithm.GIT_SHA1, text)
        return cls.from_hex(Algorithm.SHA256, text)

    @classmethod
    def digest_of(cls, algo: Algorithm, data: bytes) -> Key:
        """The key of `data` (`derive` without the checks a key from outside needs)."""
        key = object.__new__(cls)
        object.__setattr__(key, "raw", _TAGS[algo] + HASH_OF[algo.value](data).digest())
        return key

    @staticmethod
    def size_of(first: int) -> int:
        """The length of a raw key whose algorithm byte is `first` (Invalid: no such)."""
        size = _KEY_SIZE.get(first)
        if size is None:
            raise Invalid(f"no algorithm has the byte {first}")
        return size

    @classmethod
    def derive(cls, algo: Algorithm, data: bytes) -> Key:
        return cls.of(algo, HASH_OF[algo.value](data).digest())

    def matches(self, data: bytes) -> bool:
        """Whether `data` hashes to this key (no Key built: a verified small get's check)."""
        return HASH_OF[self.raw[0]](data).digest() == self.raw[1:]

    @property
    def algo(self) -> Algorithm:
        return Algorithm(self.raw[0])

    @property
    def digest(self) -> bytes:
        return self.raw[1:]

    @property
    def hex(self) -> str:
        return self.raw[1:].hex()

    def __str__(self) -> str:
        return f"{self.algo.label}/{self.hex}"

    def __repr__(self) -> str:
        return f"Key({self})"
