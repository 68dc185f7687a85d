"""The inference server: Open Inference Protocol (KServe v2 REST) on uvicorn + starlette.

    GET  /v2/health/live | /v2/health/ready           (no token needed: probes)
    GET  /v2 | /v2/models/{name} | /v2/models/{name}/ready | /v2/models/{name}/stats
    POST /v2/models/{name}[/versions/{v}]/infer
    POST /v2/models/{name}[/versions/{v}]/events      (sequence runs: users' new events)

The export of a sequence run answers retrieval and ranking requests over users'
histories (`serving.sequence_server`). For a click-log run, an infer request carries
either raw rows, one BYTES tensor `rows` [n] of lines in the
dataset's own layout (label column optional), or hashed inputs, `ids` [n, F]
INT64/UINT64 and `dense` [n, num_dense] FP32; with multi-valued features, `ids` holds
the single-valued ones and each multi-valued feature X comes as `X.ids` [nnz] (every
row's bag, row after row) and `X.lengths` [n] (bag sizes). The answer is `probabilities` [n] FP32;
`parameters.unseen_ids` counts the ids that got their table's default row. Errors
are `{"error": "..."}` with a 4xx status; the server keeps serving.

With `ServeOptions.tls` the server speaks HTTPS only (uvicorn's ssl options); a CA in it
makes every client present a certificate that CA signed (mutual TLS), probes included.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import ssl
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hybridrec.common.errors import UserError
from hybridrec.pipeline import RowError
from hybridrec.serving import _format, sequence_server
from hybridrec.serving.inputs import input_metadata
from hybridrec.serving.load import load_export
from hybridrec.serving.model import ServedModel
from hybridrec.serving.protocol import (
    ProtocolError,
    decode_inputs,
    encode_response,
    parse_body,
    requested_outputs,
)
from hybridrec.serving.service import ServeOptions, Service
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

OUTPUT = "probabilities"


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _click_metadata(model: ServedModel, service: Service) -> dict[str, Any]:
    """`GET /v2/models/{name}` of a click-log model."""
    return {
        "name": model.name,
        "versions": [str(model.version)],
        "platform": "hybridrec_jax_export",
        "inputs": input_metadata(model),
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1]}],
        "parameters": {
            "step": model.manifest["step"],
            "precision": model.precision,
            "features": model.feature_names,
            "multi_valued_features": model.bag_features,
            "pooling": model.pooling,
            "dense": list(model.spec.dense),
        },
    }


async def _click_infer(service: Service, request: Request, model: ServedModel) -> Response:
    """Click probabilities of raw or hashed rows, batched with other requests."""
    body, headers = await service.read_body(request), request.headers
    parsed, binary = parse_body(body, headers)
    inputs = decode_inputs(parsed, binary)
    binary_output = requested_outputs(parsed, (OUTPUT,))
    first, dense = service.model_inputs(model, inputs)
    if dense is None:  # raw rows: parsed, checked, transformed and hashed in the batch
        probabilities, unseen = await service.batcher.predict(model, lines=first)
    else:
        probabilities, unseen = await service.batcher.predict(model, ids=first, dense=dense)
    response = {"model_name": model.name, "model_version": str(model.version)}
    if "id" in parsed:
        response["id"] = parsed["id"]
    response["parameters"] = {"unseen_ids": int(unseen.sum())}
    content, extra = encode_response(response, OUTPUT, probabilities, binary=binary_output)
    return Response(content, media_type="application/json", headers=extra)


def _sequence_metadata(model: Any, service: Service) -> dict[str, Any]:
    return sequence_server.metadata(model, service.histories)


_KINDS = {  # model kind -> (its metadata, its infer handler)
    "clicks": (_click_metadata, _click_infer),
    "sequences": (_sequence_metadata, sequence_server.infer),
}


def _guarded(service: Service, handler):
    """The route: authorized, counted, and every ProtocolError or RowError a 4xx answer."""

    async def answer(request: Request) -> Response:
        if not service.authorized(request):
            return _error("missing or wrong bearer token", 401)
        try:
            return await handler(request)
        except ProtocolError as error:
            return _error(str(error), error.status)
        except RowError as error:
            return _error(f"input 'rows': {error}", 400)

    async def route(request: Request) -> Response:
        service.requests += 1
        try:
            response = await answer(request)
        except Exception:  # answered 500 by the framework
            service.refused += 1
            raise
        service.refused += response.status_code >= 400
        return response

    return route


def _model_routes(service: Service) -> list[Route]:
    """/v2/models/{name}[/versions/{version}][/ready | /infer | /events] and /stats."""
    metadata_of, infer_with = _KINDS[service.model.kind]

    def current(request: Request) -> Any:
        return service.check_model(request.path_params["name"], request.path_params.get("version"))

    async def model_metadata(request: Request) -> Response:
        return JSONResponse(metadata_of(current(request), service))

    async def model_ready(request: Request) -> Response:
        return JSONResponse({"name": current(request).name, "ready": True})

    async def model_stats(request: Request) -> Response:
        model = service.check_model(request.path_params["name"], None)
        stats = {
            "name": model.name,
            "version": str(model.version),
            **model.stats(),
            "batches": service.batcher.batches,
            "batched_rows": service.batcher.rows,
            "reloads": service.reloads,
        }
        if service.histories is not None:
            stats["histories"] = service.histories.stats()
        return JSONResponse(stats)

    async def infer(request: Request) -> Response:
        model = current(request)
        with service.holding(model):
            return await infer_with(service, request, model)

    async def events(request: Request) -> Response:
        model = current(request)
        with service.holding(model):
            return await sequence_server.append_events(service, request, model)

    routes = [Route("/v2/models/{name}/stats", _guarded(service, model_stats))]
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        routes += [
            Route(prefix, _guarded(service, model_metadata)),
            Route(prefix + "/ready", _guarded(service, model_ready)),
            Route(prefix + "/infer", _guarded(service, infer), methods=["POST"]),
        ]
        if service.model.takes_events:
            routes.append(Route(prefix + "/events", _guarded(service, events), methods=["POST"]))
    return routes


def create_app(model: Any, base: str | Path, options: ServeOptions) -> Starlette:
    """The ASGI application serving `model` (loaded from the export `base`): a
    `ServedModel` or a `ServedSequenceModel`."""
    service = Service(Path(base), model, options)

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        return JSONResponse({"ready": True})

    async def server_metadata(request: Request) -> Response:
        return JSONResponse(
            {"name": "hybridrec", "version": _version(), "extensions": ["binary_tensor_data"]}
        )

    async def http_error(request: Request, error: HTTPException) -> Response:
        return _error(f"{error.detail}: {request.method} {request.url.path}", error.status_code)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.batcher.start()
        watcher = asyncio.get_running_loop().create_task(service.watch()) if options.watch else None
        try:
            yield
        finally:
            if watcher:
                watcher.cancel()
            await service.batcher.stop()
            service.model.close()

    app = Starlette(
        routes=[
            Route("/v2/health/live", live),
            Route("/v2/health/ready", ready),
            Route("/v2", _guarded(service, server_metadata)),
            *_model_routes(service),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.service = service
    return app


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("hybridrec")
    except metadata.PackageNotFoundError:
        return "unknown"


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sock.listen(1024)
    return sock


def make_server(export: str | Path, sock: socket.socket, options: ServeOptions):
    """(uvicorn.Server, ServedModel) for the export; run with `server.run(sockets=[sock])`."""
    import uvicorn

    base = Path(export)
    tls = options.tls
    if tls is not None:
        tls.check_server()  # one line per bad file, before the export is loaded
    model = load_export(base, max_batch=options.max_batch, checksums=options.checksums)
    if options.watch and (base / _format.MANIFEST_FILE).exists():
        raise UserError(f"{base}: --watch needs the export base directory, not one version")
    app = create_app(model, base, options)
    ssl_options = {}
    if tls is not None:
        ssl_options = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
        if tls.ca:
            ssl_options.update(ssl_ca_certs=tls.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on", **ssl_options
    )
    return uvicorn.Server(config), model


def serve(
    export: str | Path, *, host: str = "127.0.0.1", port: int = 8000, options: ServeOptions
) -> None:
    """Loads the export and serves it until interrupted (Ctrl-C or SIGTERM)."""
    sock = bind(host, port)
    server, model = make_server(export, sock, options)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    scheme = "https" if options.tls is not None else "http"
    if options.tls is not None and options.tls.ca:
        note = "  (client certificates required)"
    elif options.token:
        note = ""
    else:
        note = "  (no token: anyone who can connect may score)"
    print(
        f"hybridrec serve: model {model.name!r} version {model.version} (step "
        f"{model.manifest['step']}, {model.precision}) on {scheme}://{shown}:{bound}{note}",
        flush=True,
    )
    for warning in _security_warnings(host, options):
        print(f"hybridrec serve: warning: {warning}", file=sys.stderr, flush=True)
    started = time.monotonic()
    # uvicorn shuts down gracefully on SIGTERM, then raises it again under the handler it
    # found: this one ends the process with a summary (the default would kill it silently)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stopped) if main else None
    try:
        server.run(sockets=[sock])
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        if server.started:  # not after a failed start, which says why itself
            _print_stopped(server, started)


def _print_stopped(server, started: float) -> None:
    service = server.config.app.state.service
    current = service.model
    work = f"{current.work()} by version {current.version}"
    kept = ""
    if service.histories is not None:
        stats = service.histories.stats()
        kept = (
            f", {stats['kept_users']:,} users' histories kept ({stats['events_appended']:,} "
            f"events appended, {stats['evicted_users']:,} users evicted)"
        )
    print(
        f"hybridrec serve: stopped after {time.monotonic() - started:,.0f} s: "
        f"{service.requests:,} requests ({service.refused:,} refused), {work}"
        + (f", {service.reloads} reload(s)" if service.reloads else "")
        + kept,
        flush=True,
    )


def _stopped(signum, frame) -> None:
    raise SystemExit(0)  # stopped as asked, after a graceful shutdown


def _security_warnings(host: str, options: ServeOptions) -> list[str]:
    """A private key other users can read; a token sent in plaintext beyond loopback."""
    warnings = []
    if options.tls is not None and (line := options.tls.warn_readable_key()):
        warnings.append(line)
    if options.token and options.tls is None and host not in ("127.0.0.1", "localhost", "::1"):
        warnings.append("the token crosses the network in plaintext: add --tls-cert and --tls-key")
    return warnings
