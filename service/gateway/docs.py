"""``GET /docs``: the OpenAPI document (``/openapi.json``) as an interactive page, fully offline.

The page is Swagger UI from the ``swagger-ui-py`` package (the ``docs`` extra; it ships Swagger UI 5,
the first release that renders OpenAPI 3.1), served from the installed package under ``/docs/…``: no
CDN, and Swagger UI's online validator badge is turned off, so the page makes no request beyond this
server. Only the three files the page loads are served, by name; the package's other files (Swagger
Editor, source maps) are not. Without the extra, ``/docs`` answers 404 saying how to install it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from aiohttp import web

from ..errors import RouteNotFound
from .contract import Doc, Text
from .routing import add_route

# The assets the page loads and the media type each is served as.
ASSETS = {
    "swagger-ui.css": "text/css",
    "swagger-ui-bundle.js": "text/javascript",
    "favicon-32x32.png": "image/png",
}
_MISSING = "The docs page needs the 'docs' extra: pip install 'coalesce[docs]'."

# Relative URLs, so the page also works behind a proxy that serves this API under a path prefix.
_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Coalesce API</title>
<link rel="icon" type="image/png" href="docs/favicon-32x32.png">
<link rel="stylesheet" href="docs/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="docs/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({url: "openapi.json", dom_id: "#swagger-ui", validatorUrl: null,
                             deepLinking: true});
</script>
</body>
</html>
"""

STATIC: web.AppKey[Path | None] = web.AppKey("docs_static")


def static_dir() -> Path | None:
    """Swagger UI's files in the installed ``swagger-ui-py`` package (found without importing it), or
    None when the extra is not installed."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "static"
    return folder if all((folder / name).is_file() for name in ASSETS) else None


async def page(request: web.Request) -> web.Response:
    """The interactive API documentation: Swagger UI over ``/openapi.json``, from this server alone."""
    if request.app[STATIC] is None:
        raise RouteNotFound(_MISSING)
    return web.Response(text=_PAGE, content_type="text/html")


async def asset(request: web.Request) -> web.FileResponse:
    """One of the files ``/docs`` loads (Swagger UI's script, its style sheet, the icon)."""
    folder = request.app[STATIC]
    name = request.match_info["asset"]
    if folder is None:
        raise RouteNotFound(_MISSING)
    if name not in ASSETS:
        raise RouteNotFound(f"No docs asset {name!r}; the page loads {', '.join(ASSETS)}.")
    return web.FileResponse(folder / name, headers={"Content-Type": ASSETS[name]})


def add_routes(app: web.Application) -> None:
    """Register ``/docs`` and its assets (open even with API keys: see ``auth.is_open``)."""
    app[STATIC] = static_dir()
    missing = (RouteNotFound(_MISSING),)
    add_route(app, "GET", "/docs", page, doc=Doc(
        "Interactive API documentation", "Service", Text("Swagger UI's page.", ("text/html",)), fails=missing,
    ))
    add_route(app, "GET", "/docs/{asset}", asset, doc=Doc(
        "A file of the documentation page", "Service",
        Text("The file.", tuple(dict.fromkeys(ASSETS.values()))), fails=missing, path_enum=tuple(ASSETS),
    ))
