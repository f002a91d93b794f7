"""Cold-start loading: BERT-family sentence-transformers models without transformers.

A process that serves from zero pays for every import before its first embedding. On a 2-core machine
``import torch`` takes ~1.9 s, ``transformers`` adds ~1.4 s and ``sentence_transformers`` brings the
total to ~8.6 s. For the models the graph-safe forward covers, what sentence-transformers does at load
time comes down to a few JSON files, one ``model.safetensors`` and one ``tokenizer.json``, so this
module reads them directly (``safetensors`` and ``tokenizers`` import in milliseconds) and builds the
same ``EncoderRunner`` that ``build_encoder_runner`` builds through ``SentenceTransformer``.

It reproduces a pipeline only when it is sure to match it: ``modules.json`` exactly Transformer →
Pooling (mean or CLS) → optional Normalize, a ``bert`` config the forward implements, single-file
safetensors weights, and a BERT (or plain ``tokenizers``) tokenizer. Anything else returns None with
a log line, and the caller falls back to the sentence-transformers loaders. The tokenizer follows what
``transformers`` does to a ``BertTokenizer`` (its ``tokenizer_config.json`` settings for lowercasing,
accents and Chinese characters override ``tokenizer.json``), and ``do_lower_case`` is applied as
sentence-transformers applies it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .bert import GraphSafeBert, PoolingMode, config_unsupported_reason
from .buckets import GraphOptions
from .encoder_runner import EncoderRunner, make_encoder_runner, place_model
from .st_runner import resolve_device
from .tokens import TokenizerAdapter

log = logging.getLogger("coalesce.kernels")

# The module kinds of a sentence-transformers pipeline this loader reproduces, by class name.
_PIPELINES = (("Transformer", "Pooling"), ("Transformer", "Pooling", "Normalize"))
# Pooling's pre-v6 boolean keys, in sentence-transformers' order, and the mode each one names.
_LEGACY_POOLING = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# sentence_bert_config.json values that mean "the plain feature-extraction Transformer".
_TRANSFORMER_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "transformer_task": (None, "feature-extraction"),
    "modality_config": (None, {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}),
    "module_output_name": (None, "token_embeddings"),
}
_TRANSFORMER_IGNORED = frozenset({"max_seq_length", "do_lower_case", "unpad_inputs"})
_BERT_TOKENIZERS = frozenset({"BertTokenizer", "BertTokenizerFast"})
_PLAIN_TOKENIZERS = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


class _Unsupported(Exception):
    """The model directory holds something this loader does not reproduce; the message says what."""


@dataclass(frozen=True, slots=True)
class FastPlan:
    """What sentence-transformers would build, read from a model directory's JSON files alone."""

    transformer_dir: Path  # holds config.json, model.safetensors and the tokenizer files
    config: dict[str, Any]  # config.json
    pooling: PoolingMode
    normalize: bool
    max_tokens: int  # sentence-transformers' max_seq_length, capped at the position table
    do_lower_case: bool  # sentence_bert_config.json's, applied on top of the tokenizer's own
    tokenizer_config: dict[str, Any]  # tokenizer_config.json over special_tokens_map.json


def read_plan(model_path: str | Path) -> FastPlan | str:
    """The plan for the sentence-transformers directory ``model_path``, or why this loader passes."""
    try:
        return _read_plan(Path(model_path))
    except _Unsupported as e:
        return str(e)


def build_fast_encoder_runner(
    model_path: str,
    *,
    name: str | None,
    device: str = "auto",
    dtype: str = "auto",
    graphs: GraphOptions = GraphOptions(),  # noqa: B008 (frozen, so one shared default is safe)
    aliases: Sequence[str] = (),
    truncate_dim: int | None = None,
    cpu_fast_forward: bool = True,
    cpu_traced_forward: bool = True,
) -> EncoderRunner | None:
    """The graph runner for the model at ``model_path``, loaded without importing transformers or
    sentence_transformers; None (logged) when the directory is outside what this loader reproduces,
    so the caller falls back to ``build_encoder_runner`` or the eager runner."""
    t0 = time.perf_counter()
    plan = read_plan(model_path)
    if isinstance(plan, str):
        log.info("model %s: no fast load (%s); falling back to the sentence-transformers loaders",
                 model_path, plan)
        return None
    from safetensors.torch import load_file

    try:
        state = load_file(plan.transformer_dir / "model.safetensors")
        model = GraphSafeBert.from_state_dict(
            state, plan.config, pooling=plan.pooling, normalize=plan.normalize, truncate_dim=truncate_dim
        )
        tokens = _tokenizer(plan, model.word.num_embeddings)
    except (_Unsupported, ValueError) as e:
        log.info("model %s: no fast load (%s); falling back to the sentence-transformers loaders",
                 model_path, e)
        return None
    dev = torch.device(resolve_device(device))
    model = place_model(model, tokens, dtype, dev, what=model_path, cpu_fast_forward=cpu_fast_forward)
    log.info("model %s loaded from safetensors and tokenizer.json in %.3f s", model_path,
             time.perf_counter() - t0)
    return make_encoder_runner(
        model, tokens, model_path=model_path, name=name, aliases=aliases, device=dev, graphs=graphs,
        cpu_traced_forward=cpu_traced_forward,
    )


# -- reading the directory -----------------------------------------------------------------------------
def _read_plan(root: Path) -> FastPlan:
    modules = _json(root / "modules.json", required=True)
    if not isinstance(modules, list):
        raise _Unsupported("modules.json is not a list")
    kinds = tuple(_module_kind(m) for m in modules)
    if kinds not in _PIPELINES:
        raise _Unsupported(f"module pipeline {list(kinds)}")
    st_config = _json(root / "config_sentence_transformers.json")
    if st_config.get("model_type", "SentenceTransformer") != "SentenceTransformer":
        raise _Unsupported(f"a {st_config['model_type']}, not a SentenceTransformer")
    tdir = root / str(modules[0].get("path") or "")
    config = _json(tdir / "config.json", required=True)
    reason = config_unsupported_reason(config)
    if reason is not None:
        raise _Unsupported(reason)
    if not (tdir / "model.safetensors").is_file():
        raise _Unsupported("no single model.safetensors (pytorch_model.bin or sharded weights)")
    if not (tdir / "tokenizer.json").is_file():
        raise _Unsupported("no tokenizer.json")
    sbert = _json(tdir / "sentence_bert_config.json")
    _check_transformer_settings(sbert)
    hidden = int(config.get("hidden_size", 768))
    pooling = _pooling_mode(_json(root / str(modules[1].get("path") or "") / "config.json"), hidden)
    tok_config = {
        **_json(tdir / "special_tokens_map.json"),
        **_json(tdir / "tokenizer_config.json"),
    }
    return FastPlan(
        transformer_dir=tdir,
        config=config,
        pooling=pooling,
        normalize=len(kinds) == 3,
        max_tokens=_max_tokens(sbert, tok_config, config),
        do_lower_case=bool(sbert.get("do_lower_case", False)),
        tokenizer_config=tok_config,
    )


def _json(path: Path, *, required: bool = False) -> Any:
    """A JSON file's content; {} for a missing optional file."""
    if not path.is_file():
        if required:
            raise _Unsupported(f"no {path.name}")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise _Unsupported(f"unreadable {path.name}: {e}") from e


def _module_kind(entry: Any) -> str:
    """``Transformer`` for ``sentence_transformers.models.Transformer`` and its v6 paths alike; custom
    modules (code outside sentence_transformers) keep their full path, so they never match."""
    kind = str(entry.get("type", "")) if isinstance(entry, dict) else ""
    return kind.rsplit(".", 1)[-1] if kind.startswith("sentence_transformers.") else kind


def _check_transformer_settings(sbert: dict[str, Any]) -> None:
    """Every sentence_bert_config.json setting must be one this loader reproduces."""
    for key, value in sbert.items():
        if key in _TRANSFORMER_IGNORED:
            continue
        allowed = _TRANSFORMER_DEFAULTS.get(key, (None, {}, [], False))
        if value not in allowed:
            raise _Unsupported(f"sentence_bert_config {key}={value!r}")


def _pooling_mode(pool: dict[str, Any], hidden: int) -> PoolingMode:
    """Pooling's mode from its config (v6 ``pooling_mode`` or the legacy booleans, as v6 reads them)."""
    dim = pool.get("embedding_dimension", pool.get("word_embedding_dimension", hidden))
    if dim != hidden:
        raise _Unsupported(f"pooling dimension {dim} differs from hidden_size {hidden}")
    if not pool.get("include_prompt", True):
        raise _Unsupported("pooling leaves the prompt out (include_prompt: false)")
    mode: Any = pool.get("pooling_mode")
    if mode is None:
        active = [m for key, m in _LEGACY_POOLING.items() if pool.get(key)]
        mode = active or ["mean"]
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else tuple(mode)
    if mode == "mean":
        return "mean"
    if mode == "cls":
        return "cls"
    raise _Unsupported(f"pooling {mode!r}")


def _max_tokens(sbert: dict[str, Any], tok_config: dict[str, Any], config: dict[str, Any]) -> int:
    """sentence-transformers' ``max_seq_length``: its own setting, else the tokenizer's
    ``model_max_length``; either way no longer than the model's position table."""
    positions = int(config.get("max_position_embeddings", 512))
    length = sbert.get("max_seq_length") or tok_config.get("model_max_length") or positions
    return min(int(length), positions)


# -- the tokenizer -------------------------------------------------------------------------------------
def _tokenizer(plan: FastPlan, vocab_rows: int) -> TokenizerAdapter:
    """The tokenizer transformers would build, as a ``TokenizerAdapter``.

    ``vocab_rows`` (the embedding table's size) caps the vocabulary the gateway accepts token ids from,
    so a token array can never index past the table.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(plan.transformer_dir / "tokenizer.json"))
    tc = plan.tokenizer_config
    cls_name = tc.get("tokenizer_class")
    bert_like = cls_name is None or cls_name in _BERT_TOKENIZERS  # None: AutoTokenizer picks by model_type
    if bert_like:
        _as_bert_tokenizer(tok, tc)
    elif cls_name not in _PLAIN_TOKENIZERS:
        raise _Unsupported(f"tokenizer_class {cls_name}")
    pad = _token_text(tc.get("pad_token")) or ("[PAD]" if bert_like else None)
    pad_id = tok.token_to_id(pad) if pad is not None else None
    if pad_id is None:
        pad_id = int(plan.config.get("pad_token_id") or 0)
    vocab = min(tok.get_vocab_size(with_added_tokens=True), vocab_rows)
    return TokenizerAdapter.from_tokenizer(
        tok, plan.max_tokens, pad_id=pad_id, vocab_size=vocab, lowercase=plan.do_lower_case
    )


def _as_bert_tokenizer(tok: Any, tc: dict[str, Any]) -> None:
    """Give ``tok`` the normaliser ``transformers``' ``BertTokenizer`` would: tokenizer_config.json's
    ``do_lower_case`` (default True), ``strip_accents`` and ``tokenize_chinese_chars`` win over
    tokenizer.json's, in transformers 4 (which rebuilds a differing normaliser) and 5 (which always does)."""
    from tokenizers.models import WordPiece
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer

    norm = tok.normalizer
    if not (
        isinstance(norm, BertNormalizer)
        and isinstance(tok.pre_tokenizer, BertPreTokenizer)
        and isinstance(tok.model, WordPiece)
    ):
        raise _Unsupported("a BertTokenizer whose tokenizer.json is not BERT's WordPiece pipeline")
    want = (
        bool(tc.get("do_lower_case", True)),
        tc.get("strip_accents"),
        bool(tc.get("tokenize_chinese_chars", True)),
    )
    if (norm.lowercase, norm.strip_accents, norm.handle_chinese_chars) != want:
        tok.normalizer = BertNormalizer(
            clean_text=norm.clean_text, lowercase=want[0], strip_accents=want[1], handle_chinese_chars=want[2]
        )


def _token_text(token: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None
