"""The served models by name, and how a route picks the one it needs.

Every route resolves its model here, so calling a model with the wrong task (``/rerank`` on an
embedding model, ``/embed`` on a classifier) is a 400 that says which models serve what, never a 500
or a silent wrong answer. TEI's request shapes carry no ``model``: they get the first served model of
the right task (``--model`` order).
"""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web
from coalesce.kernels.protocol import Task

from ..errors import InvalidRequest, ModelNotFound
from .facade import ServedModel
from .state import require_ready

_KIND = {Task.EMBED: "an embedding", Task.CLASSIFY: "a classification", Task.RERANK: "a reranking",
         Task.SPARSE: "a sparse-embedding"}
# Where a model's own task is served, for a wrong-task error to point to it.
_ROUTE = {Task.SPARSE: "POST /embed_sparse", Task.RERANK: "POST /rerank", Task.CLASSIFY: "POST /classify"}


class ModelRegistry:
    """Name → served model. Filled once at start-up, read-only afterwards."""

    def __init__(self) -> None:
        self._by_name: dict[str, ServedModel] = {}
        self.models: list[ServedModel] = []

    def add(self, served: ServedModel) -> None:
        for name in (served.info.name, *served.info.aliases):
            self._by_name[name] = served
        self.models.append(served)

    def get(self, name: str | None) -> ServedModel:
        if name is None:
            raise InvalidRequest(
                f"The 'model' field is required; this server serves: {', '.join(self.names())}.",
                param="model",
                code="missing_model",
            )
        served = self._by_name.get(name)
        if served is None:
            raise ModelNotFound(
                f"The model '{name}' does not exist on this server; it serves: {', '.join(self.names())}.",
                param="model",
            )
        return served

    def names(self) -> list[str]:
        return [m.info.name for m in self.models]

    def catalog(self) -> str:
        """``name (task), ...`` for every served model, for error messages."""
        return ", ".join(f"{m.info.name} ({m.info.task})" for m in self.models)

    def close(self) -> None:
        for served in self.models:
            served.close()


MODELS = web.AppKey("models", ModelRegistry)


def pick_model(
    request: web.Request, name: str | None, accepts: Sequence[Task], route: str, *, required: bool = False
) -> ServedModel:
    """The model ``name`` (or, when None and not ``required``, the first served one of an accepted
    task), checked to serve one of ``accepts``. Raises 503 before the models are ready, 404 for an
    unknown name, 400 otherwise."""
    require_ready(request)
    registry = request.app[MODELS]
    if name is None and not required:
        for served in registry.models:
            if served.info.task in accepts:
                return served
        raise InvalidRequest(
            f"{route} needs {_wanted(accepts)} model and this server serves none: {registry.catalog()}.",
            param="model",
            code="no_model_for_task",
        )
    served = registry.get(name)
    if served.info.task not in accepts:
        own = _ROUTE.get(served.info.task)
        raise InvalidRequest(
            f"Model '{served.info.name}' is {_KIND[served.info.task]} model; {route} needs "
            f"{_wanted(accepts)} model{f' ({own} serves this one)' if own else ''}. "
            f"This server serves: {registry.catalog()}.",
            param="model",
            code="wrong_task",
        )
    return served


def _wanted(accepts: Sequence[Task]) -> str:
    return " or ".join(_KIND[t] for t in accepts)
