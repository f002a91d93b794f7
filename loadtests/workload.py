"""What the generator sends: input mixes, text sources, recorded traces and pre-encoded request bodies.

Bodies are built before a run starts so the hot loop only writes bytes. Lengths are counted in words
drawn from :data:`WORDS`, each of which is a single WordPiece token of the BERT uncased vocabulary (the
packaged all-MiniLM-L6-v2 uses it), so for BERT-family models a length of *n* words is *n* tokens plus
the special tokens; other vocabularies split some of them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import msgspec

# Common English words, each one token of the BERT uncased vocabulary (checked against the packaged
# model's tokenizer when the list was written).
_WORD_TEXT = """
    about after air all also an and are area around art as at back bank based be been best between
    body book both but by can car care case change child church city class come cost data day drink
    during each early east end even face fact family few field film fire first food for form found
    free friend from full game girl give gold good government great green group had hand hard has
    head heart help her high him his hold home hope house human idea in into is its job just keep
    kind king know known land large last later lead learn left less life light line little long look
    love made main make man many market may mean mind moment money month more most mother much music
    name national nature need new news next night north not note number of old on one only open or
    order other out over own page paper part party peace people place plan plant point power price
    problem public question rate read real red report rest right river road rock room rule run say
    school sea season see sense several she short show side sign since six size small some sound
    south space speak stand star start state states still stop story strong study such system table
    take talk tax team test that the their then there these they think this three through time to
    town tree true turn two under united university until up used very village voice want war was
    watch water way week well were west when where which while white who wind wish with woman wood
    word work world would write year years yellow young
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


class Mix(StrEnum):
    """Built-in input mixes."""

    SHORT = "short"  # search queries: 6-16 words, one input per request
    LONG = "long"  # passages: 150-250 words, one input per request
    MIXED = "mixed"  # log-normal lengths (median 24 words, 3-250), one input per request
    MULTI = "multi"  # the mixed lengths, 16 inputs per request (a RAG indexing client)


DEFAULT_INPUTS_PER_REQUEST = {Mix.SHORT: 1, Mix.LONG: 1, Mix.MIXED: 1, Mix.MULTI: 16}


def sample_length(mix: Mix, rng: random.Random) -> int:
    """Length in words of one input of ``mix``."""
    if mix is Mix.SHORT:
        return rng.randint(6, 16)
    if mix is Mix.LONG:
        return rng.randint(150, 250)
    return max(3, min(250, round(math.exp(rng.gauss(math.log(24.0), 0.9)))))


class TextSource:
    """Produces input texts: random words from :data:`WORDS`, or a user's corpus.

    With a corpus (a text file), generated mixes send its non-empty lines as they are, picked at
    random, and length-driven requests (replay) take that many consecutive words of the corpus.
    """

    def __init__(self, rng: random.Random, corpus_lines: Sequence[str] | None = None) -> None:
        self._rng = rng
        self._lines = [line for line in (corpus_lines or ()) if line.strip()]
        self._corpus_words = [w for line in self._lines for w in line.split()]
        if corpus_lines is not None and not self._lines:
            raise ValueError("the text file has no non-empty lines")

    @classmethod
    def from_file(cls, rng: random.Random, path: Path) -> TextSource:
        return cls(rng, path.read_text(encoding="utf-8").splitlines())

    @property
    def has_corpus(self) -> bool:
        return bool(self._lines)

    def line(self) -> str:
        """One corpus line, as it is."""
        return self._rng.choice(self._lines)

    def text(self, n_words: int) -> str:
        """A text of ``n_words`` words."""
        if not self._corpus_words:
            return " ".join(self._rng.choices(WORDS, k=n_words))
        start = self._rng.randrange(len(self._corpus_words))
        words = self._corpus_words
        return " ".join(words[(start + i) % len(words)] for i in range(n_words))


class TraceEntry(msgspec.Struct, frozen=True):
    """One recorded request: its arrival offset in seconds and the length in words of each input."""

    t: float
    inputs: int
    lengths: list[int]


def read_trace(path: Path) -> list[TraceEntry]:
    """Entries of a JSONL trace, sorted by arrival; ``lengths`` may be omitted (then 16 words each)."""
    decoder = msgspec.json.Decoder(dict[str, object])
    entries = []
    for lineno, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row = decoder.decode(raw)
            t = float(row["t"])  # type: ignore[arg-type]
            lengths = [int(x) for x in row.get("lengths") or []]  # type: ignore[attr-defined]
            inputs = int(row.get("inputs", len(lengths) or 1))  # type: ignore[call-overload]
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{lineno}: not a trace line ({exc})") from exc
        if t < 0 or inputs < 1 or (lengths and len(lengths) != inputs):
            raise ValueError(f"{path}:{lineno}: need t >= 0, inputs >= 1 and one length per input")
        entries.append(TraceEntry(t=t, inputs=inputs, lengths=lengths or [16] * inputs))
    entries.sort(key=lambda e: e.t)
    return entries


def write_trace(path: Path, entries: Sequence[TraceEntry]) -> None:
    encoder = msgspec.json.Encoder()
    path.write_bytes(b"".join(encoder.encode(e) + b"\n" for e in entries))


@dataclass(frozen=True, slots=True)
class Payload:
    """A pre-encoded request body and what it asks for."""

    body: bytes
    n_inputs: int
    lengths: tuple[int, ...]


_body_encoder = msgspec.json.Encoder()


def encode_body(model: str, texts: Sequence[str], encoding_format: str) -> bytes:
    """The OpenAI embeddings body; a single input is sent as a plain string, as most clients do."""
    payload_input: str | list[str] = texts[0] if len(texts) == 1 else list(texts)
    return _body_encoder.encode({"model": model, "input": payload_input, "encoding_format": encoding_format})


class PayloadFactory:
    """Builds request payloads for one model and one encoding format from a text source."""

    def __init__(self, source: TextSource, model: str, encoding_format: str = "base64") -> None:
        self._source = source
        self._model = model
        self._format = encoding_format

    def for_lengths(self, lengths: Sequence[int]) -> Payload:
        texts = [self._source.text(n) for n in lengths]
        return Payload(encode_body(self._model, texts, self._format), len(texts), tuple(lengths))

    def for_mix(self, mix: Mix, rng: random.Random, inputs_per_request: int | None = None) -> Payload:
        k = inputs_per_request or DEFAULT_INPUTS_PER_REQUEST[mix]
        if self._source.has_corpus:
            texts = [self._source.line() for _ in range(k)]
            return Payload(
                encode_body(self._model, texts, self._format), k, tuple(len(t.split()) for t in texts)
            )
        return self.for_lengths([sample_length(mix, rng) for _ in range(k)])

    def pool(
        self, mix: Mix, rng: random.Random, size: int, inputs_per_request: int | None = None
    ) -> list[Payload]:
        """``size`` distinct payloads that a run cycles through."""
        return [self.for_mix(mix, rng, inputs_per_request) for _ in range(size)]


class PayloadStream:
    """A run's requests one after another: each a fresh payload of the mix, except that a share
    ``repeat`` of them resend, byte for byte, a body sent earlier in the run.

    Fresh payloads by default, so a result cache in the server under test answers nothing it should
    not (a cycling pool would turn a long run into cache hits); ``repeat`` measures what a cache saves.
    A repeat picks among the last ``keep`` distinct payloads, so memory stays bounded however long the
    run. Deterministic for a seed.
    """

    def __init__(
        self,
        factory: PayloadFactory,
        mix: Mix,
        rng: random.Random,
        inputs_per_request: int | None = None,
        repeat: float = 0.0,
        keep: int = 8192,
    ) -> None:
        if not 0.0 <= repeat < 1.0:
            raise ValueError(f"repeat must be in [0, 1), got {repeat}")
        self._factory = factory
        self._mix = mix
        self._rng = rng
        self._k = inputs_per_request
        self._repeat = repeat
        self._sent: list[Payload] = []
        self._keep = keep
        self._next_slot = 0

    def __call__(self, _index: int = 0) -> Payload:
        if self._sent and self._repeat and self._rng.random() < self._repeat:
            return self._rng.choice(self._sent)
        payload = self._factory.for_mix(self._mix, self._rng, self._k)
        if len(self._sent) < self._keep:
            self._sent.append(payload)
        else:
            self._sent[self._next_slot] = payload
            self._next_slot = (self._next_slot + 1) % self._keep
        return payload
