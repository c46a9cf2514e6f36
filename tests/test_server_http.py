"""The completion server over HTTP with the real default model: requests shaped exactly like
llama.vim's and llama.vscode's, streaming and not, speculation against plain decoding,
KV-cache reuse, queueing, cancellation, client disconnects, and every kind of bad input."""

import json
import re
import threading
import time

import httpx
import pytest

from localspec.server.http import ServerThread
from localspec.server.protocol import MAX_CMPL
from plugin_requests import (
    VIM_RESPONSE_FIELDS,
    llama_vim_fim,
    llama_vim_ring_update,
    llama_vscode_fim,
    llama_vscode_prepare,
)

CODE_PREFIX = (
    "def add_one(x):\n    return x + 1\n\n\n"
    "def add_two(x):\n    return x + 2\n\n\n"
    "def add_three(x):\n    return x + 3\n\n\n"
    "def add_four(x):\n"
)
CODE_SUFFIX = "\n\ndef add_six(x):\n    return x + 6\n"

def vim_request(prefix=CODE_PREFIX, middle="    return ", suffix=CODE_SUFFIX, extra=(), n_predict=16):
    return llama_vim_fim(prefix, middle, suffix, extra, n_predict=n_predict)


GREEDY = {"samplers": ["temperature"], "temperature": 0.0}


@pytest.fixture(scope="module")
def server(service):
    with ServerThread(service) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def wait_for(pred, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def sse_events(response):
    """Decoded ``data: {...}`` events of a streamed response, checking the framing."""
    raw = b"".join(response.iter_bytes())
    frames = raw.split(b"\n\n")
    assert frames[-1] == b""
    out = []
    for f in frames[:-1]:
        assert f.startswith(b"data: "), f
        out.append(json.loads(f[6:]))
    return out


# -- plugin-shaped requests ---------------------------------------------------------------------


def test_health_props_models(client):
    assert client.get("/health").json() == {"status": "ok", "slots_idle": 1, "slots_processing": 0,
                                            "requests_waiting": 0, "last_step_age_s": None}  # fmt: skip
    assert client.get("/v1/health").status_code == 200
    props = client.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] > 0 and props["fim"]["supported"] is False
    assert client.get("/v1/models").json()["data"][0]["id"].endswith(".gguf")


def test_llama_vim_fim_request(client):
    r = client.post("/infill", json=vim_request())
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    raw = r.text
    # the checks llama.vim makes before decoding (s:fim_on_response)
    assert re.match(r"^\s*{", raw) and re.search(r'"content"\s*:"', raw)
    d = r.json()
    assert set(d) == set(VIM_RESPONSE_FIELDS)
    assert isinstance(d["content"], str) and d["timings/predicted_n"] <= 16
    assert d["timings/prompt_n"] > 0 and d["tokens_cached"] >= d["timings/prompt_n"]


def test_llama_vim_ring_update_fills_the_cache(client):
    extra = [{"text": "def helper(y):\n    return y * 2\n" * 20, "filename": "helpers.py"}]
    r = client.post("/infill", json=llama_vim_ring_update(extra))
    assert r.status_code == 200 and r.json() == {}
    warm = client.post("/infill", json={**llama_vim_ring_update(extra), "response_fields": None}).json()
    n_extra = warm["tokens_evaluated"]
    assert warm["tokens_predicted"] == 0 and warm["timings"]["cache_n"] == n_extra - 1
    req = vim_request(extra=extra)
    del req["response_fields"]
    d = client.post("/infill", json=req).json()
    # the extra context comes first in the prompt, so it was all in the cache already
    assert n_extra > 200 and d["timings"]["cache_n"] >= n_extra - 1 and d["timings"]["prompt_n"] < 100


def test_llama_vscode_requests(client):
    chunks = [{"text": "x = 1\n", "filename": "a.py"}]
    assert client.post("/infill", json=llama_vscode_prepare(chunks)).status_code == 200
    answers = client.post("/infill", json=llama_vscode_fim(CODE_PREFIX, "    return ", CODE_SUFFIX, chunks)).json()
    # n_cmpl 3: a list of three completions, as llama.cpp answers and llama.vscode reads
    # (getComplFromContent: `content` of one object, or of each element of a list)
    assert isinstance(answers, list) and [d["index"] for d in answers] == [0, 1, 2]
    for d in answers:
        assert isinstance(d["content"], str) and d["stop"] is True and "cancelled" not in d
        for k in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"):
            assert k in d["timings"]
        notes = d["localspec"]["notes"]
        assert any("fill-in-the-middle" in n for n in notes) and not any("n_cmpl" in n for n in notes)
        assert d["localspec"]["fim"] is False and d["localspec"]["samplers"]["applied"] == ["top_k", "top_p", "infill"]
    # the later ones reuse the prompt's cache
    assert all(d["timings"]["cache_n"] >= d["tokens_evaluated"] - 1 for d in answers[1:])


def test_n_cmpl_alternatives_are_independent_samples_with_consecutive_seeds(client):
    body = {**llama_vscode_fim(CODE_PREFIX, "    return ", CODE_SUFFIX), "seed": 7, "temperature": 1.0,
            "samplers": ["top_k", "temperature"], "return_tokens": True, "t_max_predict_ms": 0, "n_predict": 8}  # fmt: skip
    answers = client.post("/infill", json=body).json()
    assert [d["generation_settings"]["seed"] for d in answers] == [7, 8, 9]
    without = {k: v for k, v in body.items() if k != "n_cmpl"}
    for key, req in (("n_cmpl", {**body, "n_cmpl": MAX_CMPL + 1}), ("n", {**without, "n": 100000})):
        r = client.post("/infill", json=req)  # bounded, as llama-server bounds it by its slots
        assert r.status_code == 400 and f'"{key}" must be' in r.json()["error"]["message"], r.text
    # each is the completion that seed gives alone
    for d in answers:
        alone = client.post("/infill", json={**body, "n_cmpl": 1, "seed": d["generation_settings"]["seed"]}).json()
        assert alone["tokens"] == d["tokens"] and alone["content"] == d["content"]


def test_streaming_infill(client):
    req = {**vim_request(n_predict=24), "stream": True, "n_indent": 0, **GREEDY}
    del req["response_fields"]
    with client.stream("POST", "/infill", json=req) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    final = events[-1]
    assert "".join(e["content"] for e in events[:-1]) == final["content"]
    assert final["timings"]["predicted_n"] == final["tokens_predicted"] <= 24
    assert final["stop_type"] in ("eos", "limit", "word")


def test_completion_endpoint(client):
    d = client.post("/completion", json={"prompt": "One, two, three, four,", "n_predict": 12, **GREEDY}).json()
    assert d["tokens_predicted"] > 0 and d["stop_type"] in ("limit", "eos")
    ids = client.post("/completion", json={"prompt": [2, 4521, 236764], "n_predict": 3, "return_tokens": True}).json()
    assert len(ids["tokens"]) == ids["tokens_predicted"]
    w = client.post("/completions", json={"prompt": "One, two, three, four,", "n_predict": 20, "stop": [" six"], **GREEDY})
    d = w.json()
    if d["stop_type"] == "word":
        assert d["stopping_word"] == " six" and " six" not in d["content"]


# -- speculation: same text, statistics ------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling",
    [GREEDY, {"top_k": 40, "top_p": 0.9, "samplers": ["top_k", "top_p", "infill"], "seed": 42}],
    ids=["greedy", "llama-vim-samplers-seeded"],
)
def test_speculative_and_plain_completion_give_the_same_text(client, sampling):
    base = {**vim_request(n_predict=40), "n_indent": 0, "t_max_predict_ms": 0, "return_tokens": True, **sampling}
    del base["response_fields"]
    spec = client.post("/infill", json={**base, "cache_prompt": False}).json()
    plain = client.post("/infill", json={**base, "cache_prompt": False, "speculative": False}).json()
    assert spec["tokens"] == plain["tokens"] and spec["content"] == plain["content"]
    assert spec["localspec"]["speculative"] is True and plain["localspec"]["speculative"] is False
    assert "draft_n" not in plain["timings"]
    if sampling is GREEDY:  # the repetitive prefix is drafted from
        assert spec["timings"]["draft_n"] > 0 and spec["timings"]["draft_n_accepted"] > 0
        assert spec["localspec"]["mean_acceptance_length"] > 1.0


def test_only_the_changed_last_line_is_prefilled(client):
    req = {**vim_request(n_predict=4), **GREEDY}
    del req["response_fields"]
    first = client.post("/infill", json={**req, "cache_prompt": False}).json()
    second = client.post("/infill", json={**req, "prompt": "    return x +"}).json()
    n_prompt = second["tokens_evaluated"]
    assert second["timings"]["cache_n"] >= n_prompt - 5 and second["timings"]["prompt_n"] <= 5
    assert first["timings"]["cache_n"] == 0


def test_samplers_that_cannot_be_applied_are_reported(client):
    d = client.post(
        "/completion", json={"prompt": "a b", "n_predict": 2, "samplers": ["dry", "top_k"], "dry_multiplier": 0.8}
    ).json()
    assert d["localspec"]["samplers"] == {"applied": ["top_k"], "not_applied": ["dry"]}
    assert any("dry" in n for n in d["localspec"]["notes"])


# -- concurrency, cancellation, disconnects ---------------------------------------------------------


def start_stream(server, body, first_event, events):
    def run():
        with httpx.Client(base_url=server.url, timeout=300) as c, c.stream("POST", "/completion", json=body) as r:
            buf = b""
            for chunk in r.iter_bytes():
                buf += chunk
                while b"\n\n" in buf:
                    frame, buf = buf.split(b"\n\n", 1)
                    events.append(json.loads(frame[6:]))
                    first_event.set()

    t = threading.Thread(target=run)
    t.start()
    return t


LONG = {"prompt": "Once upon a time", "n_predict": 64, "ignore_eos": True, "stream": True, **GREEDY}


def test_a_request_from_another_client_waits_its_turn(server, client):
    first, events = threading.Event(), []
    t = start_stream(server, {**LONG, "client_id": "a"}, first, events)
    first.wait(120)
    d = client.post("/completion", json={"prompt": "Hello", "n_predict": 4, "client_id": "b", **GREEDY}).json()
    t.join(300)
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 64  # not cancelled
    assert d["tokens_predicted"] == 4 and d["localspec"]["queue_ms"] > 0


def test_a_newer_request_from_the_same_client_cancels_the_older(server, client):
    first, events = threading.Event(), []
    t = start_stream(server, {**LONG, "id_slot": 0}, first, events)
    first.wait(120)
    d = client.post("/completion", json={"prompt": "Hello", "n_predict": 4, "id_slot": 0, **GREEDY}).json()
    t.join(300)
    final = events[-1]
    assert final["stop"] is True and final["stop_type"] == "none"
    assert "superseded" in final["localspec"]["cancelled"] and final["tokens_predicted"] < 64
    assert d["tokens_predicted"] == 4


def test_a_cache_warmup_is_not_cancelled_and_fills_the_cache_for_the_next_completion(service):
    # llama.vim sends a ring update (n_predict 0) and, while it runs or waits, a completion on
    # the same slot; llama.cpp queues both, so the warm-up's prefill serves the completion
    from localspec.server import parse_request

    finals = {}

    def sink(name):
        return lambda ev: finals.setdefault(name, ev) if ev.kind != "partial" else None

    extra = [{"text": "def warm_helper(y):\n    return y * 3\n" * 12, "filename": "warm.py"}]
    warm_req = {**llama_vim_ring_update(extra), "response_fields": None}
    fim = {**vim_request(extra=extra, n_predict=2), "response_fields": None}
    long = service.submit(parse_request("completion", {**LONG, "stream": False, "id_slot": 0}), sink("long"))
    warm = service.submit(parse_request("infill", warm_req), sink("warm"))
    assert not long.cancelled
    new = service.submit(parse_request("infill", fim), sink("new"))
    assert long.cancelled and not warm.cancelled and not new.cancelled
    for j in (long, warm, new):
        assert j.done.wait(300)
    w, n = finals["warm"].data, finals["new"].data
    assert "cancelled" not in w and "cancelled" not in w["localspec"] and w["tokens_evaluated"] > 150
    assert n["timings"]["cache_n"] >= w["tokens_evaluated"] - 1 and n["tokens_predicted"] > 0
    assert "content" not in finals["long"].data


def test_an_older_request_on_the_same_slot_is_answered_in_a_way_plugins_do_not_cache(server, service, client):
    # llama.vim caches any response matching "content"\s*:" (s:fim_on_response); llama.vscode
    # caches the `content` it reads: the superseded request must have no `content` at all
    old = {**vim_request(n_predict=2000), "ignore_eos": True, "n_indent": 0, "t_max_predict_ms": 0}
    answer = {}

    def send_old():
        with httpx.Client(base_url=server.url, timeout=300) as c:
            answer["r"] = c.post("/infill", json=old)

    t = threading.Thread(target=send_old)
    t.start()
    wait_for(lambda: service._live and service._n_waiting == 0)  # the old one is running
    new = client.post("/infill", json=vim_request(n_predict=4))
    t.join(300)
    r = answer["r"]
    assert r.status_code == 200 and not re.search(r'"content"\s*:"', r.text)
    d = r.json()
    assert "superseded" in d["cancelled"] and set(d) - {"cancelled"} <= set(VIM_RESPONSE_FIELDS)
    assert re.search(r'"content"\s*:"', new.text) and "cancelled" not in new.json()


def test_props_counts_finished_requests_as_finished(client):
    before = client.get("/props").json()["localspec"]["requests"]
    for _ in range(3):
        assert client.post("/completion", json={"prompt": "One, two,", "n_predict": 2}).status_code == 200
    after = client.get("/props").json()["localspec"]["requests"]
    assert after["requests"] - before["requests"] == 3 and after["cancelled"] == before["cancelled"]


def test_client_disconnect_mid_stream_cancels_generation(server, service, client):
    before = service.counters["cancelled"]
    with httpx.Client(base_url=server.url, timeout=300) as c, c.stream(
        "POST", "/completion", json={**LONG, "n_predict": 2000}
    ) as r:
        next(r.iter_bytes())  # the first event, then hang up
    wait_for(lambda: service.counters["cancelled"] > before)
    service.call(lambda e: e.cache.check())
    assert client.post("/completion", json={"prompt": "Hi", "n_predict": 3, **GREEDY}).json()["tokens_predicted"] == 3


def test_client_disconnect_while_waiting_for_a_plain_response(server, service, client):
    before = service.counters["cancelled"]
    body = {"prompt": "Once upon a time", "n_predict": 2000, "ignore_eos": True, **GREEDY}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url, timeout=1.0) as c:
        c.post("/completion", json=body)
    wait_for(lambda: service.counters["cancelled"] > before)
    service.call(lambda e: e.cache.check())
    assert client.get("/health").json() == {"status": "ok", "slots_idle": 1, "slots_processing": 0,
                                            "requests_waiting": 0, "last_step_age_s": None}  # fmt: skip


def test_full_queue_answers_503(service, client):
    old = service.config.max_queue
    service.config.max_queue = 0
    try:
        r = client.post("/completion", json={"prompt": "x", "n_predict": 1})
    finally:
        service.config.max_queue = old
    assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, status, message",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"", 400, "empty"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"input_prefix": NaN, "input_suffix": ""}', 400, "not valid JSON"),
        (b"\xff\xfe{}", 400, "not valid JSON"),
        (b'{"input_suffix": ""}', 400, '"input_prefix" is required'),
        (b'{"input_prefix": "", "input_suffix": "", "n_predict": "9"}', 400, '"n_predict" must be an integer'),
        (b'{"input_prefix": "", "input_suffix": "", "input_extra": {}}', 400, '"input_extra" must be an array'),
        (b'{"input_prefix": "", "input_suffix": "", "grammar": "root ::= ("}', 400, "grammar"),
    ],
)
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(client, content, status, message):
    r = client.post("/infill", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == status and message in err["message"] and err["type"] == "invalid_request_error"
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("input_prefix", CODE_PREFIX + "\ud800", '"input_prefix"'),
        ("input_suffix", "\udc00", '"input_suffix"'),
        ("prompt", "    return \ud800", '"prompt"'),
        ("input_extra", [{"text": "x\ud800", "filename": "a.py"}], '"input_extra"[0].text'),
        ("stop", ["\ud800"], '"stop"[0]'),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field_and_the_cache_is_kept(client, field, value, named):
    req = {**vim_request(n_predict=2), **GREEDY, "response_fields": None}
    first = client.post("/infill", json=req).json()
    # "\ud800" is valid JSON (json.dumps writes it as an escape): a lone surrogate
    raw = json.dumps({**req, field: value}).encode()
    r = client.post("/infill", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(named + " ")
    again = client.post("/infill", json=req).json()
    assert again["timings"]["cache_n"] >= first["tokens_evaluated"] - 1 and again["timings"]["prompt_n"] <= 1


def test_an_edit_above_the_fim_window_cut_keeps_the_cache(client, service):
    lines = [f"def f{i}(x):\n    return x + {i}\n" for i in range(40)]
    req = {**vim_request(prefix="".join(lines), n_predict=1), **GREEDY, "response_fields": None}
    old = service.config.window
    service.config.window = 128  # the prefix (~600 tokens) is cut
    try:
        first = client.post("/infill", json={**req, "cache_prompt": False}).json()
        edited = client.post("/infill", json={**req, "input_prefix": "import os\n" + "".join(lines)}).json()
        lines[1] = "def g1(y):\n    return y - 1\n"  # another edit above the cut
        edited2 = client.post("/infill", json={**req, "input_prefix": "import os\n" + "".join(lines)}).json()
    finally:
        service.config.window = old
    assert first["localspec"]["prompt_tokens_dropped"]["prefix"] > 300
    for d in (edited, edited2):
        assert d["tokens_evaluated"] == first["tokens_evaluated"]
        assert d["timings"]["cache_n"] >= d["tokens_evaluated"] - 1 and d["timings"]["prompt_n"] <= 1


def test_unknown_fields_are_ignored(client):
    r = client.post("/completion", json={"prompt": "a", "n_predict": 1, "no_such_field": [1, {"x": None}]})
    assert r.status_code == 200


def test_prompt_beyond_the_context_is_a_400(client, service):
    n_ctx = service.engine.n_ctx
    r = client.post("/completion", json={"prompt": [2] + [236764] * n_ctx, "n_predict": 1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"


class TokenizeSpy:
    """Records the longest text (UTF-8 bytes) the model is asked to tokenize."""

    def __init__(self, model, monkeypatch):
        self.longest, real = 0, model.tokenize

        def spy(text, *a, **kw):
            self.longest = max(self.longest, len(text.encode("utf-8")))
            return real(text, *a, **kw)

        monkeypatch.setattr(model, "tokenize", spy)


def test_huge_editor_texts_are_never_tokenized_whole(client, service, monkeypatch):
    # llama.cpp's tokenizer took 7.7 s for 60 KB of "hi\n" (32 s for 120 KB): a huge /completion
    # prompt is refused after tokenizing 8 bytes per context token of it, and a huge /infill
    # request is clipped (the prefix to its end, the suffix to its start; the extra chunks to
    # their last bytes: test_server_units) before tokenizing; the server answers the next
    # request as before
    n_ctx = service.engine.n_ctx
    spy = TokenizeSpy(service.model, monkeypatch)
    for prompt, tokenized in (("hi\n" * 400_000, 0), ("hi\n" * 30_000, 8 * n_ctx)):  # 1.2 MB: too long unread
        r = client.post("/completion", json={"prompt": prompt, "n_predict": 1})
        assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"
        assert "at least" in r.json()["error"]["message"] and "--n-ctx" in r.json()["error"]["message"]
        assert spy.longest == tokenized
    huge = "hi\n" * 400_000  # 1.2 MB
    body = vim_request(prefix=CODE_PREFIX * 20 + huge + CODE_PREFIX, suffix=CODE_SUFFIX + huge)
    body.pop("response_fields")
    old, service.config.window = service.config.window, 256  # a short prompt: fast to prefill
    try:
        spy.longest = 0
        r = client.post("/infill", json=body)
    finally:
        service.config.window = old
    assert r.status_code == 200, r.text
    assert spy.longest <= 8 * 256 + len(body["prompt"])  # prefix + typed text; the suffix
    assert r.json()["tokens_evaluated"] > 128  # the prefix's end fills its part of the window
    r = client.post("/infill", json=vim_request())
    assert r.status_code == 200 and r.json()["content"]


def test_unknown_paths_and_methods(client):
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert client.get("/infill").status_code == 405
    assert client.post("/health").status_code == 405


def test_api_key_guards_every_path_but_health(service):
    """`complete --serve --api-key KEY`: the plugins send it as ``Authorization: Bearer``."""
    from localspec.server.http import AppThread, create_app
    from localspec.server.openai import APIKeyMiddleware

    with AppThread(APIKeyMiddleware(create_app(service), "sekrit")) as srv, httpx.Client(base_url=srv.url, timeout=300) as c:
        assert c.get("/health").status_code == 200
        body = {"prompt": "One, two,", "n_predict": 2, **GREEDY}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = c.post("/completion", json=body, headers=headers)
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        r = c.post("/completion", json=body, headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 2


def test_oversized_bodies_are_refused(service):
    with ServerThread(service, max_body_bytes=1024) as small, httpx.Client(base_url=small.url, timeout=60) as c:
        big = json.dumps({"input_prefix": "x" * 4096, "input_suffix": ""}).encode()
        r = c.post("/infill", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

        def chunks():  # no content-length: the limit applies while reading
            for i in range(0, len(big), 256):
                yield big[i : i + 256]

        r = c.post("/infill", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert c.post("/completion", json={"prompt": "a", "n_predict": 1}).status_code == 200


def test_an_error_after_streaming_started_is_an_event(client):
    # the grammar allows "a" and then only the end, which ignore_eos bans: an error mid-stream
    body = {"prompt": "Say a:", "n_predict": 5, "stream": True, "grammar": 'root ::= "a"', "ignore_eos": True, **GREEDY}
    with client.stream("POST", "/completion", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[0]["content"] == "a" and events[-1]["error"]["code"] == 400
    assert "grammar" in events[-1]["error"]["message"]
    assert client.get("/health").status_code == 200
