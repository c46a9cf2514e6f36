"""LOSSY acceptance thresholds (issue 12, part 3): SGLang's target-only rule.

* Exact enumeration (``tests/oracle.py``; the one coin per node is a ``BranchUniform``
  compared with growing bounds): at thresholds 1.0 the thresholded walk's law is the target's
  for every tree of the exact tests (sampled children, duplicates among them, point masses);
  below 1.0 it is not; three plausible mutations of the rule are caught.
* The C twin (``ls_verify_thresholds``) emits the reference's tokens seed by seed on every
  enumerated tree, with and without truncation and penalties, and follows the lossy law.
* The default path is untouched: thresholds 1.0 (or unset) give the same tokens seed by seed as
  before, in both verification modes, C and reference; at temperature 0 they do not apply.
* Real uniforms follow the exact (lossy) law the oracle computes (chi-square), and the same
  samples reject the target's law: the walk that runs is the one enumerated.
* The bench's exact TVD (``localspec.bench.thresholds``, its own enumeration) equals the
  oracle's, is 0 at 1.0 and grows as the thresholds fall, while acceptance rises.
* ``lossy: true`` in generate --json, the servers' responses, bench output and the chat app's
  panel; one-line errors for values outside (0, 1].
"""

import dataclasses
import json
from unittest import mock

import httpx
import numpy as np
import pytest

import oracle
import test_verify as tv
from conftest import chisquare_pvalue, frozen_cost_model
from localspec import Engine, SamplingParams, native
from localspec import verify as verify_mod
from localspec.bench import thresholds as bt
from localspec.native import verify as native_verify
from localspec.errors import InvalidRequestError
from localspec.stats import GenerationStats
from localspec.verify import threshold_walk, verify, verify_thresholds

SCENARIOS = list(tv.SCENARIOS)


def params(ts=None, ta=None, mode="gumbel", base=tv.SAMPLED):
    return dataclasses.replace(base, accept_threshold_single=ts, accept_threshold_acc=ta, verify=mode)


def exact_law(scenario, ts, ta, fn=verify_thresholds, mode="gumbel"):
    """Exact law of one step's tokens: the scenario's draft draws and the walk enumerated."""

    def one(ch):
        tree, rows = tv.build(scenario, ch)
        return tuple(fn(tree, rows, oracle.branching_cursor(tv._cursor(params(ts, ta, mode)), ch)).tokens)

    with oracle.enumerated_draws():
        return oracle.enumerate_law(one)


def law_error(scenario, ts, ta, fn=verify_thresholds, mode="gumbel") -> float:
    step = exact_law(scenario, ts, ta, fn, mode)
    assert abs(sum(step.values()) - 1.0) < 1e-12  # every branch enumerated
    m = max(len(t) for t in step)
    return oracle.max_abs_diff(oracle.extended_law(step, tv.target_cond, m), oracle.target_law(tv.target_cond, m))


# -- exact: lossless at 1.0, lossy below ---------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_thresholds_one_give_the_target_law_for_any_tree(scenario):
    """Inverse-CDF sampling of the target: exact for sampled children (drawn from another
    distribution, duplicates included), point masses and mixes alike."""
    assert law_error(scenario, 1.0, 1.0) < 1e-12


@pytest.mark.parametrize("scenario", ["tree-points", "chain-sampled", "mixed-sampled-first"])
def test_thresholds_below_one_are_lossy_through_verify(scenario):
    """``verify`` dispatches to the thresholded walk for a lossy request (the law moves off the
    target's by far more than rounding), in either mode; at 1.0 it runs rejection sampling, exact
    as before (the Gumbel walk's noise is not enumerated: its seed-by-seed identity is below)."""
    assert law_error(scenario, 0.3, 0.6, fn=verify) > 1e-2
    assert law_error(scenario, 0.3, 0.6, fn=verify, mode="rejection") > 1e-2
    assert law_error(scenario, 1.0, 1.0, fn=verify, mode="rejection") < 1e-12


def test_one_coin_per_node_is_compared_with_growing_bounds():
    """The enumeration is not vacuous: at a node with three point-mass children the coin is
    compared several times, and a step may accept any of them or none."""
    step = exact_law("tree-points", 1.0, 1.0)
    firsts = {t[0] for t in step if len(t) > 1}
    assert firsts == set(tv.top_tokens((), 3))
    assert {len(t) for t in step} == {1, 2, 3}


MUTATIONS = {
    "keeps-tried-siblings-in-the-residual": [oracle.MUTATION_THRESHOLD_KEEP_TRIED],
    "a-coin-per-sibling": [("coin <= prob_acc / threshold_acc", "cursor.accept_uniform(0) <= prob_acc / threshold_acc")],
    "no-accumulation": [("prob_acc += p", "prob_acc = p")],
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_the_oracle_catches_mutations_of_the_rule(name):
    """Each mutation, at thresholds 1.0, misses the target law by far more than rounding on the
    trees with siblings; the rule itself is exact on them."""
    mutated = oracle.mutant(threshold_walk, *MUTATIONS[name])
    scenarios = ["tree-points", "mixed-points-first"] if name != "keeps-tried-siblings-in-the-residual" else [
        "tree-points", "chain-points", "mixed-sampled-first"]  # fmt: skip
    with mock.patch.object(verify_mod, "threshold_walk", mutated):
        for sc in scenarios:
            assert law_error(sc, 1.0, 1.0) > 1e-3, sc
    for sc in scenarios:
        assert law_error(sc, 1.0, 1.0) < 1e-12


# -- the default path ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["gumbel", "rejection"])
def test_thresholds_one_leave_the_default_path_as_it_was(mode):
    """Every enumerated tree of every scenario, 6 seeds, C walk and reference: thresholds 1.0
    (and 1.0 with None) give the same accepted path and tokens as a request without them."""
    assert not params(1.0, 1.0).lossy and not params(None, 1.0).lossy and params(0.9, None).lossy
    assert not params(0.5, 0.5, base=SamplingParams.greedy()).lossy  # temperature 0: greedy verification
    n = 0
    for sc in SCENARIOS:
        trees = []
        oracle.enumerate_law(lambda ch: trees.append(tv.build(sc, ch)) or len(trees))
        for tree, rows in trees[:40]:
            for seed in range(6):
                for native_walk in (False, True) if native.AVAILABLE else (False,):
                    ref = verify(tree, rows, tv._cursor(params(None, None, mode), seed, native_walk))
                    one = verify(tree, rows, tv._cursor(params(1.0, 1.0, mode), seed, native_walk))
                    assert (one.path, one.tokens, one.sources) == (ref.path, ref.tokens, ref.sources)
                    n += 1
    assert n > 500


# -- the C twin (ls_verify_thresholds) ------------------------------------------------------------

# plain, then a truncated / penalised distribution (the penalty window moves with every accepted token)
C_BASES = [tv.SAMPLED, dataclasses.replace(tv.SAMPLED, top_k=5, min_p=0.02, repeat_penalty=1.3, presence_penalty=0.4,
                                           frequency_penalty=0.2, penalty_last_n=3)]  # fmt: skip
C_THRESHOLDS = [(1.0, 1.0), (0.6, 0.7), (0.3, 1.0), (1.0, 0.35), (0.05, 0.05)]


@pytest.mark.skipif(not native.AVAILABLE, reason="the native library is not built")
def test_the_c_thresholded_walk_equals_the_reference():
    """Every enumerated tree of every scenario (duplicated siblings, point masses, sampled
    children), five threshold pairs, two sampling setups, 6 seeds: the C walk accepts the same
    path and emits the same tokens as ``threshold_walk`` + ``verify_thresholds``. Guards: the
    thresholds change what is accepted, and the seeds reach different outcomes."""
    n = n_moved = n_spread = 0
    for sc in SCENARIOS:
        trees = []
        oracle.enumerate_law(lambda ch: trees.append(tv.build(sc, ch)) or len(trees))
        for tree, rows in trees[:30]:
            for base in C_BASES:
                for ts, ta in C_THRESHOLDS:
                    outs = set()
                    for seed in range(6):
                        p = params(ts, ta, base=base)
                        ref = verify_thresholds(tree, rows, tv._cursor(p, seed, native_walk=False))
                        cur = tv._cursor(p, seed, native_walk=True)
                        w = native_verify.walk(tree, rows, cur.req.processor.native_state(), seed=seed, pos=cur.pos,
                                               window=cur.window, rejection=False, thresholds=(ts, ta))  # fmt: skip
                        assert (w.path, w.tokens) == (ref.path, ref.tokens), (sc, ts, ta, seed)
                        if p.lossy:  # what the engine runs: verify's dispatch (at 1.0 it is the default walk)
                            c = verify(tree, rows, tv._cursor(p, seed, native_walk=True))
                            assert (c.path, c.tokens, c.sources) == (ref.path, ref.tokens, ref.sources)
                        if (ts, ta) != (1.0, 1.0):
                            one = verify_thresholds(tree, rows, tv._cursor(params(1.0, 1.0, base=base), seed))
                            n_moved += one.tokens != ref.tokens
                        outs.add(tuple(ref.tokens))
                        n += 1
                    n_spread += len(outs) > 1
    assert n > 5000
    assert n_moved > n // 4 and n_spread > n // 12


@pytest.mark.skipif(not native.AVAILABLE, reason="the native library is not built")
@pytest.mark.parametrize("value", [0.0, 1.5, float("nan"), -0.2])
def test_the_c_thresholded_walk_refuses_thresholds_outside_0_1(value):
    tree, rows = tv.build("tree-points", None)
    cur = tv._cursor(params(0.5, 0.5), 0, native_walk=True)
    state = cur.req.processor.native_state()
    for pair in [(value, 1.0), (1.0, value)]:
        with pytest.raises(ValueError, match=r"in \(0, 1\]"):
            native_verify.walk(tree, rows, state, seed=0, pos=cur.pos, window=None, rejection=False, thresholds=pair)


# -- real uniforms against the exact lossy law -----------------------------------------------------

N_CHI = 3000


@pytest.mark.parametrize("native_walk", [False, True] if native.AVAILABLE else [False], ids=lambda v: "c" if v else "ref")
def test_sampled_lossy_steps_follow_the_exact_lossy_law(native_walk):
    """3000 steps with the cursor's real streams, reference and C walk: the first two tokens
    follow the lossy law the oracle enumerates (p > 1e-3) and not the target's (p < 1e-6), so the
    chi-square test sees the shift and the enumerated coin is the coin that runs."""
    ts, ta = 0.6, 0.7
    step = exact_law("tree-points", ts, ta)
    lossy2 = oracle.extended_law(step, tv.target_cond, 2)
    target2 = oracle.target_law(tv.target_cond, 2)
    keys = [(a, b) for a in range(tv.VS) for b in range(tv.VS)]
    rng = np.random.default_rng(5)
    counts = np.zeros(len(keys))
    for trial in range(N_CHI):
        tree, rows = tv.build("tree-points", None)
        toks = verify(tree, rows, tv._cursor(params(ts, ta), seed=trial, native_walk=native_walk)).tokens
        if len(toks) == 1:
            toks = [toks[0], int(rng.choice(tv.VS, p=tv.target_cond((toks[0],))))]
        counts[keys.index((toks[0], toks[1]))] += 1
    exp_lossy = np.array([lossy2.get(k, 0.0) for k in keys])
    exp_target = np.array([target2.get(k, 0.0) for k in keys])
    assert counts[exp_lossy == 0].sum() == 0  # nothing where the lossy law has no mass
    pos = exp_lossy > 0
    assert chisquare_pvalue(counts[pos], exp_lossy[pos]) > 1e-3
    assert counts[exp_target == 0].sum() == 0
    pos = exp_target > 0
    assert chisquare_pvalue(counts[pos], exp_target[pos]) < 1e-6


# -- the bench's exact TVD -------------------------------------------------------------------------


def test_the_bench_enumeration_equals_the_oracle():
    """The bench's own enumeration (it may not import tests/) gives the oracle's law."""
    w = bt.World(6, 3)
    tree, rows = bt.top_tree(w, (3, 2))
    for ts, ta in [(1.0, 1.0), (0.6, 0.8), (0.3, 0.3)]:
        mine = bt.exact_step_law(w, tree, rows, ts, ta)

        def one(ch):
            cur = oracle.branching_cursor(w.cursor(params(ts, ta)), ch)
            return tuple(verify_thresholds(tree, rows, cur).tokens)

        with oracle.enumerated_draws():
            ref = oracle.enumerate_law(one)
        assert oracle.max_abs_diff(mine, ref) < 1e-12


def test_tvd_is_zero_at_one_and_grows_while_acceptance_rises_as_thresholds_fall():
    steps = [1.0, 0.8, 0.6, 0.4, 0.2]
    sequences = {
        "single": [(t, 1.0) for t in steps],
        "acc": [(1.0, t) for t in steps],
        "both": [(t, t) for t in steps],
    }
    for kind, seq in sequences.items():
        rows = bt.synthetic_tvd_report(seq, vocab_sizes=(4, 6), n_worlds=2, seed=1)
        for shape in bt.SHAPES:
            r = [x for x in rows if x["shape"] == shape]
            tvd = [x["tvd_mean"] for x in r]
            acc = [x["mean_accepted"] for x in r]
            assert tvd[0] < 1e-12, (kind, shape)
            assert all(b >= a - 1e-12 for a, b in zip(tvd, tvd[1:])), (kind, shape, tvd)
            assert all(b >= a - 1e-12 for a, b in zip(acc, acc[1:])), (kind, shape, acc)
            assert tvd[-1] > 0.01 and acc[-1] > acc[0] + 0.01, (kind, shape, tvd, acc)


def test_lossy_summary_and_tables(tmp_path):
    """The bench's LOSSY aggregates are ratios of totals; the JSON keeps every run."""
    from localspec.bench.report import write_json
    from localspec.bench.specbench import PromptRecord, RunRecord

    def run(n, us, steps, drafted, accepted, lp):
        return RunRecord(n, us, us, steps, drafted, accepted, 100.0 * steps, us, n, lp)

    recs = [PromptRecord("code", "code", i, 10, plain=run(10, 1e6, 10, 0, 0, -10.0),
                         spec=run(10, 5e5, 5, 10, 5, -10.0), identical=True,
                         spec_lossy=run(10, 2.5e5, 2, 12, 8, -15.0), lossy_identical=False) for i in range(2)]  # fmt: skip
    c = bt.summarize_lossy(recs)["code"]
    assert c["speedup_lossless"] == pytest.approx(2.0) and c["speedup_lossy"] == pytest.approx(4.0)
    assert c["lossy_over_lossless"] == pytest.approx(2.0)
    assert c["mean_acceptance_length_lossy"] == pytest.approx(5.0) and c["acceptance_rate_lossy"] == pytest.approx(8 / 12)
    assert (c["mean_logprob_plain"], c["mean_logprob_lossy"]) == (pytest.approx(-1.0), pytest.approx(-1.5))
    assert c["lossy_identical_to_plain_fraction"] == 0.0
    md = bt.lossy_markdown({"accept_threshold_single": 0.5, "accept_threshold_acc": 1.0}, {"code": c})
    assert "**LOSSY**" in md and "| code | 2 | 2.00x | 4.00x | 2.00x |" in md
    write_json(tmp_path / "b.json", {"lossy": True}, {}, recs, {"lossy": True, "lossy_categories": {"code": c}})
    d = json.loads((tmp_path / "b.json").read_text())
    assert d["lossy"] is True and d["prompts"][0]["spec_lossy"]["sum_logprob"] == -15.0


# -- bad values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.5, float("nan"), float("inf"), True, "0.5"])
def test_bad_thresholds_are_refused(value):
    for name in ("accept_threshold_single", "accept_threshold_acc"):
        with pytest.raises(InvalidRequestError, match=f"{name} must be in \\(0, 1\\]"):
            SamplingParams(**{name: value})
    with pytest.raises(InvalidRequestError, match="must be in \\(0, 1\\]"):
        Engine("/nonexistent.gguf", accept_threshold_acc=value)  # refused before loading anything


def cli_error(capsys, argv) -> str:
    from localspec.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    msg = str(e.value.code)
    assert msg.startswith("localspec: error: ") and "\n" not in msg, msg
    assert "Traceback" not in capsys.readouterr().err
    return msg


@pytest.mark.parametrize("flag, value", [("--accept-threshold-single", "0"), ("--accept-threshold-acc", "1.5"),
                                         ("--accept-threshold-single", "nan"), ("--accept-threshold-acc", "-1")])  # fmt: skip
def test_bad_threshold_flags_are_one_line_errors(capsys, flag, value):
    msg = cli_error(capsys, ["generate", "hello", flag, value])
    assert flag in msg and "(0, 1]" in msg


def test_bench_refuses_thresholds_at_temperature_zero(capsys):
    msg = cli_error(capsys, ["bench", "--dataset", "code", "--accept-threshold-acc", "0.5"])
    assert "temperature > 0" in msg


def test_every_engine_command_has_the_flags():
    from localspec.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    have = {name for name, p in sub.choices.items() if any("--accept-threshold-acc" in a.option_strings for a in p._actions)}
    assert {"generate", "chat", "complete", "serve", "bench", "batch"} <= have


def test_help_says_lossy_and_temperature_zero(capsys):
    from localspec.cli.main import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "LOSSY" in out and "At temperature 0 greedy verification is used and they do not apply" in out


# -- the chat app's panel --------------------------------------------------------------------------


def test_the_chat_panel_says_lossy():
    from rich.console import Console

    from localspec.tui.stats_panel import PanelState, render_panel

    def text(st):
        c = Console(width=60, record=True, color_system=None)
        c.print(render_panel(PanelState(drafter="ngram", stats=st)))
        return c.export_text()

    lossy = GenerationStats(drafter="ngram", n_steps=2, n_step_tokens=5, n_generated_tokens=5)
    lossy.set_thresholds(params(0.5, 0.9), drafted=True)
    assert "LOSSY (accept thresholds: single 0.5, acc 0.9)" in " ".join(text(lossy).split())
    plain = GenerationStats(drafter="ngram", n_steps=2, n_step_tokens=5, n_generated_tokens=5)
    plain.set_thresholds(params(1.0, 1.0), drafted=True)
    assert "LOSSY" not in text(plain)


# -- the real model: engine, CLI, servers, bench ---------------------------------------------------

REPEAT = "one two three four five six seven eight nine ten. " * 6
CODE = "".join(f"def add_{n}(x):\n    return x + {i}\n\n\n" for i, n in enumerate(["one", "two", "three", "four", "five"], 1))


def test_engine_thresholds_one_equal_the_default_seed_by_seed(engine):
    """On the default model, fixed trees (a scripted drafter with a wrong token every third
    draft and a decoy sibling at every depth, no adaptive policy): thresholds 1.0 give the
    default output token for token, in both verification modes and for 3 seeds each."""
    from helpers import ScriptedDrafter

    toks = engine.tokenize(REPEAT)
    old, old_adaptive = engine.drafter, engine.adaptive
    try:
        engine.adaptive = False
        n_accepted = 0
        for seed in range(2):
            engine.reset()
            plain = engine.generate(toks, max_tokens=16, sampling=SamplingParams(temperature=0.9, seed=seed), speculative=False)
            for mode in ("gumbel", "rejection"):
                base = SamplingParams(temperature=0.9, seed=seed, verify=mode)
                outs = []
                for sp in (base, params(1.0, 1.0, mode, base=base)):
                    engine.drafter = ScriptedDrafter(toks + plain.token_ids, chain=4, wrong_every=3, decoys=1, seed=seed)
                    engine.reset()
                    outs.append(engine.generate(toks, max_tokens=16, sampling=sp))
                ref, one = outs
                assert one.token_ids == ref.token_ids and not one.stats.lossy and not ref.stats.lossy
                n_accepted += ref.stats.num_accepted_tokens
        assert n_accepted > 10  # the trees were used
    finally:
        engine.drafter, engine.adaptive = old, old_adaptive
        engine.reset()


def test_lower_thresholds_raise_acceptance_on_the_model(model):
    """The n-gram drafter (every drafted tree verified, at most 8 nodes) on repetitive code at
    temperature 1 without truncation (with llama.cpp's top-k / top-p / min-p the rows here are
    nearly point masses, where both rules accept the same drafts), 2 seeds: thresholds 0.3 mark
    the results lossy and accept a larger share of the drafts than lossless verification."""
    engine = Engine(model, drafter="ngram", n_ctx=1024, cost_model=frozen_cost_model(), max_tree_nodes=8, adaptive=False)
    try:
        toks = engine.tokenize(CODE)
        acc = {"lossless": [0, 0], "lossy": [0, 0]}
        for seed in range(2):
            base = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
            for kind, sp in (("lossless", base), ("lossy", params(0.3, 0.3, base=base))):
                engine.reset()
                r = engine.generate(toks, max_tokens=24, sampling=sp)
                assert r.stats.lossy == (kind == "lossy")
                acc[kind][0] += r.stats.num_accepted_tokens
                acc[kind][1] += r.stats.num_draft_tokens
        assert acc["lossless"][1] >= 20 and acc["lossy"][1] >= 20, acc  # both drafted
        rate = {k: a / d for k, (a, d) in acc.items()}
        assert rate["lossy"] > rate["lossless"] + 0.05, (acc, rate)
    finally:
        engine.close()


def test_thresholds_do_not_apply_at_temperature_zero(engine):
    toks = engine.tokenize(REPEAT)
    engine.reset()
    ref = engine.generate(toks, max_tokens=24, sampling=SamplingParams.greedy(), speculative=False)
    engine.reset()
    res = engine.generate(toks, max_tokens=24, sampling=params(0.2, 0.2, base=SamplingParams.greedy()))
    assert res.token_ids == ref.token_ids and not res.stats.lossy
    engine.reset()


def test_engine_default_thresholds_apply_to_requests_that_leave_them_unset(model):
    e = Engine(model, drafter="ngram", n_ctx=1024, cost_model=frozen_cost_model(), accept_threshold_acc=0.4)
    try:
        r = e.generate(REPEAT, max_tokens=8, sampling=SamplingParams(temperature=0.8, seed=1))
        assert r.stats.lossy and r.stats.accept_threshold_acc == 0.4 and r.stats.accept_threshold_single == 1.0
        r = e.generate(REPEAT, max_tokens=8, sampling=SamplingParams(temperature=0.8, seed=1, accept_threshold_acc=1.0))
        assert not r.stats.lossy
    finally:
        e.close()


def test_generate_json_says_lossy(capsys):
    from localspec.cli.main import main

    common = ["generate", REPEAT, "-n", "12", "--temperature", "0.8", "--seed", "3", "--json"]
    assert main(common + ["--accept-threshold-single", "0.5", "--accept-threshold-acc", "0.7"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["lossy"] is True and d["stats"]["lossy"] is True
    assert (d["stats"]["accept_threshold_single"], d["stats"]["accept_threshold_acc"]) == (0.5, 0.7)
    assert main(common) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["lossy"] is False and d["stats"]["lossy"] is False


@pytest.fixture(scope="module")
def servers(model, engine):
    from localspec.scheduler import BatchScheduler
    from localspec.server import CompletionService, ServiceConfig
    from localspec.server.http import AppThread
    from localspec.server.openai import OpenAIService, create_serve_app

    sched = BatchScheduler(model, parallel=1, n_ctx=512, cost_model=frozen_cost_model()).start()
    oai = OpenAIService(sched, model_name="gemma-test", sampling=SamplingParams.greedy())
    editor = CompletionService(engine, ServiceConfig(sampling=SamplingParams.greedy()))
    app = create_serve_app(oai, editor, max_body_bytes=64 * 1024)
    with AppThread(app) as srv:
        yield srv
    editor.close()
    sched.close()
    engine.reset()


LOSSY_FIELDS = {"temperature": 0.8, "seed": 2, "accept_threshold_single": 0.5, "accept_threshold_acc": 0.6}


def test_openai_responses_say_lossy(servers):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=servers.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    r = client.completions.create(model="gemma-test", prompt=REPEAT, max_tokens=8,
                                  extra_body={"accept_threshold_single": 0.5, "accept_threshold_acc": 0.6},
                                  temperature=0.8, seed=2)  # fmt: skip
    t = r.model_extra["timings"]
    assert t["lossy"] is True and t["accept_threshold_single"] == 0.5 and t["accept_threshold_acc"] == 0.6
    r = client.completions.create(model="gemma-test", prompt=REPEAT, max_tokens=8, temperature=0.8, seed=2)
    assert "lossy" not in r.model_extra["timings"]
    events = []
    with httpx.stream("POST", servers.url + "/v1/chat/completions", timeout=600, json={
            "messages": [{"role": "user", "content": REPEAT}], "max_tokens": 6, "stream": True, **LOSSY_FIELDS}) as s:  # fmt: skip
        for line in s.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    assert events[-1]["timings"]["lossy"] is True
    bad = httpx.post(servers.url + "/v1/completions", json={"prompt": "x", "accept_threshold_acc": 0}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "accept_threshold_acc"
    assert "(0, 1]" in bad.json()["error"]["message"]


def test_editor_completion_says_lossy(servers):
    r = httpx.post(servers.url + "/completion", json={"prompt": REPEAT, "n_predict": 8, **LOSSY_FIELDS}, timeout=600)
    d = r.json()
    assert r.status_code == 200 and d["timings"]["lossy"] is True
    assert d["localspec"]["lossy"] is True and d["localspec"]["accept_threshold_acc"] == 0.6
    r = httpx.post(servers.url + "/completion", json={"prompt": REPEAT, "n_predict": 8, "temperature": 0.8}, timeout=600)
    assert "lossy" not in r.json()["timings"] and "lossy" not in r.json()["localspec"]
    bad = httpx.post(servers.url + "/completion", json={"prompt": "x", "accept_threshold_single": 1.5}, timeout=60)
    assert bad.status_code == 400 and "accept_threshold_single" in bad.json()["error"]["message"]
    assert httpx.get(servers.url + "/health", timeout=60).status_code == 200  # still serving


def test_bench_reports_the_lossy_run(tmp_path, capsys):
    from localspec.cli.main import main

    out = tmp_path / "b"
    assert main(["bench", "--dataset", "code", "--per-category", "2", "-n", "16", "--temperature", "0.8",
                 "--accept-threshold-acc", "0.5", "--out", str(out)]) == 0  # fmt: skip
    d = json.loads((out / "bench.json").read_text())
    assert d["config"]["lossy"] is True and d["lossy"] is True and d["config"]["accept_threshold_acc"] == 0.5
    c = d["lossy_categories"]["code"]
    assert c["n_prompts"] == 2 and c["mean_logprob_lossy"] is not None and c["mean_logprob_lossless"] is not None
    assert all("spec_lossy" in p for p in d["prompts"])
    assert {(r["threshold_single"], r["threshold_acc"]) for r in d["synthetic_tvd"]} >= {(1.0, 1.0), (1.0, 0.5)}
    assert all(r["tvd_max"] < 1e-12 for r in d["synthetic_tvd"] if r["threshold_acc"] == r["threshold_single"] == 1.0)
    md = (out / "bench.md").read_text()
    assert "LOSSY" in md and "TVD" in md
