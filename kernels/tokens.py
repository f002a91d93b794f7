"""Tokenisation and padding shared by every runner.

Works on the ``tokenizers`` backend directly (a private copy with padding and truncation switched off):
the batcher needs each input's true length before batching, and special tokens are added after our own
truncation so ``--no-truncate`` can name an input that is too long. The adapter is built either from a
Hugging Face tokenizer object or, for a cold start without ``transformers``, from a bare
``tokenizers.Tokenizer`` read from ``tokenizer.json``. ``spec``/``from_spec`` carry an adapter to
another process exactly (a gateway tokenises with the engine's own tokenizer, without torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """A ``TokenizerAdapter`` as plain data: the backend's JSON and the limits around it."""

    json: str
    max_tokens: int
    pad_id: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class TokenSpan:
    """One token of a text: its id, its text, whether the tokenizer added it, and its character span."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class TokenizerAdapter:
    """Raw ids, special tokens and truncation for one tokenizer (Hugging Face or bare ``tokenizers``)."""

    def __init__(self, hf_tokenizer: Any, max_tokens: int) -> None:
        from tokenizers import Tokenizer

        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(hf_tokenizer).__name__} has no fast (tokenizers) backend")
        tok = Tokenizer.from_str(backend.to_str())
        pad = hf_tokenizer.pad_token_id
        vocab_size = max(len(hf_tokenizer), tok.get_vocab_size(with_added_tokens=True))
        self._setup(tok, max_tokens, int(pad) if pad is not None else 0, vocab_size)

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Tokenizer, max_tokens: int, *, pad_id: int, vocab_size: int, lowercase: bool = False
    ) -> TokenizerAdapter:
        """An adapter over a bare ``tokenizers.Tokenizer``, which it takes over (it switches off the
        tokenizer's padding and truncation, and may change its normaliser).

        ``lowercase`` is sentence-transformers' ``do_lower_case``: as sentence-transformers does, a
        ``Lowercase`` normaliser runs first unless the normaliser already holds one, so texts are
        lowercased exactly as its ``encode`` lowercases them.
        """
        if lowercase:
            from tokenizers.normalizers import Lowercase
            from tokenizers.normalizers import Sequence as NormalizerSequence

            current = tokenizer.normalizer
            # A normaliser Sequence iterates at run time; its type stub does not say so.
            parts = list(cast(Any, current)) if isinstance(current, NormalizerSequence) else [current]
            if not any(isinstance(n, Lowercase) for n in parts):
                tokenizer.normalizer = NormalizerSequence([Lowercase(), *(n for n in parts if n is not None)])
        adapter = cls.__new__(cls)
        adapter._setup(tokenizer, max_tokens, pad_id, vocab_size)
        return adapter

    @classmethod
    def from_spec(cls, spec: TokenizerSpec) -> TokenizerAdapter:
        """The adapter ``spec`` describes (made by ``spec()`` in another process)."""
        from tokenizers import Tokenizer

        return cls.from_tokenizer(
            Tokenizer.from_str(spec.json), spec.max_tokens, pad_id=spec.pad_id, vocab_size=spec.vocab_size
        )

    def spec(self) -> TokenizerSpec:
        """Everything needed to rebuild this adapter elsewhere: the backend tokenizer as it runs here
        (normaliser changes included) and the limits around it."""
        return TokenizerSpec(self._tok.to_str(), self.max_tokens, self.pad_id, self.vocab_size)

    def _setup(self, tok: Tokenizer, max_tokens: int, pad_id: int, vocab_size: int) -> None:
        self._tok = tok
        # Ids only: encode_batch_fast skips the character offsets (tokenizers >= 0.21), the same ids
        # for less work per text; spans() keeps encode_batch, which has them.
        self._encode_ids = getattr(tok, "encode_batch_fast", tok.encode_batch)
        self._tok.no_padding()
        self._tok.no_truncation()
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        self.prefix, self.suffix = self._single_template()
        self.pair_prefix, self.pair_middle, self.pair_suffix = self._pair_template()

    # -- templates -----------------------------------------------------------------------------------
    def _single_template(self) -> tuple[list[int], list[int]]:
        raw = self._tok.encode("a", add_special_tokens=False)
        full = self._tok.post_process(raw, None, True).ids
        start = _find(full, raw.ids)
        return full[:start], full[start + len(raw.ids) :]

    def _pair_template(self) -> tuple[list[int], list[int], list[int]]:
        a = self._tok.encode("a", add_special_tokens=False)
        b = self._tok.encode("b", add_special_tokens=False)
        full = self._tok.post_process(a, b, True).ids
        i = _find(full, a.ids)
        j = _find(full[i + len(a.ids) :], b.ids) + i + len(a.ids)
        return full[:i], full[i + len(a.ids) : j], full[j + len(b.ids) :]

    # -- public --------------------------------------------------------------------------------------
    @property
    def specials(self) -> int:
        return len(self.prefix) + len(self.suffix)

    @property
    def prefix_len(self) -> int:
        return len(self.prefix)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Raw ids without special tokens, untruncated."""
        return [e.ids for e in self._encode_ids(list(texts), add_special_tokens=False)]

    def spans(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[TokenSpan]]:
        """Each text's tokens with their character offsets (TEI's ``/tokenize``). CPU work, any thread."""
        out = []
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        for text, enc in zip(texts, encodings, strict=True):
            row = []
            for tid, tok, special, (start, stop) in zip(
                enc.ids, enc.tokens, enc.special_tokens_mask, enc.offsets, strict=True
            ):
                if special:
                    row.append(TokenSpan(int(tid), str(tok), True, None, None))
                else:
                    row.append(TokenSpan(int(tid), text[start:stop], False, int(start), int(stop)))
            out.append(row)
        return out

    def decode(self, ids: Sequence[Sequence[int]], skip_special_tokens: bool) -> list[str]:
        """The text of each id sequence (TEI's ``/decode``), special tokens left out when
        ``skip_special_tokens``. Ids must be in ``0..vocab_size-1``. CPU work, any thread."""
        seqs = [list(seq) for seq in ids]
        return list(self._tok.decode_batch(seqs, skip_special_tokens=skip_special_tokens))

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        """Truncate to fit ``max_tokens`` with the special tokens, then add them."""
        room = self.max_tokens - self.specials
        return [*self.prefix, *ids[:room], *self.suffix]

    def pair_with_special_tokens(self, a: Sequence[int], b: Sequence[int]) -> tuple[list[int], int]:
        """A sequence pair (query, document) truncated longest-first; returns ids and where B starts."""
        room = self.max_tokens - len(self.pair_prefix) - len(self.pair_middle) - len(self.pair_suffix)
        la, lb = len(a), len(b)
        while la + lb > room:
            if la >= lb:
                la -= 1
            else:
                lb -= 1
        first = [*self.pair_prefix, *a[:la], *self.pair_middle]
        return [*first, *b[:lb], *self.pair_suffix], len(first)


def _find(haystack: Sequence[int], needle: Sequence[int]) -> int:
    n = len(needle)
    for i in range(len(haystack) - n + 1):
        if list(haystack[i : i + n]) == list(needle):
            return i
    raise ValueError("tokenizer template does not contain the encoded text")


def pad_batch(
    seqs: Sequence[Sequence[int]], length: int, pad_id: int, rows: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad ``seqs`` to ``length`` (and to ``rows`` rows): int64 ids and an int64 attention mask.

    Rows past ``len(seqs)`` are all padding with an all-zero mask; runners must keep them out of results.
    """
    n = rows if rows is not None else len(seqs)
    ids = np.full((n, length), pad_id, dtype=np.int64)
    mask = np.zeros((n, length), dtype=np.int64)
    for i, seq in enumerate(seqs):
        k = min(len(seq), length)
        ids[i, :k] = seq[:k]
        mask[i, :k] = 1
    return ids, mask
