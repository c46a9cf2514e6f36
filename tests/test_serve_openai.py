"""`localspec serve`'s OpenAI API, driven by the official `openai` client against a real server
on 127.0.0.1 (the default model), and by raw HTTP for malformed / oversized bodies and
disconnects. The server keeps serving after each."""

import json
import socket
import threading
import time
from dataclasses import replace

import httpx
import pytest

openai = pytest.importorskip("openai")

from conftest import frozen_cost_model  # noqa: E402
from helpers import serve_app_thread  # noqa: E402
from localspec import SamplingParams  # noqa: E402
from localspec.scheduler import BatchScheduler  # noqa: E402
from localspec.server.http import AppThread  # noqa: E402
from localspec.server.openai import OAIError, OpenAIService, create_serve_app, parse_oai  # noqa: E402

PROMPT = "The capital of France is"
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server(model, engine):
    with serve_app_thread(model, engine, max_body_bytes=MAX_BODY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def wait_until(cond, timeout=300.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["gemma-test"]


def test_completion_equals_the_engine_and_reports_speculation(client, engine):
    r = client.completions.create(model="gemma-test", prompt=PROMPT, max_tokens=12, temperature=0)
    engine.reset()
    ref = engine.generate(PROMPT, max_tokens=12, sampling=SamplingParams.greedy())
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(engine.tokenize(PROMPT))
    t = r.model_extra["timings"]
    assert t["predicted_n"] == 12 and {"draft_n", "draft_n_accepted"} <= set(t)


def test_chat_and_streamed_chat_agree(client, server):
    msgs = [{"role": "user", "content": "Name three colours."}]
    r = client.chat.completions.create(model="x", messages=msgs, max_tokens=16, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and text and not text.startswith(" ")
    pieces, finish, n_chunks = [], None, 0
    with client.chat.completions.create(model="x", messages=msgs, max_tokens=16, temperature=0, stream=True,
                                        stream_options={"include_usage": True}) as stream:
        for ch in stream:
            n_chunks += 1
            if ch.choices:
                pieces.append(ch.choices[0].delta.content or "")
                finish = ch.choices[0].finish_reason or finish
            else:
                usage = ch.usage
    assert "".join(pieces) == text and n_chunks > 3
    assert finish == r.choices[0].finish_reason and usage.completion_tokens == r.usage.completion_tokens


def test_stop_and_logprobs(client):
    r = client.completions.create(model="x", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"], logprobs=2)
    c = r.choices[0]
    assert c.finish_reason == "stop" and " 7" not in c.text and "6" in c.text
    assert len(c.logprobs.tokens) == r.usage.completion_tokens
    assert all(len(t) == 2 for t in c.logprobs.top_logprobs) and all(lp <= 0 for lp in c.logprobs.token_logprobs)
    ch = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                        temperature=0, logprobs=True, top_logprobs=3)
    content = ch.choices[0].logprobs.content
    assert len(content) == ch.usage.completion_tokens and all(len(x.top_logprobs) == 3 for x in content)


def test_json_schema_response_parses(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Is Paris in France? Answer in JSON."}], max_tokens=40,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert json.loads(r.choices[0].message.content)["answer"] in ("yes", "no")
    # json_object: llama.cpp's JSON grammar, whose root is an object: the first character is "{"
    # (without the grammar this base model continues with a space or a newline)
    r = client.completions.create(model="x", prompt="A JSON object:", max_tokens=8, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.startswith("{")
    plain = client.completions.create(model="x", prompt="A JSON object:", max_tokens=8, temperature=0)
    assert not plain.choices[0].text.startswith("{")


@pytest.mark.parametrize("kw,param", [
    ({"temperature": 5}, "temperature"),
    ({"n": 2}, "n"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"extra_body": {"cache_prompt": "yes"}}, "cache_prompt"),
    ({"seed": -7}, "seed"),
    # these were taken and ignored: a client asking for tool calls waited for ones that never came
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"extra_body": {"best_of": 3}}, "best_of"),
])
def test_error_objects(client, kw, param):
    args = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    if param == "messages[0].role":
        assert e.value.body["message"] == "messages[0].role must be system, developer, user or assistant, not 'wizard'"


def test_tool_choice_none_and_a_developer_message_are_taken(client):
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="x", messages=msgs, max_tokens=2, tool_choice="none", tools=[])
    assert r.choices[0].finish_reason


SEED_PROMPT = "Here is a list of unusual words:"


def test_a_64_bit_seed_is_kept_whole_and_gives_the_python_apis_text(client, engine):
    seed = 2**32 + 5  # cut to 32 bits it would be seed 5
    r = client.completions.create(model="x", prompt=SEED_PROMPT, max_tokens=24, temperature=1.0, seed=seed)
    cut = client.completions.create(model="x", prompt=SEED_PROMPT, max_tokens=24, temperature=1.0, seed=seed & 0xFFFFFFFF)
    engine.reset()
    sampling = replace(SamplingParams.greedy(), temperature=1.0)  # the server's defaults, the request's temperature
    ref = engine.generate(SEED_PROMPT, max_tokens=24, sampling=sampling.with_seed(seed))
    assert r.choices[0].text == ref.text != cut.choices[0].text
    chat = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Say a word."}],
                                          max_tokens=8, temperature=1.0, seed=2**64 - 1)  # the largest seed
    assert chat.choices[0].finish_reason


def test_top_p_zero_is_the_greedy_text_at_any_temperature(client):
    greedy = client.completions.create(model="x", prompt=SEED_PROMPT, max_tokens=16, temperature=0)
    for seed in (1, 2):
        r = client.completions.create(model="x", prompt=SEED_PROMPT, max_tokens=16, temperature=1.5, top_p=0, seed=seed)
        assert r.choices[0].text == greedy.choices[0].text


def test_seed_minus_one_draws_a_fresh_seed_per_request(client):
    texts = {client.completions.create(model="x", prompt=SEED_PROMPT, max_tokens=24, temperature=1.0,
                                       seed=-1).choices[0].text for _ in range(2)}  # fmt: skip
    assert len(texts) == 2


def test_logit_bias_is_applied_as_in_llama_cpp(client, engine):
    # the OpenAI form {"token id": bias}; llama.cpp's /v1 endpoints apply it (and its text keys)
    greedy = client.completions.create(model="x", prompt=PROMPT, max_tokens=4, temperature=0)
    first = engine.tokenize(greedy.choices[0].text, add_special=False)[0]
    r = client.completions.create(model="x", prompt=PROMPT, max_tokens=4, temperature=0,
                                  logit_bias={str(first): -100})
    engine.reset()
    ref = engine.generate(PROMPT, max_tokens=4, sampling=SamplingParams.greedy(logit_bias={first: -100.0}))
    assert r.choices[0].text == ref.text != greedy.choices[0].text
    chat = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          temperature=0, logit_bias={str(first): -100})  # accepted on chat too
    assert chat.choices[0].finish_reason
    for bias, message in [({"99999999": 1}, "outside the vocabulary"), ({"5": "x"}, "biases must be numbers")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="x", prompt=PROMPT, max_tokens=2, logit_bias=bias)
        assert e.value.body["param"] == "logit_bias" and message in e.value.body["message"]


def test_the_next_chat_turn_reuses_the_first_turns_cells(client):
    first = [{"role": "user", "content": "Describe a lighthouse in two sentences."}]
    r1 = client.chat.completions.create(model="x", messages=first, max_tokens=24, temperature=0)
    turn2 = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "Now describe its keeper."}]  # fmt: skip
    hit = client.chat.completions.create(model="x", messages=turn2, max_tokens=12, temperature=0)
    miss = client.chat.completions.create(model="x", messages=turn2, max_tokens=12, temperature=0,
                                          extra_body={"cache_prompt": False})  # fmt: skip
    cached = hit.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens <= cached < hit.usage.prompt_tokens  # turn 1's prompt and (most of) its reply
    t = hit.model_extra["timings"]
    assert t["cache_n"] == cached and t["prompt_n"] == hit.usage.prompt_tokens - cached
    assert miss.usage.prompt_tokens_details.cached_tokens == 0 and miss.model_extra["timings"]["cache_n"] == 0
    assert hit.choices[0].message.content == miss.choices[0].message.content


def test_a_prompt_far_too_long_is_refused_before_it_is_tokenized_whole(client):
    # the server's context is 512 tokens: 30 KB cannot fit whatever the tokens (Gemma 3's
    # longest token text has 48 bytes), and 9 KB of "hi\n" overflows in its first 8 x 512 bytes
    # already; llama.cpp takes seconds to tokenize such text whole
    for prompt in ("hi\n" * 10_000, "hi\n" * 3_000):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="x", prompt=prompt, max_tokens=2)
        assert e.value.body["code"] == "context_length_exceeded" and "at least" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}] * 1_500, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"


def test_waiting_requests_are_counted_beyond_the_free_slots(model):
    sched = BatchScheduler(model, parallel=2, n_ctx=64, cost_model=frozen_cost_model())  # not started: nothing runs
    try:
        svc = OpenAIService(sched, model_name="m", sampling=SamplingParams.greedy(), max_queue=1)
        req = parse_oai("completion", {"prompt": "Hello", "max_tokens": 1}, svc.sampling)
        for _ in range(3):  # two take the free slots, one waits
            svc.submit(req, on_chunk=None, on_done=None)
        with pytest.raises(OAIError) as e:
            svc.submit(req, on_chunk=None, on_done=None)
        assert e.value.status == 503 and "(1)" in e.value.message
        assert e.value.body()["error"]["type"] == "unavailable_error"  # llama-server's, as the editor endpoints'
    finally:
        sched.close()


def test_a_burst_of_requests_cannot_all_pass_the_queue_check_while_they_are_tokenized(model):
    """Requests arrive together and are tokenized off the event loop, each before it reaches the
    scheduler's queue: they count as waiting from the check on, so with one slot and
    ``max_queue=1`` two of four are taken and two get 503 (before: all four, the check seeing
    an empty queue each time)."""
    sched = BatchScheduler(model, parallel=1, n_ctx=64, cost_model=frozen_cost_model())  # not started: nothing runs
    try:
        svc = OpenAIService(sched, model_name="m", sampling=SamplingParams.greedy(), max_queue=1)
        req = parse_oai("completion", {"prompt": "Hello", "max_tokens": 1}, svc.sampling)
        arrived = threading.Condition()
        n_arrived, outcomes = [0], []
        tokenize = svc.prompt_tokens

        def arrive() -> None:
            with arrived:
                n_arrived[0] += 1
                arrived.notify_all()

        def slow_tokenize(r):  # holds each request inside its tokenization until all four arrived or were refused
            arrive()
            with arrived:
                assert arrived.wait_for(lambda: n_arrived[0] == 4, timeout=60)
            return tokenize(r)

        svc.prompt_tokens = slow_tokenize

        def client() -> None:
            try:
                svc.submit(req, on_chunk=None, on_done=None)
                outcomes.append(200)
            except OAIError as e:
                outcomes.append(e.status)
                arrive()

        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert sorted(outcomes) == [200, 200, 503, 503]
    finally:
        sched.close()


def test_stop_accepting_cancels_what_was_submitted_and_refuses_more(model):
    sched = BatchScheduler(model, parallel=1, n_ctx=64, cost_model=frozen_cost_model())  # not started: nothing runs
    try:
        svc = OpenAIService(sched, model_name="m", sampling=SamplingParams.greedy())
        req = parse_oai("completion", {"prompt": "Hello", "max_tokens": 8}, svc.sampling)
        done = []
        jobs = [svc.submit(req, on_chunk=None, on_done=done.append) for _ in range(2)]  # one in a slot, one waits
        svc.stop_accepting()
        assert all(j.cancelled.is_set() for j in jobs)
        with pytest.raises(OAIError) as e:
            svc.submit(req, on_chunk=None, on_done=None)
        assert e.value.status == 503 and "shutting down" in e.value.message
        sched.run_until_idle()
        assert len(done) == 2 and {id(j) for j in done} == {id(j) for j in jobs}  # each answered once
        assert all(j.result.finish_reason == "cancelled" for j in jobs)
    finally:
        sched.close()


def test_a_shutdown_cuts_off_the_requests_in_flight_with_an_error_not_a_finished_answer(model):
    # `localspec serve` stops on SIGINT / SIGTERM through stop_accepting (cli/serve.py's
    # on_shutdown); the requests it cancels were answered 200 with the partial text and
    # finish_reason "stop", as if finished. Now: 503 for the plain one, an error event for the
    # stream, each raised by the official client; two slots, so both run when it stops
    sched = BatchScheduler(model, parallel=2, n_ctx=4096, cost_model=frozen_cost_model()).start()
    oai = OpenAIService(sched, model_name="m", sampling=SamplingParams.greedy())
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0,
            "extra_body": {"logit_bias": {str(t): False for t in model.eog_ids}}}  # fmt: skip  (no end of text: runs on)
    try:
        with AppThread(create_serve_app(oai, max_body_bytes=MAX_BODY)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
            once: dict = {}

            def not_streamed() -> None:
                try:
                    once["answer"] = client.completions.create(**body)
                except openai.APIError as e:
                    once["error"] = e

            t = threading.Thread(target=not_streamed)
            t.start()
            chunks, streamed = [], None
            try:
                for ch in client.completions.create(**body, stream=True):
                    chunks.append(ch)
                    if len(chunks) == 1:  # the stream's first token is out
                        wait_until(lambda: sched.n_active == 2)  # and the other request runs too
                        oai.stop_accepting()
            except openai.APIError as e:
                streamed = e
            t.join(600)
            assert not t.is_alive()
            finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
            assert streamed is not None, f"the stream ended without an error, finish reasons {set(finishes)}"
            assert not isinstance(streamed, openai.APIStatusError)  # 200 headers, then the error event
            assert streamed.code == "server_shutdown" and streamed.type == "unavailable_error"
            assert "cut off" in streamed.message and "retry" in streamed.message and "\n" not in streamed.message
            assert chunks and set(finishes) == {None}  # no chunk says the answer finished
            assert "answer" not in once, once["answer"].choices[0].finish_reason
            e = once["error"]
            assert isinstance(e, openai.InternalServerError) and e.status_code == 503
            assert e.body["code"] == "server_shutdown" and "cut off" in e.body["message"]
            with pytest.raises(openai.InternalServerError) as new:  # and nothing more is taken
                client.completions.create(model="m", prompt=PROMPT, max_tokens=2)
            assert new.value.status_code == 503 and "shutting down" in new.value.message
    finally:
        sched.close()


def test_context_overflow_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="x", prompt="word " * 700, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path", ["/v1/completions", "/completion"])
def test_a_client_gone_before_its_body_ended_is_one_log_line_not_a_traceback(server, path):
    """Half a body, then the socket closed: uvicorn logged "Exception in ASGI application" and
    a ClientDisconnect traceback (``complete --serve``: two). The server kept serving then too."""
    import logging

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.DEBUG)
    loggers = [logging.getLogger(n) for n in ("localspec.server", "uvicorn", "uvicorn.error")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: 1000\r\n\r\n{{\"prompt\"".encode())  # fmt: skip
        wait_until(lambda: any("disconnected after 9 bytes" in r.getMessage() for r in records))
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
    line = [r for r in records if "disconnected" in r.getMessage()]
    assert [r.getMessage() for r in line] == [f"POST {path}: the client disconnected after 9 bytes of the request body"]
    assert not [r for r in records if r.levelno >= logging.WARNING or r.exc_info], [r.getMessage() for r in records]
    with httpx.Client(base_url=server.url, timeout=120) as h:
        assert h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_raw_http_malformed_and_oversized(server, client):
    with httpx.Client(base_url=server.url, timeout=60) as h:
        r = h.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = h.post("/v1/completions", content=b"[1, 2]")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = h.post("/v1/completions", content=b'{"prompt": "' + b"a" * (MAX_BODY + 10) + b'"}')
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
        r = h.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        # JSON can escape a lone UTF-16 surrogate, which no tokenizer can encode: a 400 naming the field
        for path, body, param in (
            ("/v1/completions", b'{"prompt": "ab\\ud800c", "max_tokens": 2}', "prompt"),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\uDC00"}]}', "messages[0].content"),
            ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud83d"]}', "stop[0]"),
        ):
            r = h.post(path, content=body)
            err = r.json()["error"]
            assert r.status_code == 400 and "lone UTF-16 surrogate" in err["message"] and err["param"] == param
        r = h.post("/v1/completions", content=b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 1, "temperature": 0}')
        assert r.status_code == 200  # a surrogate pair is one character
        r = h.post("/v1/completions", content=b"[" * 20_000 + b"]" * 20_000)
        assert r.status_code == 400 and "too deeply" in r.json()["error"]["message"]
        r = h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "cache_prompt": None})
        assert r.status_code == 200  # null is the default, as for every field
        assert h.get("/health").json()["status"] == "ok"
    assert client.models.list().data  # still serving


def test_disconnect_frees_the_slot(server, client):
    body = json.dumps({"model": "x", "prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                       "temperature": 0}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while b"data: {" not in got:  # wait for the first streamed event
        got += s.recv(65536)
    assert server.sched.n_active == 1
    s.close()
    wait_until(lambda: server.sched.n_active == 0)
    r = client.completions.create(model="x", prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_editor_endpoints_in_the_same_process(server):
    with httpx.Client(base_url=server.url, timeout=600) as h:
        r = h.post("/completion", json={"prompt": PROMPT, "n_predict": 4})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 4


def test_api_key_required(server):
    app = create_serve_app(OpenAIService(server.sched, model_name="k"), max_body_bytes=MAX_BODY, api_key="sekrit")
    with AppThread(app) as srv:
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert [m.id for m in good.models.list().data] == ["k"]
        assert httpx.get(srv.url + "/health").status_code == 200
