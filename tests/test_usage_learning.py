"""Learning from use: ``--record-usage DIR`` keeps finished requests' tokens in a bounded
folder (engine and batch scheduler), requests that opt out of the drafting memory stay out,
and ``train-eagle3 --from-usage DIR`` continues the shipped head on them and writes a GGUF
that drafts losslessly."""

import json
import logging

import numpy as np
import pytest

pytest.importorskip("torch")

from conftest import frozen_cost_model  # noqa: E402
from helpers import localspec_process  # noqa: E402
from localspec import Engine, SamplingParams  # noqa: E402
from localspec.scheduler import BatchScheduler  # noqa: E402
from localspec.usage import UsageLog, usage_shards  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "A list of fruits: apple, banana,", "User: Hi!\nAssistant:"]


def _record(engine, folder, prompts) -> None:
    """Greedy generations of ``prompts`` (24 tokens each) recorded by ``engine`` into ``folder``."""
    log = UsageLog(folder, max_mib=4, flush_tokens=1)
    engine.usage_log = log
    try:
        for p in prompts:
            engine.generate(p, max_tokens=24, sampling=SamplingParams.greedy())
    finally:
        engine.usage_log = None
        log.close()


def _sequences(folder):
    out = []
    for p in usage_shards(folder):
        with np.load(p) as z:
            starts = np.concatenate([[0], np.cumsum(z["lengths"])])
            out += [(z["tokens"][starts[i] : starts[i + 1]].tolist(), int(z["n_prompt"][i]), bool(z["greedy"][i]))
                    for i in range(z["lengths"].size)]  # fmt: skip
    return out


def test_a_later_turn_replaces_the_pending_earlier_one_and_bad_bounds_are_refused(tmp_path):
    log = UsageLog(tmp_path, max_mib=1, flush_tokens=10_000)
    log.add([1, 2, 3, 4], 2, greedy=True)
    log.add([1, 2, 3, 4, 5, 6], 5, greedy=True)  # the same conversation, one turn on
    log.add([7, 8, 9], 1, greedy=False)
    log.add([7, 8, 1], 2, greedy=False)  # an edit: the previous prompt, one token on, a new completion
    log.add([10, 11, 12], 1, greedy=True, allowed=False)
    log.add([7, 2, 2], 1, greedy=True)  # the same first token, another prompt
    assert usage_shards(tmp_path) == []  # nothing written before the flush
    log.close()
    assert _sequences(tmp_path) == [([1, 2, 3, 4, 5, 6], 5, True), ([7, 8, 1], 2, False), ([7, 2, 2], 1, True)]
    assert log.n_skipped == 1
    with pytest.raises(ValueError, match="> 0 MiB"):
        UsageLog(tmp_path, max_mib=0)


@pytest.fixture(scope="module")
def engine(model_path):
    e = Engine(model_path, drafter="ngram", cost_model=frozen_cost_model(), n_ctx=1024)
    yield e
    e.close()


def test_engine_records_within_the_bound_and_skips_opted_out_requests(engine, model, tmp_path):
    one = UsageLog(tmp_path / "probe", max_mib=1, flush_tokens=1)
    engine.usage_log = one
    try:
        engine.generate(PROMPTS[0], max_tokens=8, sampling=SamplingParams.greedy())
    finally:
        engine.usage_log = None
    shard_bytes = usage_shards(tmp_path / "probe")[0].stat().st_size
    bound = 2.5 * shard_bytes  # room for two shards of this size, not for three
    log = UsageLog(tmp_path / "u", max_mib=bound / 2**20, flush_tokens=1)
    engine.usage_log = log
    try:
        outs = [engine.generate(p, max_tokens=8, sampling=SamplingParams.greedy()) for p in PROMPTS]
        secret = engine.generate("my password is hunter2 and", max_tokens=8,
                                 sampling=SamplingParams(temperature=0.0, draft_memory=False))  # fmt: skip
    finally:
        engine.usage_log = None
        log.close()
    files = usage_shards(tmp_path / "u")
    assert 1 <= len(files) < len(PROMPTS) and sum(f.stat().st_size for f in files) <= bound
    assert files[-1].name == f"shard-{len(PROMPTS) - 1:05d}.npz"  # the newest kept, the oldest removed
    seqs = _sequences(tmp_path / "u")
    want = model.tokenize(PROMPTS[-1]) + outs[-1].token_ids
    assert seqs[-1] == (want, len(model.tokenize(PROMPTS[-1])), True)
    assert secret.token_ids and log.n_skipped == 1
    secret_prompt = model.tokenize("my password is hunter2 and")
    assert all(s[: len(secret_prompt)] != secret_prompt for s, _, _ in _sequences(tmp_path / "u"))
    assert all(s[: len(secret_prompt)] != secret_prompt for s, _, _ in _sequences(tmp_path / "probe"))


def test_batch_scheduler_records_its_requests(model, tmp_path):
    log = UsageLog(tmp_path, max_mib=1, flush_tokens=10_000)
    sched = BatchScheduler(model, parallel=2, n_ctx=256, cost_model=frozen_cost_model())
    sched.usage_log = log
    try:
        greedy = sched.submit(model.tokenize(PROMPTS[1]), max_tokens=6, sampling=SamplingParams.greedy())
        sampled = sched.submit(model.tokenize(PROMPTS[2]), max_tokens=6, sampling=SamplingParams(temperature=0.8, seed=3))
        out = sched.submit(model.tokenize(PROMPTS[3]), max_tokens=6,
                           sampling=SamplingParams(temperature=0.0, draft_memory=False))  # fmt: skip
        sched.run_until_idle()
    finally:
        sched.close()
        log.close()
    got = sorted(_sequences(tmp_path))
    want = sorted([(model.tokenize(PROMPTS[1]) + greedy.wait().token_ids, len(model.tokenize(PROMPTS[1])), True),
                   (model.tokenize(PROMPTS[2]) + sampled.wait().token_ids, len(model.tokenize(PROMPTS[2])), False)])  # fmt: skip
    assert out.wait().token_ids and got == want


def test_from_usage_continues_the_shipped_head_and_the_gguf_drafts_losslessly(engine, model_path, tmp_path, capsys, caplog):
    from localspec.cli.main import main
    from localspec.models.eagle3_gguf import read_eagle3_gguf
    from localspec.models.eagle3_heads import shipped_head

    _record(engine, tmp_path / "usage", PROMPTS[:3])
    out = tmp_path / "head.gguf"
    args = ["train-eagle3", "--from-usage", str(tmp_path / "usage"), "--out", str(out), "--steps", "3", "--batch", "2",
            "--window", "24", "--unroll", "2", "--device", "cpu", "--no-bf16", "--seq-len", "64", "--json"]  # fmt: skip
    assert main(args) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["steps"] == 3 and len(info["train_accuracy"]) == 2
    base_cfg, base = read_eagle3_gguf(shipped_head(model_path))
    cfg, w = read_eagle3_gguf(out)
    assert cfg == base_cfg and np.array_equal(w.d2t, base.d2t)  # the same head, trained on
    # three small steps: close to the shipped head (Q8_0 both times), but moved
    assert 0 < np.abs(w.w_down - base.w_down).max() < 0.05
    with Engine(model_path, drafter="eagle3", eagle=out, cost_model=frozen_cost_model(), n_ctx=1024) as e3:
        for p in PROMPTS[:2]:
            plain = engine.generate(p, max_tokens=24, sampling=SamplingParams.greedy(), speculative=False)
            assert e3.generate(p, max_tokens=24, sampling=SamplingParams.greedy()).token_ids == plain.token_ids
    # more usage, and a shard cut short: the bad shard is skipped, named, and the same --out
    # trains again on all of it (it resumed the finished checkpoint and trained 0 steps)
    first = info["train_tokens"]
    good = usage_shards(tmp_path / "usage")[0]
    (tmp_path / "usage" / "shard-99999.npz").write_bytes(good.read_bytes()[:1500])
    _record(engine, tmp_path / "usage", PROMPTS[3:])
    with caplog.at_level(logging.WARNING, logger="localspec.train"):
        assert main(args) == 0
    captured = capsys.readouterr()
    again = json.loads(captured.out.strip().splitlines()[-1])
    assert again["steps"] == 3 and len(again["train_accuracy"]) == 2 and again["train_tokens"] > first, again
    assert "the usage in" in captured.err and "training starts again from" in captured.err, captured.err
    assert any("shard-99999.npz" in r.getMessage() and "cannot be read" in r.getMessage() for r in caplog.records)


def test_a_head_round_trips_through_load_weights(model_path):
    import torch

    from localspec.models.eagle3_gguf import read_eagle3_gguf
    from localspec.models.eagle3_heads import shipped_head
    from localspec.models.training.eagle3_torch import Eagle3Head
    from localspec.models.training.eagle3_train import load_weights, read_target

    cfg, w = read_eagle3_gguf(shipped_head(model_path))
    tt = read_target(model_path)
    scale = np.linspace(0.5, 3.0, 3 * cfg.n_embd_target).astype(np.float32)
    head = Eagle3Head(cfg, np.zeros((8, cfg.n_embd), np.float32), w.d2t, scale)
    load_weights(head, w)
    back = head.to_weights()
    for name in ("fc", "wq", "w_down", "output", "output_norm"):
        np.testing.assert_allclose(getattr(back, name), getattr(w, name), rtol=1e-6, atol=1e-6)
    assert tt.n_embd == cfg.n_embd and isinstance(head.fc.weight, torch.nn.Parameter)


def test_per_step_table_puts_training_beside_held_out():
    from localspec.cli.train import per_step_table

    t = per_step_table([0.8, 0.7], [0.5, 0.4], {"generated": {"n_seq": 3, "acc": [0.6, 0.5]}}).splitlines()
    assert t[0].split() == ["unroll", "step", "0", "1"]
    assert t[1].split() == ["train", "0.8000", "0.7000"]
    assert t[2].split() == ["held-out", "0.5000", "0.4000"]
    assert t[3].split() == ["held-out", "generated", "0.6000", "0.5000"]
    assert per_step_table([0.8], []).splitlines()[2].split() == ["held-out", "-"]


def test_bad_usage_arguments_are_one_line_errors(tmp_path, model_path):
    import argparse

    from localspec.cli.common import usage_log_from_args
    from localspec.cli.main import main

    with pytest.raises(SystemExit, match="needs --data PATH..., --self-prompts N or --from-usage DIR"):
        main(["train-eagle3", "--out", str(tmp_path / "h.gguf")])
    with pytest.raises(SystemExit, match="--self-prompts must be >= 0, got -1"):
        main(["train-eagle3", "--self-prompts", "-1", "--out", str(tmp_path / "h.gguf")])
    with pytest.raises(SystemExit, match="--head continues a head on --from-usage DIR"):
        main(["train-eagle3", "--data", "stdlib", "--head", "x.gguf", "--out", str(tmp_path / "h.gguf")])
    (tmp_path / "empty").mkdir()
    # --data was taken and ignored, without a word (a new user's report)
    with pytest.raises(SystemExit, match=r"^localspec: error: --from-usage trains on the recorded usage only, not on "
                                         r"--data, --self-prompts: leave them out, or train on them in a run without --from-usage$"):  # fmt: skip
        main(["train-eagle3", "--from-usage", str(tmp_path / "empty"), "--data", "stdlib", "--self-prompts", "4",
              "--out", str(tmp_path / "h.gguf")])  # fmt: skip
    with pytest.raises(SystemExit, match="no recorded usage in"):
        main(["train-eagle3", "--from-usage", str(tmp_path / "empty"), "--out", str(tmp_path / "h.gguf")])
    a = argparse.Namespace(record_usage=str(tmp_path / "u"), record_usage_mib=8.0, no_draft_memory=True)
    with pytest.raises(SystemExit, match="choose one"):
        usage_log_from_args(a)
    a.no_draft_memory, a.record_usage_mib = False, -1.0
    with pytest.raises(SystemExit, match="bound must be > 0 MiB"):
        usage_log_from_args(a)


def test_localspec_serve_record_usage_keeps_requests_but_not_opted_out_ones(model_path, model, tmp_path):
    """The command itself: `localspec serve --record-usage DIR` as a process; the OpenAI
    client's requests are in DIR after the server stops, a `draft_memory: false` one is not."""
    openai = pytest.importorskip("openai")
    folder = tmp_path / "usage"
    args = ["serve", "--port", "0", "--drafter", "ngram", "--parallel", "2", "--ctx-per-request", "256",
            "-m", str(model_path), "-t", "1", "--record-usage", str(folder), "--record-usage-mib", "1"]  # fmt: skip
    with localspec_process(*args) as (_proc, url, err):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        kept = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=6, temperature=0)
        client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                  extra_body={"draft_memory": False})  # fmt: skip
    seqs = _sequences(folder)
    prompt = model.tokenize(PROMPTS[0])
    assert len(seqs) == 1, "".join(err)
    seq, n_prompt, greedy = seqs[0]
    assert seq[: len(prompt)] == prompt and n_prompt == len(prompt) and greedy
    assert len(seq) == len(prompt) + kept.usage.completion_tokens
    assert model.detokenize(seq[len(prompt) :]) == kept.choices[0].text
