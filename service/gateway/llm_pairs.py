"""(query, document) pairs for LLM rerankers (Qwen3-Reranker style), built as their model card builds them.

A served model whose ``ModelInfo.rerank_template`` is set reads each pair through that template: the
prefix's ids, then the tokenizer's special tokens around the pair formatted with the instruction, query
and document (one text, as the card tokenises it), then the suffix's ids. The runner scores the last
position, so the sequence must end with the suffix whatever is cut.

* **Instruction**: the request's ``instruction`` (an extra field on every rerank shape), else the
  server's ``--rerank-instruction NAME=TEXT``, else the template's (the card's default). A cross-encoder
  takes none: asking it for one is a 400, not an instruction silently dropped.
* **Truncation** cuts the document only, never the template, the instruction or the query: a pair is
  fitted to the model's length, or ``--max-rerank-tokens`` when shorter, by dropping the document's last
  tokens (``max_tokens_per_doc`` first cuts every document to that many). Where the document's tokens
  start and end in the formatted text is found by tokenising the text around it alone: the tokens shared
  with it are the template's; a token that merges across the boundary counts as the document's.

Every id of a pair is one the model computes, so the batcher charges a pair what it costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web
from coalesce.kernels.protocol import RerankTemplate, Task

from ..errors import InvalidRequest
from ..settings import Settings
from .admission import Admission
from .facade import ServedModel
from .state import SETTINGS


def instruction_for(request: web.Request, model: ServedModel, asked: str | None) -> str | None:
    """The instruction ``model`` reads pairs with: the request's, the server's, or the template's. None
    for a cross-encoder (and a 400 when the request sent one for it)."""
    template = model.info.rerank_template
    if template is None:
        if asked is not None:
            raise InvalidRequest(
                f"Model '{model.info.name}' is a cross-encoder and takes no 'instruction'; only LLM "
                "rerankers (Qwen3-Reranker style) do. Leave the field out.",
                param="instruction",
                code="unexpected_instruction",
            )
        return None
    if asked is not None:
        return asked
    server = server_instruction(request.app[SETTINGS], model)
    return template.instruction if server is None else server


def server_instruction(settings: Settings, model: ServedModel) -> str | None:
    """``--rerank-instruction`` for ``model`` (by its name or an alias), if any."""
    names = (model.info.name, *model.info.aliases)
    return next((text for name, text in settings.rerank_instructions if name in names), None)


def check_instructions(models: Sequence[ServedModel], settings: Settings) -> None:
    """At start-up: every ``--rerank-instruction`` names an LLM reranker this server serves."""
    for name, _ in settings.rerank_instructions:
        served = next((m for m in models if name in (m.info.name, *m.info.aliases)), None)
        if served is None or served.info.rerank_template is None:
            raise ValueError(
                f"--rerank-instruction {name}=...: {name} is not an LLM reranker served here (instructions "
                "are for rerankers read through a template, Qwen3-Reranker style)"
            )


def rerank_limit(settings: Settings, model: ServedModel) -> int:
    """The longest pair ``model`` is given: its own length, or for a reranker ``--max-rerank-tokens``
    when shorter."""
    bound, most = settings.max_rerank_tokens, model.info.max_tokens
    return most if bound is None or model.info.task is not Task.RERANK else min(bound, most)


def document_span(full: Sequence[int], head: Sequence[int], tail: Sequence[int]) -> tuple[int, int]:
    """``(start, stop)`` of the document's tokens in a formatted pair's ids ``full``: after the longest
    run it shares with the ids of the text before the document (``head``), before the longest run it
    shares with those of the text after it (``tail``)."""
    start = 0
    while start < min(len(full), len(head)) and full[start] == head[start]:
        start += 1
    shared = 0
    while shared < min(len(tail), len(full) - start) and full[-1 - shared] == tail[-1 - shared]:
        shared += 1
    return start, len(full) - shared


@dataclass(frozen=True, slots=True)
class _Texts:
    """The texts one request tokenises, each once: template parts, the text around each query's
    document, and every formatted pair."""

    template: RerankTemplate
    instruction: str

    def around(self, query: str) -> tuple[str, str]:
        before, after = self.template.pair.split("{document}")
        return (before.format(instruction=self.instruction, query=query),
                after.format(instruction=self.instruction, query=query))

    def pair(self, query: str, document: str) -> str:
        return self.template.pair.format(instruction=self.instruction, query=query, document=document)


async def encode_template_pairs(
    model: ServedModel,
    adm: Admission,
    pairs: Sequence[tuple[str, str]],
    *,
    instruction: str,
    cut: bool,
    field: str,
    limit: int,
    positions: Sequence[int] | None = None,
    max_b: int | None = None,
) -> list[list[int]]:
    """Complete id sequences of ``pairs`` read through ``model``'s template with ``instruction``, each
    at most ``limit`` ids, the document cut (``cut``) or the pair refused by name when longer."""
    template = model.info.rerank_template
    assert template is not None, "encode_template_pairs serves LLM rerankers only"
    texts = _Texts(template, instruction)
    queries = list(dict.fromkeys(q for q, _ in pairs))
    arounds = {q: texts.around(q) for q in queries}
    formatted = [texts.pair(q, d) for q, d in pairs]
    first, total = model.estimate(formatted, template.prefix + template.suffix)
    model.check_room(adm, first, total, len(pairs))  # refuse before tokenising, template included
    wanted = [template.prefix, template.suffix, *(t for q in queries for t in arounds[q]), *formatted]
    distinct = list(dict.fromkeys(wanted))
    ids_of = dict(zip(distinct, await model.tokenize(distinct), strict=True))
    prefix, suffix = ids_of[template.prefix], ids_of[template.suffix]
    room = limit - len(prefix) - len(suffix) - model.specials  # for the formatted pair's own ids
    seqs = []
    for i, ((query, _), text) in enumerate(zip(pairs, formatted, strict=True)):
        full = ids_of[text]
        head, tail = (ids_of[t] for t in arounds[query])
        start, stop = document_span(full, head, tail)
        doc = full[start:stop][:max_b]
        kept = start + len(full) - stop  # the template's, the instruction's and the query's ids
        if kept >= room:
            raise InvalidRequest(
                f"The query, with the template and instruction of model '{model.info.name}', takes "
                f"{kept + len(prefix) + len(suffix) + model.specials} tokens, which leaves no room for a "
                f"document within {limit}. Shorten the query or the instruction.",
                param="query",
                code="query_too_long",
            )
        if kept + len(doc) > room:
            if not cut:
                index = positions[i] if positions else i
                total = kept + len(doc) + len(prefix) + len(suffix) + model.specials
                raise InvalidRequest(
                    f"{field}[{index}] makes a pair of {total} tokens with the query and the template; "
                    f"model '{model.info.name}' takes at most {limit}. Shorten it, or send "
                    '"truncate": true.',
                    param=f"{field}[{index}]",
                    code="input_too_long",
                )
            doc = doc[: room - kept]
        pair = model.tokens.with_special_tokens([*full[:start], *doc, *full[stop:]])
        seqs.append([*prefix, *pair, *suffix])
    return seqs
