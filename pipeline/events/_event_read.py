"""One chunk of an event log read into columnar events: what the event-log job's parse
step (`pipeline.events.event_job`) and the event follower (`pipeline.events.event_follow`) share."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pyarrow as pa
from hybridrec.pipeline import _chunks, _header
from hybridrec.pipeline.events import _event_inputs
from hybridrec.pipeline.events._event_parse import EventBlock, EventParser
from hybridrec.pipeline.events._histories import Events
from hybridrec.pipeline.events.event_spec import EventSpec
from hybridrec.pipeline.events.event_stats import EventStats


@dataclasses.dataclass
class ChunkEvents:
    """A chunk's valid events in input order, its counts and its rejected rows."""

    events: Events
    stats: EventStats  # lines, events, rejected_by_reason, time formats and range, actions
    rejected: list[dict]  # {"file", "line" | "row", "reason", "detail", "text"} each
    blocks: list[tuple[int, EventBlock]]  # (chunk-local first line, block): raw ids

    def item_names(self) -> tuple[np.ndarray, pa.Array]:
        """(item ids ascending, the raw id of each at its first occurrence in the chunk)."""
        items = [block.items for _, block in self.blocks]
        if not sum(len(ids) for ids in items):
            return np.zeros(0, np.uint64), pa.array([], pa.large_binary())
        firsts = [np.unique(ids, return_index=True)[1] for ids in items]
        ids = np.concatenate([ids[first] for ids, first in zip(items, firsts, strict=True)])
        names = pa.concat_arrays(
            [
                block.item_cells.take(first).to_arrow()
                for (_, block), first in zip(self.blocks, firsts, strict=True)
            ]
        )
        ids, first = np.unique(ids, return_index=True)  # blocks are in input order
        return ids, names.take(pa.array(first))

    def user_names(self, wanted: set[int]) -> dict[int, str]:
        """The raw ids of the users `wanted` (hashed ids) that the chunk holds."""
        wanted, names = set(wanted), {}
        for _, block in self.blocks:
            if not wanted:
                break
            for row in np.flatnonzero(np.isin(block.users, list(wanted))):
                user = int(block.users[row])
                if user in wanted:
                    names[user] = block.user_cells.text(int(row))
                    wanted.discard(user)
        return names


def read_chunk_events(
    chunk: _chunks.Chunk,
    spec: EventSpec,
    parser: EventParser,
    block_bytes: int,
    progress_path: str | None = None,
) -> ChunkEvents:
    """Parses and hashes a chunk block by block (its bad rows rejected with reasons)."""
    stats = EventStats()
    parts, rejected = [], []
    for first_line, block in _blocks(chunk, spec, parser, block_bytes, progress_path):
        stats.lines += block.lines_read
        stats.events += len(block)
        for line, reason, detail, text in block.rejected:
            stats.rejected_by_reason[reason] = stats.rejected_by_reason.get(reason, 0) + 1
            where = "row" if chunk.format == "parquet" else "line"
            record = {"file": chunk.path, where: first_line + line, "reason": reason}
            rejected.append({**record, "detail": detail, "text": text})
        if block.time_format:
            stats.time_formats.setdefault(block.time_format, chunk.path)
        for kind, count in zip(*np.unique(block.actions, return_counts=True), strict=True):
            stats.actions[int(kind)] = stats.actions.get(int(kind), 0) + int(count)
        parts.append((first_line, block))
    stats.chunk_lines.append((chunk.file_index, chunk.chunk_index, stats.lines))
    events = Events.concat(
        [
            Events(
                users=block.users,
                items=block.items,
                times=block.times,
                actions=block.actions,
                sides=block.sides,
                files=np.full(len(block), chunk.file_index, np.int32),
                chunks=np.full(len(block), chunk.chunk_index, np.int32),
                lines=block.lines + first_line,
                positions=block.positions,
            )
            for first_line, block in parts
        ],
        [feature.name for feature in spec.event_features],
    )
    if len(events):
        stats.time_min, stats.time_max = int(events.times.min()), int(events.times.max())
    return ChunkEvents(events, stats, rejected, parts)


def _blocks(chunk: _chunks.Chunk, spec: EventSpec, parser: EventParser, block_bytes: int, progress):
    """(chunk-local index of the block's first line, EventBlock) of each block."""
    where = _event_inputs.Where(chunk)
    line, seen = 0, ""
    if chunk.format == "parquet":
        for batch in _event_inputs.event_batches(chunk, spec, max(1, block_bytes // 256)):
            block = parser.parse_batch(batch, lambda row, at=line: where(at + row), seen)
            seen = seen or block.time_format
            yield line, block
            line += batch.num_rows
            if progress:
                consumed = chunk.data_bytes * line // max(chunk.rows, 1)
                _chunks.write_progress(progress, consumed, line, len(block.rejected))
        return
    position = [0]
    for data in _chunks.read_blocks(chunk, block_bytes, position):
        if line == 0 and chunk.chunk_index == 0:
            data = _header.strip_bom(data)
            if spec.header:
                data = _header.strip_header(data, spec, chunk.path)
                line = 1
        block = parser.parse_text(data, lambda at, first=line: where(first + at), seen)
        seen = seen or block.time_format
        yield line, block
        line += block.lines_read
        if progress:
            done = position[0] - (0 if chunk.compressed else chunk.start)
            _chunks.write_progress(progress, done, line, 0)


def progress_file(progress_dir: str | None, chunk: _chunks.Chunk) -> str | None:
    return os.path.join(progress_dir, f"chunk-{chunk.key}.json") if progress_dir else None
