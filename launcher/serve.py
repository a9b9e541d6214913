"""``flowmill serve``: an export (``flowmill.runtime.saved_model``) behind TensorFlow
Serving's REST API, so clients written for TF Serving call it unchanged.

One model, version 1, at ``/v1/models/NAME`` (``/versions/1`` may be named too):

- ``GET /v1/models/NAME``: its status (``model_version_status``, state ``AVAILABLE``);
- ``GET /v1/models/NAME/metadata``: its signature (inputs and outputs: tensor, dtype, shape);
- ``POST /v1/models/NAME:predict``: ``{"instances": [...]}`` (row format: one value of the
  single input per instance, or an object of input names) answers ``{"predictions":
  [...]}``; ``{"inputs": ...}`` (columnar: the input's value, or an object of them)
  answers ``{"outputs": ...}``. One output is given as its value, several as an object.

The server is ``aiohttp.web``: requests are read and answered on one event loop, and each
prediction (parsing the JSON, running the model, writing the answer) runs in a thread
pool, so a slow one never stops the server answering others. The model is a compiled
step, safe to run from several threads as a session's steps are.

Every error is JSON ``{"error": "..."}`` naming what is wrong: 400 for a request the model
cannot take (not JSON, an unknown or missing input, a shape or dtype that does not fit),
404 for another model or path, 413 for a body over the limit, 500 for a failure of the
model itself. None of them stops the server. SIGTERM or Ctrl-C stops it: it stops
listening, lets the requests in flight finish (up to a grace period) and exits 0.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from aiohttp import web

from flowmill.runtime.addresses import format_address
from flowmill.runtime.saved_model import PredictionError, SavedModel, load
from flowmill.runtime.session import FeedError

log = logging.getLogger("flowmill.serve")

VERSION = "1"
SIGNATURE_NAME = "serving_default"
DEFAULT_PORT = 8501  # TensorFlow Serving's REST port
DEFAULT_MAX_BODY = 16 << 20
STOP_GRACE_S = 10.0
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# After /v1/models/: the model, an optional version, then the status, metadata or a verb.
_PATH_RE = re.compile(r"(?P<name>[^/:]+)(?:/versions/(?P<version>[^/:]+))?(?P<rest>.*)")
_JSON = "application/json"


class BadRequest(Exception):
    """A request the model cannot take; answered 400 naming the field or input."""


def default_name(path: str) -> str:
    """The model's name when none is given: the export directory's last component."""
    return path.rstrip("/").rsplit("/", 1)[-1]


class ModelServer:
    """The routes of one loaded model, its thread pool and its body-size limit."""

    def __init__(self, model: SavedModel, name: str, max_body: int, workers: int = 4):
        if not NAME_RE.fullmatch(name):
            raise ValueError(f"model name {name!r} must be letters, digits, '.', '_' or '-' "
                             "(flowmill serve --name NAME)")
        self.model, self.name, self.max_body = model, name, max_body
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="predict")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[self._errors])
        app.router.add_get("/v1/models/{tail:.+}", self._get)
        app.router.add_post("/v1/models/{tail:.+}", self._post)
        app.router.add_route("*", "/{tail:.*}", self._unknown)
        return app

    # ---- routes

    def _route(self, request: web.Request) -> str:
        """What follows the model (and version) in the path, once they are this one's."""
        m = _PATH_RE.fullmatch(request.match_info["tail"])
        if m is None or m["name"] != self.name:
            raise web.HTTPNotFound(text=f"no model {m['name'] if m else ''!r} here: this "
                                   f"server serves {self.name!r}")
        if m["version"] not in (None, VERSION):
            raise web.HTTPNotFound(text=f"model {self.name!r} has no version {m['version']!r}; "
                                   f"it serves version {VERSION}")
        return m["rest"]

    async def _get(self, request: web.Request) -> web.Response:
        rest = self._route(request)
        if rest == "":
            return _json({"model_version_status": [{
                "version": VERSION, "state": "AVAILABLE",
                "status": {"error_code": "OK", "error_message": ""},
            }]})
        if rest == "/metadata":
            return _json({
                "model_spec": {"name": self.name, "signature_name": "", "version": VERSION},
                "metadata": {"signature_def": {"signature_def": {
                    SIGNATURE_NAME: self.model.signature}}},
            })
        raise web.HTTPNotFound(text=f"no resource {rest!r} of model {self.name!r} (there are "
                               "its status, /metadata and :predict)")

    async def _post(self, request: web.Request) -> web.Response:
        rest = self._route(request)
        if rest != ":predict":
            raise web.HTTPNotFound(text=f"model {self.name!r} answers POST to :predict only, "
                                   f"not {rest!r}")
        body = await request.read()  # over client_max_size: 413, from aiohttp
        loop = asyncio.get_running_loop()
        answer = await loop.run_in_executor(self.pool, self.predict, body)
        return web.Response(body=answer, content_type=_JSON)

    async def _unknown(self, request: web.Request) -> web.Response:
        raise web.HTTPNotFound(text=f"no route {request.method} {request.path}: the API is GET "
                               f"/v1/models/{self.name}[/metadata] and POST "
                               f"/v1/models/{self.name}:predict")

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the request body is over the limit of {self.max_body} bytes "
                          "(flowmill serve --max-body-bytes)")
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _error(e.status, e.text or e.reason)
        except (BadRequest, FeedError) as e:
            return _error(400, str(e))
        except PredictionError as e:
            if not e.bad_input:
                log.error("model %r failed on a request", self.name, exc_info=e)
            return _error(400 if e.bad_input else 500, str(e))
        except Exception as e:  # noqa: BLE001 - the server answers and keeps serving
            log.exception("request %s %s failed", request.method, request.path)
            return _error(500, f"internal error: {type(e).__name__}: {e}")

    # ---- predict, in the thread pool

    def predict(self, body: bytes) -> bytes:
        """The answer to a predict request's body, as JSON bytes."""
        doc = _parse(body)
        if "instances" in doc:
            feeds, rows = self._rows(doc["instances"]), len(doc["instances"])
            out = self.model(feeds)
            return _dumps({"predictions": _predictions(out, rows)})
        out = self.model(self._columns(doc["inputs"]))
        if len(out) == 1:
            return _dumps({"outputs": next(iter(out.values())).tolist()})
        return _dumps({"outputs": {k: v.tolist() for k, v in out.items()}})

    def _rows(self, instances: Any) -> dict[str, list]:
        """Row format: instances stacked into a batch of each input."""
        names = self.model.input_names
        if not isinstance(instances, list) or not instances:
            raise BadRequest("'instances' must be a non-empty list, one entry per example")
        objects = [isinstance(x, dict) for x in instances]
        if len(names) == 1 and not any(objects):
            return {names[0]: instances}
        for i, instance in enumerate(instances):
            if not isinstance(instance, dict):
                raise BadRequest(f"instance {i} must be an object of the inputs "
                                 f"{_names(names)}, as the others are" if any(objects) else
                                 f"instance {i} must be an object of the inputs {_names(names)}")
            unknown = [k for k in instance if k not in names]
            missing = [k for k in names if k not in instance]
            if unknown or missing:
                what = ", ".join([f"unknown input {k!r}" for k in unknown]
                                 + [f"missing input {k!r}" for k in missing])
                raise BadRequest(f"instance {i}: {what} (the model takes {_names(names)})")
        return {k: [x[k] for x in instances] for k in names}

    def _columns(self, inputs: Any) -> dict[str, Any]:
        """Columnar format: the single input's value, or an object of input values."""
        names = self.model.input_names
        if isinstance(inputs, dict):
            return inputs
        if len(names) == 1:
            return {names[0]: inputs}
        raise BadRequest(f"'inputs' must be an object of the inputs {_names(names)}")


def _parse(body: bytes) -> dict:
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the request body is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadRequest("the request body must be a JSON object with 'instances' (row "
                         "format) or 'inputs' (columnar format)")
    unknown = sorted(set(doc) - {"instances", "inputs", "signature_name"})
    if unknown:
        raise BadRequest(f"unknown request field(s) {_names(unknown)} (the fields are "
                         "'instances' or 'inputs', and 'signature_name')")
    if ("instances" in doc) == ("inputs" in doc):
        raise BadRequest("give exactly one of 'instances' (row format) or 'inputs' "
                         "(columnar format)")
    signature = doc.get("signature_name", SIGNATURE_NAME)
    if signature != SIGNATURE_NAME:
        raise BadRequest(f"no signature {signature!r}: the model has {SIGNATURE_NAME!r}")
    return doc


def _predictions(out: dict[str, np.ndarray], rows: int) -> list:
    """Row format's answer: each output split back into one entry per instance."""
    for name, value in out.items():
        if value.ndim == 0 or value.shape[0] != rows:
            raise BadRequest(f"output {name!r} has shape {value.shape}, not one row per "
                             f"instance ({rows}): ask in the columnar format ('inputs')")
    if len(out) == 1:
        return next(iter(out.values())).tolist()
    lists = {k: v.tolist() for k, v in out.items()}
    return [{k: lists[k][i] for k in lists} for i in range(rows)]


def _names(names) -> str:
    return ", ".join(map(repr, names)) or "none"


def _binary(value: Any) -> Any:
    """Bytes are written as TensorFlow Serving writes them: ``{"b64": ...}``."""
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode()}
    raise TypeError(f"cannot write a {type(value).__name__} as JSON")


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, default=_binary).encode()


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(body=_dumps(doc), status=status, content_type=_JSON)


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


# ---- running


async def _run(server: ModelServer, host: str, port: int, path: str) -> None:
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=STOP_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise OSError(f"cannot listen on {format_address(host, port)}: {e.strerror or e}") from None
    bound = runner.addresses[0][1]  # the port taken, where 0 asked for any
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    url = f"http://{format_address(host, bound)}/v1/models/{server.name}"
    print(f"flowmill serve: model {server.name!r} (version {VERSION}, from {path}) ready at "
          f"{url}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()  # stop listening; requests in flight finish first
        server.pool.shutdown(wait=True, cancel_futures=True)
    print(f"flowmill serve: model {server.name!r} stopped", file=sys.stderr, flush=True)


def serve(path: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT, name: str | None = None,
          max_body: int = DEFAULT_MAX_BODY) -> int:
    """Load the export at ``path`` and serve it until SIGTERM or Ctrl-C; 0 then."""
    logging.basicConfig(format="flowmill serve: %(message)s", stream=sys.stderr)
    server = ModelServer(load(path), name or default_name(path), max_body)
    asyncio.run(_run(server, host, port, path))
    return 0
