"""The OpenAPI document of the server, from the pydantic models.

The routes read their JSON bodies themselves (strict JSON validation, OpenAI's 400 error JSON
naming the bad field instead of FastAPI's 422), so FastAPI cannot see the bodies: each route
declares its body with `json_body(Model)` (a $ref in openapi_extra) and `install_openapi` adds
those models' schemas to the document's components. Responses and error statuses are declared
with `responses(...)`; every error has OpenAI's shape (ErrorResponse).
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pagedlm.entrypoints.openai.protocol import ErrorResponse

_REF = "#/components/schemas/{model}"

ERROR_DESCRIPTIONS = {
    400: "Bad request: the message names the bad field in `param`.",
    401: "Missing or wrong API key (only when the server was started with one).",
    404: "Unknown model (or adapter).",
    408: "The request body paused for longer than the server waits (--request-read-timeout).",
    413: "The request body is larger than the server accepts (--max-request-body-bytes).",
    415: "The request body is not sent as uncompressed JSON (Content-Type: application/json, "
         "no Content-Encoding).",
    500: "Internal error, or the engine is not running.",
    503: "The engine failed: the server is shutting down (/engine/events: or the most view "
         "streams served at once are open).",
}


def json_body(*models: type[BaseModel], description: str | None = None) -> dict[str, Any]:
    """openapi_extra declaring a required JSON body of one of `models`."""
    refs = [{"$ref": _REF.format(model=m.__name__)} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    body: dict[str, Any] = {"required": True,
                            "content": {"application/json": {"schema": schema}}}
    if description:
        body["description"] = description
    return {"requestBody": body}


def responses(ok: type[BaseModel] | None = None, *errors: int, ok_description: str = "OK",
              ok_content: dict[str, Any] | None = None) -> dict[int | str, dict[str, Any]]:
    """The route's `responses`: 200 (a model, and/or other media types) and error statuses."""
    out: dict[int | str, dict[str, Any]] = {}
    ok_entry: dict[str, Any] = {"description": ok_description}
    if ok is not None:
        ok_entry["model"] = ok
    if ok_content:
        ok_entry["content"] = ok_content
    out[200] = ok_entry
    for status in errors:
        out[status] = {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
    return out


def sse_content(description: str) -> dict[str, Any]:
    """A text/event-stream response. The schema describes one event (its `data` field), which
    is how OpenAPI tools such as schemathesis read an event-stream schema."""
    return {"text/event-stream": {"schema": {
        "type": "object", "description": description,
        "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                       "id": {"type": "string"}, "retry": {"type": "integer"}}}}}


SSE_CONTENT = sse_content("With stream=true: server-sent events, one JSON chunk per `data:` "
                          "line, then `data: [DONE]`.")


def install_openapi(app: FastAPI, body_models: list[type[BaseModel]]) -> None:
    """Make app.openapi() add the body models' schemas to the generated document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description,
                          routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in body_models],
                                     ref_template=_REF)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in defs.get("$defs", {}).items():
            if name in schemas and schemas[name] != schema:
                # A response model of the same name: one schema must serve both uses.
                raise RuntimeError(f"OpenAPI schema {name!r} differs between a request body "
                                   f"and a response")
            schemas[name] = schema
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
