"""``ms.data.TFRecordDataset``: TensorFlow's record files, read without TensorFlow.

Records come out as ``bytes`` (batches as 1-D object arrays of ``bytes``), both CRCs of
every record checked (``DataLossError`` naming file and offset); parse them with
``ms.io.parse_example``::

    >>> import os, tempfile, mpistrat as ms
    >>> path = os.path.join(tempfile.mkdtemp(), "a.tfrecord")
    >>> with ms.io.TFRecordWriter(path) as writer:
    ...     for i in range(5):
    ...         writer.write(b"record %d" % i)
    >>> [bytes(r) for r in ms.data.TFRecordDataset(path).take(2)]
    [b'record 0', b'record 1']
    >>> [len(b) for b in ms.data.TFRecordDataset([path, path]).batch(4)]
    [4, 4, 2]

Plain (uncompressed) files have random access through an index of record offsets, made
once per file at the first read (a scan of the record headers), cached in the user's cache
directory or ``index_dir`` (never beside the data) and rebuilt when the file changes: ``global_shuffle``, seekable positions and
the distributed layouts work as on the other readers. Under
``strategy.experimental_distribute_dataset``, ``FILE`` deals files to ranks; ``DATA`` has
each rank read only its own records of every global batch (one read per run of them), each
file indexed by one rank and the offsets shared with the others; ``AUTO`` picks ``FILE``
when there are at least as many files as ranks. Compressed files (``"GZIP"``, ``"ZLIB"``)
cannot be read from the middle: they are read forward, and under ``DATA`` every rank
decompresses each file and keeps its records (TensorFlow reads everything on every worker
too).
"""

import os
from typing import List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from mpistrat.data import ops
from mpistrat.data.dataset import Dataset
from mpistrat.data.mpiio import read_runs, runs_of
from mpistrat.data.options import AutoShardPolicy
from mpistrat.data.readers import RecordFiles, view_of
from mpistrat.errors import DataLossError, NotFoundError
from mpistrat.tfformats.record_index import load_index, save_index
from mpistrat.tfformats.records import (compression_of, scan_offsets, split_records,
                                        stream_chunks, stream_records)

__all__ = ["TFRecordDataset", "TFRecordFiles"]

_DEFAULT_BUFFER = 1 << 20
_MAX_READ = 1 << 30            # one MPI-IO read at most (counts are C ints)


def _records_array(records: List[bytes]) -> np.ndarray:
    out = np.empty(len(records), dtype=object)
    out[:] = records
    return out


class _Counts(Sequence):
    """Records per file, each file indexed only when its count is asked for."""

    def __init__(self, reader: "TFRecordFiles"):
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader.files)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return len(self.reader.offsets(index)) - 1


class _TFRecordSource(ops.Source):
    """The records as a dataset source: random access through the record index (plain
    files, indexed at the first random read), read forward only when compressed."""

    name = "a TFRecordDataset"

    def __init__(self, reader: "TFRecordFiles"):
        self.reader, self._gather = reader, reader.gather_rows

    @property
    def row_bytes(self) -> int:
        """Bytes read per record, for the read-ahead window of a distributed dataset
        (``READ_AHEAD_BYTES`` of records): the mean over the files indexed so far (a
        distributed dataset indexes them before it plans), 1 before any is."""
        return self.reader.mean_record_bytes()

    @property
    def length(self) -> int:
        return self.reader.num_rows

    def blocker(self):
        if self.reader.compression is not None:
            return (f"a {self.reader.compression} compressed TFRecordDataset (it can only be "
                    f"read from the start of each file)")
        return None

    def cardinality(self):
        return ops.UNKNOWN if self.reader.compression is not None else self.length

    def sequential(self, it):
        return self.reader._records()


class TFRecordFiles(RecordFiles):
    """The records of one or more TFRecord files, numbered across the files in order."""

    def __init__(self, filenames, compression_type: Optional[str] = None,
                 buffer_size: Optional[int] = None, index_dir: Optional[str] = None):
        if isinstance(filenames, (str, os.PathLike)):
            filenames = [filenames]
        self.files = [os.fspath(f) for f in filenames]
        if not self.files:
            raise ValueError("a TFRecordDataset needs at least one file")
        for path in self.files:
            if not os.path.isfile(path):
                raise NotFoundError(f"TFRecord file {path} does not exist or is not a "
                                    f"regular file")
        self.compression = compression_of(compression_type)
        self.buffer_size = int(buffer_size) if buffer_size else _DEFAULT_BUFFER
        if self.buffer_size < 0:
            raise ValueError(f"buffer_size must not be negative, got {buffer_size}")
        self.index_dir = None if index_dir is None else os.fspath(index_dir)
        self.dtype, self.shape, self.record_bytes = np.dtype(object), (), None
        self.bytes_read, self.index_bytes_read = 0, 0
        self.files_indexed = 0  # files this process indexed itself (not from a cache)
        self._offsets: List[Optional[np.ndarray]] = [None] * len(self.files)
        self._cursor = None     # compressed files: (file index, next record, stream)
        self._starts = None
        self.views = [view_of(path) for path in self.files]  # agreed by distributed datasets
        Dataset.__init__(self, node=_TFRecordSource(self))
    # -- the index ------------------------------------------------------------------
    def mean_record_bytes(self) -> int:
        """The mean bytes of a record (its framing included) over the files indexed so far;
        1 while none is (or they hold no record)."""
        known = [o for o in self._offsets if o is not None and len(o) > 1]
        records = sum(len(o) - 1 for o in known)
        return max(1, -(-sum(int(o[-1] - o[0]) for o in known) // records)) if records else 1

    def offsets(self, file_index: int) -> np.ndarray:
        """Byte offsets of file ``file_index``'s records, then its end (indexed on demand)."""
        if self._offsets[file_index] is None:
            self._offsets[file_index] = self._cached(file_index)
            if self._offsets[file_index] is None:
                offsets = self._build(file_index)
                save_index(self.files[file_index], self.compression, self.index_dir, offsets)
                self._offsets[file_index] = offsets
        return self._offsets[file_index]

    def _cached(self, file_index: int) -> Optional[np.ndarray]:
        stats: dict = {}
        offsets = load_index(self.files[file_index], self.compression, self.index_dir, stats)
        self.index_bytes_read += stats.get("index_bytes", 0)
        return offsets

    def _build(self, file_index: int) -> np.ndarray:
        path = self.files[file_index]
        self.files_indexed += 1
        if self.compression is None:
            return scan_offsets(path)
        ends = [0]
        for offset, record in stream_records(path, self.compression, self.buffer_size):
            ends.append(offset + len(record) + 16)
        return np.array(ends, dtype=np.int64)

    @property
    def counts(self) -> Sequence[int]:
        return _Counts(self)

    @property
    def starts(self) -> np.ndarray:
        """The global number of each file's first record (then the total): every file indexed."""
        if self._starts is None:
            counts = [self.counts[i] for i in range(len(self.files))]
            self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return self._starts

    def prepare_shards(self, engine, policy) -> None:
        """Index the files this rank will need, each built once (collective).

        Called by ``experimental_distribute_dataset`` before reading, once the ranks have
        agreed that they see the same files (path, size, modification time: ``views``); a
        file without a valid cache is indexed by rank ``i % N`` and its offsets sent to the
        ranks that need them (all under ``DATA``, its owner under ``FILE``); a failure on any
        rank raises on every rank.
        """
        if policy is AutoShardPolicy.OFF:
            return
        rank, size = engine.rank, engine.size
        needed = range(len(self.files)) if policy is not AutoShardPolicy.FILE else \
            range(rank, len(self.files), size)
        what = "preparing a TFRecordDataset"
        missing = np.zeros(len(self.files), np.int64)
        with engine.agreed(what, doing="reading the TFRecord index caches"):
            for index in needed:
                if self._offsets[index] is None:
                    self._offsets[index] = self._cached(index)
                missing[index] = self._offsets[index] is None
        missing = engine.all_reduce(missing, "MAX")
        with engine.agreed(what, doing="indexing a TFRecord file"):
            for index in np.flatnonzero(missing):
                if index % size == rank:
                    self.offsets(int(index))   # build and cache
        if policy is AutoShardPolicy.FILE:
            return                                 # each file's builder is its reader
        for index in np.flatnonzero(missing):
            root = int(index) % size
            count = np.array([len(self._offsets[index]) if rank == root else 0], np.int64)
            engine.wait([engine.comm.Ibcast(count, root=root)], "a TFRecord file's record count")
            offsets = self._offsets[index] if rank == root else np.empty(count[0], np.int64)
            engine.wait([engine.comm.Ibcast(offsets, root=root)], "a TFRecord file's offsets")
            self._offsets[index] = offsets

    # -- reading --------------------------------------------------------------------
    def read_file_rows(self, file_index: int, first: int, stop: int) -> np.ndarray:
        """Records ``[first, stop)`` of one file: one MPI-IO read (plain files)."""
        if stop <= first:
            return np.empty(0, dtype=object)
        if self.compression is not None:
            return _records_array(self._stream_rows(file_index, first, stop))
        offsets = self.offsets(file_index)
        if stop > len(offsets) - 1:
            raise ValueError(f"records [{first}, {stop}) of {self.files[file_index]}, which "
                             f"holds {len(offsets) - 1}")
        return self._read_runs(file_index, np.array([first]), np.array([stop - first]))

    def _read_runs(self, file_index: int, firsts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The records of runs ``(firsts, lengths)`` of one plain file, in order: their bytes
        in one MPI-IO call per ``RUNS_PER_CALL`` runs (pieces of at most 1 GiB), then split
        and checked."""
        offsets, path = self.offsets(file_index), self.files[file_index]
        byte_starts, byte_ends = offsets[firsts], offsets[firsts + lengths]
        pieces = [(int(a), int(b - a)) for a, b in zip(byte_starts, byte_ends)]
        out: List[bytes] = []
        group: List[tuple] = []
        for k, piece in enumerate(pieces + [None]):
            if piece is not None and (not group or sum(g[1] for g in group) + piece[1]
                                      <= _MAX_READ):
                group.append(piece + (k,))
                continue
            starts = np.array([a for a, _, _ in group], np.int64)
            sizes = np.array([n for _, n, _ in group], np.int64)
            block = read_runs(self._handle(file_index), 0, 1, starts, sizes)
            self.bytes_read += block.nbytes
            position = 0
            for a, n, run in group:
                first = int(firsts[run])
                out.extend(split_records(block[position:position + n], a,
                                         offsets[first:first + int(lengths[run])], path))
                position += n
            group = [] if piece is None else [piece + (k,)]
        return _records_array(out)

    def _stream_rows(self, file_index: int, first: int, stop: int) -> List[bytes]:
        """Compressed files read forward: continue the last stream when it is at ``first``
        or before, else start the file again."""
        cursor = self._cursor
        if cursor is None or cursor[0] != file_index or cursor[1] > first:
            cursor = [file_index, 0, (r for rs in self._stream(file_index) for r in rs)]
        out: List[bytes] = []
        while cursor[1] < stop:
            record = next(cursor[2], None)
            if record is None:
                raise DataLossError(f"{self.files[file_index]}: fewer records than indexed "
                                    f"(the file changed?)")
            if cursor[1] >= first:
                out.append(record)
            cursor[1] += 1
        self._cursor = cursor
        return out

    def _stream(self, file_index: int):
        """The records of one file from its start, in lists (one per piece read)."""
        stats = {"bytes": 0}
        counted = 0
        for records in stream_chunks(self.files[file_index], self.compression,
                                     self.buffer_size, stats):
            self.bytes_read += stats["bytes"] - counted
            counted = stats["bytes"]
            yield records
        self.bytes_read += stats["bytes"] - counted

    def _chunks(self):
        for index in range(len(self.files)):
            yield from self._stream(index)

    def _records(self):
        for records in self._chunks():
            yield from records

    def _read_file_set(self, file_index: int, rows: np.ndarray) -> np.ndarray:
        """Sorted, distinct ``rows`` of one file: one read per run of consecutive rows."""
        if self.compression is not None:
            first, stop = int(rows[0]), int(rows[-1]) + 1
            return self.read_file_rows(file_index, first, stop)[rows - first]
        return self._read_runs(file_index, *runs_of(rows))


def TFRecordDataset(filenames, compression_type: Optional[str] = None,
                    buffer_size: Optional[int] = None, num_parallel_reads=None, *,
                    index_dir: Optional[str] = None) -> TFRecordFiles:
    """The records of TFRecord files, as ``tf.data.TFRecordDataset`` (see the module).

    ``compression_type``: ``None``/``""``, ``"GZIP"`` or ``"ZLIB"``; ``buffer_size``: bytes
    read at a time from compressed files; ``num_parallel_reads`` is accepted and ignored
    (records come in file order); ``index_dir`` (ours): where to cache record indexes
    (default ``$XDG_CACHE_HOME/mpistrat/tfrecord-index``; never beside the data).
    """
    return TFRecordFiles(filenames, compression_type, buffer_size, index_dir)
