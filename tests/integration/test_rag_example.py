"""``examples/rag.py`` end to end, offline: against a running server with a reranker, and starting its own."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from ..conftest import ServerThread
from .tiny_models import shared_server, stop_shared_server

RAG_PATH = Path(__file__).resolve().parents[2] / "examples" / "rag.py"


@pytest.fixture(scope="module")
def rag() -> ModuleType:
    spec = importlib.util.spec_from_file_location("coalesce_rag_example", RAG_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def server() -> Iterator[ServerThread]:
    yield shared_server()
    stop_shared_server()


def answers(out: str) -> dict[str, list[str]]:
    """Query → the sources of its printed passages, in order."""
    found: dict[str, list[str]] = {}
    query = ""
    for line in out.splitlines():
        if line.startswith("Q: "):
            query = line[3:]
            found[query] = []
        elif line[:1].isdigit() and ". [" in line:
            found[query].append(line.split("[", 1)[1].split("]", 1)[0])
    return found


def test_chunks_are_paragraphs_and_long_ones_overlap(rag: ModuleType) -> None:
    text = "# Title\n\nshort paragraph\n\n" + " ".join(f"w{i}" for i in range(25))
    chunks = rag.chunk_text(text, max_words=10, overlap=2)
    assert chunks[0] == "short paragraph"
    assert chunks[1].split() == [f"w{i}" for i in range(10)] and chunks[2].split()[0] == "w8"
    assert chunks[-1].split()[-1] == "w24"
    passages = rag.load_chunks(rag.DOCS)
    assert len({c.source for c in passages}) == 6 and all(len(c.text.split()) <= 80 for c in passages)


def test_rag_with_a_served_reranker(
    rag: ModuleType, server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    query = "How do I fix a flat bicycle tyre?"
    assert rag.main(["--url", server.url, "--top-k", "6", "--top-n", "3", query]) == 0
    out = capsys.readouterr().out
    assert "reranked the top 6 with rr" in out
    assert len(answers(out)[query]) == 3
    assert out.count("relevance ") == 3  # the reranker scored what is printed
    with rag.Client(server.url) as client:
        index = rag.Index(client, rag.load_chunks(rag.DOCS))
        by_similarity = rag.retrieve(index, query, k=6, n=6)
        reranked = rag.retrieve(index, query, k=6, n=3, reranker="rr")
    assert by_similarity[0].chunk.source == "bicycle-repair.md"
    assert [h.relevance for h in reranked] == sorted((h.relevance for h in reranked), reverse=True)
    assert {h.chunk for h in reranked} <= {h.chunk for h in by_similarity}  # reranking reorders top-k


def test_rag_starts_its_own_server_and_answers_offline(
    rag: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert rag.main([]) == 0  # the sample queries, against the embedded model in this process
    out = capsys.readouterr().out
    assert "no reranker served" in out
    found = answers(out)
    assert found["How do I fix a flat bicycle tyre?"][0] == "bicycle-repair.md"
    assert found["Where does the oxygen we breathe come from?"][0] == "photosynthesis.md"
