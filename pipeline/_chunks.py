"""Input chunks: listing, reading in line-aligned blocks or record batches, processing one chunk.

An uncompressed text file is cut into equal byte ranges of at most `chunk_bytes`; a line belongs
to the chunk holding its first byte. A compressed file (.gz) is one chunk. Each
text chunk is read in blocks of about `block_bytes` that end on a line boundary, so
memory per worker stays bounded whatever the file size. A Parquet file is cut into
runs of whole row groups of about `chunk_bytes` (compressed) and read in record
batches of `block_bytes // 256` rows (65,536 at 16 MB); its rows are numbered like
lines, so the split and statistics are the same for both formats.

Everything here is independent of Beam: the Beam job (`pipeline.click_job`) and the
single-process benchmark baseline call the same functions.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from hybridrec.common.errors import UserError
from hybridrec.pipeline import _header, _parquet
from hybridrec.pipeline._errors import InputError
from hybridrec.pipeline._parse import BlockParser, ParsedBlock
from hybridrec.pipeline._splits import SplitRule
from hybridrec.pipeline.spec import FeatureSpec
from hybridrec.pipeline.stats import PartialStats

ROW_GROUP_ROWS = 65_536
_HEADER_READ_BYTES = 1 << 16  # read at a time while looking for the end of a header line


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A piece of one input file.

    Text: bytes `start`..`end` (`end` < 0: to the end of the file). Parquet: row
    groups `start`..`end` (exclusive), holding `rows` rows in `data_bytes` bytes.
    """

    file_index: int
    path: str
    chunk_index: int
    start: int
    end: int
    size: int  # bytes of the file (compressed size for .gz)
    format: str = "text"  # "text" or "parquet"
    rows: int = -1  # parquet: rows of the chunk's row groups
    data_bytes: int = -1  # parquet: compressed bytes of the chunk's row groups

    @property
    def key(self) -> str:
        return f"{self.file_index:05d}-{self.chunk_index:05d}"

    @property
    def compressed(self) -> bool:
        return self.format == "text" and self.path.endswith(".gz")

    @property
    def input_bytes(self) -> int:
        """Bytes of input this chunk reads (for progress and runner sizing)."""
        if self.data_bytes >= 0:
            return self.data_bytes
        return self.size if self.end < 0 else self.end - self.start


def list_chunks(
    patterns: Sequence[str],
    chunk_bytes: int,
    *,
    spec: FeatureSpec | None = None,
    input_format: str = "auto",
) -> list[Chunk]:
    """Expands paths/globs (local or any Beam filesystem) into chunks, in input order.

    Args:
        input_format: "auto" (Parquet for `.parquet`/`.pq` names, text otherwise),
            "text" or "parquet".
        spec: when given, each Parquet file's schema is checked against it here,
            before any processing starts.

    Raises:
        UserError: a pattern matches nothing, a path is a directory, or a Parquet file
            is unreadable or lacks (or mistypes) a column of the spec.
    """
    chunks: list[Chunk] = []
    file_index = 0
    for pattern in patterns:
        try:
            matches = FileSystems.match([pattern])[0].metadata_list
        except Exception as error:  # a filesystem's own error type; report the pattern
            raise UserError(f"input {pattern}: {error}") from None
        if not matches:
            raise UserError(f"input {pattern}: no such file (or the glob matches nothing)")
        for metadata in sorted(matches, key=lambda m: m.path):
            path, size = metadata.path, metadata.size_in_bytes
            if "://" not in path and os.path.isdir(path):
                raise UserError(f"input {path} is a directory; pass its files or a glob ({path}/*)")
            if _parquet.is_parquet(path, input_format):
                try:
                    groups = _parquet.row_group_chunks(path, spec, chunk_bytes)
                except InputError as error:
                    raise UserError(error.plain) from None
                for index, (start, end, rows, data_bytes) in enumerate(groups):
                    chunks.append(
                        Chunk(
                            file_index, path, index, start, end, size, "parquet", rows, data_bytes
                        )
                    )
            elif path.endswith(".gz") or size <= chunk_bytes:
                chunks.append(Chunk(file_index, path, 0, 0, -1, size))
            else:
                # equal parts: no small last chunk running alone after the others
                count = -(-size // chunk_bytes)
                bounds = [size * index // count for index in range(count + 1)]
                for index in range(count):
                    chunks.append(
                        Chunk(file_index, path, index, bounds[index], bounds[index + 1], size)
                    )
            file_index += 1
    return chunks


def check_headers(chunks: Sequence[Chunk], spec: FeatureSpec, spec_source: str) -> None:
    """Compares the first line of every text input with the spec's columns (`header = true`).

    Args:
        spec_source: the spec as the user named it (file or built-in name), for messages.

    Raises:
        UserError: a header that differs, naming the file and the first differing field;
            or a file whose first block cannot be read (a truncated small .gz).
    """
    if not spec.header:
        return
    for chunk in chunks:
        if chunk.format != "text" or chunk.chunk_index != 0:
            continue
        try:
            first = next(read_blocks(chunk, _HEADER_READ_BYTES), b"")
        except InputError as error:
            raise UserError(error.plain) from None
        line = _header.strip_bom(first).split(b"\n", 1)[0]
        problem = _header.mismatch(_header.decode_line(line), spec) if first else None
        if problem:
            raise UserError(
                f"{chunk.path}: line 1: header does not match spec {spec_source}: {problem}"
            )


def _line_aligned(reads: Iterator[bytes]) -> Iterator[bytes]:
    carry = b""
    for data in reads:
        if carry:
            data = carry + data
        cut = data.rfind(b"\n") + 1
        carry = data[cut:]
        if cut:
            yield data[:cut]
    if carry:
        yield carry


def _plain_reads(chunk: Chunk, block_bytes: int, position: list[int]) -> Iterator[bytes]:
    with FileSystems.open(chunk.path, compression_type=CompressionTypes.UNCOMPRESSED) as handle:
        if chunk.start > 0:
            handle.seek(chunk.start - 1)
            if handle.read(1) != b"\n":
                handle.readline()  # that line belongs to the previous chunk
        pos = handle.tell()
        end = chunk.size if chunk.end < 0 else chunk.end
        last = b"\n"
        while pos < end:
            data = handle.read(min(block_bytes, end - pos))
            if not data:
                break
            pos += len(data)
            position[0] = pos
            last = data[-1:]
            yield data
        if last != b"\n":
            yield handle.readline()  # finish the line that started inside the range


def _gzip_reads(chunk: Chunk, block_bytes: int, position: list[int]) -> Iterator[bytes]:
    """Decompresses incrementally, so a truncated or corrupt file is reported at its line."""
    lines = 0
    pending: list[bytes] = []
    pending_bytes = 0

    def fail(problem: str) -> InputError:
        line = lines + sum(part.count(b"\n") for part in pending) + 1
        return InputError(f"{chunk.path}: line {line}: {problem}; re-download or remove the file")

    # Small reads keep the reported line of corrupt data close to the damage.

    with FileSystems.open(chunk.path, compression_type=CompressionTypes.UNCOMPRESSED) as raw:
        decompressor = zlib.decompressobj(wbits=31)
        in_member = False
        while compressed := raw.read(1 << 16):
            position[0] += len(compressed)
            while compressed:
                in_member = True
                try:
                    data = decompressor.decompress(compressed)
                except zlib.error as error:
                    raise fail(f"corrupt gzip data at or after this line ({error})") from None
                pending.append(data)
                pending_bytes += len(data)
                compressed = b""
                if decompressor.eof:  # a member ended; another may follow (or zero padding)
                    compressed = decompressor.unused_data.lstrip(b"\0")
                    decompressor = zlib.decompressobj(wbits=31)
                    in_member = False
            if pending_bytes >= block_bytes:
                block = b"".join(pending)
                pending, pending_bytes = [], 0
                lines += block.count(b"\n")
                yield block
        if in_member:
            raise fail("compressed data is truncated (the gzip stream ends early)")
        if pending:
            yield b"".join(pending)


def read_blocks(chunk: Chunk, block_bytes: int, position: list[int] | None = None):
    """Yields line-aligned blocks of `chunk`; `position[0]` tracks input bytes consumed.

    Raises:
        InputError: the file cannot be read (vanished, permissions, truncated gzip).
    """
    position = position if position is not None else [0]
    reads = _gzip_reads if chunk.compressed else _plain_reads
    try:
        yield from _line_aligned(reads(chunk, block_bytes, position))
    except InputError:
        raise
    except OSError as error:
        raise InputError(f"{chunk.path}: cannot read: {error}") from None


def count_lines(chunk: Chunk, block_bytes: int) -> int:
    """Lines in `chunk` (a last line without newline counts); rows for Parquet."""
    if chunk.format == "parquet":
        return chunk.rows
    return sum(
        block.count(b"\n") + (not block.endswith(b"\n"))
        for block in read_blocks(chunk, block_bytes)
    )


class SplitWriter:
    """Streams one split of one chunk into a Parquet file with ~ROW_GROUP_ROWS row groups."""

    def __init__(self, path: str, schema: pa.Schema, compression: str):
        self.path, self.schema, self.compression = path, schema, compression
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.rows = 0
        self.writer: pq.ParquetWriter | None = None

    def write(self, table: pa.Table, final: bool = False) -> None:
        if table.num_rows:
            self.pending.append(table)
            self.pending_rows += table.num_rows
        if self.pending_rows >= ROW_GROUP_ROWS or (final and self.pending_rows):
            merged = pa.concat_tables(self.pending).combine_chunks()
            cut = merged.num_rows if final else merged.num_rows // ROW_GROUP_ROWS * ROW_GROUP_ROWS
            if self.writer is None:
                self.handle = FileSystems.create(self.path)
                self.writer = pq.ParquetWriter(
                    self.handle, self.schema, compression=self.compression
                )
            self.writer.write_table(merged.slice(0, cut), row_group_size=ROW_GROUP_ROWS)
            self.rows += cut
            rest = merged.slice(cut)
            self.pending, self.pending_rows = ([rest] if rest.num_rows else []), rest.num_rows

    def close(self) -> int:
        self.write(pa.Table.from_batches([], self.schema), final=True)
        if self.writer is not None:
            self.writer.close()
            self.handle.close()
        return self.rows


def process_chunk(
    chunk: Chunk,
    *,
    spec: FeatureSpec,
    parser: BlockParser,
    first_line: int,
    global_first_line: int,
    split: SplitRule,
    temp_dir: str,
    block_bytes: int,
    compression: str = "zstd",
    progress_path: str | None = None,
    parquet_parser: _parquet.ParquetParser | None = None,
) -> tuple[PartialStats, list[str]]:
    """Parses, validates, hashes, splits and writes one chunk (text or Parquet).

    Args:
        first_line: 0-based line (Parquet: row) index of the chunk's first line within its file.
        global_first_line: the same, counted over all input files in order.
        temp_dir: where the chunk's Parquet files go (`<split>/chunk-<key>.parquet`).
        progress_path: optional local file updated with {"bytes", "lines", "rejected"} after
            each block.
        parquet_parser: reused for Parquet chunks (built here when not given).

    Returns:
        (partial statistics, rejected rows as JSON lines). A rejected text line is
        `{"file", "line" (1-based), "reason", "detail", "text"}`; a rejected Parquet row
        `{"file", "row" (0-based index in the file), "reason", "detail", "values"}`.
    """
    stats = PartialStats(source=chunk.key)
    rejected: list[str] = []
    writers = {
        name: SplitWriter(
            FileSystems.join(temp_dir, name, f"chunk-{chunk.key}.parquet"),
            parser.schema,
            compression,
        )
        for name in split.names
    }
    hash_split = split.mode == "hash"
    if chunk.format == "parquet":
        parquet_parser = parquet_parser or _parquet.ParquetParser(spec)
        blocks = _parquet_blocks(chunk, spec, parquet_parser, first_line, block_bytes, hash_split)
    else:
        blocks = _text_blocks(chunk, spec, parser, first_line, block_bytes, hash_split)
    line = first_line
    for block_first, parsed, consumed in blocks:
        stats.lines += block_first + parsed.lines - line
        line = block_first + parsed.lines
        stats.rows_read += parsed.lines
        stats.crlf_lines += parsed.crlf_lines
        for offset, reason, detail, shown in parsed.rejected:
            stats.rejected_by_reason[reason] = stats.rejected_by_reason.get(reason, 0) + 1
            if chunk.format == "parquet":
                where, what = {"row": block_first + offset}, {"values": shown}
            else:
                where, what = {"line": block_first + offset + 1}, {"text": shown}
            record = {"file": chunk.path, **where, "reason": reason, "detail": detail, **what}
            rejected.append(json.dumps(record))
        global_lines = global_first_line + (block_first - first_line) + parsed.line_offsets
        assigned = split.assign(global_lines, parsed.row_hashes)
        for index, name in enumerate(split.names):
            mask = assigned == index
            part = parsed.table.filter(pa.array(mask)) if not mask.all() else parsed.table
            stats.rows_by_split[name] = stats.rows_by_split.get(name, 0) + part.num_rows
            writers[name].write(part)
            if name == "train":
                stats.add_table(part, spec)
        if progress_path is not None:
            write_progress(progress_path, consumed, line - first_line, len(rejected))
    if line == 0 and chunk.chunk_index == 0:
        stats.empty_files.append(chunk.path)
    for name, writer in writers.items():
        rows = writer.close()
        if rows:
            stats.files.append((name, chunk.key, rows))
    return stats, rejected


def _text_blocks(
    chunk: Chunk,
    spec: FeatureSpec,
    parser: BlockParser,
    first_line: int,
    block_bytes: int,
    row_hashes: bool,
) -> Iterator[tuple[int, ParsedBlock, int]]:
    """(line index in the file of the block's first line, parsed block, input bytes consumed)."""
    position = [0]
    line = first_line
    first_block = chunk.chunk_index == 0
    for block in read_blocks(chunk, block_bytes, position):
        if first_block:
            first_block = False
            block = _header.strip_bom(block)
            if spec.header:
                block = _header.strip_header(block, spec, chunk.path)
                line += 1
        parsed = parser.parse(block, row_hashes=row_hashes)
        yield line, parsed, position[0] - (0 if chunk.compressed else chunk.start)
        line += parsed.lines


def _parquet_blocks(
    chunk: Chunk,
    spec: FeatureSpec,
    parser: _parquet.ParquetParser,
    first_row: int,
    block_bytes: int,
    row_hashes: bool,
) -> Iterator[tuple[int, ParsedBlock, int]]:
    """(row index in the file of the batch's first row, parsed batch, input bytes consumed)."""
    row = first_row
    batch_rows = max(1, block_bytes // 256)
    batches = _parquet.read_batches(
        chunk.path,
        spec,
        range(chunk.start, chunk.end),
        batch_rows,
        extra_columns=parser.unused_columns if row_hashes else (),
    )
    pending: list[pa.RecordBatch] = []
    pending_rows = 0
    for batch in [*batches, None]:
        if batch is not None:
            # small row groups give small batches: parse at least `batch_rows` rows at once
            pending.append(batch)
            pending_rows += batch.num_rows
            if pending_rows < batch_rows:
                continue
        if not pending:
            break
        merged = pending[0] if len(pending) == 1 else pa.concat_batches(pending)
        pending, pending_rows = [], 0
        parsed = parser.parse(merged, row_hashes=row_hashes)
        done = row + parsed.lines - first_row
        yield row, parsed, chunk.data_bytes * done // max(chunk.rows, 1)
        row += parsed.lines


def write_progress(path: str, consumed: int, lines: int, rejected: int) -> None:
    """A chunk's progress file (read by `_launch.run_with_progress`): input bytes consumed,
    lines read and rows rejected so far."""
    temp = f"{path}.tmp"
    with open(temp, "w") as handle:
        json.dump({"bytes": consumed, "lines": lines, "rejected": rejected}, handle)
    os.replace(temp, path)
