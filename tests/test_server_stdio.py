"""The JSON-lines stdio mode (in process and as ``localspec complete --stdio``), and the
``localspec complete --serve`` command."""

import io
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from localspec.server.stdio import StdioServer

GREEDY = {"samplers": ["temperature"], "temperature": 0.0}


def run_lines(service, *msgs):
    lines = [m if isinstance(m, str) else json.dumps(m) for m in msgs]
    out = io.StringIO()
    assert StdioServer(service, io.StringIO("\n".join(lines) + "\n"), out).run() == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


def by_id(outs, rid, key="result"):
    return [o for o in outs if o.get("id") == rid and key in o]


def test_requests_results_partials_and_errors(service):
    outs = run_lines(
        service,
        {"id": 1, "method": "infill", "params": {"input_prefix": "def f(x):\n", "input_suffix": "", "n_predict": 4, **GREEDY}},
        {"id": 2, "method": "completion", "params": {"prompt": "One, two,", "n_predict": 3, "stream": True, **GREEDY}},
        {"id": 3, "method": "health"},
        "{not json",
        "[1, 2]",
        {"id": 5, "method": "translate"},
        {"id": 6, "method": "infill", "params": {"input_suffix": ""}},
        {"id": 7, "method": "completion", "params": {"prompt": "a", "n_predict": 2}},
        {"id": 7, "method": "completion", "params": {"prompt": "b", "n_predict": 2}},
    )
    assert "ready" in outs[0]
    r1 = by_id(outs, 1)[0]["result"]
    assert r1["tokens_predicted"] <= 4 and r1["localspec"]["fim"] is False
    partials = by_id(outs, 2, "partial")
    final = by_id(outs, 2)[0]["result"]
    assert partials and "".join(p["partial"]["content"] for p in partials) == final["content"]
    h = by_id(outs, 3)[0]["result"]
    assert h["status"] == "ok" and {"slots_processing", "requests_waiting", "last_step_age_s"} <= set(h)
    errors = [o for o in outs if o.get("id") is None and "error" in o]
    assert len(errors) == 2 and "not valid JSON" in errors[0]["error"]["message"]
    assert by_id(outs, 5, "error")[0]["error"]["code"] == 404
    assert '"input_prefix" is required' in by_id(outs, 6, "error")[0]["error"]["message"]
    assert len(by_id(outs, 7)) == 1 and "still in use" in by_id(outs, 7, "error")[0]["error"]["message"]


def test_cancel_and_supersede(service):
    long = {"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True, **GREEDY}
    outs = run_lines(
        service,
        {"id": "a", "method": "completion", "params": long},
        {"id": "c1", "method": "cancel", "params": {"id": "a"}},
        {"id": "c2", "method": "cancel", "params": {"id": "nothing"}},
        {"id": "b", "method": "completion", "params": {**long, "client_id": "ed"}},
        {"id": "d", "method": "completion", "params": {"prompt": "Hi", "n_predict": 2, "client_id": "ed", **GREEDY}},
    )
    a = by_id(outs, "a")[0]["result"]
    assert a["localspec"]["cancelled"] == "cancelled by the client" and a["tokens_predicted"] < 400
    assert by_id(outs, "c1")[0]["result"] == {"cancelled": True}
    assert by_id(outs, "c2")[0]["result"] == {"cancelled": False}
    assert "superseded" in by_id(outs, "b")[0]["result"]["localspec"]["cancelled"]
    assert by_id(outs, "d")[0]["result"]["tokens_predicted"] == 2


def test_bad_ids_and_deep_nesting_are_400_lines_and_the_server_goes_on(service):
    """A ``cancel`` of a list or object id (a TypeError: unhashable) and a line nested 200,000
    deep (a RecursionError) ended the process with a traceback, losing every later line (a new
    user's report). Every id, the request's and a cancel's target, is checked alike."""
    outs = run_lines(
        service,
        {"id": 11, "method": "cancel", "params": {"id": [1]}},
        {"id": 12, "method": "cancel", "params": {"id": {"x": 1}}},
        {"id": [1], "method": "health"},
        {"id": 1.5, "method": "completion", "params": {"prompt": "Hi", "n_predict": 1}},
        "[" * 200_000,
        '{"id": 13, "method": "completion", "params": {"prompt": "Hi", "n_predict": NaN}}',
        {"id": 14, "method": "completion", "params": {"prompt": "Hi", "n_predict": 2, **GREEDY}},
    )
    for rid, name in ((11, '"params.id"'), (12, '"params.id"')):
        err = by_id(outs, rid, "error")[0]["error"]
        assert err == {"code": 400, "message": f"{name} must be a string, an integer or null", "type": "invalid_request_error"}, rid
    bad = [o["error"]["message"] for o in outs if o.get("id") is None and "error" in o]  # a bad id is answered as null
    assert bad == ['"id" must be a string, an integer or null', '"id" must be a string, an integer or null',
                   "the line nests arrays or objects too deeply",
                   "the line is not valid JSON: NaN is not valid JSON"], bad  # fmt: skip
    assert by_id(outs, 14)[0]["result"]["tokens_predicted"] == 2


def test_an_id_that_cannot_be_written_back_is_answered_as_null_and_the_server_goes_on(service):
    """A lone surrogate in an id ended the server at once with status 0 and no word (writing it
    to standard output raised, which looked like a client gone); ``1e400`` was echoed as
    ``Infinity``, which no strict JSON parser reads (a new user's report)."""
    out = io.StringIO()
    lines = ['{"id": "\\ud800", "method": "health"}', '{"id": 1e400, "method": "health"}',
             '{"id": 2, "method": "cancel", "params": {"id": "\\udfff"}}', '{"id": 3, "method": "health"}']  # fmt: skip
    assert StdioServer(service, io.StringIO("\n".join(lines) + "\n"), out).run() == 0
    got = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} written")) for line in out.getvalue().splitlines()]
    out.getvalue().encode("utf-8")  # every line is UTF-8 text
    msgs = [(o["id"], o["error"]["message"]) for o in got if "error" in o]
    assert msgs == [(None, '"id" holds a lone UTF-16 surrogate (not valid Unicode text); send UTF-8 text'),
                    (None, '"id" must be a string, an integer or null'),
                    (2, '"params.id" holds a lone UTF-16 surrogate (not valid Unicode text); send UTF-8 text')], msgs  # fmt: skip
    assert got[-1]["id"] == 3 and got[-1]["result"]["status"] == "ok"


def test_a_request_cancelled_in_the_queue_reports_its_own_settings(service):
    """Its ``generation_settings`` were the server's defaults (temperature 0.8 for a request
    that asked for 0; a new user's report)."""
    long = {"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True, **GREEDY}
    outs = run_lines(
        service,
        {"id": "a", "method": "completion", "params": long},
        {"id": "q", "method": "completion", "params": {"prompt": "Hi", "n_predict": 5, "temperature": 0.0, "top_k": 3}},
        {"id": "c1", "method": "cancel", "params": {"id": "q"}},
        {"id": "c2", "method": "cancel", "params": {"id": "a"}},
    )
    q = by_id(outs, "q")[0]["result"]
    assert q["localspec"]["cancelled"] == "cancelled by the client" and q["tokens_predicted"] == 0
    settings = q["generation_settings"]
    assert (settings["temperature"], settings["top_k"], settings["n_predict"]) == (0.0, 3, 5), settings


def test_a_reply_with_a_lone_surrogate_is_written_with_json_escapes(service):
    """Writing one to a UTF-8 standard output raised UnicodeEncodeError, which the server took
    for a client gone: it stopped answering, without a word."""
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8", errors="strict")
    server = StdioServer(service, io.StringIO(""), out)
    server.write({"id": 1, "result": {"content": "a\ud800b"}})
    server.write({"id": 2, "result": {}})
    assert not server.broken
    assert raw.getvalue().decode("ascii").splitlines() == ['{"id":1,"result":{"content":"a\\ud800b"}}', '{"id":2,"result":{}}']


def test_shutdown_cancels_outstanding_requests(service):
    """The running request and the queued ones are all cancelled before any is waited for
    (waiting on a queued one first let the running one decode to its end)."""
    long = {"prompt": "Once", "n_predict": 4000, "ignore_eos": True}
    outs = run_lines(
        service,
        *[{"id": i, "method": "completion", "params": long} for i in (1, 4, 5, 6)],
        {"id": 2, "method": "shutdown"},
        {"id": 3, "method": "health"},  # never read
    )
    assert by_id(outs, 2)[0]["result"] == {"shutdown": True}
    for i in (1, 4, 5, 6):
        r = by_id(outs, i)[0]["result"]
        assert r["localspec"]["cancelled"] == "the client shut the server down" and r["tokens_predicted"] < 4000, i
    assert by_id(outs, 1)[0]["result"]["stop_type"] == "none" and not by_id(outs, 3)
    service.call(lambda e: e.cache.check())


def cli(*args):
    return [sys.executable, "-m", "localspec", "complete", *args]


def test_cli_stdio_one_shot():
    lines = "\n".join(
        [
            json.dumps({"id": 1, "method": "infill", "params": {"input_prefix": "x = ", "input_suffix": "", "n_predict": 3}}),
            json.dumps({"id": 2, "method": "health"}),
        ]
    )
    r = subprocess.run(cli("--stdio", "--temperature", "0"), input=lines, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    outs = [json.loads(x) for x in r.stdout.splitlines()]
    assert outs[0]["ready"]["fim"] is False and outs[0]["ready"]["drafter"] == "ngram"
    assert by_id(outs, 1)[0]["result"]["tokens_predicted"] <= 3
    assert by_id(outs, 2)[0]["result"]["status"] == "ok"


def test_cli_stdio_ctrl_c_answers_every_outstanding_request():
    """Ctrl-C once serving cancels the running and the queued request, answers both (their
    ``result`` says why), then exits 130. It used to end the process at once, answering none."""
    p = subprocess.Popen(cli("--stdio", "--temperature", "0"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, bufsize=1)  # fmt: skip
    try:
        assert "ready" in json.loads(p.stdout.readline()), p.stderr.read()
        long = {"prompt": "Once upon a time", "n_predict": 3000, "ignore_eos": True, "stream": True}
        for i in (1, 2):
            p.stdin.write(json.dumps({"id": i, "method": "completion", "params": long}) + "\n")
        p.stdin.flush()
        assert json.loads(p.stdout.readline())["id"] == 1  # id 1 is generating, id 2 waits
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 130 and err.endswith("localspec: interrupted\n"), err
    outs = [json.loads(line) for line in out.splitlines()]
    for i in (1, 2):
        r = by_id(outs, i)[0]["result"]
        assert r["localspec"]["cancelled"] == "the server was interrupted (Ctrl-C)" and r["tokens_predicted"] < 3000


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_serve_prints_its_address_and_stops_on_a_signal(sig):
    p = subprocess.Popen(cli("--serve", "--port", "0"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("localspec complete: listening on http://127.0.0.1:"), p.stderr.read()
        url = line.split()[-1]
        assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"
        d = httpx.post(url + "/infill", json={"input_prefix": "a", "input_suffix": "", "n_predict": 2}, timeout=300)
        assert d.status_code == 200
        p.send_signal(sig)
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()


def test_cli_serve_on_a_taken_port_fails_at_once():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        r = subprocess.run(cli("--serve", "--port", str(s.getsockname()[1])), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "cannot listen" in r.stderr and "loading model" not in r.stderr


def test_cli_needs_a_mode():
    r = subprocess.run(cli(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--serve" in r.stderr
