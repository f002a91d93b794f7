"""The retrieval half of a RAG pipeline, served by Coalesce: chunk, embed, search, rerank, print.

    python examples/rag.py "How do I fix a flat tyre?"
        starts its own server in this process (the embedded all-MiniLM-L6-v2, offline) and answers
    python examples/rag.py --model default --model rr=/models/my-cross-encoder "..."
        its own server with a reranker beside the embedder
    python examples/rag.py --url http://localhost:8080 "..."
        uses a running server

Steps: split the bundled documents (``examples/docs``) into passages of at most ``--chunk-words``
words; embed them all through the service (one call: the client splits it to the server's cap, and
the server batches it); embed the query and take the ``--top-k`` passages by cosine similarity; when
the server serves a reranker, rerank those with the cross-encoder and keep the ``--top-n`` best;
print them. A generator model would take these passages as its context.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from coalesce.service.client import Client

DOCS = Path(__file__).resolve().parent / "docs"
SAMPLE_QUERIES = ("How do I fix a flat bicycle tyre?", "Where does the oxygen we breathe come from?")


@dataclass(frozen=True, slots=True)
class Chunk:
    source: str  # the document's file name
    text: str


@dataclass(frozen=True, slots=True)
class Hit:
    chunk: Chunk
    similarity: float  # cosine similarity of the query and the passage embeddings
    relevance: float | None = None  # the reranker's score, when one ran


def chunk_text(text: str, max_words: int, overlap: int) -> list[str]:
    """Paragraphs (headings dropped); a paragraph over ``max_words`` becomes overlapping windows."""
    chunks = []
    for block in text.split("\n\n"):
        lines = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        words = " ".join(lines).split()
        step = max(1, max_words - overlap)
        for start in range(0, len(words), step):
            chunks.append(" ".join(words[start : start + max_words]))
            if start + max_words >= len(words):
                break
    return chunks


def load_chunks(folder: Path, max_words: int = 80, overlap: int = 15) -> list[Chunk]:
    """Every ``*.md`` and ``*.txt`` document under ``folder``, chunked, in file-name order."""
    files = sorted(p for p in folder.iterdir() if p.suffix in (".md", ".txt"))
    return [
        Chunk(path.name, text)
        for path in files
        for text in chunk_text(path.read_text(encoding="utf-8"), max_words, overlap)
    ]


class Index:
    """The passages' unit embeddings, searched by cosine similarity (a dot product of unit vectors)."""

    def __init__(self, client: Client, chunks: Sequence[Chunk], model: str | None = None) -> None:
        self.client = client
        self.chunks = list(chunks)
        self.model = model
        self.vectors = _unit(client.embed([c.text for c in self.chunks], model=model))

    def search(self, query: str, k: int) -> list[Hit]:
        q = _unit(self.client.embed([query], model=self.model))[0]
        sims = self.vectors @ q
        best = np.argsort(-sims, kind="stable")[:k]
        return [Hit(self.chunks[i], float(sims[i])) for i in best]


def _unit(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    out: np.ndarray = rows / np.where(norms > 0, norms, 1.0)
    return out


def retrieve(index: Index, query: str, *, k: int = 8, n: int = 3, reranker: str | None = None) -> list[Hit]:
    """The ``n`` best passages for ``query``: the top ``k`` by similarity, reranked when possible."""
    hits = index.search(query, k)
    if reranker is None:
        return hits[:n]
    ranked = index.client.rerank(query, [h.chunk.text for h in hits], model=reranker, top_n=n)
    return [replace(hits[r.index], relevance=r.score) for r in ranked]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def local_server(model_args: Sequence[str], ready_timeout: float = 300.0) -> Iterator[str]:
    """A Coalesce server on loopback, in a thread of this process, for the ``--model`` values given."""
    import asyncio

    from aiohttp import web
    from coalesce.service.gateway.app import create_app
    from coalesce.service.settings import build

    port = _free_port()
    argv = ["--host", "127.0.0.1", "--port", str(port)]
    for spec in model_args:
        argv += ["--model", spec]
    app = create_app(build(argv))
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=2)

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, name="rag-server", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, ready_timeout)
        yield url
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


def _wait_ready(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/ready", timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"the server at {url} did not become ready within {timeout:.0f} s")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("queries", nargs="*", default=list(SAMPLE_QUERIES), help="questions to answer")
    p.add_argument("--url", help="a running Coalesce server (default: start one in this process)")
    p.add_argument("--model", action="append", default=[], help="NAME=PATH for the server started here")
    p.add_argument("--docs", type=Path, default=DOCS, help="folder of .md/.txt documents")
    p.add_argument("--embedder", help="embedding model to use (default: the server's first)")
    p.add_argument("--reranker", help="reranking model (default: the server's first, if any)")
    p.add_argument("--no-rerank", action="store_true", help="skip reranking even when a reranker is served")
    p.add_argument("--top-k", type=int, default=8, help="passages retrieved by similarity")
    p.add_argument("--top-n", type=int, default=3, help="passages printed (after reranking)")
    p.add_argument("--chunk-words", type=int, default=80, help="longest passage, in words")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    server = contextlib.nullcontext(args.url) if args.url else local_server(args.model)
    with server as url, Client(url) as client:
        tasks = client.models()
        embedder = args.embedder or next((m for m, t in tasks.items() if t == "embed"), None)
        if embedder is None:
            print(f"The server at {url} serves no embedding model: {tasks}", file=sys.stderr)
            return 1
        reranker = (
            None
            if args.no_rerank
            else args.reranker or next((m for m, t in tasks.items() if t == "rerank"), None)
        )
        chunks = load_chunks(args.docs, args.chunk_words, overlap=max(0, args.chunk_words // 5))
        index = Index(client, chunks, embedder)
        how = f"reranked the top {args.top_k} with {reranker}" if reranker else "no reranker served"
        print(
            f"Indexed {len(chunks)} passages from {len({c.source for c in chunks})} documents "
            f"with {embedder}; {how}."
        )
        for query in args.queries:
            print(f"\nQ: {query}")
            for rank, hit in enumerate(
                retrieve(index, query, k=args.top_k, n=args.top_n, reranker=reranker), 1
            ):
                score = f"similarity {hit.similarity:.3f}"
                if hit.relevance is not None:
                    score += f", relevance {hit.relevance:.3f}"
                print(f"{rank}. [{hit.chunk.source}] ({score})\n   {hit.chunk.text}")
    return 0


if __name__ == "__main__":
    from coalesce.service.logs import configure

    configure("warning", "console")  # keep the server's logs out of the answer
    raise SystemExit(main())
