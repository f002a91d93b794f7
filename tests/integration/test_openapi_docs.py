"""``/openapi.json`` and ``/docs`` from a running server on loopback: the document as built, the page and
every file it loads served by this server alone (no CDN), all of it open with API keys on; and the
``Allow`` header of a 405, which the document's fuzzing asks for.

The server runs with ``--api-keys-file`` and is not waited on to be ready: the docs do not need the
model, and a model route's refusal without a key comes before any model is picked.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from coalesce.service.gateway.docs import ASSETS
from coalesce.service.gateway.openapi import build as build_document
from coalesce.service.settings import build

from ..conftest import ServerThread
from .tiny_models import load


def _get(url: str, method: str = "GET", key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers.items()), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers.items()), err.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("k1 tenant-a\n")
    srv = ServerThread(build(["--api-keys-file", str(keys)], environ={}), load).launch()
    yield srv
    srv.stop()


def test_the_document_is_served_as_built(server: ServerThread) -> None:
    status, headers, body = _get(server.url + "/openapi.json")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert json.loads(body) == json.loads(json.dumps(build_document(server.app)))
    assert _get(server.url + "/openapi.json")[2] == body  # built once, at the first request
    assert json.loads(body)["security"] == [{"bearer": []}]


def test_the_docs_page_and_its_files_come_from_this_server(server: ServerThread) -> None:
    status, headers, page = _get(server.url + "/docs")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    html = page.decode()
    loaded = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert sorted(loaded) == sorted(f"docs/{name}" for name in ASSETS)  # relative: nothing off-server
    assert 'url: "openapi.json"' in html and "validatorUrl: null" in html  # no online validator badge
    for name, media in ASSETS.items():
        status, headers, body = _get(f"{server.url}/docs/{name}")
        assert status == 200, name
        assert headers["Content-Type"].startswith(media), name
        assert len(body) > 1000, name
    bundle = _get(server.url + "/docs/swagger-ui-bundle.js")[2]
    assert b"SwaggerUIBundle" in bundle and b"3.1" in bundle


def test_docs_serve_only_the_pages_files(server: ServerThread) -> None:
    for name in ("swagger-editor-bundle.js", "..%2Fcore.py", "index.css"):
        status, headers, body = _get(f"{server.url}/docs/{name}")
        assert status == 404, name
        assert headers["x-error-code"] == "not_found"
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def test_keys_guard_the_model_routes_not_the_docs(server: ServerThread) -> None:
    for path in ("/openapi.json", "/docs", "/docs/swagger-ui.css", "/health"):
        assert _get(server.url + path)[0] == 200, path
    status, headers, body = _get(server.url + "/info")
    assert status == 401 and headers["x-error-code"] == "invalid_api_key"
    assert json.loads(body)["error_type"] == "Validation"


def test_a_405_says_which_methods_the_path_serves(server: ServerThread) -> None:
    status, headers, body = _get(server.url + "/health", method="DELETE")
    assert status == 405 and headers["Allow"] == "GET"
    assert json.loads(body)["error"]["code"] == "method_not_allowed"
    status, headers, body = _get(server.url + "/embed", method="PUT", key="k1")  # TEI's route: TEI's error
    assert status == 405 and headers["Allow"] == "POST"
    assert json.loads(body)["error_type"] == "Validation"

