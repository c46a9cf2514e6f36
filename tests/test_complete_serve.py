"""`localspec complete --serve` as a real process over real HTTP: what /props reports for the
drafter it was started with, and a SIGTERM while a request streams."""

import json
import signal
import time

import httpx
import pytest

from helpers import localspec_process


@pytest.fixture
def serve_process(model_path):
    """A `localspec complete --serve --drafter none` process on a free port; yields
    ``(process, base_url)`` once it listens (its stderr is collected in ``process.err``)."""
    args = ["complete", "--serve", "--port", "0", "--drafter", "none", "-m", str(model_path), "--n-ctx", "1024", "-t", "1"]
    with localspec_process(*args) as (proc, url, err):
        proc.err = err
        yield proc, url


def test_props_says_speculation_is_off_without_a_drafter(serve_process):
    _proc, url = serve_process
    with httpx.Client(base_url=url, timeout=300) as c:
        spec = c.get("/props").json()["speculative"]
        assert spec == {"drafter": "none", "enabled": False}
        for _ in range(3):
            assert c.post("/completion", json={"prompt": "One, two,", "n_predict": 2}).status_code == 200
        assert c.get("/props").json()["localspec"]["requests"] == {"requests": 3, "cancelled": 0, "errors": 0}
    # one log line per request on stderr, printed without --verbose (as llama-server does)
    deadline = time.monotonic() + 60
    while sum("localspec.server: request " in ln for ln in _proc.err) < 3:
        assert time.monotonic() < deadline, "".join(_proc.err)
        time.sleep(0.05)
    line = next(ln for ln in _proc.err if "localspec.server: request " in ln)
    assert "/completion: prompt " in line and "completion 2 tokens, drafted 0, accepted 0" in line


def test_sigterm_with_a_request_in_flight_answers_it_and_exits_cleanly(serve_process):
    proc, url = serve_process
    body = {"prompt": "Once upon a time", "n_predict": 100000, "ignore_eos": True, "stream": True,
            "temperature": 0.0, "samplers": ["temperature"]}  # fmt: skip
    events, raw = [], b""
    with httpx.Client(base_url=url, timeout=300) as c, c.stream("POST", "/completion", json=body) as r:
        assert r.status_code == 200
        for chunk in r.iter_bytes():
            if not events:  # the first event: the request is being generated; stop the server
                proc.send_signal(signal.SIGTERM)
            raw += chunk
            while b"\n\n" in raw:
                frame, raw = raw.split(b"\n\n", 1)
                assert frame.startswith(b"data: "), frame
                events.append(json.loads(frame[6:]))
    assert raw == b""  # the stream ended on a whole event
    final = events[-1]
    assert final["stop"] is True and final["stop_type"] == "none"
    assert final["cancelled"] == "the server is shutting down" and "content" not in final
    assert all(e["stop"] is False and e["content"] for e in events[:-1]) and final["tokens_predicted"] < 100000
    assert proc.wait(120) == 0
    err = "".join(proc.err)
    assert "Traceback" not in err and "ASGI" not in err and "localspec complete: stopped" in err, err
