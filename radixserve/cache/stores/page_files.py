"""The storage tier's backends: where its pages live, behind one small interface.

A page is one KV page of the tree (`--page-size` tokens, every layer's K and V in the device pool's
bytes), named by its chained page hash (`block_hash.page_hashes`, the KV events' hash: it stands for
the whole prefix up to the page's end). A record carries what proves it is the page asked for: the
hash it chains from, its token ids and a CRC-32 of its bytes. A read checks all three; a mismatch
is a corrupt page, which is dropped and reported as missing (the caller computes those tokens), so
a bit flip or a truncated file never turns into wrong tokens.

`LocalFileBackend` (the default) keeps one file per page under `<dir>/pages/`, written to a
temporary name and renamed, so a crash never leaves half a page under a page's name; the directory
listing is the truth at start-up (pages written after the last index save are found by the scan),
`index.bin` only remembers the least-recently-used order across restarts. `STAMP.json` is the
version stamp: a directory written by another model, page size, KV dtype, hash scheme or
tensor-parallel layout is not read (one warning line; its pages are removed). Under tp N each rank
has a directory of its own, `tp<N>-rank<r>` under --storage-dir, stamped with the tp size and its
rank; the pages another tp size wrote (tp 1's at the top, tp M's in their own rank directories)
are left alone and not read (`other_tp_layouts`: one warning line each), and one server at a
time holds the directory (an exclusive `flock` on `LOCK`).

A hybrid model's store holds a second record kind beside its pages: a recurrent-state snapshot
(every linear-attention layer's conv window and recurrent state at a page's end), named by
`snapshot_key` of the hash of the page it ends, and chaining from that page's hash (so a snapshot
is checked to be the one of that prefix as a page is). It has its own magic and its own CRC-32;
the stamp's `states` (the state shapes and dtypes) refuses another model's states.

`RedisBackend` (stores/redis_pages.py) keeps the same records in a Redis server that several
workers share.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import struct
import time
import zlib
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Protocol, Sequence

logger = logging.getLogger("radixserve")

FORMAT_VERSION = 1
# Page reads in flight at once (the store's reader threads, and the start-up measurement's): an
# NVMe drive reaches its bandwidth only with many requests queued.
READ_THREADS = 8
HASH_SCHEME = "blake2b-64 chained pages (block_hash.page_hashes), namespace parents (namespace_page_parent)"
_MAGIC = b"RXKVPAGE"
_SNAPSHOT_MAGIC = b"RXSTSNAP"  # a recurrent-state snapshot's record (a hybrid model's)
PAGE, SNAPSHOT = "page", "snapshot"  # PageRecord.kind
# magic, format, key, parent (+1: 0 means the root), tokens, payload bytes, payload crc32
_HEADER = struct.Struct("<8sHQQIQI")
_INDEX_MAGIC = b"RXKVIDX1"


@dataclass(frozen=True)
class StoreStamp:
    """What a page's bytes depend on: pages written under another stamp are never read."""
    model: str
    page_size: int
    kv_dtype: str
    bytes_per_token: int
    num_layers: int
    tp_size: int = 1
    tp_rank: int = 0
    format_version: int = FORMAT_VERSION
    hash_scheme: str = HASH_SCHEME
    # A hybrid model's snapshot records: the state shapes and dtypes they hold ("": no snapshots).
    states: str = ""

    def to_json(self) -> str:
        fields = asdict(self)
        if not fields["states"]:  # an attention model's stamp reads as before snapshots were stored
            del fields["states"]
        return json.dumps(fields, sort_keys=True)

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.bytes_per_token


@dataclass
class PageRecord:
    key: int
    parent: Optional[int]  # the page hash it chains from; None at the root (a snapshot: the page it ends)
    tokens: Sequence[int]  # a snapshot's: none (its page's hash names its prefix)
    kind: str = PAGE  # PAGE | SNAPSHOT


def snapshot_key(page_hash: int) -> int:
    """The key of the state snapshot at the end of the page named page_hash (a hash of it, so it
    never names a page)."""
    digest = hashlib.blake2b(b"state snapshot" + page_hash.to_bytes(8, "big"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def snapshot_record(page_hash: int) -> PageRecord:
    return PageRecord(snapshot_key(page_hash), page_hash, (), SNAPSHOT)


def _magic(record: PageRecord) -> bytes:
    return _SNAPSHOT_MAGIC if record.kind == SNAPSHOT else _MAGIC


class PageMissing(Exception):
    """A page could not be read as asked (gone, unreadable or corrupt); why is the message."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # "missing" | "corrupt" | "error"


class PageBackend(Protocol):
    """Where pages live. Called from the storage tier's I/O process only (never from the step)."""
    capacity_bytes: int
    shared: bool  # other servers write to it too: its keys are listed again from time to time

    def open(self, stamp: StoreStamp) -> list[int]:
        """Take the store for this stamp; the keys it holds, least recently used first."""

    def put(self, record: PageRecord, payload: memoryview) -> None:
        """Store a page (an OSError, e.g. ENOSPC, leaves nothing behind)."""

    def get_into(self, record: PageRecord, out: memoryview) -> None:
        """Read the page named record.key into out (PageMissing when it cannot be had as asked)."""

    def remove(self, key: int) -> None: ...

    def make_room(self, nbytes: int) -> list[int]:
        """Drop least recently used pages until nbytes more fit; the keys dropped."""

    def list_keys(self) -> list[int]:
        """The keys it holds now (a shared backend: others' pages too)."""

    def probe_read_bandwidth(self, page_bytes: int) -> float:
        """Bytes per second of page-sized reads, latency included."""

    def close(self) -> None: ...


def _encode_parent(parent: Optional[int]) -> int:
    return 0 if parent is None else (parent + 1) % (1 << 64) or 1  # 0 is the root; a hash of 2**64-1 folds to 1


def encode_page(record: PageRecord, payload: memoryview) -> tuple[bytes, bytes]:
    """A page's header and token ids (its payload follows them)."""
    header = _HEADER.pack(_magic(record), FORMAT_VERSION, record.key, _encode_parent(record.parent), len(record.tokens),
                          payload.nbytes, zlib.crc32(payload))
    return header, array("q", record.tokens).tobytes()


def check_header(record: PageRecord, header: bytes, nbytes: int) -> int:
    """The payload's CRC-32 from a header that names record (PageMissing "corrupt" otherwise)."""
    if len(header) < _HEADER.size:
        raise PageMissing("corrupt", "a truncated header")
    magic, version, key, parent, ntokens, size, crc = _HEADER.unpack(header)
    if magic != _magic(record) or version != FORMAT_VERSION or key != record.key:
        raise PageMissing("corrupt", "not this page's header")
    if parent != _encode_parent(record.parent) or ntokens != len(record.tokens) or size != nbytes:
        raise PageMissing("corrupt", "another prefix's page under this hash")
    return crc


def check_page(record: PageRecord, data: bytes, out: memoryview) -> None:
    """Copy a whole page's bytes (header, tokens, payload) into out after checking them all."""
    crc = check_header(record, data[:_HEADER.size], out.nbytes)
    start = _HEADER.size + 8 * len(record.tokens)
    if data[_HEADER.size:start] != array("q", record.tokens).tobytes():
        raise PageMissing("corrupt", "other tokens under this hash")
    payload = memoryview(data)[start:]
    if payload.nbytes != out.nbytes or zlib.crc32(payload) != crc:
        raise PageMissing("corrupt", "its bytes fail their checksum")
    out[:] = payload


class LocalFileBackend:
    """One file per page under `directory`, at most `capacity_bytes` of them (LRU)."""
    shared = False

    def __init__(self, directory: str, capacity_bytes: int, *, read_latency_s: float = 0.0):
        self.root = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.read_latency_s = read_latency_s
        self.pages = self.root / "pages"
        self._sizes: OrderedDict[int, int] = OrderedDict()  # key -> file bytes, least recently used first
        self.used_bytes = 0
        self._lock_fd: Optional[int] = None

    # ------------------------------------------------------------------ opening
    def open(self, stamp: StoreStamp) -> list[int]:
        # Page records hold every tenant's token ids, salted ones too: the server's user alone reads them.
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.pages.mkdir(mode=0o700, exist_ok=True)
        self._take_lock()
        stamp_path = self.root / "STAMP.json"
        wanted = stamp.to_json()
        try:
            found: Optional[str] = stamp_path.read_text()
        except FileNotFoundError:
            found = None
        if found is not None and found.strip() != wanted:
            logger.warning("storage tier: %s holds pages of another configuration (%s; this server: %s): "
                           "not reading them; they are removed", self.root, _differences(found, stamp), wanted)
            self._remove_all_pages()
        if found is None or found.strip() != wanted:
            tmp = stamp_path.with_suffix(".tmp")
            tmp.write_text(wanted + "\n")
            os.replace(tmp, stamp_path)
        return self._scan()

    def _take_lock(self) -> None:
        fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(f"storage_dir {self.root} is in use by another server (its LOCK is held): give each "
                             "server its own directory") from None
        self._lock_fd = fd

    def _remove_all_pages(self) -> None:
        for entry in os.scandir(self.pages):
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass
        try:
            os.unlink(self.root / "index.bin")
        except FileNotFoundError:
            pass

    def _scan(self) -> list[int]:
        """The pages on disk, in the LRU order index.bin remembers (pages it does not know: newest)."""
        on_disk: dict[int, int] = {}
        for entry in os.scandir(self.pages):
            name = entry.name
            if name.endswith(".tmp"):  # a write the last process did not finish
                os.unlink(entry.path)
                continue
            if not name.endswith(".page"):
                continue
            try:
                on_disk[int(name[:-5], 16)] = entry.stat().st_size
            except (ValueError, FileNotFoundError):
                continue
        order = [k for k in self._read_index() if k in on_disk]
        known = set(order)
        order += [k for k in on_disk if k not in known]
        for key in order:
            self._sizes[key] = on_disk[key]
            self.used_bytes += on_disk[key]
        dropped = self.make_room(0)  # a smaller --storage-size than last time
        return [k for k in order if k not in set(dropped)]

    def _read_index(self) -> list[int]:
        try:
            data = (self.root / "index.bin").read_bytes()
        except FileNotFoundError:
            return []
        if not data.startswith(_INDEX_MAGIC) or (len(data) - 12) % 8 or len(data) < 12:
            return []
        body = data[8:-4]
        if zlib.crc32(body) != int.from_bytes(data[-4:], "little"):
            return []  # a torn index: the scan alone gives the pages, in no particular order
        keys = array("Q")
        keys.frombytes(body)
        return list(keys)

    def save_index(self) -> None:
        body = array("Q", self._sizes.keys()).tobytes()
        tmp = self.root / "index.tmp"
        tmp.write_bytes(_INDEX_MAGIC + body + zlib.crc32(body).to_bytes(4, "little"))
        os.replace(tmp, self.root / "index.bin")

    # ------------------------------------------------------------------ pages
    def _path(self, key: int) -> Path:
        return self.pages / f"{key:016x}.page"

    def make_room(self, nbytes: int) -> list[int]:
        dropped = []
        while self._sizes and self.used_bytes + nbytes > self.capacity_bytes:
            key, _ = next(iter(self._sizes.items()))
            self.remove(key)
            dropped.append(key)
        return dropped

    def probe_read_bandwidth(self, page_bytes: int) -> float:
        return probe_read_bandwidth(str(self.root), page_bytes, read_latency_s=self.read_latency_s)

    def put(self, record: PageRecord, payload: memoryview) -> None:
        header, tokens = encode_page(record, payload)
        size = len(header) + len(tokens) + payload.nbytes
        if size > self.capacity_bytes:
            raise OSError(errno.ENOSPC, f"a page of {size} bytes is larger than storage_size")
        path = self._path(record.key)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(tokens)
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        if record.key in self._sizes:
            self.used_bytes -= self._sizes.pop(record.key)
        self._sizes[record.key] = size
        self.used_bytes += size

    def get_into(self, record: PageRecord, out: memoryview) -> None:
        if self.read_latency_s:
            time.sleep(self.read_latency_s)
        try:
            with open(self._path(record.key), "rb", buffering=0) as f:
                crc = check_header(record, f.read(_HEADER.size), out.nbytes)
                if f.read(8 * len(record.tokens)) != array("q", record.tokens).tobytes():
                    raise PageMissing("corrupt", "other tokens under this hash")
                got = f.readinto(out)
                if got != out.nbytes or zlib.crc32(out) != crc:
                    raise PageMissing("corrupt", "its bytes fail their checksum")
        except FileNotFoundError:
            raise PageMissing("missing", "its file is gone") from None
        except OSError as e:
            raise PageMissing("error", f"unreadable: {e}") from None
        self._sizes.move_to_end(record.key, last=True)

    def list_keys(self) -> list[int]:
        return list(self._sizes)

    def remove(self, key: int) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        try:
            self.save_index()
        except OSError as e:
            logger.warning("storage tier: could not save its index (%s); the next start scans the directory", e)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the flock goes with it
            self._lock_fd = None


def model_identity(model_path: str) -> str:
    """The weights a directory's pages were computed with: the model directory, its config.json and
    its weight files' names and sizes (a checkpoint replaced in place with files of the same names
    and sizes is not told apart: clear the directory then)."""
    root = Path(model_path).resolve()
    h = zlib.crc32(b"")
    files = []
    try:
        h = zlib.crc32((root / "config.json").read_bytes(), h)
        files = sorted((p.name, p.stat().st_size) for p in root.iterdir() if p.suffix in (".safetensors", ".bin"))
    except OSError:
        pass
    h = zlib.crc32(repr(files).encode(), h)
    return f"{root} config+weights crc32 {h:08x}"


def other_tp_layouts(root: str, tp_size: int) -> list[str]:
    """What directory `root` holds that another tensor-parallel layout wrote, a line each: tp 1's
    pages (its STAMP.json and pages/ at the top) or tp M's rank directories (tp<M>-rank<r>), M !=
    tp_size. A server reads only its own layout's."""
    path = Path(root)
    if not path.is_dir():
        return []
    found = []
    if tp_size > 1 and (path / "STAMP.json").exists():
        found.append(f"{root} holds pages written with tp_size 1 (its pages/ directory)")
    ranks: dict[int, int] = {}
    for entry in path.iterdir():
        match = re.fullmatch(r"tp(\d+)-rank(\d+)", entry.name)
        if match and entry.is_dir() and int(match.group(1)) != tp_size:
            ranks[int(match.group(1))] = ranks.get(int(match.group(1)), 0) + 1
    for size, count in sorted(ranks.items()):
        found.append(f"{root} holds pages written with tp_size {size} ({count} rank directories tp{size}-rank<r>)")
    return found


def _differences(found: str, stamp: StoreStamp) -> str:
    try:
        old = json.loads(found)
    except ValueError:
        return "an unreadable stamp"
    new = asdict(stamp)
    old.setdefault("states", "")  # a stamp written without snapshot records
    diff = [f"{k} {old.get(k)!r}" for k in new if old.get(k) != new[k]]
    return "written with " + ", ".join(diff) if diff else "another stamp"


def probe_read_bandwidth(directory: str, page_bytes: int, *, read_latency_s: float = 0.0) -> float:
    """Bytes per second of reading pages of page_bytes from directory as the tier reads them (a file
    each: open, read, close; READ_THREADS at a time), written fresh and dropped from the page cache
    first where the OS lets us: the time a page read costs there, per byte, latency included."""
    reads = max(2 * READ_THREADS, min(64, (64 << 20) // max(page_bytes, 1)))
    probe = Path(directory) / "bandwidth-probe"
    probe.mkdir(exist_ok=True)
    data = os.urandom(page_bytes)
    paths = [probe / f"{i}.page" for i in range(reads)]

    def read(path: Path) -> None:
        if read_latency_s:
            time.sleep(read_latency_s)
        with open(path, "rb", buffering=0) as f:
            f.readinto(bytearray(page_bytes))

    try:
        for path in paths:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        with ThreadPoolExecutor(READ_THREADS) as readers:
            start = time.perf_counter()
            list(readers.map(read, paths))
            seconds = max(time.perf_counter() - start, 1e-9)
    finally:
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        probe.rmdir()
    return reads * page_bytes / seconds
