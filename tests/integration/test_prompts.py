"""Prompts, as sentence-transformers applies them: read from the model's config, chosen per request by
``prompt_name`` (TEI's ``/embed``, and ``/v1/embeddings`` through the openai client's ``extra_body``),
counted in usage and in the length limit, never cut by truncation, and left out of pooling where the
model's Pooling says ``include_prompt: false``. Every vector equals ``SentenceTransformer.encode``'s."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from coalesce.service.settings import build

from ..conftest import ServerThread

PROMPTS = {"query": "query: ", "passage": "passage: "}
TEXTS = ["how do plants make oxygen", "Photosynthesis turns light into chemical energy.", "a b c"]
LONG = " ".join(["sunlight"] * 400)  # past the 256-token limit


def _copy(src: str, dest: Path, *, include_prompt: bool) -> str:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("README.md"))
    config = json.loads((dest / "config_sentence_transformers.json").read_text())
    (dest / "config_sentence_transformers.json").write_text(json.dumps({**config, "prompts": PROMPTS}))
    pooling = json.loads((dest / "1_Pooling" / "config.json").read_text())
    (dest / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "include_prompt": include_prompt}))
    return str(dest)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory, minilm_path: str) -> dict[str, str]:
    root = tmp_path_factory.mktemp("prompted")
    return {
        "e5": _copy(minilm_path, root / "e5", include_prompt=True),
        "instr": _copy(minilm_path, root / "instr", include_prompt=False),
    }


@pytest.fixture(scope="module")
def server(dirs: dict[str, str]) -> Iterator[ServerThread]:
    settings = build(
        [
            "--model",
            f"e5={dirs['e5']}",
            "--model",
            f"instr={dirs['instr']}",
            "--model",
            "plain=default",
            "--default-prompt-name",
            "instr=query",
        ],
        environ={},
    )
    srv = ServerThread(settings).start()
    yield srv
    srv.stop()


def _st(path: str) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu")


def _close(got: Any, want: Any) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.99999, cos


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json()


async def test_prompt_name_on_embed_equals_encode_with_that_prompt(
    server: ServerThread, dirs: dict[str, str]
) -> None:
    st = _st(dirs["e5"])
    for name in PROMPTS:
        status, rows = await _post(
            server.url + "/embed", {"model": "e5", "inputs": TEXTS, "prompt_name": name}
        )
        assert status == 200
        _close(rows, st.encode(TEXTS, prompt_name=name))
    status, rows = await _post(server.url + "/embed", {"model": "e5", "inputs": TEXTS})
    _close(rows, st.encode(TEXTS))  # no default prompt: none
    # Truncation cuts the text, never the prompt: as sentence-transformers truncates prompt + text.
    status, rows = await _post(
        server.url + "/embed", {"model": "e5", "inputs": [LONG], "prompt_name": "query"}
    )
    assert status == 200
    _close(rows, st.encode([LONG], prompt_name="query"))


def test_the_openai_client_sends_prompt_name_in_extra_body(
    server: ServerThread, dirs: dict[str, str]
) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    resp = client.embeddings.create(model="e5", input=TEXTS, extra_body={"prompt_name": "passage"})
    _close([d.embedding for d in resp.data], _st(dirs["e5"]).encode(TEXTS, prompt_name="passage"))
    # The prompt's tokens count in usage: [CLS] + "passage: " + text + [SEP] per input.
    st = _st(dirs["e5"])
    counted = sum(len(st.tokenize(["passage: " + t])["input_ids"][0]) for t in TEXTS)
    assert resp.usage.prompt_tokens == counted


async def test_a_pooling_that_leaves_the_prompt_out_matches_encode(
    server: ServerThread, dirs: dict[str, str]
) -> None:
    st = _st(dirs["instr"])
    status, rows = await _post(
        server.url + "/embed", {"model": "instr", "inputs": TEXTS, "prompt_name": "passage"}
    )
    assert status == 200
    _close(rows, st.encode(TEXTS, prompt_name="passage"))
    # --default-prompt-name instr=query: a request that names none gets the query prompt.
    status, rows = await _post(server.url + "/embed", {"model": "instr", "inputs": TEXTS})
    _close(rows, st.encode(TEXTS, prompt_name="query"))
    # Mixed prompts in one batch stay per input (sentence-transformers' own prompt_length is per batch).
    async with aiohttp.ClientSession() as s:
        import asyncio

        bodies = [{"model": "instr", "inputs": [t], "prompt_name": n} for t in TEXTS for n in PROMPTS]
        answers = await asyncio.gather(*(s.post(server.url + "/embed", json=b) for b in bodies))
        got = [(await a.json())[0] for a in answers]
    want = [st.encode([b["inputs"][0]], prompt_name=b["prompt_name"])[0] for b in bodies]
    _close(got, want)


async def test_bad_prompt_names_are_refused_naming_the_choices(server: ServerThread) -> None:
    status, body = await _post(server.url + "/embed", {"model": "e5", "inputs": "x", "prompt_name": "nope"})
    assert status == 422 and body["error_type"] == "Validation"
    assert "no prompt 'nope'" in body["error"] and "passage, query" in body["error"]
    status, body = await _post(
        server.url + "/v1/embeddings", {"model": "plain", "input": "x", "prompt_name": "query"}
    )
    assert status == 400 and body["error"]["param"] == "prompt_name"
    assert "has no prompts" in body["error"]["message"]


async def test_info_lists_the_prompts(server: ServerThread) -> None:
    async with aiohttp.ClientSession() as s:
        e5 = await (await s.get(server.url + "/info?model=e5")).json()
        instr = await (await s.get(server.url + "/info?model=instr")).json()
        plain = await (await s.get(server.url + "/info?model=plain")).json()
    assert e5["prompts"] == PROMPTS and e5["default_prompt"] is None
    assert instr["default_prompt"] == "query: "
    assert plain["prompts"] is None


async def test_a_default_prompt_name_the_model_lacks_fails_start_up(dirs: dict[str, str]) -> None:
    import asyncio

    settings = build(["--model", f"e5={dirs['e5']}", "--default-prompt-name", "e5=nope"], environ={})
    srv = ServerThread(settings).launch()
    try:
        body: dict[str, Any] = {}
        async with aiohttp.ClientSession() as s:
            for _ in range(600):  # ≤ 60 s to load the model and fail
                async with s.get(srv.url + "/ready") as r:
                    body = await r.json()
                if body["status"] != "starting":
                    break
                await asyncio.sleep(0.1)
        assert body["status"] == "failed" and "no prompt 'nope'" in body["error"], body
    finally:
        srv.stop()
