"""Wire schemas: every request and response body is a msgspec Struct declared here.

Decoders are built once. Decoding errors become :class:`~coalesce.service.errors.InvalidRequest` with
the JSON path of the offending field as ``param``; no raw dict travels past this module.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, TypeVar

import msgspec

from .errors import InvalidRequest

T = TypeVar("T")

# What the routes require of inputs beyond their types: declared here for the OpenAPI document only
# (``extra_json_schema``), as the routes check them to answer each dialect's own error (an empty input
# is TEI's 400 ``Empty``, not a decoding error), and ids must also fall inside the model's vocabulary.
Text = Annotated[str, msgspec.Meta(extra_json_schema={"minLength": 1})]
NonEmpty = Annotated[list[T], msgspec.Meta(extra_json_schema={"minItems": 1})]
Texts = NonEmpty[Text]
Labels = Annotated[list[Text], msgspec.Meta(extra_json_schema={"minItems": 1, "uniqueItems": True})]
TokenId = Annotated[int, msgspec.Meta(extra_json_schema={"minimum": 0})]
TokenIds = NonEmpty[TokenId]


class EmbeddingRequest(msgspec.Struct, frozen=True):
    """OpenAI ``POST /v1/embeddings``. ``model`` is checked by the route, for a precise error."""

    input: Text | NonEmpty[Text | TokenId | TokenIds]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    prompt_name: str | None = None  # ours, one of the model's prompts (openai's client: extra_body)
    long_input: str | None = None  # ours: truncate, chunk or error (default: --long-input)
    chunk_overlap: int | None = None  # ours: tokens each window repeats (default: --chunk-overlap)


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


class Health(msgspec.Struct, frozen=True):
    """``GET /health``: the event loop answers."""

    status: Literal["ok"] = "ok"


PhaseName = Literal["starting", "ready", "draining", "failed"]


class Readiness(msgspec.Struct, frozen=True, omit_defaults=True):
    """``GET /ready``: ``ready`` with the served models (200), else the phase and why (503)."""

    status: PhaseName
    models: list[str] | None = None
    error: str | None = None


# -- errors: one body per dialect (``dialects.py`` decides which a route answers with) ----------------


class ErrorDetail(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct, frozen=True):
    """OpenAI's error body."""

    error: ErrorDetail


TeiErrorType = Literal["Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"]


class TeiError(msgspec.Struct, frozen=True):
    """TEI's ``ErrorResponse``: the message and its ``ErrorType``."""

    error: str
    error_type: TeiErrorType


class CohereError(msgspec.Struct, frozen=True):
    """Cohere's error body (the ``cohere`` client raises it as an ``ApiError`` with this ``body``)."""

    message: str


# -- classification and reranking (service/gateway/classify.py, rerank.py) ---------------------------


class ClassifyRequest(msgspec.Struct, frozen=True):
    """Infinity ``POST /classify``. With ``labels``, zero-shot classification by an embedding model."""

    input: Text | NonEmpty[Text | TokenId | TokenIds]
    model: str | None = None
    raw_scores: bool = False
    labels: Labels | None = None


class Prediction(msgspec.Struct, frozen=True):
    label: str
    score: float


class ClassifyResponse(msgspec.Struct, frozen=True):
    data: list[list[Prediction]]  # per input, every label, best first
    model: str
    usage: Usage
    object: str = "classify"


class PredictRequest(msgspec.Struct, frozen=True):
    """TEI ``POST /predict``: a text, a pair ``[a, b]``, or a batch ``[[a], [a, b], ...]``."""

    inputs: Text | NonEmpty[Text | Texts]
    raw_scores: bool = False
    truncate: bool | None = None
    model: str | None = None


class RerankDocument(msgspec.Struct, frozen=True):
    text: Text


class RerankRequest(msgspec.Struct, frozen=True):
    """``POST /rerank`` and ``/v1/rerank`` in Cohere's v1 shape (``documents``, ``top_n``,
    ``return_documents``; Jina's and vLLM's are the same) or TEI's (``texts``, ``return_text``,
    ``raw_scores``); exactly one of ``documents`` and ``texts``. ``return_documents`` left out means
    the path's default (``/v1/rerank``: true, as Jina and vLLM answer; ``/rerank``: false).
    ``instruction`` (ours, in either shape) is the task an LLM reranker judges pairs for."""

    query: Text
    documents: NonEmpty[Text | RerankDocument] | None = None
    texts: Texts | None = None
    model: str | None = None
    top_n: int | None = None
    return_documents: bool | None = None
    max_tokens_per_doc: int | None = None
    return_text: bool = False
    raw_scores: bool = False
    truncate: bool | None = None
    instruction: str | None = None


class RerankResult(msgspec.Struct, frozen=True, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(msgspec.Struct, frozen=True):
    id: str
    results: list[RerankResult]  # best first
    model: str
    usage: Usage
    object: str = "rerank"


class ApiVersion(msgspec.Struct, frozen=True):
    version: str


class EmbedV2Request(msgspec.Struct, frozen=True):
    """Cohere v2 ``POST /v2/embed`` (what ``cohere.ClientV2.embed`` sends). Text only: ``images`` and
    ``inputs`` are refused by name; ``priority`` is accepted and ignored (``X-Priority`` orders work)."""

    model: str | None = None
    input_type: str | None = None
    texts: Texts | None = None
    images: list[str] | None = None
    inputs: list[msgspec.Raw] | None = None
    max_tokens: int | None = None
    output_dimension: int | None = None
    embedding_types: list[str] | None = None
    truncate: str | None = None
    priority: int | None = None
    long_input: str | None = None  # ours: truncate, chunk or error (wins over truncate)
    chunk_overlap: int | None = None


class EmbeddingsByType(msgspec.Struct, frozen=True, omit_defaults=True):
    """The types a request asked for, each a list in input order (``float`` is a Python builtin's
    name, hence ``float_`` here)."""

    float_: list[list[float]] | None = msgspec.field(default=None, name="float")
    int8: list[list[int]] | None = None
    uint8: list[list[int]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None


class BilledUnits(msgspec.Struct, frozen=True):
    input_tokens: int


class EmbedV2Meta(msgspec.Struct, frozen=True):
    api_version: ApiVersion
    billed_units: BilledUnits


class EmbedV2Response(msgspec.Struct, frozen=True):
    """Cohere v2's ``EmbedByTypeResponse``."""

    id: str
    embeddings: EmbeddingsByType
    texts: list[str]
    meta: EmbedV2Meta
    response_type: str = "embeddings_by_type"


class RerankV2Request(msgspec.Struct, frozen=True):
    """Cohere v2 ``POST /v2/rerank`` (what ``cohere.ClientV2.rerank`` sends). ``priority`` and
    ``relevant_spans`` are accepted and ignored (``X-Priority`` orders work here). ``instruction``
    (ours; the ``cohere`` client sends it in ``request_options``' ``additional_body_parameters``) is
    the task an LLM reranker judges pairs for."""

    query: Text
    documents: Texts
    model: str | None = None
    top_n: int | None = None
    max_tokens_per_doc: int | None = None
    instruction: str | None = None


class RerankV2Result(msgspec.Struct, frozen=True):
    index: int
    relevance_score: float


class MetaTokens(msgspec.Struct, frozen=True):
    input_tokens: int


class RerankV2Meta(msgspec.Struct, frozen=True):
    """Cohere's ``ApiMeta``, with what is true here: the API version spoken and the tokens computed
    (nothing is billed, so no ``billed_units``)."""

    api_version: ApiVersion
    tokens: MetaTokens


class RerankV2Response(msgspec.Struct, frozen=True):
    """Cohere v2's ``V2RerankResponse``: results best first, without the documents (v2 has none)."""

    id: str
    results: list[RerankV2Result]
    meta: RerankV2Meta


# -- TEI (service/gateway/tei.py, tei_meta.py): named after TEI's own schemas, for an OpenAPI document --


class TeiRank(msgspec.Struct, frozen=True, omit_defaults=True):
    """TEI ``Rank``: one item of ``/rerank``'s bare array."""

    index: int
    score: float
    text: str | None = None


class TeiEmbedRequest(msgspec.Struct, frozen=True):
    """TEI ``EmbedRequest`` (``POST /embed``; what LlamaIndex's ``TextEmbeddingsInference`` and Haystack
    send) → ``[[float]]``."""

    inputs: Text | Texts
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: str = "right"
    dimensions: int | None = None
    prompt_name: str | None = None
    model: str | None = None
    long_input: str | None = None  # ours: truncate, chunk or error (wins over truncate)
    chunk_overlap: int | None = None


class TeiEmbedAllRequest(msgspec.Struct, frozen=True):
    """TEI ``EmbedAllRequest`` (``POST /embed_all``) → ``[[[float]]]``: per input, one vector per token
    (special tokens included, padding never)."""

    inputs: Text | Texts
    truncate: bool | None = None
    truncation_direction: str = "right"
    prompt_name: str | None = None
    model: str | None = None
    long_input: str | None = None  # ours: truncate or error (chunk pools; token vectors do not)


class TeiEmbedSparseRequest(msgspec.Struct, frozen=True):
    """TEI ``EmbedSparseRequest`` (``POST /embed_sparse``) → ``[[SparseValue]]``: per input, its
    non-zero weights over the vocabulary."""

    inputs: Text | Texts
    truncate: bool | None = None
    truncation_direction: str = "right"
    prompt_name: str | None = None
    model: str | None = None


class SparseValue(msgspec.Struct, frozen=True):
    """TEI ``SparseValue``: a vocabulary index and its weight."""

    index: int
    value: float


class SimilarityInput(msgspec.Struct, frozen=True):
    source_sentence: Text
    sentences: Texts


class SimilarityParameters(msgspec.Struct, frozen=True):
    truncate: bool | None = None
    truncation_direction: str = "right"
    prompt_name: str | None = None
    long_input: str | None = None  # ours: truncate, chunk or error (wins over truncate)
    chunk_overlap: int | None = None


class SimilarityRequest(msgspec.Struct, frozen=True):
    """TEI ``SimilarityRequest`` (``POST /similarity``, and ``POST /`` when ``inputs`` is an object, as
    ``huggingface_hub``'s ``sentence_similarity`` sends) → ``[float]``, one cosine per sentence."""

    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None
    model: str | None = None


class DecodeRequest(msgspec.Struct, frozen=True):
    """TEI ``DecodeRequest`` (``POST /decode``): ``ids`` one sequence or a batch → ``[str]``."""

    ids: NonEmpty[TokenId | TokenIds]  # msgspec unions hold one array type: the route checks homogeneity
    skip_special_tokens: bool = True
    model: str | None = None


class TokenizeRequest(msgspec.Struct, frozen=True):
    """TEI ``TokenizeRequest`` (``POST /tokenize``) → ``[[SimpleToken]]``."""

    inputs: Text | Texts
    add_special_tokens: bool = True
    model: str | None = None


class SimpleToken(msgspec.Struct, frozen=True):
    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class EmbeddingModelType(msgspec.Struct, frozen=True):
    pooling: str


class ClassifierModelType(msgspec.Struct, frozen=True):
    id2label: dict[str, str]
    label2id: dict[str, int]


class ModelType(msgspec.Struct, frozen=True, omit_defaults=True):
    """TEI ``ModelType``: exactly one of its three fields, the model's kind."""

    classifier: ClassifierModelType | None = None
    embedding: EmbeddingModelType | None = None
    reranker: ClassifierModelType | None = None


class ServedTask(msgspec.Struct, frozen=True):
    id: str
    task: str


class TeiInfo(msgspec.Struct, frozen=True):
    """TEI ``Info`` (``GET /info``) for one model, every field TEI's document requires, plus ``models``:
    every served model and its task. Nullable fields are sent as null, as TEI does."""

    model_id: str
    model_sha: str | None
    model_dtype: str
    model_type: ModelType
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int | None
    max_client_batch_size: int
    auto_truncate: bool
    tokenization_workers: int
    version: str
    sha: str | None
    docker_label: str | None
    served_model_name: str | None
    prompts: dict[str, str] | None
    # Our extras after TEI's fields.
    default_prompt: str | None  # the prompt text applied when a request names none
    # int8 output's step at full width (x ≈ int8 × scale; uint8 = int8 + 128), from the calibration corpus
    quantization_scale: float | None
    models: list[ServedTask]


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
