"""Wire schemas: every request and response body is a msgspec Struct declared here.

Decoders are built once. Decoding errors become :class:`~coalesce.service.errors.InvalidRequest` with
the JSON path of the offending field as ``param``; no raw dict travels past this module.
"""

from __future__ import annotations

import re
from typing import Literal, TypeVar

import msgspec

from .errors import InvalidRequest

T = TypeVar("T")


class EmbeddingRequest(msgspec.Struct, frozen=True):
    """OpenAI ``POST /v1/embeddings``. ``model`` is checked by the route, for a precise error."""

    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EmbeddingData(msgspec.Struct, frozen=True):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, frozen=True):
    data: list[EmbeddingData]
    model: str
    usage: Usage
    object: str = "list"


class ModelCard(msgspec.Struct, frozen=True):
    id: str
    created: int
    owned_by: str = "coalesce"
    object: str = "model"


class ModelList(msgspec.Struct, frozen=True):
    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct, frozen=True):
    error: ErrorDetail


_decoders: dict[type, msgspec.json.Decoder] = {}
encoder = msgspec.json.Encoder()

_PATH_RE = re.compile(r"at `\$(?P<path>[^`]*)`")
_MISSING_RE = re.compile(r"missing required field `(?P<field>[^`]*)`")


def decode(body: bytes, kind: type[T]) -> T:
    """Decode ``body`` into ``kind`` or raise InvalidRequest naming the field that is wrong."""
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.json.Decoder(kind)
    if not body.strip():
        raise InvalidRequest("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        return dec.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH_RE.search(text)
        missing = _MISSING_RE.search(text)
        param = match.group("path").lstrip(".") if match else (missing.group("field") if missing else None)
        raise InvalidRequest(f"Invalid request: {text}", param=param or None, code="invalid_type") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
