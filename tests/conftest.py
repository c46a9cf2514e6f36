"""Shared fixtures. Tests that need the real default model (Gemma 3 270M) use ``model`` /
``engine``; they share one loaded model per session."""

from __future__ import annotations

import os

import numpy as np
import pytest


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (``make test`` runs ``-n 2``): give each worker its own share of the
    CPUs this process may use, before llama.cpp starts any thread. llama.cpp sizes its thread
    pool from the affinity mask (``default_threads``), and two workers each spinning threads
    on every core would slow each other 10-100x; one core per worker on 2 CPUs instead runs
    two tests at once. Subprocesses (CLI and server tests) inherit the mask."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or n < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < n:
        return
    os.sched_setaffinity(0, cpus[int(worker[2:]) % n :: n])


_pin_xdist_worker()

from localspec.costmodel import CostModel  # noqa: E402 - after the pinning (it loads llama.cpp)

# A fixed cost table (ms measured on a 2-core CPU, see docs/architecture.md), so tests do not
# spend seconds calibrating and behave the same on every machine.
FIXED_COSTS_US = {
    1: 11900.0, 2: 22900.0, 3: 26000.0, 4: 29300.0, 8: 45900.0, 12: 58000.0, 16: 68700.0,
    24: 94000.0, 32: 120000.0, 48: 170000.0, 64: 238000.0,
}  # fmt: skip


def fixed_cost_model() -> CostModel:
    """``FIXED_COSTS_US`` as a cost table that learns online as an engine's does: for policy
    simulations that feed it their own times (``observe_step``). Engines on the real model use
    ``frozen_cost_model``."""
    return CostModel(dict(FIXED_COSTS_US))


def frozen_cost_model(table_us: dict[int, float] | None = None) -> CostModel:
    """A cost table (default ``FIXED_COSTS_US``) that learns nothing online, for every engine
    on the real model in the tests: an engine feeds its measured decodes to
    ``CostModel.observe``, which moves a fixed table to this machine's batch costs (on a 2-core
    AMD EPYC t(2) = 2.3 t(1), where no draft pays; under a load, steeper still), and a test
    that asserts drafting would then test the machine rather than the code."""
    cm = CostModel(dict(FIXED_COSTS_US if table_us is None else table_us))
    cm.observe = lambda b, t_us: None
    return cm


@pytest.fixture(scope="session")
def model_path():
    from localspec.models import default_model_path

    return default_model_path()


# Layers of the shared models offloaded to a GPU (CUDA / Metal builds of llama.cpp only;
# docs/gpu.md): LOCALSPEC_TEST_N_GPU_LAYERS=-1 runs the model tests offloaded. Default 0: CPU.
TEST_N_GPU_LAYERS = int(os.environ.get("LOCALSPEC_TEST_N_GPU_LAYERS", "0") or 0)


@pytest.fixture(scope="session")
def model(model_path):
    from localspec.backend import Model

    m = Model(model_path, n_gpu_layers=TEST_N_GPU_LAYERS)
    yield m
    m.close()


# FIM token ids written into the FIM test model: <unused0> ... <unused4> of Gemma 3's vocabulary
FIM_IDS = {"pre": 6, "suf": 7, "mid": 8, "rep": 9, "sep": 10}


@pytest.fixture(scope="session")
def fim_model_path(model_path, tmp_path_factory):
    """The default model with fill-in-the-middle tokens in its metadata (written once per session)."""
    from localspec.models.gguf_edit import copy_gguf

    dst = tmp_path_factory.mktemp("fim") / "gemma-3-270m-fim.gguf"
    return copy_gguf(model_path, dst, set_kv={f"tokenizer.ggml.fim_{k}_token_id": v for k, v in FIM_IDS.items()})


@pytest.fixture(scope="session")
def derived_draft_path(model_path, tmp_path_factory):
    """A real, different draft model: the default model's first 12 of 18 layers (written once
    per session; its greedy acceptance is low, so drafts are often rejected)."""
    from localspec.models.derive import derive_draft

    return derive_draft(model_path, tmp_path_factory.mktemp("drafts") / "draft-12.gguf", 12)


@pytest.fixture(scope="session")
def derived_draft(derived_draft_path):
    from localspec.backend import Model

    m = Model(derived_draft_path, n_gpu_layers=TEST_N_GPU_LAYERS)
    yield m
    m.close()


@pytest.fixture(scope="session")
def random_head_path(model_path, tmp_path_factory):
    """An untrained EAGLE-3 head for the default model (written once per session)."""
    from localspec.models.eagle3_gguf import random_eagle3

    return random_eagle3(model_path, tmp_path_factory.mktemp("heads") / "eagle3-random.gguf", draft_vocab=4096)


@pytest.fixture(scope="session")
def engine(model):
    """A shared engine (n-gram drafter) on conftest's table held fixed (``frozen_cost_model``):
    many modules assert that its requests draft, and a table that learned this machine's batch
    costs online (under a load, or on a CPU where t(2) = 2.3 t(1)) would rightly draft nothing.
    Tests must leave its drafter as they found it."""
    from localspec import Engine

    e = Engine(model, drafter="ngram", n_ctx=4096, cost_model=frozen_cost_model())
    yield e
    e.close()


@pytest.fixture(scope="module")
def service(engine):
    """A completion service on the shared engine (greedy by default), for one test module."""
    from localspec.sampling import SamplingParams
    from localspec.server import CompletionService, ServiceConfig

    svc = CompletionService(engine, ServiceConfig(sampling=SamplingParams.greedy()))
    yield svc
    svc.close()
    engine.reset()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


class FakeModel:
    """Just enough of ``backend.Model`` for sampling/verification unit tests."""

    def __init__(self, n_vocab: int, eog=(0,)) -> None:
        self.n_vocab = n_vocab
        self.suppress_tokens = np.zeros(0, dtype=np.int32)
        self._eog = set(eog)

    def is_eog(self, t: int) -> bool:
        return t in self._eog

    def token_bytes(self, t: int) -> bytes:
        return f"<{t}>".encode()


@pytest.fixture
def fake_model():
    return FakeModel


def chisquare_pvalue(observed, probs, min_expected: float = 5.0) -> float:
    """Chi-square goodness-of-fit p-value of counts ``observed`` against ``probs``.

    Bins with an expected count below ``min_expected`` are pooled into one bin, so the test
    stays valid for long-tailed distributions.
    """
    from scipy import stats

    obs = np.asarray(observed, dtype=np.float64)
    p = np.asarray(probs, dtype=np.float64)
    p = p / p.sum()
    exp = p * obs.sum()
    big = exp >= min_expected
    o = list(obs[big])
    e = list(exp[big])
    if (~big).any():
        o.append(obs[~big].sum())
        e.append(exp[~big].sum())
    o, e = np.array(o), np.array(e)
    e = e * (o.sum() / e.sum())
    if len(o) < 2:
        return 1.0
    return float(stats.chisquare(o, e).pvalue)


# The chat template of Gemma 3 instruction-tuned models (as published with them), written
# into a copy of the default (base) model by ``chat_template_model_path``.
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


@pytest.fixture(scope="session")
def chat_template_model_path(model_path, tmp_path_factory):
    """A copy of the default model whose GGUF carries Gemma's chat template (written once per session)."""
    from localspec.models.gguf_edit import copy_gguf

    dst = tmp_path_factory.mktemp("gguf") / "gemma3-270m-chat-template.gguf"
    return copy_gguf(model_path, dst, set_kv={"tokenizer.chat_template": GEMMA_CHAT_TEMPLATE})


@pytest.fixture(scope="session")
def chat_template_engine(chat_template_model_path):
    """An engine (n-gram drafter) on the default model with Gemma's chat template."""
    from localspec import Engine

    e = Engine(chat_template_model_path, drafter="ngram", n_ctx=2048, cost_model=frozen_cost_model())
    yield e
    e.close()
