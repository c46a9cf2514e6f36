"""Temperatures whose division overflows float32, ``+inf`` logit biases and ``top_p`` 0, at
every entry point: the sampling pipeline (numpy reference and C kernels), tree verification, the Python
API, ``localspec generate``, ``localspec complete --stdio`` and the HTTP ``/completion`` and
``/infill`` endpoints.

The rule (``LogitsProcessor.greedy_row``, ``ls_rows.c``): at temperature > 0 a row is
decided greedily when ``float32(max finite logit) / float32(T)`` is not finite (T = 1e-38
with logits above ~3.4, 1e-40, 1e-300) or when a logit bias of ``+inf`` forces a token
(the lowest such id; llama.cpp's argmax at temperature 0). Before the rule the C kernel ran
off its array (segfault) and the numpy reference returned the lowest-id overflowed token.

``top_p`` 0 keeps only the most likely token (llama.cpp's top-p keeps at least one), so any
temperature gives the greedy text; the CLI used to refuse it while the servers took it.
"""

import json
import math
import subprocess
import sys

import httpx
import numpy as np
import pytest

from conftest import FakeModel
from localspec import native
from localspec.bench.kernels import gemma_like_rows
from localspec.cli.main import main
from localspec.errors import InvalidRequestError
from localspec.request_state import RequestState
from localspec.sampling import LogitsProcessor, SamplingParams
from localspec.server.http import ServerThread
from localspec.tree import TokenSource, TreeBuilder
from localspec.verify import verify

TINY = [1e-38, 1e-40, 1e-300]
PATHS = [False, True] if native.AVAILABLE else [False]
TRUNCATIONS = [
    dict(top_k=0, top_p=1.0, min_p=0.0),  # no truncation: the whole row (gumbel_row in C)
    dict(top_k=40, top_p=0.95, min_p=0.05),  # llama.cpp's defaults
    dict(top_k=0, top_p=0.95, min_p=0.0),
    dict(top_k=0, top_p=1.0, min_p=0.1),
]


def rows_with_overflow(rng, n_vocab):
    """Rows whose maximum is > 4 (so that max / 1e-38 overflows float32), with suppressed
    (-inf) tokens and a tie at the top in one of them."""
    rows = [(rng.standard_normal(n_vocab) * 3).astype(np.float32) for _ in range(3)]
    for r in rows:
        r[int(rng.integers(n_vocab))] = 12.0
    rows[1][[3, 7]] = -np.inf
    rows[2][[5, 9]] = rows[2].max() + 1.0  # tie: the lower id wins
    return rows


@pytest.mark.parametrize("use_native", PATHS, ids=["numpy", "native"][: len(PATHS)])
@pytest.mark.parametrize("trunc", TRUNCATIONS, ids=lambda t: ",".join(f"{k}={v}" for k, v in t.items()))
@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperatures_are_greedy_in_both_paths(temperature, trunc, use_native, rng):
    for n_vocab in (50, 262144):
        rows = rows_with_overflow(rng, n_vocab) if n_vocab == 50 else list(gemma_like_rows(rng, 2))
        params = SamplingParams(temperature=temperature, **trunc)
        proc = LogitsProcessor(params, n_vocab, use_native=use_native)
        for row in rows:
            want = int(np.argmax(row))
            assert float(row[want]) > 4.0
            for pos in range(3):
                assert proc.choose(row, pos, seed=pos) == want
            c = proc.candidates(row)
            assert c.ids.tolist() == [want] and c.logits.tolist() == [0.0]
            assert np.isfinite(c.probs()).all()


@pytest.mark.parametrize("use_native", PATHS, ids=["numpy", "native"][: len(PATHS)])
def test_small_temperatures_that_do_not_overflow_still_sample(use_native):
    """The rule looks at the division, not at a threshold: a row whose maximum / T is finite
    keeps its distribution even at T = 1e-40 (lower logits that overflow to -inf have
    probability 0 within float precision)."""
    x = np.array([1e-39, 0.7e-39, -1e-39, -1.0], dtype=np.float32)  # / 1e-40: 10, 7, -10, -inf
    params = SamplingParams(temperature=1e-40, top_k=0, top_p=1.0, min_p=0.0)
    proc = LogitsProcessor(params, 4, use_native=use_native)
    c = proc.candidates(x)
    assert c.ids.size == 4 and c.logits[3] == -np.inf
    p = c.dense_probs(4)
    assert p[1] == pytest.approx(math.exp(-3) / (1 + math.exp(-3) + math.exp(-20)), rel=1e-3)
    picks = np.array([proc.choose(x, pos, seed=1) for pos in range(4000)])
    assert set(picks.tolist()) == {0, 1}
    n1 = int((picks == 1).sum())
    assert abs(n1 - 4000 * p[1]) < 5 * math.sqrt(4000 * p[1] * (1 - p[1]))
    assert not proc.greedy_row(proc.adjusted(x, None))


def test_both_paths_agree_on_tiny_temperatures(rng):
    if not native.AVAILABLE:
        pytest.skip("native kernels not built")
    for T in TINY + [1e-30, 1e-37, 3e-38]:
        for trunc in TRUNCATIONS:
            params = SamplingParams(temperature=T, **trunc)
            ref = LogitsProcessor(params, 50, use_native=False)
            nat = LogitsProcessor(params, 50, use_native=True)
            for row in rows_with_overflow(rng, 50) + [np.linspace(-1e-37, 1e-37, 50).astype(np.float32)]:
                a, b = ref.candidates(row), nat.candidates(row)
                assert a.ids.tolist() == b.ids.tolist() and np.array_equal(a.logits, b.logits)
                for pos in range(4):
                    assert ref.choose(row, pos, 7) == nat.choose(row, pos, 7)


@pytest.mark.parametrize("verify_mode", ["gumbel", "rejection"])
@pytest.mark.parametrize("use_native", PATHS, ids=["numpy", "native"][: len(PATHS)])
def test_tree_verification_at_tiny_temperatures_is_greedy_verification(verify_mode, use_native, rng):
    V = 16
    for trial in range(30):
        b = TreeBuilder(0)
        q = np.full(V, 1.0 / V)
        b.set_draft_dist(0, q)
        for _ in range(3):
            b.add(0, int(rng.integers(V)), source=TokenSource.DRAFT_MODEL, draft_prob=1.0 / V)
        b.add(1, int(rng.integers(V)), source=TokenSource.NGRAM)
        tree = b.build()
        logits = (rng.standard_normal((tree.n_nodes, V)) * 4 + 10).astype(np.float32)
        for i in range(1, tree.n_nodes):
            if rng.random() < 0.5:
                logits[int(tree.parents[i]), int(tree.token_ids[i])] = 40.0
        out = []
        for T in [0.0] + TINY:
            params = SamplingParams(temperature=T, verify=verify_mode, seed=trial)
            with native.use(use_native):
                res = verify(tree, logits, RequestState(params, FakeModel(V, eog=()), []).cursor(5))
            out.append((res.path, res.tokens))
        assert out[1:] == [out[0]] * len(TINY)


# -- +inf logit bias --------------------------------------------------------------------------


@pytest.mark.parametrize("use_native", PATHS, ids=["numpy", "native"][: len(PATHS)])
@pytest.mark.parametrize("trunc", TRUNCATIONS, ids=lambda t: ",".join(f"{k}={v}" for k, v in t.items()))
@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.5, 1e-40])
def test_plus_inf_bias_forces_the_token(temperature, trunc, use_native, rng):
    """``+inf`` forces the token at every temperature and truncation (as ``+1e30`` does);
    with two forced tokens the lower id; a forced token that is also suppressed stays banned."""
    n = 300
    for trial in range(5):
        row = (rng.standard_normal(n) * 3).astype(np.float32)
        low = int(np.argmin(row))  # the least likely token: truncation would drop it
        for bias, want in [({low: math.inf}, low), ({low: 1e30}, low), ({200: math.inf, low: math.inf}, min(200, low))]:
            params = SamplingParams(temperature=temperature, logit_bias=bias, **trunc)
            proc = LogitsProcessor(params, n, use_native=use_native)
            assert all(proc.choose(row, pos, seed=trial) == want for pos in range(5))
            if math.inf in bias.values():
                assert proc.candidates(row).ids.tolist() == [want]
        params = SamplingParams(temperature=temperature, logit_bias={low: math.inf}, **trunc)
        proc = LogitsProcessor(params, n, suppress_ids=[low], use_native=use_native)
        assert proc.choose(row, 0, seed=trial) != low


def test_plus_inf_bias_with_a_grammar(model):
    """With a grammar the forced token wins where the grammar allows it; where it does not,
    the row is sampled as if the token were banned (numpy path: the C kernels take no
    grammar)."""
    from localspec.grammar import GrammarState

    digits = [model.tokenize(str(d), add_special=False)[0] for d in range(10)]
    letter_a = model.tokenize("a", add_special=False)[0]
    row = np.zeros(model.n_vocab, dtype=np.float32)
    for T in (0.0, 0.8, 1e-40):
        for trunc in TRUNCATIONS[:2]:
            g = GrammarState(model, "root ::= [0-9]+")
            try:
                proc = LogitsProcessor(SamplingParams(temperature=T, logit_bias={digits[7]: math.inf}, **trunc), model.n_vocab)
                assert proc.choose(row, 0, 1, grammar=g) == digits[7]
                assert proc.candidates(row, grammar=g).ids.tolist() == [digits[7]]
                proc = LogitsProcessor(SamplingParams(temperature=T, logit_bias={letter_a: math.inf}, **trunc), model.n_vocab)
                assert proc.choose(row, 0, 1, grammar=g) != letter_a
                assert g.allows(proc.choose(row, 0, 1, grammar=g))
            finally:
                g.close()


def test_nan_bias_is_refused():
    with pytest.raises(InvalidRequestError, match="^logit_bias of token 3 must be a number, got nan$"):
        SamplingParams(logit_bias={3: math.nan})


# -- entry points with the real model -----------------------------------------------------------

PROMPT = "The capital of France is"


def test_python_api_at_tiny_temperatures(engine):
    """Speculative and plain decoding, both kernel paths: the greedy tokens."""
    for use in PATHS:
        with native.use(use):
            want = engine.generate(PROMPT, max_tokens=16, sampling=SamplingParams(temperature=0.0, seed=1)).token_ids
            for T in TINY:
                for speculative in (True, False):
                    got = engine.generate(PROMPT, max_tokens=16, sampling=SamplingParams(temperature=T, seed=1), speculative=speculative)
                    assert got.token_ids == want, (T, use, speculative)


def test_python_api_plus_inf_bias(engine):
    tok = engine.model.tokenize(" banana", add_special=False)[0]
    for T in (0.0, 0.8, 1e-40):
        r = engine.generate(PROMPT, max_tokens=4, sampling=SamplingParams(temperature=T, seed=2, logit_bias={tok: math.inf}))
        assert r.token_ids == [tok] * 4


def test_generate_command_at_tiny_temperatures(capsys):
    outs = []
    for T in ["0"] + [repr(t) for t in TINY]:
        assert main(["generate", PROMPT, "-n", "8", "--temperature", T, "--seed", "3", "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outs[1:] == [outs[0]] * len(TINY)


def test_generate_command_plus_inf_bias(capsys, model):
    tok = model.tokenize(" banana", add_special=False)[0]
    for T in ("0", "0.8"):
        assert main(["generate", PROMPT, "-n", "3", "--temperature", T, "--logit-bias", f"{tok}=inf", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == [tok] * 3


def test_top_p_zero_gives_the_greedy_tokens_in_the_python_api(engine):
    for use in PATHS:
        with native.use(use):
            want = engine.generate(PROMPT, max_tokens=16, sampling=SamplingParams(temperature=0.0)).token_ids
            for speculative in (True, False):
                got = engine.generate(PROMPT, max_tokens=16, sampling=SamplingParams(temperature=1.2, top_p=0.0, seed=9),
                                      speculative=speculative)  # fmt: skip
                assert got.token_ids == want, (use, speculative)


def test_generate_command_top_p_zero(capsys):
    outs = []
    for extra in (["--temperature", "0"], ["--temperature", "1.2", "--top-p", "0", "--seed", "9"]):
        assert main(["generate", PROMPT, "-n", "8", "--json", *extra]) == 0
        outs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outs[1] == outs[0]


def test_complete_stdio_at_tiny_temperatures():
    msgs = []
    for i, T in enumerate([0.0] + TINY):
        msgs.append({"id": i, "method": "completion", "params": {"prompt": PROMPT, "n_predict": 6, "temperature": T, "seed": 1}})
        msgs.append({"id": 10 + i, "method": "infill", "params": {"input_prefix": "def f(x):\n", "input_suffix": "", "n_predict": 6, "temperature": T, "seed": 1}})
    r = subprocess.run(
        [sys.executable, "-m", "localspec", "complete", "--stdio"],
        input="\n".join(json.dumps(m) for m in msgs) + "\n",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    res = {o["id"]: o["result"]["content"] for o in map(json.loads, r.stdout.splitlines()) if "result" in o}
    assert len(res) == 8, r.stdout
    assert [res[i] for i in range(1, 4)] == [res[0]] * 3
    assert [res[10 + i] for i in range(1, 4)] == [res[10]] * 3


@pytest.fixture(scope="module")
def http(service):
    with ServerThread(service) as srv, httpx.Client(base_url=srv.url, timeout=300) as c:
        yield c


@pytest.mark.parametrize("endpoint", ["/completion", "/infill"])
def test_http_at_tiny_temperatures(http, endpoint):
    body = {"prompt": PROMPT} if endpoint == "/completion" else {"input_prefix": "def f(x):\n", "input_suffix": ""}
    outs = []
    for T in [0.0] + TINY:
        for stream in (False, True):
            r = http.post(endpoint, json={**body, "n_predict": 6, "temperature": T, "seed": 1, "stream": stream})
            assert r.status_code == 200, r.text
            if stream:
                text = "".join(json.loads(line[6:])["content"] for line in r.text.split("\n\n") if line.startswith("data: "))
            else:
                text = r.json()["content"]
            outs.append(text)
    assert outs[2:] == outs[:2] * len(TINY)
    assert http.get("/health").json()["status"] == "ok"


def test_http_top_p_zero(http):
    """llama.cpp's fields (``samplers`` with ``top_p``) at top_p 0: the greedy text."""
    body = {"prompt": PROMPT, "n_predict": 6, "seed": 4}
    greedy = http.post("/completion", json={**body, "temperature": 0.0})
    cut = http.post("/completion", json={**body, "temperature": 1.5, "top_p": 0.0, "samplers": ["top_p", "temperature"]})
    assert greedy.status_code == cut.status_code == 200, cut.text
    assert cut.json()["content"] == greedy.json()["content"]


def test_http_plus_inf_bias(http, model):
    """JSON has no infinity; Python's and llama.cpp's parsers accept ``Infinity`` (and
    ``1e999``), which is how a client sends it."""
    tok = model.tokenize(" banana", add_special=False)[0]
    for T in (0.0, 0.8):
        raw = '{"prompt": "%s", "n_predict": 3, "temperature": %s, "logit_bias": [[%d, 1e999]]}' % (PROMPT, T, tok)
        r = http.post("/completion", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert r.json()["content"] == model.detokenize([tok] * 3)
