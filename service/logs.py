"""structlog configured once, at start-up. Request ids travel in contextvars; input text is never logged."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import msgspec

from . import tracing


@contextlib.contextmanager
def _unimportable(name: str) -> Iterator[None]:
    """While inside, ``import name`` fails as if it were not installed (a ``None`` in ``sys.modules``,
    unless it is imported already); afterwards anything may import it again."""
    blocked = name not in sys.modules
    if blocked:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if blocked and name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]


# structlog imports rich eagerly wherever it is installed (a development dependency here, not the
# server's), for pretty tracebacks this configuration never uses (format_exc_info below renders every
# exception as plain text first): that was the larger part of structlog's import, paid at every start.
# Without it, structlog does as it does where rich is absent; the rest of the process can still import it.
with _unimportable("rich"):
    import structlog

_json = msgspec.json.Encoder()

# The request a line is logged for, set by the gateway's middleware for as long as it runs one: its id,
# a context variable set and reset a request, put on a line only when a line is written; with tracing on,
# the trace and span ids of the request's span (tracing.current(), the span's own context variable), read
# only then too. (structlog's bind_contextvars and unbind_contextvars, which they replaced, ran about 60
# bytecodes of Python a request (loadtests.gateway_ops) for lines that hardly any request writes, and its
# merge walked the whole context at every line.)
REQUEST_ID: ContextVar[str | None] = ContextVar("coalesce_request_id", default=None)


def _add_request_context(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    # (setdefault: a line's own field of the same name, if it names one, stands)
    rid = REQUEST_ID.get()
    if rid is not None:
        event.setdefault("request_id", rid)
    trace = tracing.current()
    if trace is not None:
        ctx = trace.span.get_span_context()
        event.setdefault("trace_id", f"{ctx.trace_id:032x}")
        event.setdefault("span_id", f"{ctx.span_id:016x}")
    return event


def _serialize(obj: Any, default: Any = None) -> str:
    # structlog's JSONRenderer passes default=; msgspec takes enc_hook.
    return (
        _json.encode(obj).decode() if default is None else msgspec.json.encode(obj, enc_hook=default).decode()
    )


def configure(level: str = "info", fmt: str = "json", process: str | None = None) -> None:
    """Configure structlog and the stdlib root logger (libraries log through it). ``process`` names
    this process on every line when it is one of several (``engine``, ``gateway-0``, ...)."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    renderer: Any = (
        structlog.processors.JSONRenderer(serializer=_serialize)
        if fmt == "json"
        # Plain tracebacks whatever is installed (its default is rich's where rich is importable).
        else structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    )
    shared: list[Any] = [
        _add_request_context,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if process is not None:
        shared.append(lambda _logger, _name, event: {**event, "process": process})
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # One write per line (PrintLogger writes the text and its newline apart): several processes
        # share one stderr, and unbuffered (PYTHONUNBUFFERED) lines must not interleave.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=shared,
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(numeric, logging.INFO))  # library debug logs stay off even at --log-level debug
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
