"""Self-generated chat- and code-like prompts (``train-eagle3 --self-prompts``): the target
writes them by continuing numbered lists; they are new text, deduplicated, reproducible for a
seed, and end up answered by the target in recorded shards."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from conftest import frozen_cost_model  # noqa: E402
from localspec import Engine  # noqa: E402
from localspec.models.training.eagle3_data import load_shard, prepare_data  # noqa: E402
from localspec.models.training.self_prompts import (  # noqa: E402
    SEEDS,
    harvest_prompts,
    item_key,
    near_duplicate,
    split_items,
    word_set,
)
from localspec.tui.chat_format import chat_prompt_tokens  # noqa: E402

LAYERS = (2, 9, 15)


def test_split_items_and_keys():
    text = "1. What is a list?\n2. How do I\n   sort it?\n3) Why?\nthen prose"
    assert split_items(text) == ["What is a list?", "How do I sort it?", "Why? then prose"]
    assert split_items("no numbers here") == []
    assert item_key("  What IS a   list? ") == item_key("what is a list")
    assert item_key("what is a list") != item_key("what is a set")
    runs = [word_set("How to run a shell script?")]
    assert near_duplicate(word_set("How do I run a shell script?"), runs)
    assert not near_duplicate(word_set("How do I undo a git commit?"), runs)
    assert not near_duplicate(word_set("How do I run a shell script?"), [])


@pytest.fixture(scope="module")
def engine(model_path):
    e = Engine(model_path, drafter=None, cost_model=frozen_cost_model(), n_ctx=1024)
    yield e
    e.close()


def _harvest(engine, seed, temperature=0.9):
    return harvest_prompts(engine, 6, seed=seed, max_tokens=48, temperature=temperature, seeds=SEEDS[:2], max_rounds=2)


def test_harvest_is_new_deduplicated_and_seeded(engine):
    a = _harvest(engine, seed=3)
    assert 1 <= len(a.prompts) <= 6 and len(a.kinds) == len(a.prompts)
    assert set(a.kinds) <= {"question", "code"}
    keys = [item_key(p) for p in a.prompts]
    assert len(set(keys)) == len(keys)
    for i, (p, kind) in enumerate(zip(a.prompts, a.kinds)):  # no near repeat of an earlier prompt of its kind
        assert not near_duplicate(word_set(p), [word_set(q) for q, k in zip(a.prompts[:i], a.kinds) if k == kind])
    seed_text = " ".join(item_key(s.header) for s in SEEDS)
    assert all(k not in seed_text for k in keys)  # written by the model, not copied from the headers
    assert _harvest(engine, seed=3).prompts == a.prompts  # the same seed: the same prompts
    assert _harvest(engine, seed=4).prompts != a.prompts


def test_greedy_rounds_repeat_items_and_dedup_drops_them(engine):
    # at temperature 0 a round that shows harvested items as the list's first entries tends to
    # write some of them again; none of them may come back twice
    h = harvest_prompts(engine, 40, seed=0, max_tokens=64, temperature=0.0, seeds=SEEDS[:1], max_rounds=3)
    keys = [item_key(p) for p in h.prompts]
    assert len(set(keys)) == len(keys) and len(keys) >= 2


def test_prepare_data_records_the_targets_answers_to_its_own_prompts(model_path, tmp_path):
    shards = prepare_data(model_path, tmp_path, [], LAYERS, max_tokens=0, self_distill=0, self_prompts=2,
                          self_prompt_tokens=48, gen_tokens=8, seed=5, topk=4, n_seq=2, progress=False)  # fmt: skip
    saved = json.loads((tmp_path / "self_prompts.json").read_text())
    assert len(saved["prompts"]) == 2
    from localspec.backend import Model

    m = Model(model_path, vocab_only=True)
    try:
        want = sorted(chat_prompt_tokens(m, p) for p in saved["prompts"])
        got = []
        for s in (load_shard(p) for p in shards):
            for i in range(s.starts.size - 1):
                seq = s.tokens[s.starts[i] : s.starts[i + 1]].tolist()
                pre = next(w for w in want if seq[: len(w)] == w)  # the chat prompt, then the answer
                assert len(seq) > len(pre)
                got.append(pre)
                assert np.isfinite(s.features(int(s.starts[i]), int(s.starts[i + 1]))).all()
        assert sorted(got) == want
        texts = [m.detokenize(w) for w in want]
        assert all(any(f"User: {p}" in t for t in texts) for p in saved["prompts"])
    finally:
        m.close()


def test_a_deadline_leaves_the_harvest_a_share_and_the_answers_the_rest(model_path, tmp_path, monkeypatch):
    import time

    from localspec.models.training import eagle3_data, self_prompts

    seen = []
    real = self_prompts.harvest_prompts

    def spy(engine, n, **kw):
        seen.append((time.time(), kw["deadline"]))
        return real(engine, n, **kw)

    monkeypatch.setattr(self_prompts, "harvest_prompts", spy)
    t0 = time.time()
    deadline = t0 + 600.0
    shards = prepare_data(model_path, tmp_path, [], LAYERS, max_tokens=0, self_distill=0, self_prompts=2,
                          self_prompt_tokens=48, gen_tokens=8, seed=5, topk=4, n_seq=2, progress=False,
                          deadline=deadline)  # fmt: skip
    (t_call, harvest_deadline), = seen
    share = eagle3_data.HARVEST_SHARE
    assert 0.0 < share < 1.0
    cut = lambda now: now + share * (deadline - now)  # noqa: E731  (the rule, at the moment prepare_data read the clock)
    assert cut(t0) <= harvest_deadline <= cut(t_call)
    assert harvest_deadline < deadline - 300.0  # the answers keep the rest of the time
    assert shards and sum(load_shard(p).starts.size - 1 for p in shards) == 2


def test_bare_framing_answers_the_saved_prompts_as_plain_text(model_path, tmp_path):
    """A harvest already in the folder is reused (no new harvest), and ``bare`` gives each
    prompt as its text alone, as ``generate`` and ``bench`` without ``--chat-format`` do."""
    prompts = ["How do I list the files in a folder with Python?", "Write a haiku about the sea."]
    (tmp_path / "self_prompts.json").write_text(json.dumps(dict(prompts=prompts, kinds=["code", "writing"])))
    shards = prepare_data(model_path, tmp_path, [], LAYERS, max_tokens=0, self_distill=0, self_prompts=2,
                          self_prompt_framing="bare", gen_tokens=4, seed=5, topk=4, n_seq=2,
                          progress=False)  # fmt: skip
    from localspec.backend import Model

    m = Model(model_path, vocab_only=True)
    try:
        want = sorted(m.tokenize(p, add_special=True) for p in prompts)
        got = []
        for s in (load_shard(p) for p in shards):
            for i in range(s.starts.size - 1):
                seq = s.tokens[s.starts[i] : s.starts[i + 1]].tolist()
                pre = next(w for w in want if seq[: len(w)] == w)
                assert len(seq) > len(pre)
                got.append(pre)
        assert sorted(got) == want
        assert not any("User:" in m.detokenize(w) for w in want)
    finally:
        m.close()
    with pytest.raises(ValueError, match="framing"):
        prepare_data(model_path, tmp_path / "x", [], LAYERS, max_tokens=0, self_distill=0, self_prompts=2,
                     self_prompt_framing="markdown", gen_tokens=4, seed=5)  # fmt: skip
