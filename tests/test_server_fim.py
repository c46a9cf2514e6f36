"""Fill-in-the-middle with a model whose vocabulary has FIM tokens (a copy of the default
model with FIM token ids written into its metadata): the prompt layout, the response, and
speculation against plain decoding on the FIM path."""

import httpx
import pytest

from conftest import FIM_IDS, frozen_cost_model
from localspec import Engine
from localspec.sampling import SamplingParams
from localspec.server import CompletionService, ServiceConfig
from localspec.server.http import ServerThread
from localspec.server.prompt import CURRENT_FILE, REPO_NAME, ExtraChunk, build_infill_prompt, has_fim
from localspec.server.service import NO_FIM_NOTE

PREFIX = "def add_one(x):\n    return x + 1\n\n\ndef add_two(x):\n    return x + 2\n\n\ndef add_three(x):\n"
SUFFIX = "\n\ndef add_five(x):\n    return x + 5\n"


@pytest.fixture(scope="module")
def fim_engine(fim_model_path):
    e = Engine(fim_model_path, drafter="ngram", n_ctx=2048, cost_model=frozen_cost_model())
    yield e
    e.close()


@pytest.fixture(scope="module")
def fim_server(fim_engine):
    svc = CompletionService(fim_engine, ServiceConfig(sampling=SamplingParams.greedy()))
    with ServerThread(svc) as srv:
        yield srv
    svc.close()


def test_the_model_reports_its_fim_tokens(fim_engine):
    assert fim_engine.model.fim_tokens() == FIM_IDS and has_fim(fim_engine.model)


def test_repo_level_fim_prompt_layout(fim_engine):
    m = fim_engine.model
    extra = [ExtraChunk("import os\n", "util.py")]
    b = build_infill_prompt(m, PREFIX, SUFFIX, "    ret", extra, n_ctx=2048, n_predict=16)

    def tok(s):
        return m.tokenize(s, add_special=False)

    f = FIM_IDS
    expected = (
        [m.bos, f["rep"], *tok(REPO_NAME), f["sep"], *tok("util.py\n"), *tok("import os\n"), f["sep"], *tok(CURRENT_FILE)]
        + [f["pre"], *tok(PREFIX), *tok("    ret"), f["suf"], *tok(SUFFIX), f["mid"]]
    )
    assert b.fim and b.tokens == expected and b.draft_context == []


def test_infill_over_http_uses_fim(fim_server):
    body = {
        "input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "    return ",
        "input_extra": [{"text": "import os\n", "filename": "util.py"}], "n_predict": 8,
        "samplers": ["top_k", "top_p", "infill"], "top_k": 40, "top_p": 0.9, "seed": 3,
    }  # fmt: skip
    with httpx.Client(base_url=fim_server.url, timeout=300) as c:
        assert c.get("/props").json()["fim"]["supported"] is True
        d = c.post("/infill", json=body).json()
    assert d["localspec"]["fim"] is True and NO_FIM_NOTE not in d["localspec"]["notes"]
    assert d["prompt"].count("<unused0>") == 1 and d["prompt"].endswith("<unused2>")


def test_fim_speculative_equals_plain(fim_server):
    body = {
        "input_prefix": PREFIX * 3, "input_suffix": SUFFIX, "prompt": "", "n_predict": 32,
        "samplers": ["temperature"], "temperature": 0.0, "ignore_eos": True, "return_tokens": True,
        "cache_prompt": False,
    }  # fmt: skip
    with httpx.Client(base_url=fim_server.url, timeout=300) as c:
        spec = c.post("/infill", json=body).json()
        plain = c.post("/infill", json={**body, "speculative": False}).json()
    assert spec["tokens"] == plain["tokens"] and len(spec["tokens"]) == 32
    assert spec["localspec"]["speculative"] and not plain["localspec"]["speculative"]
