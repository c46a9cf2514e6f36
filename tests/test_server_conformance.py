"""Server conformance (issue 31): a streamed response carries exactly the text, tokens,
logprobs and offsets of the non-streamed one, on the OpenAI endpoints (official `openai`
client) and on llama.cpp's ``/completion``; per-request speculation fields; ``/health``; the
per-request log line. Real default model, real servers on 127.0.0.1."""

import json
import threading
import time

import pytest

openai = pytest.importorskip("openai")

import httpx  # noqa: E402

from conftest import frozen_cost_model  # noqa: E402
from helpers import serve_app_thread  # noqa: E402
from localspec import SamplingParams  # noqa: E402
from localspec.scheduler import BatchScheduler  # noqa: E402
from localspec.server import CompletionService, ServiceConfig  # noqa: E402
from localspec.server.http import AppThread, create_app  # noqa: E402
from localspec.server.openai import OpenAIService, create_serve_app  # noqa: E402

# Gemma 3 has no tokens for these mathematical letters: each is four byte tokens, and the
# model continues them the same way (greedy)
FRAKTUR = "Rare: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝔣𝔬𝔫𝔱𝔰 𝔞𝔯𝔢"
CASES = [  # prompt, stop
    ("1, 2, 3, 4,", [" 7"]),  # " " is held back as the start of " 7", then " 7" cuts two tokens
    (FRAKTUR, None),  # tokens that end inside a character
    (FRAKTUR, ["𝔡"]),  # a stop string completed by the last byte token of a character
]


@pytest.fixture(scope="module")
def server(model, engine):
    with serve_app_thread(model, engine, max_body_bytes=1 << 20) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def prefix_chars(model, tokens) -> list[int]:
    """The oracle for ``text_offset``: characters completed by the tokens before each one."""
    return [len(b"".join(model.token_bytes(t) for t in tokens[:i]).decode("utf-8", "ignore"))
            for i in range(len(tokens))]  # fmt: skip


def streamed_completion(client, **kw) -> dict:
    out = {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": [], "finish": None}
    with client.completions.create(stream=True, **kw) as stream:
        for ch in stream:
            c = ch.choices[0]
            out["text"] += c.text
            if c.logprobs is not None:
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    out[k] += getattr(c.logprobs, k)
            out["finish"] = c.finish_reason or out["finish"]
    return out


@pytest.mark.parametrize("prompt,stop", CASES)
@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "plain"])
def test_streamed_completion_equals_non_streamed(client, model, engine, prompt, stop, speculative):
    kw = dict(model="x", prompt=prompt, max_tokens=24, temperature=0, stop=stop, logprobs=2,
              extra_body={"speculative": speculative})  # fmt: skip
    r = client.completions.create(**kw)
    c = r.choices[0]
    engine.reset()
    ref = engine.generate(prompt, max_tokens=24, sampling=SamplingParams.greedy(), stop=stop or ())
    assert c.text == ref.text and r.usage.completion_tokens == len(ref.token_ids)
    assert len(c.logprobs.tokens) == len(ref.token_ids)
    assert c.logprobs.text_offset == prefix_chars(model, ref.token_ids)
    assert all(o <= len(c.text) for o in c.logprobs.text_offset)
    once = {"text": c.text, "finish": c.finish_reason,
            **{k: getattr(c.logprobs, k) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}}  # fmt: skip
    assert streamed_completion(client, **kw) == once


def test_streamed_chat_logprobs_equal_non_streamed(client):
    # the plain transcript's stop strings ("\nUser:") cut this reply
    kw = dict(model="x", messages=[{"role": "user", "content": "Say hello, then ask me a question."}],
              max_tokens=60, temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "stop" and r.usage.completion_tokens < 60  # the transcript's stop string
    assert len(c.logprobs.content) == r.usage.completion_tokens
    text, entries, finish = "", [], None
    with client.chat.completions.create(stream=True, **kw) as stream:
        for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                if ch.choices[0].logprobs is not None:
                    entries += ch.choices[0].logprobs.content or []
                finish = ch.choices[0].finish_reason or finish
    assert (text, finish) == (c.message.content, c.finish_reason)
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in c.logprobs.content]


def sse_events(resp) -> list[dict]:
    import json

    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("prompt,stop", CASES)
def test_streamed_llama_completion_equals_non_streamed(server, engine, prompt, stop):
    body = {"prompt": prompt, "n_predict": 24, "stop": stop or [], "return_tokens": True}
    with httpx.Client(base_url=server.url, timeout=600) as h:
        once = h.post("/completion", json=body).json()
        with h.stream("POST", "/completion", json={**body, "stream": True}) as resp:
            events = sse_events(resp)
    engine.reset()
    ref = engine.generate(prompt, max_tokens=24, sampling=SamplingParams.greedy(), stop=stop or ())
    assert (once["content"], once["tokens"], once["tokens_predicted"]) == (ref.text, ref.token_ids, len(ref.token_ids))
    partials, final = events[:-1], events[-1]
    assert final["stop"] and not any(e["stop"] for e in partials)
    assert "".join(e["content"] for e in partials) == once["content"]
    assert [t for e in partials for t in e["tokens"]] == once["tokens"]
    assert [e["tokens_predicted"] for e in partials] == sorted(e["tokens_predicted"] for e in partials)


REPEATS = "alpha beta gamma delta epsilon zeta eta theta, " * 6 + "alpha beta"  # the n-gram drafter's ground


def test_speculation_fields_on_the_openai_endpoints(client):
    kw = dict(model="x", prompt=REPEATS, max_tokens=32, temperature=0)
    free = client.completions.create(**kw)
    assert free.model_extra["timings"]["draft_n"] > 0
    for extra in ({"speculative": False}, {"speculative.n_max": 0}, {"speculative": {"p_min": 1.0}}):
        r = client.completions.create(**kw, extra_body=extra)
        assert r.choices[0].text == free.choices[0].text
        assert r.model_extra["timings"]["draft_n"] == 0, extra
        assert "localspec" not in r.model_extra  # nothing ignored: no notes
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": REPEATS}], max_tokens=8,
                                       temperature=0, extra_body={"speculative.n_min": 2, "speculative.n_max": 0})
    assert r.model_extra["timings"]["draft_n"] == 0
    assert any("speculative.n_min" in n for n in r.model_extra["localspec"]["notes"])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, extra_body={"speculative.p_min": 2})
    assert e.value.body["param"] == "speculative" and "speculative.p_min" in e.value.body["message"]


def test_speculation_fields_on_completion(server):
    body = {"prompt": REPEATS, "n_predict": 32}
    with httpx.Client(base_url=server.url, timeout=600) as h:
        free = h.post("/completion", json=body).json()
        assert free["localspec"]["num_draft_tokens"] > 0
        for extra in ({"speculative.n_max": 0}, {"speculative": {"p_min": 1.0}}, {"speculative.p_min": 1}):
            r = h.post("/completion", json={**body, **extra}).json()
            assert r["content"] == free["content"] and r["localspec"]["num_draft_tokens"] == 0, extra
            assert "draft_n" not in r["timings"] and r["localspec"]["notes"] == []
        r = h.post("/completion", json={**body, "speculative.n_min": 4}).json()
        assert any("speculative.n_min" in n for n in r["localspec"]["notes"])
        r = h.post("/completion", json={**body, "speculative.n_max": -1})
        assert r.status_code == 400 and "speculative.n_max" in r.json()["error"]["message"]


def test_one_log_line_per_request(client, server, caplog):
    caplog.set_level("INFO", logger="localspec.server")
    client.completions.create(model="x", prompt="One, two,", max_tokens=3, temperature=0)
    list(client.completions.create(model="x", prompt="One, two,", max_tokens=3, temperature=0, stream=True))
    with httpx.Client(base_url=server.url, timeout=600) as h:
        h.post("/completion", json={"prompt": "One, two,", "n_predict": 3})
    lines = [r.getMessage() for r in caplog.records if r.name == "localspec.server"]
    assert len(lines) == 3, lines
    assert [ln.split(": ")[0].split()[-1] for ln in lines] == ["/v1/completions", "/v1/completions", "/completion"]
    for ln in lines:
        assert ln.startswith("request ") and "completion 3 tokens" in ln and "drafted " in ln and "accepted " in ln
        assert " ms, length" in ln


def test_health_shows_a_stuck_scheduler(model, monkeypatch):
    sched = BatchScheduler(model, parallel=1, n_ctx=256, cost_model=frozen_cost_model())
    release = threading.Event()
    entered = threading.Event()
    real_step = sched._decode_step

    def hanging_step(active):  # the second step hangs until the test releases it
        if sched.n_steps >= 1:
            entered.set()
            release.wait()
        return real_step(active)

    monkeypatch.setattr(sched, "_decode_step", hanging_step)
    oai = OpenAIService(sched.start(), model_name="m", sampling=SamplingParams.greedy(), stall_s=0.05)
    with AppThread(create_serve_app(oai, max_body_bytes=1 << 20)) as srv, httpx.Client(base_url=srv.url, timeout=600) as h:
        r = h.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok", "slots_idle": 1, "slots_processing": 0,
                                                     "requests_waiting": 0, "last_step_age_s": None}  # fmt: skip
        done = {}
        t = threading.Thread(target=lambda: done.update(r=h.post("/v1/completions", json={"prompt": "One, two,",
                                                                                        "max_tokens": 4})))  # fmt: skip
        t.start()
        assert entered.wait(600)
        deadline = time.monotonic() + 600
        while (r := h.get("/health")).status_code != 503:  # until the hang outlasts stall_s
            assert time.monotonic() < deadline
        body = r.json()
        assert body["status"] == "error" and body["slots_processing"] == 1 and body["last_step_age_s"] >= 0.05  # rounded to ms
        assert "no scheduler step" in body["error"]
        release.set()
        t.join(600)
        assert done["r"].status_code == 200
        r = h.get("/health")
        assert r.status_code == 200 and r.json()["slots_processing"] == 0 and r.json()["last_step_age_s"] >= 0
    sched.close()


def test_editor_health_shows_the_running_request(service):
    with AppThread(create_app(service)) as srv, httpx.Client(base_url=srv.url, timeout=600) as h:
        # sampled at a high temperature without drafts: the request runs for seconds, not a
        # fraction of one (greedy text that loops is drafted and over before /health answers)
        body = {"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True, "stream": True,
                "temperature": 1.5, "samplers": ["temperature"], "seed": 1, "speculative.n_max": 0}  # fmt: skip
        seen = None
        with h.stream("POST", "/completion", json=body) as resp:
            for _line in resp.iter_lines():  # pieces while the request runs: /health shows it
                st = h.get("/health").json()
                if st["slots_processing"] == 1:
                    seen = st
                    break
        assert seen is not None, "no /health answer showed the running request"
        assert seen["requests_waiting"] == 0 and seen["last_step_age_s"] >= 0
        deadline = time.monotonic() + 600
        while h.get("/health").json()["slots_processing"]:  # the disconnect cancels it
            assert time.monotonic() < deadline
        assert h.get("/health").json()["last_step_age_s"] is None


def test_editor_health_shows_a_stuck_worker(engine, monkeypatch):
    """`complete --serve`'s ``/health``: 503 with the waiting requests once the worker has
    made no step for ``stall_s`` (here its prefill hangs until the test releases it); 200 again
    when it goes on."""
    release, entered = threading.Event(), threading.Event()
    real_prefill = engine._prefill

    def hanging_prefill(gen, draft_context):
        entered.set()
        release.wait()
        return real_prefill(gen, draft_context)

    monkeypatch.setattr(engine, "_prefill", hanging_prefill)
    svc = CompletionService(engine, ServiceConfig(sampling=SamplingParams.greedy(), stall_s=0.05))
    try:
        with AppThread(create_app(svc)) as srv, httpx.Client(base_url=srv.url, timeout=600) as h:
            r = h.get("/health")
            assert (r.status_code, r.json()) == (200, {"status": "ok", "slots_idle": 1, "slots_processing": 0,
                                                       "requests_waiting": 0, "last_step_age_s": None})  # fmt: skip
            done: dict = {}

            def post(key, prompt):
                done[key] = h.post("/completion", json={"prompt": prompt, "n_predict": 3, "cache_prompt": False})

            threads = [threading.Thread(target=post, args=("a", "One, two,"))]
            threads[0].start()
            assert entered.wait(600)
            threads.append(threading.Thread(target=post, args=("b", "Three, four,")))
            threads[1].start()
            deadline = time.monotonic() + 120  # the prefill hangs for good: 503 comes 0.05 s after b arrives
            while (r := h.get("/health")).status_code != 503 or r.json()["requests_waiting"] != 1:
                assert time.monotonic() < deadline
            body = r.json()
            assert body["status"] == "error" and body["slots_processing"] == 1 and body["last_step_age_s"] >= 0.05  # rounded to ms
            assert body["error"].startswith("no engine step has ended for ") and "while 2 requests" in body["error"]
            release.set()
            for t in threads:
                t.join(600)
            assert done["a"].status_code == 200 and done["b"].status_code == 200
            r = h.get("/health")  # nothing waits: ok, whether or not the worker has cleared its slot yet
            assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["requests_waiting"] == 0
    finally:
        release.set()
        svc.close()
        engine.reset()


def test_health_says_loading_model_until_the_model_is_loaded(server):
    """``serve_while_loading`` (what `serve` and `complete --serve` run): the socket answers
    while ``load()`` runs, held here on an Event."""
    from localspec.errors import ModelLoadError
    from localspec.server.http import address_of, bind_socket, serve_while_loading

    go, stop, ready = threading.Event(), threading.Event(), []
    oai = OpenAIService(server.sched, model_name="m", sampling=SamplingParams.greedy())

    def load():
        go.wait()
        return create_serve_app(oai, max_body_bytes=1 << 20), None

    sock = bind_socket("127.0.0.1", 0)
    url = address_of(sock)
    t = threading.Thread(target=serve_while_loading, args=(sock, load), kwargs={"on_ready": ready.append, "stop": stop})
    t.start()
    try:
        with httpx.Client(base_url=url, timeout=600) as h:
            r = h.get("/health")
            assert (r.status_code, r.json()) == (503, {"status": "loading model"})
            r = h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
            assert ready == []
            go.set()
            deadline = time.monotonic() + 600
            while (r := h.get("/health")).status_code != 200:
                assert r.json() == {"status": "loading model"} and time.monotonic() < deadline
            assert r.json()["status"] == "ok" and ready == [url]
            assert h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200
    finally:
        go.set()
        stop.set()
        t.join(60)
    assert not t.is_alive()

    def broken():
        raise ModelLoadError("model file not found: x.gguf")

    with pytest.raises(ModelLoadError, match="not found"):
        serve_while_loading(bind_socket("127.0.0.1", 0), broken)


def test_stopped_while_loading_it_never_serves_nor_says_it_is_ready():
    """A stop (a signal) while ``load()`` runs: the load is let end, then nothing is served,
    ``on_ready`` (the "listening" line) is not called, and it raises KeyboardInterrupt."""
    from localspec.server.http import address_of, bind_socket, serve_while_loading

    async def app(scope, receive, send):  # never reached
        raise AssertionError("served after the stop")

    go, stop, ready, outcome = threading.Event(), threading.Event(), [], []

    def load():
        go.wait()
        return app, None

    def run():
        try:
            serve_while_loading(sock, load, on_ready=ready.append, stop=stop)
        except KeyboardInterrupt:
            outcome.append("interrupted")

    sock = bind_socket("127.0.0.1", 0)
    url = address_of(sock)
    t = threading.Thread(target=run)
    t.start()
    try:
        with httpx.Client(base_url=url, timeout=60) as h:
            assert h.get("/health").status_code == 503  # serving the loading gate
        stop.set()
        deadline = time.monotonic() + 60
        while True:  # until the listening socket is closed: the server has stopped
            try:
                httpx.get(url + "/health", timeout=5)
            except httpx.TransportError:
                break
            assert time.monotonic() < deadline, "the server did not stop"
            time.sleep(0.05)
        assert t.is_alive()  # waiting for the load to end
    finally:
        go.set()
        t.join(60)
    assert not t.is_alive() and outcome == ["interrupted"] and ready == []


def test_serve_cli_logs_each_request_and_stops_on_sigterm(model_path):
    import os
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "localspec", "serve", "--port", "0", "--drafter", "none", "--parallel", "1",
           "--ctx-per-request", "256", "-m", str(model_path), "-t", "1", "--no-editor"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert "listening on " in line, line
        url = line.split("listening on ", 1)[1].split()[0]
        with httpx.Client(base_url=url, timeout=600) as h:
            assert h.get("/health").json()["status"] == "ok"
            r = h.post("/v1/completions", json={"prompt": "One, two,", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    logged = [ln for ln in err.splitlines() if ln.startswith("localspec.server: request ")]
    assert len(logged) == 1 and "/v1/completions: prompt " in logged[0] and "completion 3 tokens" in logged[0], err
    assert "localspec serve: stopped" in err and "Traceback" not in err


@pytest.mark.parametrize("sig_name", ["SIGINT", "SIGTERM"])
def test_serve_cli_stopped_while_requests_run_cuts_them_off_with_an_error_and_exits_cleanly(model, model_path, sig_name):
    # Ctrl-C (or SIGTERM) with two OpenAI requests in flight, one streamed: neither passes for a
    # finished answer (they were 200 / a last chunk with finish_reason "stop"): the plain one is
    # a 503, the stream ends on an error event and [DONE]; the server exits 0 without uvicorn's
    # 'timeout graceful shutdown exceeded' traceback
    import os
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "localspec", "serve", "--port", "0", "--drafter", "none", "--parallel", "2",
           "--ctx-per-request", "4096", "-m", str(model_path), "-t", "1", "--no-editor"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    watchdog = threading.Timer(900, proc.kill)  # a hung process fails the test instead of the run
    watchdog.start()
    once: dict = {}
    try:
        line = proc.stdout.readline()
        assert "listening on " in line, line
        url = line.split("listening on ", 1)[1].split()[0]
        body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0,
                "logit_bias": {str(t): False for t in model.eog_ids}}  # fmt: skip  (no end of text: runs on)

        def not_streamed() -> None:
            with httpx.Client(base_url=url, timeout=600) as h:
                once["response"] = h.post("/v1/completions", json=body)

        t = threading.Thread(target=not_streamed)
        t.start()
        frames = []
        with httpx.Client(base_url=url, timeout=600) as h, h.stream("POST", "/v1/completions",
                                                                    json={**body, "stream": True}) as r:  # fmt: skip
            assert r.status_code == 200
            for ln in r.iter_lines():
                if not ln:
                    continue
                if not frames:  # the first token is out; once the other request runs too, stop the server
                    with httpx.Client(base_url=url, timeout=600) as c:
                        deadline = time.monotonic() + 600
                        while c.get("/health").json()["slots_processing"] < 2:
                            assert time.monotonic() < deadline, "the second request never started"
                            time.sleep(0.05)
                    proc.send_signal(getattr(signal, sig_name))
                frames.append(ln)
        t.join(600)
        _out, err = proc.communicate(timeout=120)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert frames[-1] == "data: [DONE]", frames[-3:]
    events = [json.loads(f[len("data: "):]) for f in frames[:-1]]
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1]), events[-2:]
    error = events[-1].get("error")
    assert error is not None and error["code"] == "server_shutdown" and "cut off" in error["message"], events[-1]
    r = once["response"]
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "server_shutdown" and "retry" in r.json()["error"]["message"]
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "ASGI" not in err and "localspec serve: stopped" in err, err
