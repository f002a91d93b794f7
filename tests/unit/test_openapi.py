"""The published OpenAPI document against the application it describes (no model: the app is composed,
never started): every registered route in it, a valid OpenAPI 3.1 document, and the things a client
reads from it — request fields, each route's error shape and statuses, the headers, the bearer scheme
with API keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from coalesce.service.gateway.app import create_app
from coalesce.service.gateway.contract import Doc
from coalesce.service.gateway.openapi import build as build_document
from coalesce.service.gateway.routing import add_route
from coalesce.service.settings import build
from openapi_spec_validator import validate


def _app(*argv: str) -> web.Application:
    return create_app(build(list(argv), environ={}), lambda spec: None)


def _document(app: web.Application) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(json.dumps(build_document(app)))
    return doc


def _resolve(doc: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        *_, kind, name = node["$ref"].split("/")
        node = doc["components"][kind][name]
    return node


def _error_schema(doc: dict[str, Any], path: str, status: str, method: str = "post") -> set[str]:
    """The error body components a route answers ``status`` with (their names)."""
    schema = doc["paths"][path][method]["responses"][status]["content"]["application/json"]["schema"]
    return {ref["$ref"].rsplit("/", 1)[1] for ref in schema.get("oneOf", [schema])}


@pytest.fixture(scope="module")
def app() -> web.Application:
    return _app()


@pytest.fixture(scope="module")
def doc(app: web.Application) -> dict[str, Any]:
    return _document(app)


def test_every_registered_route_is_in_the_document_and_nothing_else(app: web.Application,
                                                                    doc: dict[str, Any]) -> None:
    registered = {(route.method.lower(), route.resource.canonical)
                  for route in app.router.routes() if route.resource is not None}
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert registered == documented
    assert len(registered) >= 25


def test_a_route_cannot_be_added_without_its_contract() -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    with pytest.raises(TypeError):
        add_route(app, "GET", "/x", handler)  # type: ignore[call-arg]
    add_route(app, "GET", "/x", handler, doc=Doc("X", "Service", str))


@pytest.mark.parametrize("argv", [(), ("--api-keys-file", "KEYS")])
def test_the_document_is_valid_openapi_3_1(argv: tuple[str, ...], tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1 tenant-a\n")
    doc = _document(_app(*(str(keys) if a == "KEYS" else a for a in argv)))
    assert doc["openapi"] == "3.1.0"
    validate(doc)


def test_the_openai_route_takes_openais_fields(doc: dict[str, Any]) -> None:
    body = doc["paths"]["/v1/embeddings"]["post"]["requestBody"]
    schema = _resolve(doc, body["content"]["application/json"]["schema"])
    assert {"input", "model", "encoding_format", "dimensions", "user"} <= set(schema["properties"])
    assert schema["required"] == ["input"]
    assert set(schema["properties"]["encoding_format"]["enum"]) == {"float", "base64"}
    ok = doc["paths"]["/v1/embeddings"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert {"data", "model", "usage"} <= set(_resolve(doc, ok)["properties"])


def test_each_dialect_declares_its_own_error_body(doc: dict[str, Any]) -> None:
    assert _error_schema(doc, "/embed", "422") == {"TeiError"}
    tei = doc["components"]["schemas"]["TeiError"]
    assert set(tei["required"]) == {"error", "error_type"}
    assert "Empty" in tei["properties"]["error_type"]["enum"]
    assert _error_schema(doc, "/embed", "400") == {"TeiError"}  # an empty input: TEI's 400 Empty
    assert _error_schema(doc, "/v1/embeddings", "400") == {"ErrorResponse"}
    assert _error_schema(doc, "/v2/rerank", "400") == {"CohereError"}
    assert doc["components"]["schemas"]["CohereError"]["required"] == ["message"]
    # /rerank answers TEI's or Cohere's by the body's shape: both where both can answer.
    assert _error_schema(doc, "/rerank", "400") == {"TeiError", "CohereError"}
    assert _error_schema(doc, "/rerank", "422") == {"TeiError"}  # Cohere's dialect has no 422


def test_statuses_follow_each_dialects_mapping(doc: dict[str, Any]) -> None:
    tei = set(doc["paths"]["/embed"]["post"]["responses"])
    openai = set(doc["paths"]["/v1/embeddings"]["post"]["responses"])
    assert {"200", "400", "404", "413", "422", "424", "429", "503", "504"} <= tei
    assert "500" not in tei  # a failed batch is TEI's 424
    assert {"200", "400", "404", "413", "429", "500", "503", "504"} <= openai and "422" not in openai
    assert "401" not in tei  # no API keys configured
    assert set(doc["paths"]["/health"]["get"]["responses"]) == {"200"}
    assert set(doc["paths"]["/ready"]["get"]["responses"]) == {"200", "503"}


def test_headers_in_and_out(doc: dict[str, Any]) -> None:
    op = doc["paths"]["/embed"]["post"]
    params = {_resolve(doc, p)["name"] for p in op["parameters"]}
    assert params == {"X-Request-ID", "X-Request-Timeout", "X-Priority", "X-Tenant"}
    ok = op["responses"]["200"]["headers"]
    assert set(ok) == {"x-request-id", "x-total-time", "x-queue-time", "x-inference-time", "x-compute-tokens"}
    for status in ("429", "503"):
        headers = op["responses"][status]["headers"]
        assert _resolve(doc, headers["Retry-After"])["required"] is True
        assert _resolve(doc, headers["x-error-code"])["required"] is True
    assert "Retry-After" not in op["responses"]["422"]["headers"]
    info = doc["paths"]["/info"]["get"]
    assert {_resolve(doc, p)["name"] for p in info["parameters"]} == {"X-Request-ID", "model"}
    assert "x-queue-time" not in info["responses"]["200"]["headers"]


def test_non_json_routes_say_what_they_answer(doc: dict[str, Any]) -> None:
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(doc["paths"]["/docs"]["get"]["responses"]["200"]["content"]) == {"text/html"}
    asset = doc["paths"]["/docs/{asset}"]["get"]
    assert asset["parameters"][-1]["schema"]["enum"] == ["swagger-ui.css", "swagger-ui-bundle.js",
                                                         "favicon-32x32.png"]
    root = doc["paths"]["/"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {r["$ref"].rsplit("/", 1)[1] for r in root["anyOf"]} == {
        "TeiEmbedRequest", "SimilarityRequest", "PredictRequest", "RerankRequest"}


def test_with_api_keys_the_bearer_scheme_guards_all_but_the_open_routes(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1 tenant-a\n")
    doc = _document(_app("--api-keys-file", str(keys)))
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": "A key from --api-keys-file."}
    assert doc["security"] == [{"bearer": []}]
    for path in ("/health", "/ready", "/metrics", "/openapi.json", "/docs", "/docs/{asset}"):
        op = doc["paths"][path]["get"]
        assert op["security"] == [] and "401" not in op["responses"], path
    embed = doc["paths"]["/embed"]["post"]
    assert "security" not in embed and _error_schema(doc, "/embed", "401") == {"TeiError"}
    assert "X-Tenant" not in {_resolve(doc, p)["name"] for p in embed["parameters"]}  # the key names it
