"""The drafting memory (issue 29): what it drafts, its bound and eviction, opt-out, files,
concurrency, and outputs that do not depend on it (alone and batched, greedy and seeded)."""

import dataclasses
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import frozen_cost_model
from localspec import SamplingParams
from localspec.drafters import make_drafter
from localspec.drafters.memory import DraftMemory, MemoryFileError
from localspec.drafters.ngram import NgramDrafter
from localspec.scheduler import BatchScheduler


def memory_nodes(drafter: NgramDrafter, tree) -> list[int]:
    """Token ids of the nodes that carry a memory bucket."""
    return [int(t) for t, b in zip(tree.token_ids[1:], tree.feature[1:]) if b >= drafter.memory_bucket_offset]


def path_tokens(tree, node: int) -> list[int]:
    return [int(tree.token_ids[i]) for i in tree.path_to(node)]


def test_memory_drafts_what_followed_the_suffix_in_an_earlier_request():
    mem = DraftMemory(1)
    mem.write([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    d = NgramDrafter(memory=mem)
    d.begin([50, 60, 2, 3, 4])  # the request's own history has no earlier 4
    tree = d.propose(16, 32)
    assert memory_nodes(d, tree)[:6] == [5, 6, 7, 8, 9, 10]
    assert tree.is_chain()
    assert np.all(np.diff(tree.score) <= 0) and 0 < tree.score[-1] < 1
    # without a memory nothing is drafted
    plain = NgramDrafter()
    plain.begin([50, 60, 2, 3, 4])
    assert plain.propose(16, 32).n_nodes == 1


def test_continuations_are_weighted_by_frequency_and_rare_ones_dropped():
    mem = DraftMemory(1)
    for _ in range(9):
        mem.write([7, 8, 9, 100, 101])
    mem.write([7, 8, 9, 200, 201])  # share 1/10: kept (>= 0.1), scored lower
    d = NgramDrafter(memory=mem)
    d.begin([1, 7, 8, 9])
    tree = d.propose(8, 32)
    kids = {int(tree.token_ids[c]): c for c in tree.children(0)}
    assert set(kids) == {100, 200}
    assert tree.score[kids[100]] > tree.score[kids[200]]
    for _ in range(10):  # now 1/20 < 0.1: dropped
        mem.write([7, 8, 9, 100, 101])
    d.begin([1, 7, 8, 9])
    tree = d.propose(8, 32)
    assert [int(tree.token_ids[c]) for c in tree.children(0)] == [100]


def test_memory_nodes_merge_with_the_requests_own_ngram_tree():
    mem = DraftMemory(1)
    mem.write([3, 4, 5, 6, 7])
    d = NgramDrafter(memory=mem)
    d.begin([3, 4, 9, 9, 3, 4])  # own history: 4 was followed by 9; the memory says 5
    tree = d.propose(8, 32)
    first = sorted(int(tree.token_ids[c]) for c in tree.children(0))
    assert first == [5, 9]
    # the same token proposed by both appears once
    mem.write([3, 4, 9, 9, 1])
    tree = d.propose(8, 32)
    assert sorted(int(tree.token_ids[c]) for c in tree.children(0)) == [5, 9]


def _displacing_memory_case():
    """A request whose own history says 4 -> 5 6 7 8 twice, and a memory that says, many
    times over, 4 -> 30 31 32 33 34 35: memory nodes scored above the n-grams' weaker ones."""
    mem = DraftMemory(1)
    for _ in range(12):
        mem.write([2, 3, 4, 30, 31, 32, 33, 34, 35, 36, 37])
    d = NgramDrafter(memory=mem)
    d.begin([9, 4, 5, 6, 7, 8, 11, 4, 5, 6, 7, 8, 12, 2, 3, 4])
    return d


def test_memory_nodes_never_displace_what_the_ngram_tree_alone_would_verify():
    """The memory adds, never displaces (``SpeculationPolicy.keep_base_plan``): the nodes the
    policy verifies from the n-gram tree alone are among the verified nodes of the merged
    tree, and the memory's come after them in the order the budget takes nodes."""
    from localspec.policy import SpeculationPolicy
    from localspec.step import propose_one

    d = _displacing_memory_case()
    merged = d.propose(16, 32)
    assert merged.base_score is not None and merged.n_nodes > merged.base_score.size
    m = merged.base_score.size
    first = dataclasses.replace(merged.subtree(np.arange(merged.n_nodes) < m), score=merged.base_score, base_score=None)
    from localspec.costmodel import CostModel

    # batches priced like this project's 2-core CPU (t(2)/t(1) 1.17): the n-grams alone pay
    pol = SpeculationPolicy(CostModel({1: 22000.0, 2: 25700.0, 4: 33400.0, 8: 51000.0, 16: 80000.0, 32: 140000.0, 64: 260000.0}))
    n = pol.choose(first).n_nodes
    assert 1 < n < m  # the n-gram tree alone verifies some of its nodes, not all
    want = {tuple(path_tokens(t, i)) for t in [first.best_subtree(n)] for i in range(1, t.n_nodes)}
    # without the rule the memory's nodes (scored higher) push n-gram ones out of the best n
    raw_best = merged.best_subtree(n)
    assert {tuple(path_tokens(raw_best, i)) for i in range(1, raw_best.n_nodes)} != want
    kept = pol.keep_base_plan(merged)
    assert kept.base_score is None
    for k in range(n, kept.n_nodes + 1):
        best = kept.best_subtree(k)
        assert want <= {tuple(path_tokens(best, i)) for i in range(1, best.n_nodes)}
    assert np.all(kept.score[1:] <= kept.score[kept.parents[1:]])  # still path probabilities
    # and a step verifies those nodes, also when its budget is only as large as they are
    for budget in (n, 32):
        prop = propose_one(pol, _displacing_memory_case(), 4, 16, budget)
        got = {tuple(path_tokens(prop.tree, i)) for i in range(1, prop.tree.n_nodes)}
        assert want <= got, budget


def test_the_request_is_written_when_it_ends_and_an_opted_out_one_leaves_no_trace():
    mem = DraftMemory(1)
    d = make_drafter("ngram", memory=mem)
    d.begin([11, 12, 13])
    d.accept([14, 15])
    assert mem.documents() == []
    d.close()
    assert [x.tolist() for x in mem.documents()] == [[11, 12, 13, 14, 15]]
    # a request that opts out: it drafts nothing from the memory and writes nothing
    before = mem.stored().copy()

    class Req:
        params = dataclasses.replace(SamplingParams.greedy(), draft_memory=False)

    d.set_sampling(Req())
    d.begin([40, 12, 13])
    tree = d.propose(8, 32)
    assert tree.n_nodes == 1  # 12 13 -> 14 15 is in the memory, but not for this request
    d.accept([14, 77])
    d.close()
    np.testing.assert_array_equal(mem.stored(), before)
    assert mem.info().observations == 0
    # the next request (not opted out) reads it again
    d.begin([40, 12, 13])
    assert path_tokens(d.propose(8, 32), 2) == [14, 15]


def test_a_chat_that_repeats_its_history_writes_only_what_is_new():
    mem = DraftMemory(1)
    d = NgramDrafter(memory=mem)
    turn1 = list(range(100, 140))
    d.begin(turn1)
    d.close()
    d.begin(turn1 + [7, 8, 9])
    d.close()
    docs = mem.documents()
    assert len(docs) == 2 and docs[1].tolist() == (turn1 + [7, 8, 9])[-(3 + 16) :]


def drafts_from(mem: DraftMemory, seq: list[int]) -> bool:
    """Whether a request whose history ends with seq[:10] gets seq[10:15] from the memory."""
    d = NgramDrafter(memory=mem)
    d.begin([1] + seq[:10])
    got = memory_nodes(d, d.propose(8, 32))[:5] == seq[10:15]
    d.close()  # writes [1] + seq[:10]: not what is looked for
    return got


def test_eviction_keeps_what_drafts_read_over_a_flood_of_unread_text():
    mem = DraftMemory(0.25)
    cap = mem.capacity
    rng = np.random.default_rng(1)
    kept = rng.integers(60000, 61000, 40).tolist()  # drafted from again and again
    once = rng.integers(61000, 62000, 40).tolist()  # drafted from once, early
    never = rng.integers(62000, 63000, 40).tolist()  # written as early, never read
    for seq in (kept, once, never):
        mem.write(seq)
    assert drafts_from(mem, kept) and drafts_from(mem, once)
    for cycle in range(8):  # 8 times the capacity of unread text
        for _ in range(cap // 100):
            mem.write(rng.integers(0, 50000, 99).tolist())
        assert drafts_from(mem, kept), f"evicted in cycle {cycle}"
        if cycle == 0:
            assert not drafts_from(mem, never)  # unread text leaves oldest first
    # what was read once survives a few rounds of eviction, not forever
    assert not drafts_from(mem, once)
    assert mem.info().bytes <= 0.25 * 2**20


def test_eviction_keeps_the_store_within_its_budget_and_the_newest_text():
    mem = DraftMemory(0.25)
    cap = mem.capacity
    rng = np.random.default_rng(0)
    first = rng.integers(0, 1000, 50).tolist()
    mem.write(first)
    for _ in range(4 * cap // 100):
        mem.write(rng.integers(0, 50000, 99).tolist())
    last = rng.integers(0, 1000, 50).tolist()
    mem.write(last)
    info = mem.info()
    assert info.bytes <= 0.25 * 2**20
    # a write makes room for itself (and one separator) before it starts
    assert info.written > 3 * cap and cap - 102 <= mem.stored().size <= cap
    d = NgramDrafter(memory=mem)
    d.begin([1] + first[:10])
    assert not memory_nodes(d, d.propose(8, 32))  # evicted
    d.begin([1] + last[:10])
    assert memory_nodes(d, d.propose(8, 32))[:5] == last[10:15]
    # the table holds only what is stored: a draft reads at most max_occurrences occurrences
    stats = np.zeros(6, dtype=np.int64)
    mem._lib.ls_memory_stats(mem._ptr, stats.ctypes.data)
    assert stats[3] <= cap * (mem.max_n - mem.min_n + 1) < stats[4]


def test_lookup_reads_at_most_max_occurrences():
    mem = DraftMemory(1, max_occurrences=5)
    for i in range(100):
        mem.write([1, 2, 3, 1000 + i])
    d = NgramDrafter(memory=mem)
    d.begin([9, 1, 2, 3])
    tree = d.propose(4, 64)
    assert mem._info[1] == 5  # occurrences read
    assert sorted(int(tree.token_ids[c]) for c in tree.children(0)) == [1095, 1096, 1097, 1098, 1099]


def test_concurrent_writers_and_drafters():
    mem = DraftMemory(0.5)
    errors = []

    def worker(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            d = NgramDrafter(memory=mem)
            for _ in range(60):
                doc = rng.integers(0, 300, 80).tolist()
                d.begin(doc[:40])
                for _ in range(3):
                    tree = d.propose(16, 32)
                    d.observe(tree, doc[40:42])
                    d.accept(doc[40:42])
                d.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(mem.documents()) > 0 and mem.info().observations > 0


# -- files ----------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    mem = DraftMemory(1, vocab="v1")
    mem.write([1, 2, 3, 4])
    mem.write([5, 6, 7])
    mem.fold(np.arange(35.0), np.arange(35.0) * 2)
    path = tmp_path / "m.lsmem"
    mem.save(path)
    back = DraftMemory.load(path, vocab="v1")
    assert [x.tolist() for x in back.documents()] == [[1, 2, 3, 4], [5, 6, 7]]
    np.testing.assert_array_equal(back.acc, mem.acc)
    np.testing.assert_array_equal(back.n, mem.n)
    assert (back.min_n, back.max_n, back.capacity) == (mem.min_n, mem.max_n, mem.capacity)
    assert not list(tmp_path.glob(".draftmem-*"))  # no temporary file left


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign", "not-a-memory", "version", "missing"])
def test_bad_files_are_one_line_errors(tmp_path, damage):
    mem = DraftMemory(1, vocab="v1")
    mem.write(list(range(100)))
    path = tmp_path / "m.lsmem"
    mem.save(path)
    data = bytearray(path.read_bytes())
    vocab = "v1"
    if damage == "corrupt":
        data[-10] ^= 0xFF
    elif damage == "truncated":
        del data[-7:]
    elif damage == "foreign":
        vocab = "v2"
    elif damage == "not-a-memory":
        data[:5] = b"GGUF\x00"
    elif damage == "version":
        data[11] = 99
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(bytes(data))
    with pytest.raises(MemoryFileError) as e:
        DraftMemory.load(path, vocab=vocab)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_save_refuses_without_a_vocabulary_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "m.lsmem"
    good = DraftMemory(1, vocab="v1")
    good.write([1, 2, 3])
    good.save(path)
    with pytest.raises(ValueError):
        DraftMemory(1).save(path)
    assert DraftMemory.load(path).documents()[0].tolist() == [1, 2, 3]


# -- with the real model: outputs never depend on the memory --------------------------------

PROMPTS = [
    "def fibonacci(n):\n    ",
    "def fibonacci(n):\n    \"\"\"Return the n-th number.\"\"\"\n    ",
    "List of primes: 2, 3, 5, 7, 11,",
]
N = 32


@pytest.fixture(scope="module")
def plain(engine):
    s = SamplingParams(temperature=0.8, seed=1234)
    out = {"greedy": [], "seeded": []}
    for p in PROMPTS:
        out["greedy"].append(engine.generate(p, max_tokens=N, sampling=SamplingParams.greedy(), speculative=False).token_ids)
        out["seeded"].append(engine.generate(p, max_tokens=N, sampling=s, speculative=False).token_ids)
    return out


def test_engine_outputs_with_memory_equal_plain(model, plain):
    from localspec import Engine

    mem = DraftMemory(4)
    with Engine(model, drafter="ngram", n_ctx=1024, cost_model=frozen_cost_model(), draft_memory=mem) as e:
        for _ in range(2):  # the second round drafts from the first one's outputs
            assert [e.generate(p, max_tokens=N, sampling=SamplingParams.greedy()).token_ids for p in PROMPTS] == plain["greedy"]
        s = SamplingParams(temperature=0.8, seed=1234)
        rs = [e.generate(p, max_tokens=N, sampling=s) for p in PROMPTS]
        assert [r.token_ids for r in rs] == plain["seeded"]
    assert len(mem.documents()) >= 3
    assert mem.info().observations > 0


def test_batched_outputs_with_memory_equal_plain(model, plain):
    mem = DraftMemory(4)
    for round_ in range(2):
        for sampling, key in ((SamplingParams.greedy(), "greedy"), (SamplingParams(temperature=0.8, seed=1234), "seeded")):
            sched = BatchScheduler(model, parallel=3, n_ctx=256, cost_model=frozen_cost_model(), draft_memory=mem)
            try:
                jobs = [sched.submit(model.tokenize(p), max_tokens=N, sampling=sampling) for p in PROMPTS]
                sched.run_until_idle()
                assert [j.wait().token_ids for j in jobs] == plain[key]
            finally:
                sched.close()
    assert len(mem.documents()) >= 6


def test_engine_memory_drafts_a_repeated_request(model):
    """A mutation that dropped the memory's drafts (or its writes) fails here: a repeated
    prompt accepts more of its tokens than the same request opted out of the memory."""
    from localspec import Engine

    mem = DraftMemory(4)
    p = "def is_prime(n):\n"
    g = SamplingParams.greedy()
    # adaptive=False: every step verifies what the drafter proposes. This tests the memory; how
    # much of its chain the policy verifies depends on the machine's host time per node, which
    # it learns online (on a 2-core Intel Xeon it verified nothing of the memory's 32-node chain
    # on 9 of 13 steps against the fixed table: 19 of 32 tokens accepted)
    with Engine(model, drafter="ngram", n_ctx=1024, cost_model=frozen_cost_model(), draft_memory=mem,
                adaptive=False) as e:  # fmt: skip
        first = e.generate(p, max_tokens=N, sampling=g)
        e.generate("Unrelated text in between.", max_tokens=4, sampling=g)
        off = e.generate(p, max_tokens=N, sampling=dataclasses.replace(g, draft_memory=False))
        on = e.generate(p, max_tokens=N, sampling=g)
        secret = "My password is hunter2 and"
        e.generate(secret, max_tokens=4, sampling=dataclasses.replace(g, draft_memory=False))
    # the opted-out requests were not written (the last document is the last request that was)
    docs = mem.documents()
    assert len(docs) == 3 and docs[-1].tolist()[-len(on.token_ids) :] == on.token_ids
    assert on.token_ids == off.token_ids == first.token_ids
    assert on.stats.num_accepted_tokens >= 0.75 * len(first.token_ids)
    assert on.stats.num_accepted_tokens > off.stats.num_accepted_tokens


# -- request fields -------------------------------------------------------------------------


def test_server_request_fields_opt_out():
    from localspec.server.fields import RequestError
    from localspec.server.openai import OAIError, parse_oai
    from localspec.server.sampling_fields import parse_sampler_fields, resolve_sampling

    class Vocab:
        n_vocab = 10

        def tokenize(self, text, **kw):
            return [1]

    d = SamplingParams()
    assert parse_oai("completion", {"prompt": "x", "draft_memory": False}, d).sampling.draft_memory is False
    assert parse_oai("completion", {"prompt": "x"}, d).sampling.draft_memory is True
    with pytest.raises(OAIError):
        parse_oai("completion", {"prompt": "x", "draft_memory": "no"}, d)
    plan = resolve_sampling(parse_sampler_fields({"draft_memory": False}), d, Vocab())
    assert plan.params.draft_memory is False
    assert resolve_sampling(parse_sampler_fields({}), d, Vocab()).params.draft_memory is True
    with pytest.raises(RequestError):
        parse_sampler_fields({"draft_memory": 0})


# -- commands -------------------------------------------------------------------------------


def run_cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "localspec", *args], capture_output=True, text=True, timeout=600)


def test_memory_build_and_info(tmp_path):
    src = tmp_path / "proj"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("def add(a, b):\n    return a + b\n")
    (src / "b.txt").write_text("hello world\n")
    (src / "blob.bin").write_bytes(b"\x00\x01\x02")
    (src / "empty.txt").write_text("")  # counted as empty, not as "not UTF-8 text"
    (src / "gone.txt").symlink_to(src / "nowhere.txt")  # a broken link: unreadable (it was "not UTF-8 text")
    (src / ".git").mkdir()
    (src / ".git" / "config").write_text("not me\n")
    out = tmp_path / "m.lsmem"
    r = run_cli("memory", "build", str(src), "--out", str(out), "--mib", "1")
    assert r.returncode == 0, r.stderr
    assert "2 files" in r.stderr and "skipped: 2 unreadable or not UTF-8 text, 1 empty)" in r.stderr, r.stderr
    r = run_cli("memory", "info", str(out), "--json")
    assert r.returncode == 0, r.stderr
    import json

    info = json.loads(r.stdout)
    assert info["documents"] == 2 and info["tokens"] > 10 and len(info["vocab"]) == 64
    out.write_bytes(out.read_bytes()[:-3])
    r = run_cli("memory", "info", str(out))
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "truncated" in r.stderr


@pytest.mark.parametrize("kind", ["damaged", "not a memory", "another model's"])
def test_generate_with_a_memory_file_it_cannot_use_goes_on_and_leaves_the_file_alone(tmp_path, kind):
    # --draft-memory PATH saves at exit: a file it could not read (a typo'd path to the user's
    # own file, another model's memory) must not be replaced by this run's memory
    path = tmp_path / "m.lsmem"
    if kind == "damaged":
        path.write_bytes(b"LSDRAFTMEM\ngarbage")
    elif kind == "not a memory":
        path.write_text("my notes, not a drafting memory\n")
    else:
        other = DraftMemory(1, vocab="0" * 64)
        other.write([1, 2, 3, 4, 5])
        other.save(path)
    before = path.read_bytes()
    r = run_cli("generate", "def add(a, b):", "-n", "8", "--temperature", "0", "--json", "--draft-memory", str(path))
    assert r.returncode == 0, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if str(path) in x]
    assert line.startswith(f"localspec: {path} ") and line.endswith(
        "; starting with an empty drafting memory, which is not saved over it (give another path, or delete the file)")
    assert path.read_bytes() == before
    # --no-draft-memory: the file is neither read nor written
    r = run_cli("generate", "def sub(a, b):", "-n", "4", "--temperature", "0", "--draft-memory", str(path), "--no-draft-memory")
    assert r.returncode == 0, r.stderr
    assert path.read_bytes() == before


def test_a_smaller_budget_drafts_from_a_memory_file_without_cutting_it(tmp_path):
    """``--draft-memory-mib`` below what the file holds kept its newest tokens and saved that
    over the file at exit, without a word: most of a built memory was gone (a new user's
    report). Now one line says so and the file stays as it was."""
    src = tmp_path / "words.txt"
    src.write_text(" ".join(f"w{i}" for i in range(20_000)) + "\n")
    path = tmp_path / "big.lsmem"
    assert run_cli("memory", "build", str(src), "--out", str(path)).returncode == 0
    before = path.read_bytes()
    n_tokens = DraftMemory.load(path).info().tokens
    kept = DraftMemory.load(path, budget_mib=1).info().tokens
    assert kept < n_tokens  # the file does not fit 1 MiB: the case under test
    r = run_cli("generate", "w19990 w19991", "-n", "4", "--temperature", "0", "--draft-memory", str(path),
                "--draft-memory-mib", "1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if str(path) in x]
    assert line == (f"localspec: {path} holds more than --draft-memory-mib 1 keeps: drafting from its newest tokens "
                    f"({n_tokens - kept} older ones left out), and not saving over it (give --draft-memory-mib 64 "
                    "to use and keep it whole)")  # fmt: skip
    assert path.read_bytes() == before


def test_generate_saves_its_memory_to_a_new_path_and_draws_on_it_next_time(tmp_path):
    path = tmp_path / "m.lsmem"
    r = run_cli("generate", "def add(a, b):", "-n", "8", "--temperature", "0", "--json", "--draft-memory", str(path))
    assert r.returncode == 0, r.stderr
    import json

    out = json.loads(r.stdout)
    (doc,) = DraftMemory.load(path).documents()
    assert doc.tolist()[-len(out["token_ids"]) :] == out["token_ids"]
    r = run_cli("generate", "def mul(a, b):", "-n", "4", "--temperature", "0", "--draft-memory", str(path))
    assert r.returncode == 0, r.stderr
    assert len(DraftMemory.load(path).documents()) == 2  # loaded, added to, saved again


def test_auto_drafts_from_the_memory_through_its_ngram_part():
    mem = DraftMemory(1)
    mem.write([1, 2, 3, 4, 5])
    d = make_drafter("auto", memory=mem)
    assert d.ngram.memory is mem
    d.begin([9, 2, 3])
    assert [int(t) for t in d.propose(8, 32).token_ids[1:3]] == [4, 5]
    assert make_drafter("ngram").memory is None


def test_bench_memory_runs_requests_in_order_with_identical_outputs(engine):
    from localspec.bench.memory import code_workload, format_report, run_memory_bench

    prompts = code_workload(2)
    seen = []
    rep = run_memory_bench(engine, [("code", prompts), ("again", prompts[:1])], max_tokens=12,
                           on_request=lambda name, i, a, b: seen.append((name, i)))  # fmt: skip
    assert seen == [("code", 0), ("code", 1), ("again", 0)]
    assert [w["identical"] for w in rep["workloads"]] == [True, True]
    again = rep["workloads"][1]
    # the repeated prompt drafts its whole output from the memory: fewer target calls
    assert again["on"]["steps"] < again["off"]["steps"]
    assert rep["memory"]["documents"] == 3
    assert "again" in format_report(rep) and engine.drafter_name == "ngram"


def test_replay_counts_target_calls_with_and_without_memory():
    from localspec.bench.memory import replay

    rng = np.random.default_rng(3)
    out = rng.integers(100, 5000, 60).tolist()
    reqs = [{"prompt": [1, 2, 3], "output": out}, {"prompt": [1, 2, 4], "output": out}]
    (row,) = replay([{"name": "w", "requests": reqs}], budget=16)
    assert row["tokens"] == 120
    # the first request has nothing to draft from (random tokens): one call per token, both sides
    # the second repeats the first: only the memory drafts it
    assert row["calls_off"] == 120
    assert row["calls_on"] < 60 + 60 // 4


def test_policy_replay_prices_each_side_with_the_policy_on_a_cost_table():
    from localspec.bench.memory import replay_policy

    rng = np.random.default_rng(3)
    out = rng.integers(100, 5000, 60).tolist()
    reqs = [{"prompt": [1, 2, 3], "output": out}, {"prompt": [1, 2, 4], "output": out}]
    table = {1: 22000.0, 2: 25700.0, 4: 33400.0, 8: 51000.0, 16: 80000.0, 32: 140000.0, 64: 260000.0}
    (row,) = replay_policy([{"name": "w", "requests": reqs}], table)
    assert row["tokens"] == 120 and row["calls_off"] == 120  # nothing to draft without the memory
    assert row["calls_on"] < 60 + 60 // 2  # the repeat is drafted from the memory
    # a plain step costs t(1) plus the host prior; the memory's steps cost more each, fewer in all
    assert row["est_us_off"] > row["est_us_on"] > row["calls_on"] * table[1]


def test_the_suffix_automaton_finds_the_longest_occurring_prefix_as_brute_force_does():
    from localspec.bench.memory import _SuffixAutomaton

    rng = np.random.default_rng(11)
    text = rng.integers(0, 3, 300).tolist()  # three symbols: many repeats, clones in the automaton
    sam = _SuffixAutomaton()
    for i, t in enumerate(text):
        sam.extend(t)
        if i % 37 == 0:
            seen = text[: i + 1]
            for _ in range(20):
                pat = rng.integers(0, 3, 12).tolist()
                want = max(n for n in range(13) if any(seen[j : j + n] == pat[:n] for j in range(len(seen) - n + 1)))
                assert sam.longest_prefix(pat) == want


def test_the_copying_bound_verifies_exactly_what_the_right_occurrence_agrees_on():
    from localspec.bench.memory import replay_bound
    from localspec.costmodel import CostModel
    from localspec.policy import SpeculationPolicy

    rng = np.random.default_rng(3)
    out = rng.choice(np.arange(100, 5000), 60, replace=False).tolist()  # no n-gram repeats inside
    reqs = [{"prompt": [1, 2, 3], "output": out}, {"prompt": [1, 2, 4], "output": out}]
    table = {1: 22000.0, 2: 25700.0, 4: 33400.0, 8: 51000.0, 16: 80000.0, 32: 140000.0, 64: 260000.0}
    (row,) = replay_bound([{"name": "w", "requests": reqs}], table, min_match=2)
    step = SpeculationPolicy(CostModel(table)).step_us
    assert row["tokens"] == 120
    # own text only: nothing repeats inside a request, one call per token
    assert row["calls_own"] == 120 and row["est_us_own"] == pytest.approx(120 * step(1))
    # with the run's earlier text: the second request's first two tokens follow (2, 4) and
    # (4, out[0]), never seen; from (out[0], out[1]) on, the first request's output agrees to
    # the last token, whose verification emits it (57 drafts and the target's own token)
    assert row["calls_mem"] == 60 + 3
    assert row["est_us_mem"] == pytest.approx(62 * step(1) + step(58))
    (capped,) = replay_bound([{"name": "w", "requests": reqs}], table, min_match=2, max_depth=20)
    assert capped["calls_mem"] == 60 + 2 + 3  # 58 tokens as 21 + 21 + 16
    with pytest.raises(ValueError):
        replay_bound([], table, min_match=0)


def test_humaneval_workload_is_each_problems_prompt_once_without_the_evaluated_ones(tmp_path):
    import gzip

    from localspec.bench.complete import spread
    from localspec.bench.memory import humaneval_workload

    rows = []
    for pid in range(50):
        for line in range(3):
            rows.append({"task_id": f"SingleLineInfilling/HumanEval/{pid}/L{line}",
                         "prompt": f"def f{pid}():\n" + "    x = 1\n" * line, "suffix": "", "canonical_solution": ""})  # fmt: skip
    path = tmp_path / "he.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    evaluated = {r["task_id"].split("/")[2] for r in spread(rows, 10)}
    got = humaneval_workload(path, leave_out_tasks=10)
    assert got == [f"def f{p}():\n" for p in range(50) if str(p) not in evaluated]
    assert 0 < len(evaluated) and len(got) == 50 - len(evaluated)
    assert humaneval_workload(path, 3, leave_out_tasks=10) == got[:3]
    plain = tmp_path / "HumanEval.jsonl"  # HumanEval's own file: one prompt per problem
    plain.write_text("".join(json.dumps({"task_id": f"HumanEval/{p}", "prompt": f"def g{p}(): pass\n"}) + "\n" for p in range(4)))
    assert humaneval_workload(plain) == [f"def g{p}(): pass\n" for p in range(4)]
    empty = tmp_path / "none.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no HumanEval problems"):
        humaneval_workload(empty)


def test_the_store_stays_within_its_budget_over_many_requests():
    budget = 0.5
    mem = DraftMemory(budget)
    d = NgramDrafter(memory=mem)
    rng = np.random.default_rng(2)
    shared = rng.integers(0, 3000, 30).tolist()  # read by every request: kept by eviction
    written = 0
    for i in range(400):
        prompt = shared + rng.integers(0, 3000, 60).tolist()
        d.begin(prompt)
        for k in range(0, 40, 4):
            d.propose(16, 32)
            d.accept(prompt[k : k + 4])  # outputs copy the prompt: drafts read the memory
        d.close()
        u = mem.usage()
        assert u["bytes"] <= budget * 2**20 and u["stored"] <= u["capacity"] and u["entries"] < u["slots"] * 2 // 3
        written = u["written"]
    # the run wrote many times the capacity (copies of what was read included), at most about
    # twice what the requests brought
    assert mem.capacity * 4 < written < 2 * 400 * (90 + 40 + 2) + mem.capacity


def test_bench_memory_rss_reports_resident_memory_against_the_budget():
    # a fresh process: in the test process, pages freed by earlier tests would hide the growth
    out = subprocess.run([sys.executable, "-m", "localspec", "bench", "memory", "--rss", "200", "--mib", "2", "--json"],
                         capture_output=True, text=True, timeout=600, check=True).stdout  # fmt: skip
    rep = json.loads(out)
    assert [s["requests"] for s in rep["samples"]] == list(range(0, 201, 20))
    last = rep["samples"][-1]
    assert last["store_mib"] <= 2 and last["written"] > 3 * rep["capacity"]  # it ran past the capacity
    assert 0 < last["growth_mib"] < 2 + 4  # the store, touched as it fills, and a little Python


# -- bench memory's workloads -------------------------------------------------------------------


def test_batch_workload_is_one_instruction_over_distinct_inputs():
    from localspec.bench.memory import batch_workload

    ps = batch_workload(200)
    assert len(ps) == len(set(ps)) == 200
    head = ps[0].split("Text:")[0]
    assert all(p.startswith(head) for p in ps)


def test_editor_workload_types_the_file_with_growing_infill_prompts(model, tmp_path):
    from localspec.bench.memory import editor_workload

    src = tmp_path / "m.py"
    src.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(40)))
    reqs = editor_workload(model, src, 5, n_ctx=2048, n_predict=16)
    assert len(reqs) == 5
    for a, b in zip(reqs, reqs[1:]):  # the next request's prefix holds the previous one's typed lines
        assert len(b.prompt) > len(a.prompt)
    # the text below the typed part (the file's last functions) is there to draft from
    tail = model.tokenize("def f39(x):", add_special=False)
    ctx = [t for c in reqs[0].draft_context for t in c] + list(reqs[0].prompt)
    assert any(ctx[i : i + len(tail)] == tail for i in range(len(ctx)))


def test_project_workload_completes_held_out_files_with_the_others_as_corpus(model, tmp_path):
    from localspec.bench.memory import project_workload

    for k in range(10):
        (tmp_path / f"mod{k}.py").write_text(
            f'"""module {k}"""\n\n\ndef fun_{k}(a, b):\n    """Add them ({k})."""\n    c = a + b\n    d = c * {k}\n    return d\n'
        )
    w = project_workload(model, tmp_path, 10, held_every=5)
    assert w.corpus_files == 8 and len(w.corpus) == 8  # mod0 and mod5 are held out
    assert w.items == ['"""module 0"""\n\n\ndef fun_0(a, b):\n    """Add them (0)."""\n',
                       '"""module 5"""\n\n\ndef fun_5(a, b):\n    """Add them (5)."""\n']  # fmt: skip
    held = model.tokenize("d = c * 5", add_special=False)
    assert not any(d[i : i + len(held)] == held for d in w.corpus for i in range(len(d)))


def test_second_turn_workload_asks_the_second_question_after_the_models_answer(model, tmp_path):
    from localspec.bench.memory import Request, second_turn_workload

    data = tmp_path / "q.jsonl"
    data.write_text("\n".join(json.dumps({"question_id": i, "category": "writing", "turns": [f"Name a colour {i}.",
                                                                                             f"Now another {i}."]})
                              for i in range(3)) + '\n{"question_id": 9, "category": "qa", "turns": ["one turn"]}\n')  # fmt: skip
    items = second_turn_workload(model, data, 2)
    assert len(items) == 4 and not items[0].measured and isinstance(items[0], Request)
    answer = type("R", (), {"text": " Blue-ish green. "})()
    second = items[1](answer)
    assert second.measured and second.stop  # the transcript format ends a turn at "\nUser:"
    assert second.prompt.index("Name a colour 0.") < second.prompt.index("Blue-ish green.") < second.prompt.index("Now another 0.")


def test_bench_memory_writes_a_corpus_first_and_counts_only_measured_requests(engine, tmp_path):
    from localspec.bench.memory import Request, Workload, format_report, plot_report, replay, run_memory_bench

    text = "def handler(request):\n    payload = request.json()\n    return Response(payload, status=201)\n"
    corpus = [engine.tokenize(text * 2, add_special=False)]
    prompt = "def handler(request):\n    payload ="
    w = Workload("proj", [Request("import json\n", measured=False), prompt], corpus=corpus, corpus_files=1)
    rep = run_memory_bench(engine, [w], max_tokens=12)
    (r,) = rep["workloads"]
    assert r["identical"] and r["n_requests"] == 1 and r["corpus_files"] == 1
    assert [q["measured"] for q in r["requests"]] == [False, True]
    assert rep["memory"]["documents"] == 3  # the corpus, then both requests
    assert r["on"]["tokens"] == r["off"]["tokens"] == len(r["requests"][1]["output"])
    (row,) = replay(rep["workloads"], budget=16)
    assert row["tokens"] == r["off"]["tokens"]
    # the corpus drafts the code that follows the prompt: fewer calls with the memory
    assert row["calls_on"] < row["calls_off"]
    assert "proj" in format_report(rep)
    plot_report(rep, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(not os.environ.get("LOCALSPEC_LLAMA_SERVER"), reason="LOCALSPEC_LLAMA_SERVER: a llama-server binary")
def test_bench_memory_sends_the_same_requests_to_llama_server_modes(engine, tmp_path):
    import argparse

    from localspec.bench.memory import Workload, run_memory_bench
    from localspec.cli.bench import _memory_peers

    text = "def handler(request):\n    payload = request.json()\n    return Response(payload, status=201)\n"
    w = Workload("proj", ["def handler(request):\n    payload ="], corpus=[engine.tokenize(text, add_special=False)])
    a = argparse.Namespace(peer_llama_server=os.environ["LOCALSPEC_LLAMA_SERVER"], peer_modes="ngram-mod,ngram-cache",
                           peer_kernels="same")  # fmt: skip
    peers = _memory_peers(a, engine, [w], tmp_path)
    try:
        assert [p.mode for p in peers] == ["ngram-mod", "ngram-cache"]
        assert "-lcs" in peers[1].args and (tmp_path / "corpus.lcs").stat().st_size > 0  # the corpus' static cache
        rep = run_memory_bench(engine, [w], max_tokens=12, peers=peers)
    finally:
        for p in peers:
            p.close()
    (r,) = rep["workloads"]
    assert set(r["peers"]) == {"ngram-mod", "ngram-cache"}
    for p in r["peers"].values():
        assert p["requests"] == 1 and p["tokens"] == 12 and p["same_output"] == 1


def test_bench_memory_prompts_cut_every_workload_but_those_given_their_own_count(engine, tmp_path):
    from localspec.cli.main import build_parser
    from localspec.cli.bench import memory_workloads

    proj = tmp_path / "proj"
    proj.mkdir()
    for k in range(10):
        (proj / f"m{k}.py").write_text("".join(f"def f{i}(x):\n    y = x + {i}\n    z = y * 2\n    return z\n\n" for i in range(5)))
    a = build_parser().parse_args(["bench", "memory", "--prompts", "3", "--batch", "7", "--project", str(proj)])
    ws = memory_workloads(a, engine)
    assert [(w.name, len(w.items)) for w in ws] == [("code", 3), ("batch", 7), ("editor:prompt.py", 3), ("project:proj", 3)]
    a = build_parser().parse_args(["bench", "memory", "--workloads", "specbench"])
    with pytest.raises(SystemExit, match="needs --dataset"):
        memory_workloads(a, engine)
    he = tmp_path / "HumanEval.jsonl"
    he.write_text("".join(json.dumps({"task_id": f"HumanEval/{p}", "prompt": f"def g{p}():\n"}) + "\n" for p in range(9)))
    a = build_parser().parse_args(["bench", "memory", "--workloads", "code", "--code-file", str(he), "--prompts", "4"])
    assert [(w.name, len(w.items)) for w in memory_workloads(a, engine)] == [("code:humaneval", 4)]
    a = build_parser().parse_args(["bench", "memory", "--workloads", "code", "--code-file", str(tmp_path / "missing.jsonl")])
    with pytest.raises(SystemExit, match="missing.jsonl"):
        memory_workloads(a, engine)


@pytest.mark.parametrize("mib", ["0", "-5", "nan"])
def test_memory_build_refuses_a_budget_that_is_not_positive(tmp_path, mib):
    from localspec.cli.main import main

    (tmp_path / "a.py").write_text("x = 1\n")
    out = tmp_path / "m.lsmem"
    with pytest.raises(SystemExit) as e:  # --mib 0 built a 64 MiB memory; -5 was a traceback
        main(["memory", "build", str(tmp_path / "a.py"), "--out", str(out), "--mib", mib])
    assert str(e.value) == f"localspec: error: --mib must be a finite number > 0, got {float(mib)}" and not out.exists()


def test_a_memory_that_cannot_be_saved_is_one_line_naming_the_given_path(tmp_path, capsys):
    # a folder that does not exist is refused before the model loads (it ran the whole
    # generation, then said "not saved" with status 0)
    path = tmp_path / "missing-folder" / "m.lsmem"
    r = run_cli("generate", "def add(a, b):", "-n", "2", "--temperature", "0", "--draft-memory", str(path))
    assert r.returncode == 1 and "loading model" not in r.stderr, r.stderr
    assert r.stderr.strip() == (f"localspec: error: --draft-memory {path}: the folder {path.parent} does not exist, "
                                "so the memory could not be saved there")  # fmt: skip
    # a folder that goes away while it runs: the save at exit names the given path, not the
    # temporary file it writes first ('.draftmem-...')
    from localspec.cli import common

    mem = DraftMemory(1, vocab="v")
    mem.write([1, 2, 3, 1, 2, 3])
    common._SAVE_AT_EXIT[str(path)] = mem
    try:
        capsys.readouterr()
        common._save_memories()
    finally:
        del common._SAVE_AT_EXIT[str(path)]
    assert capsys.readouterr().err.strip() == f"localspec: the drafting memory was not saved to {path}: No such file or directory"


def test_a_budget_too_large_to_allocate_is_a_one_line_error(tmp_path):
    """It was a bare ``MemoryError`` traceback from ``memory build --mib`` and
    ``--draft-memory-mib``; now a ``LocalSpecError`` (still a ``MemoryError``)."""
    from localspec.errors import AllocationError, LocalSpecError

    with pytest.raises(AllocationError, match="cannot allocate a drafting memory of 1e\\+09 MiB") as e:
        DraftMemory(1e9)
    assert isinstance(e.value, MemoryError) and isinstance(e.value, LocalSpecError)
    (tmp_path / "a.txt").write_text("hello world\n")
    r = subprocess.run([sys.executable, "-m", "localspec", "memory", "build", str(tmp_path / "a.txt"), "--out",
                        str(tmp_path / "m.lsmem"), "--mib", "1e9"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "localspec: error: cannot allocate a drafting memory of 1e+09 MiB: give a smaller budget"
    assert not (tmp_path / "m.lsmem").exists()


def test_an_infinite_budget_is_one_line(tmp_path):
    """``--mib inf`` and ``--draft-memory-mib inf`` were an OverflowError traceback."""
    (tmp_path / "a.txt").write_text("hello world\n")
    for args, flag in ((["memory", "build", str(tmp_path / "a.txt"), "--out", str(tmp_path / "m.lsmem"), "--mib", "inf"], "--mib"),
                       (["generate", "Hi", "-n", "1", "--draft-memory-mib", "inf"], "--draft-memory-mib")):  # fmt: skip
        r = subprocess.run([sys.executable, "-m", "localspec", *args], capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1] == f"localspec: error: {flag} must be a finite number > 0, got inf", r.stderr
    with pytest.raises(ValueError, match="finite number of MiB"):
        DraftMemory(float("inf"))
