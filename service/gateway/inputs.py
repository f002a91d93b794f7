"""Fitting a request's inputs to its model: validated items, token ids, truncation, special tokens.

Every route turns what the caller sent into complete id sequences here, with one set of rules: a
precise 400 naming the field (or the element) that is wrong; a full queue refused before any text is
tokenised; texts and a client's token arrays cut to the model's length alike (keeping the end for
``truncation_direction: left``) or, without truncation, rejected by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from aiohttp import web
from coalesce.kernels.protocol import ModelInfo, PairIds, PromptIds

from ..errors import InvalidRequest
from .admission import Admission
from .facade import ServedModel
from .llm_pairs import encode_template_pairs
from .state import SETTINGS

T = TypeVar("T", str, list[int])

SEND_TRUNCATE = 'send "truncate": true'


def checked_items(raw: T | Sequence[T], field: str, max_inputs: int) -> list[T]:
    """A single item or a non-empty list of non-empty items (texts or token arrays), at most
    ``max_inputs`` of them; a precise 400 naming ``field`` (or the offending element) otherwise."""
    items: list[T] = [raw] if isinstance(raw, str) else list(raw)  # type: ignore[arg-type]
    if not items:
        raise InvalidRequest(f"'{field}' must not be an empty list.", param=field, code="empty_input")
    if len(items) > max_inputs:
        raise InvalidRequest(
            f"'{field}' has {len(items)} items; at most {max_inputs} are allowed per request.",
            param=field,
            code="too_many_inputs",
        )
    for i, item in enumerate(items):
        if not item:
            raise InvalidRequest(f"{field}[{i}] is empty.", param=f"{field}[{i}]", code="empty_input")
    return items


def parse_inputs(
    raw: str | list[str | int | list[int]], max_inputs: int
) -> tuple[list[str], list[list[int]]]:
    """Split OpenAI's ``input`` into texts or token arrays (never both), rejecting what OpenAI rejects."""
    if isinstance(raw, str):  # (the common cases first: one text, a list of texts)
        return checked_items([raw], "input", max_inputs), []
    items = raw
    if items and type(items[0]) is str and all(type(x) is str for x in items):
        return checked_items(items, "input", max_inputs), []  # type: ignore[arg-type]
    if items and all(isinstance(x, int) for x in items):  # one token array
        return [], [list(items)]  # type: ignore[arg-type]
    if all(isinstance(x, str) for x in items):
        return checked_items(items, "input", max_inputs), []  # type: ignore[arg-type]
    if all(isinstance(x, list) for x in items):
        return [], checked_items(items, "input", max_inputs)  # type: ignore[arg-type]
    raise InvalidRequest(
        "'input' must be a string, a list of strings, a token array, or a list of token arrays — not a mix.",
        param="input",
        code="invalid_type",
    )


def check_dimensions(dimensions: int | None, info: ModelInfo, field: str = "dimensions") -> None:
    """``dimensions`` (when given) must be 1..the model's width."""
    if dimensions is not None and not 1 <= dimensions <= info.dim:
        raise InvalidRequest(
            f"'{field}' must be between 1 and {info.dim} for model '{info.name}'; got {dimensions}.",
            param=field,
            code="invalid_dimensions",
        )


def check_ids(ids: Sequence[int], vocab_size: int, index: int) -> None:
    """Token ids must be in the model's own vocabulary (LangChain sends OpenAI's ids by default)."""
    for tok in ids:
        if tok < 0 or tok >= vocab_size:
            raise InvalidRequest(
                f"Token id {tok} in input {index} is outside this model's vocabulary (0..{vocab_size - 1}). "
                "Token arrays must use the served model's tokenizer; LangChain's OpenAIEmbeddings "
                "sends OpenAI's ids unless check_embedding_ctx_length=False, which makes it send text.",
                param=f"input[{index}]",
                code="invalid_token_id",
            )


def truncating(request: web.Request, truncate: bool | None) -> bool:
    """A request's own ``truncate`` (TEI's field) wins; without it, the server's ``--truncate``."""
    return request.app[SETTINGS].truncate if truncate is None else truncate


def _too_long(info: ModelInfo, field: str, i: int, tokens: int, hint: str,
              longest: int | None = None, bound: str = "max_tokens") -> InvalidRequest:
    most = f"{info.max_tokens}" if longest in (None, info.max_tokens) else f"{longest} here ({bound})"
    return InvalidRequest(
        f"{field}[{i}] has {tokens} tokens; model '{info.name}' takes at most {most}. Shorten it, or {hint}.",
        param=f"{field}[{i}]",
        code="input_too_long",
    )


class ModelDefault:
    """The ``prompt`` of a route with no prompt field: whatever the model applies by default."""


MODEL_DEFAULT = ModelDefault()


async def encode_texts(
    model: ServedModel,
    adm: Admission,
    texts: Sequence[str],
    *,
    cut: bool,
    field: str,
    left: bool = False,
    positions: Sequence[int] | None = None,
    hint: str = SEND_TRUNCATE,
    prompt: str | ModelDefault | None = MODEL_DEFAULT,
    limit: int | None = None,
) -> list[list[int]]:
    """Complete id sequences for single texts behind ``prompt`` (the model's default prompt unless a
    request chose one; None: none), truncated (keeping the end when ``left``) or rejected.

    ``positions`` are the texts' indices in the request's ``field``, for the error naming one; ``hint``
    tells the caller how to have it truncated instead; ``limit`` caps a sequence below the model's own
    maximum (special tokens included)."""
    raw, prompt_len = await tokenize_texts(model, adm, texts, prompt)
    return fit_sequences(model, raw, cut=cut, field=field, left=left, positions=positions, hint=hint,
                         prompt_len=prompt_len, limit=limit)


async def tokenize_texts(
    model: ServedModel, adm: Admission, texts: Sequence[str], prompt: str | ModelDefault | None
) -> tuple[list[list[int]], int]:
    """(raw ids of each text behind ``prompt``, the prompt's length in tokens), after refusing a full
    queue. The prompt is tokenised together with each text, as sentence-transformers does."""
    text = model.prompts.default if isinstance(prompt, ModelDefault) else prompt
    model.check_room(adm, *model.estimate(texts, text), len(texts))  # refuse before tokenising
    raw = await model.tokenize([text + t for t in texts] if text else texts)
    return raw, model.prompt_length(text) if text else 0


def fit_sequences(
    model: ServedModel,
    raw: Sequence[Sequence[int]],
    *,
    cut: bool,
    field: str,
    left: bool = False,
    positions: Sequence[int] | None = None,
    hint: str = SEND_TRUNCATE,
    prompt_len: int = 0,
    limit: int | None = None,
) -> list[list[int]]:
    """Raw ids (tokenised texts or a client's token arrays) with special tokens added, each cut to
    the model's length, or ``limit`` when shorter (keeping the end when ``left``), or, without
    truncation, rejected by name.

    The first ``prompt_len`` ids are a prompt: truncation keeps them, and a model whose pooling leaves
    the prompt out gets sequences marked with where pooling starts."""
    longest = model.info.max_tokens if limit is None else min(limit, model.info.max_tokens)
    room = longest - model.specials
    if prompt_len >= room:
        raise InvalidRequest(
            f"The prompt takes {prompt_len} tokens; at most {max(room, 0)} fit besides the special tokens, "
            "which leaves no room for the text.",
            param="prompt_name" if prompt_len else "max_tokens",
            code="prompt_too_long" if prompt_len else "invalid_value",
        )
    seqs: list[list[int]] = []
    for i, ids in enumerate(raw):
        if len(ids) > room:
            if not cut:
                raise _too_long(model.info, field, positions[i] if positions else i,
                                len(ids) + model.specials, hint, longest)
            ids = [*ids[:prompt_len], *ids[len(ids) - (room - prompt_len) :]] if left else ids[:room]
        seq = model.tokens.with_special_tokens(ids)
        if prompt_len and not model.info.include_prompt:
            seq = PromptIds(seq, model.tokens.prefix_len + prompt_len)
        seqs.append(seq)
    return seqs


async def encode_pairs(
    model: ServedModel,
    adm: Admission,
    pairs: Sequence[tuple[str, str]],
    *,
    cut: bool,
    field: str,
    positions: Sequence[int] | None = None,
    max_b: int | None = None,
    limit: int | None = None,
    instruction: str | None = None,
) -> list[list[int]]:
    """Complete id sequences for text pairs (segment B marked), truncated longest-first or rejected.

    Each distinct string is tokenised once, so a rerank query shared by every pair costs one pass.
    ``max_b`` first cuts every second text to that many tokens (Cohere's ``max_tokens_per_doc``);
    ``limit`` caps a pair below the model's own maximum (special tokens included). An LLM reranker's
    pairs are read through its template with ``instruction`` (None: the template's) instead, cutting
    only the second text (see ``llm_pairs``).
    """
    longest = model.info.max_tokens if limit is None else min(limit, model.info.max_tokens)
    template = model.info.rerank_template
    if template is not None:
        return await encode_template_pairs(
            model, adm, pairs, instruction=template.instruction if instruction is None else instruction,
            cut=cut, field=field, limit=longest, positions=positions, max_b=max_b,
        )
    distinct = list(dict.fromkeys(s for pair in pairs for s in pair))
    first, total = model.estimate([a + b for a, b in pairs[:1]])
    model.check_room(adm, first, first * len(pairs), len(pairs))  # refuse before tokenising
    ids_of = dict(zip(distinct, await model.tokenize(distinct), strict=True))
    tokens = model.tokens
    specials = len(tokens.pair_with_special_tokens([], [])[0])
    seqs: list[list[int]] = []
    for i, (a, b) in enumerate(pairs):
        ids_a, ids_b = ids_of[a], ids_of[b][:max_b]
        total = len(ids_a) + len(ids_b) + specials
        if total > longest:
            if not cut:
                raise _too_long(model.info, field, positions[i] if positions else i, total, SEND_TRUNCATE,
                                longest, bound="--max-rerank-tokens")
            ids_a, ids_b = _longest_first(ids_a, ids_b, longest - specials)
        seqs.append(PairIds(*tokens.pair_with_special_tokens(ids_a, ids_b)))
    return seqs


def _longest_first(a: list[int], b: list[int], room: int) -> tuple[list[int], list[int]]:
    """``a`` and ``b`` cut to ``room`` ids together, a token at a time from the longer (as the
    tokenizer's own ``longest_first`` truncation cuts a pair)."""
    la, lb = len(a), len(b)
    while la + lb > max(room, 0):
        if la >= lb:
            la -= 1
        else:
            lb -= 1
    return a[:la], b[:lb]
