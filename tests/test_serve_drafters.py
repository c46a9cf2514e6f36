"""`localspec serve` with every model drafter, driven by the official `openai` client.

A real `localspec serve --drafter auto --parallel 4` process, and in-process servers with the
shipped EAGLE-3 head, the shipped Medusa heads and a draft model: chat, streamed chat and a
JSON-schema completion each give the engine's text for that request (greedy: the target's
own text), and the responses report the drafter that served them.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

from conftest import frozen_cost_model  # noqa: E402
from helpers import localspec_process  # noqa: E402
from localspec import SamplingParams  # noqa: E402
from localspec.engine import Engine  # noqa: E402
from localspec.scheduler import BatchScheduler  # noqa: E402
from localspec.server.http import AppThread  # noqa: E402
from localspec.server.openai import OpenAIService, create_serve_app  # noqa: E402

PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}  # fmt: skip
N = 24


@pytest.fixture(scope="module")
def plain_engine(model):
    eng = Engine(model, drafter="none", n_ctx=1024, cost_model=frozen_cost_model())
    yield eng
    eng.close()


def check_client(client, plain_engine: Engine, drafter: str) -> None:
    """Completion, chat, streamed chat and a JSON-schema completion: each equals plain decoding
    of the same prompt, and the drafter is the one the server was started with."""
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=N, temperature=0)
    plain_engine.reset()
    ref = plain_engine.generate(PROMPT, max_tokens=N, sampling=SamplingParams.greedy())
    assert r.choices[0].text == ref.text
    t = r.model_extra["timings"]
    assert t["drafter"] == drafter and t["draft_n"] > 0, t  # the drafter really drafted (adaptive off)

    msgs = [{"role": "user", "content": "List four fruits, comma separated."}]
    chat = client.chat.completions.create(model="m", messages=msgs, max_tokens=N, temperature=0)
    pieces = []
    with client.chat.completions.create(model="m", messages=msgs, max_tokens=N, temperature=0, stream=True) as s:
        for ch in s:
            if ch.choices:
                pieces.append(ch.choices[0].delta.content or "")
    assert "".join(pieces) == chat.choices[0].message.content

    js = client.completions.create(model="m", prompt="A person as JSON: ", max_tokens=48, temperature=0,
                                   extra_body={"response_format": {"type": "json_schema",
                                                                   "json_schema": {"schema": SCHEMA}}})  # fmt: skip
    plain = client.completions.create(model="m", prompt="A person as JSON: ", max_tokens=48, temperature=0,
                                      extra_body={"speculative": False, "response_format": {
                                          "type": "json_schema", "json_schema": {"schema": SCHEMA}}})  # fmt: skip
    assert js.choices[0].text == plain.choices[0].text
    if js.choices[0].finish_reason == "stop":
        obj = json.loads(js.choices[0].text)
        assert set(obj) >= {"name", "age"}


@pytest.mark.parametrize("drafter", ["eagle3", "medusa", "draft"])
def test_in_process_serve_with_a_model_drafter(model, plain_engine, derived_draft_path, drafter):
    options = {"draft_model": str(derived_draft_path)} if drafter == "draft" else {}
    sched = BatchScheduler(model, parallel=4, n_ctx=512, cost_model=frozen_cost_model(), drafter=drafter,
                           drafter_options=options, adaptive=False, max_tree_nodes=8).start()  # fmt: skip
    oai = OpenAIService(sched, model_name="m", sampling=SamplingParams.greedy())
    try:
        with AppThread(create_serve_app(oai, None, max_body_bytes=1 << 20)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
            check_client(client, plain_engine, drafter)
    finally:
        sched.close()


def test_localspec_serve_drafter_auto_parallel_4(model_path, plain_engine):
    """The command itself: `localspec serve --drafter auto --parallel 4` (n-grams + the shipped
    EAGLE-3 head), as a process on a free port."""
    args = ["serve", "--port", "0", "--drafter", "auto", "--parallel", "4", "--ctx-per-request", "512",
            "-m", str(model_path), "-t", "1", "--no-adaptive", "--max-tree-nodes", "8"]  # fmt: skip
    with localspec_process(*args) as (_proc, url, _err):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        check_client(client, plain_engine, "auto")
