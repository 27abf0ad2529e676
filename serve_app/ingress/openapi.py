"""The app's /openapi.json describes the real request bodies of completions and chat.

The generation routes read the raw body themselves (size limit first, then one pydantic parse with
OpenAI-shaped errors), so FastAPI cannot infer their bodies; without this a client generator or a
fuzzer (schemathesis, in the integration suite) learns nothing from the schema.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is ``model``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def install(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` carry the JSON schemas of ``models`` (and of what they use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template=_REF, mode="validation")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
