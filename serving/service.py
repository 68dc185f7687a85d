"""What the server's routes share: its options (`ServeOptions`) and its state (`Service`):
the model being served and its hot reload, the batcher, the kept histories, the checks
of a request's token, model and body, and the counts the stats route reports."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import sys
from pathlib import Path
from typing import Any

from hybridrec.common.errors import UserError
from hybridrec.common.tls import TLSFiles
from hybridrec.serving import _format
from hybridrec.serving.batching import DynamicBatcher
from hybridrec.serving.inputs import model_inputs
from hybridrec.serving.kept_histories import KeptHistories
from hybridrec.serving.load import load_export
from hybridrec.serving.model import ServedModel
from hybridrec.serving.protocol import ProtocolError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """How the server batches, limits and authenticates."""

    max_batch: int = 256  # most rows in one forward pass
    max_delay_ms: float = 2.0  # how long a batch's first request waits for others
    max_rows: int = 4096  # most rows in one request (more: 413)
    max_body_bytes: int = 16 << 20  # largest request body (more: 413)
    token: str | None = None  # required bearer token (None: no authentication)
    watch: bool = False  # load newer versions of the export as they appear
    watch_interval: float = 1.0  # seconds between looks for a newer version
    checksums: bool = True  # verify every file's sha256 at load (sizes are always checked)
    tls: TLSFiles | None = None  # certificate and key: HTTPS; with a CA: client certificates too
    keep_histories: int = 0  # sequence models: events kept per user (0: none kept)
    max_users: int = 100_000  # sequence models: users kept, least recently used evicted
    history_cache_mb: float = 1024.0  # sequence models: the kept histories' tower caches

    def __post_init__(self):
        for name in ("max_batch", "max_rows", "max_body_bytes", "max_users"):
            if getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_delay_ms < 0:
            raise UserError(f"max-delay-ms must be >= 0, got {self.max_delay_ms}")
        if self.keep_histories < 0:
            raise UserError(f"keep-histories must be >= 0, got {self.keep_histories}")


class Service:
    """The state behind the routes: the current model, the batcher, the watcher."""

    def __init__(self, base: Path, model: Any, options: ServeOptions):
        self.base = base
        self.model = model
        self.options = options
        self.histories = None
        if options.keep_histories:
            if not model.takes_events:
                raise UserError("--keep-histories is for exports of sequence runs")
            self.histories = KeptHistories(
                options.keep_histories,
                options.max_users,
                cache_bytes=int(options.history_cache_mb * (1 << 20)),
            )
        self.batcher = DynamicBatcher(
            max_batch=options.max_batch, max_delay=options.max_delay_ms / 1e3
        )
        self.failed_versions: set[int] = set()
        self.reloads = 0
        self.in_flight: dict[int, int] = {}  # id(model) -> requests holding it
        self.requests = 0  # answered by the guarded routes (every route but health)
        self.refused = 0  # of them, answered with an error status

    @contextlib.contextmanager
    def holding(self, model: Any):
        """Marks a request as using `model`: a replaced model is closed only when unused."""
        key = id(model)
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        try:
            yield model
        finally:
            self.in_flight[key] -= 1
            if not self.in_flight[key]:
                del self.in_flight[key]

    # ------------------------------------------------------------------ checks

    def authorized(self, request: Request) -> bool:
        if self.options.token is None:
            return True
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        expected = self.options.token.encode()
        # compare_digest takes the same time wherever the strings differ
        return hmac.compare_digest(given.strip().encode(), expected) and scheme.lower() == "bearer"

    def check_model(self, name: str, version: str | None) -> Any:
        model = self.model
        if name != model.name:
            raise ProtocolError(f"unknown model {name!r}; this server has {model.name!r}", 404)
        if version is not None and version != str(model.version):
            raise ProtocolError(
                f"model {name!r} has no version {version!r} loaded (serving {model.version})", 404
            )
        return model

    async def read_body(self, request: Request) -> bytes:
        limit = self.options.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ProtocolError(
                f"request body of {declared} bytes exceeds the {limit}-byte limit", 413
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ProtocolError(f"request body exceeds the {limit}-byte limit", 413)
            chunks.append(chunk)
        return b"".join(chunks)

    def model_inputs(self, model: ServedModel, inputs: dict) -> tuple[Any, Any]:
        """(lines, None) for raw rows or (ids, dense) for hashed inputs (`serving.inputs`)."""
        return model_inputs(model, inputs, max_rows=self.options.max_rows)

    # ------------------------------------------------------------------ hot reload

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.options.watch_interval)
            found = [v for v in _format.versions(self.base) if v not in self.failed_versions]
            if not found or found[-1] <= self.model.version:
                continue
            version = found[-1]
            try:
                fresh = await run_in_threadpool(
                    load_export,
                    self.base / str(version),
                    max_batch=self.options.max_batch,
                    checksums=self.options.checksums,
                )
            except UserError as error:
                self.failed_versions.add(version)
                print(f"hybridrec serve: not loading version {version}: {error}", file=sys.stderr)
                continue
            differs = None
            if fresh.name != self.model.name:
                differs = f"model name {fresh.name!r} differs from {self.model.name!r}"
            elif fresh.kind != self.model.kind:
                differs = f"it is an export of a {fresh.kind} run, not of a {self.model.kind} run"
            if differs:
                self.failed_versions.add(version)
                print(f"hybridrec serve: not loading version {version}: {differs}", file=sys.stderr)
                fresh.close()
                continue
            old, self.model = self.model, fresh  # requests from now on use the new version
            self.reloads += 1
            # requests that took the old version before the swap finish with it first
            while self.in_flight.get(id(old)):
                await asyncio.sleep(0.01)
            await self.batcher.run_on_worker(old.close)
            print(f"hybridrec serve: now serving version {version}", file=sys.stderr, flush=True)
