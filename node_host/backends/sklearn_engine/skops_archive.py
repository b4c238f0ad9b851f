"""What a .skops file holds, bounded before skops reads it (pure: the file's bytes in, its node types out).

skops reads the zip members a node names whole while it builds its tree, before any trust decision
(`get_untrusted_types` already does), and a schema may name one highly compressed member many times: a
0.19 MiB file made the loader hold 4.3 GiB. zipfile itself turns every entry of the central directory
into an object when the archive opens. So, before skops sees the bytes (`ArchiveLimits` says how much):

- the member count is bounded before zipfile opens the archive, by counting the bytes that begin a
  central directory entry (an entry zipfile reads begins with them, wherever the end record says the
  directory is), and again after;
- the members' uncompressed sizes (zipfile never yields more than an entry declares) total at most
  `uncompressed_limit(file size)`: a multiple of the file's size above a floor, under an absolute cap;
- schema.json is bounded in size and nesting;
- no member is named by two nodes: skops writes an object it meets again as a reference to its id, so
  a file naming a member twice was not written by skops, and would be read twice;
- a named member that is itself a zip (scipy.sparse.load_npz reads a sparse matrix's .npz, decompressing
  its arrays) is held to the same bounds, its members counted in the total.

`inspect` returns the (module, name) of every node, as skops will import and look them up, so the worker
can check the types a spec trusts where skops will find them.
"""

from __future__ import annotations

import io
import json
import lzma
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sie.errors import Problem, SpecError

MiB = 1024**2
_DIRECTORY_ENTRY = b"PK\x01\x02"  # the signature that begins every central directory entry
Refuse = Callable[[str], SpecError]
# What zipfile and its decompressors raise for a damaged archive or member (an encrypted member is a
# RuntimeError, an unknown compression method NotImplementedError, bzip2's bad data an OSError).
_UNREADABLE = (
    zipfile.BadZipFile,
    zlib.error,
    lzma.LZMAError,
    ValueError,
    EOFError,
    NotImplementedError,
    RuntimeError,
    OSError,
)


@dataclass(frozen=True)
class ArchiveLimits:
    max_members: int = 100_000
    """Members of one archive: a forest of 1,000 trees has about 3,000, a boosted model 10 per tree and class."""
    max_schema_bytes: int = 32 * MiB
    """schema.json's size: about 1 KiB a tree; parsed, it takes about ten times that in memory."""
    max_depth: int = 256
    """Nesting of schema.json (objects and lists): a pipeline nests a few dozen; skops recurses per level."""
    ratio: int = 64
    """Uncompressed bytes allowed per byte of the file, beyond the floor (deflated float arrays shrink 2-10
    times; skops stores members uncompressed by default)."""
    floor_bytes: int = 256 * MiB
    """Uncompressed bytes any file may hold, however small (a sparse model's zeros compress well)."""
    max_bytes: int = 4 * 1024**3
    """Uncompressed bytes no file may exceed: the most a scorer's model may take in memory."""

    def uncompressed_limit(self, file_bytes: int) -> int:
        return min(self.max_bytes, max(self.floor_bytes, self.ratio * file_bytes))


def inspect(data: bytes, name: str, limits: ArchiveLimits = ArchiveLimits()) -> frozenset[tuple[str, str]]:
    """The (module, name) of every node in the skops file `data` (called `name` in messages), or SpecError
    at spec.model.path saying which bound it exceeds."""

    def refuse(reason: str) -> SpecError:
        return SpecError("spec.model.path", [Problem("spec.model.path", f"{name}: {reason}")])

    limit = limits.uncompressed_limit(len(data))
    with _open(data, limits, refuse) as archive:
        total = _uncompressed(archive, limits, refuse)
        if total > limit:
            raise refuse(_too_large(total, limit, len(data), limits))
        try:
            info = archive.getinfo("schema.json")
        except KeyError:
            raise refuse("no schema.json; save the estimator with skops.io.dump") from None
        if info.file_size > limits.max_schema_bytes:
            raise refuse(f"schema.json has {info.file_size} bytes, more than {limits.max_schema_bytes}")
        try:
            schema = json.loads(archive.read(info))
        except (*_UNREADABLE, RecursionError) as exc:  # RecursionError: JSON nested past the parser's stack
            raise refuse(f"schema.json does not read as JSON ({str(exc)[:200]})") from None
        types, files = _walk(schema, limits, refuse)
        for member in files:
            total += _nested(archive, member, limits, refuse)
            if total > limit:
                raise refuse(_too_large(total, limit, len(data), limits))
    return types


def _open(data: bytes, limits: ArchiveLimits, refuse: Refuse) -> zipfile.ZipFile:
    entries = data.count(_DIRECTORY_ENTRY)  # at least the entries zipfile would make objects of on open
    if entries > limits.max_members:
        raise refuse(f"{entries} zip entries, more than {limits.max_members}")
    try:
        return zipfile.ZipFile(io.BytesIO(data))
    except _UNREADABLE as exc:
        raise refuse(f"not a readable zip archive ({str(exc)[:200]})") from None


def _uncompressed(archive: zipfile.ZipFile, limits: ArchiveLimits, refuse: Refuse) -> int:
    members = archive.infolist()
    if len(members) > limits.max_members:
        raise refuse(f"{len(members)} members, more than {limits.max_members}")
    return sum(m.file_size for m in members)


def _too_large(total: int, limit: int, file_bytes: int, limits: ArchiveLimits) -> str:
    return (
        f"its members hold {total} bytes uncompressed, more than the {limit} allowed for a file of {file_bytes} "
        f"bytes ({limits.ratio} times its size, at least {limits.floor_bytes}, at most {limits.max_bytes})"
    )


def _walk(schema: Any, limits: ArchiveLimits, refuse: Refuse) -> tuple[frozenset[tuple[str, str]], list[str]]:
    """The node types and the members named, in order; SpecError for a member named twice or a schema
    nested too deep. Iterative, so a deep schema cannot exhaust the stack here."""
    types: set[tuple[str, str]] = set()
    files: list[str] = []
    named: set[str] = set()
    pending: list[tuple[Any, int]] = [(schema, 0)]
    while pending:
        node, depth = pending.pop()
        if depth > limits.max_depth:
            raise refuse(f"schema.json is nested more than {limits.max_depth} levels deep")
        if isinstance(node, list):
            pending.extend((item, depth + 1) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        module, cls = node.get("__module__"), node.get("__class__")
        if isinstance(module, str) and isinstance(cls, str):
            types.add((module, cls))
        member = node.get("file")
        if "__loader__" in node and isinstance(member, str):
            if member in named:
                raise refuse(
                    f"schema.json names the member {member[:100]!r} more than once; skops writes a shared "
                    "object once, so this file was not written by skops.io.dump"
                )
            named.add(member)
            files.append(member)
        pending.extend((value, depth + 1) for value in node.values())
    return frozenset(types), files


def _nested(archive: zipfile.ZipFile, member: str, limits: ArchiveLimits, refuse: Refuse) -> int:
    """Uncompressed bytes inside `member` when it is a zip itself (scipy's .npz), bounded like the file;
    0 otherwise. A member that is missing, or not a zip zipfile can read, is skops' to refuse: numpy and
    scipy cannot read it either."""
    try:
        with archive.open(member) as stream:
            if stream.read(2) != b"PK":
                return 0
        inner = archive.read(member)
    except KeyError:
        return 0
    except _UNREADABLE as exc:
        raise refuse(f"member {member[:100]!r} does not read ({str(exc)[:200]})") from None
    entries = inner.count(_DIRECTORY_ENTRY)
    if entries > limits.max_members:
        raise refuse(f"member {member[:100]!r} is a zip of {entries} entries, more than {limits.max_members}")
    try:
        nested = zipfile.ZipFile(io.BytesIO(inner))
    except _UNREADABLE:
        return 0
    with nested:
        return _uncompressed(nested, limits, refuse)
