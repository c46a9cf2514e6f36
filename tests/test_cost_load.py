"""The cost table under load (issue 31): a table measured under contention is not cached as
the machine's truth, a cached table that the machine beats for long expires, and the policy
goes back to verifying trees when the load goes away. Timings are injected (scripted clocks,
fed-back step times), never real load."""

import json
import os

import pytest

from conftest import FIXED_COSTS_US, fixed_cost_model
from localspec.costmodel import calibrate, load_during_calibration
from localspec.policy import SpeculationPolicy
from localspec.tree import TokenSource, TokenTree


def verbatim_chain(n=16):
    """What an n-gram drafter proposes on text that repeats itself verbatim."""
    return TokenTree.chain(1, list(range(10, 10 + n)), TokenSource.NGRAM, [0.97 ** (i + 1) for i in range(n)])


def loaded_then_quiet(pol: SpeculationPolicy, *, rows: int = 1, quiet_steps: int = 40) -> tuple[int, int]:
    """Feed ``pol`` a loaded phase, then a quiet one; returns the verified-tree sizes chosen for
    ``verbatim_chain()`` at the end of each phase.

    Loaded (1-minute load 5 on 2 cores): the plain steps take 3.5x their quiet time; the
    steps that verified trees (8 rows) ran in bursts, 10x their quiet time, with the host
    work slowed as much. Quiet: the table's times. ``rows`` is the plain step's batch
    (several requests decoded together, ``BatchScheduler``)."""
    t = fixed_cost_model().t_decode_us
    chain = verbatim_chain()
    for _ in range(12):
        pol.observe_step(rows, 3.5 * t(rows), 3.5 * 1500.0)
        pol.observe_step(rows, 3.5 * t(rows), 3.5 * 1500.0)
        pol.observe_step(8, 10.0 * t(8), 10.0 * (1500.0 + 7 * 100.0))
    loaded = pol.choose(chain).n_nodes
    for _ in range(quiet_steps):
        pol.observe_step(rows, t(rows), 1500.0)
    return loaded, pol.choose(chain).n_nodes


def test_the_policy_verifies_trees_again_when_the_load_goes_away():
    """Under load the trees that ran in bursts priced every tree dear and the policy went
    plain on verbatim text; since only verified trees re-measure those prices, the policy
    stayed plain after the load went (the issue: 128 steps, 7 drafted). Now what was learned
    under a load that has since fallen 1.5x is forgotten."""
    cm = fixed_cost_model()
    pol = SpeculationPolicy(cm, max_nodes=64)
    assert pol.choose(verbatim_chain()).n_nodes > 1  # quiet, before any load
    loaded, quiet = loaded_then_quiet(pol)
    assert loaded == 1  # the loaded phase did stop the drafting: the state to recover from
    assert quiet > 1
    assert cm.ratio(8) == pytest.approx(FIXED_COSTS_US[8] / FIXED_COSTS_US[1])  # back to the table
    assert pol.t_host_node_us == 100.0


def test_the_policy_stays_plain_while_the_load_lasts():
    """Forgetting follows the load, not the clock: while the plain steps stay slow, the
    prices learned under that load stand."""
    pol = SpeculationPolicy(fixed_cost_model(), max_nodes=64)
    loaded_then_quiet(pol, quiet_steps=0)
    for _ in range(200):
        pol.observe_step(1, 3.5 * FIXED_COSTS_US[1], 3.5 * 1500.0)
    assert pol.choose(verbatim_chain()).n_nodes == 1


def test_batched_steps_recover_too():
    """With several requests decoded together the plain steps are batches (never b = 1): the
    load is read from every size, so the price of the trees learned in the bursts is
    forgotten without a single-token step. (Before, the quiet batches of 4 brought back
    trees of 4 nodes, but 8 rows stayed priced at 33 plain decodes for good.)"""
    pol = SpeculationPolicy(fixed_cost_model(), max_nodes=64)
    loaded, quiet = loaded_then_quiet(pol, rows=4)
    assert loaded == 1
    assert quiet == SpeculationPolicy(fixed_cost_model(), max_nodes=64).choose(verbatim_chain()).n_nodes == 8
    assert pol.cost.ratio(8) == pytest.approx(FIXED_COSTS_US[8] / FIXED_COSTS_US[1], rel=0.01)


def test_the_first_batch_timed_in_a_burst_moves_its_price_a_bounded_step():
    """The first observation of a size was taken as it came: one decode of 8 in a 10x burst
    priced 8 nodes at 4.9x their table ratio and, through the correction of unobserved
    sizes, every other size at 3.2x."""
    cm = fixed_cost_model()
    r8, r16 = cm.ratio(8), cm.ratio(16)
    cm.observe(8, 10 * FIXED_COSTS_US[8])
    assert cm.ratio(8) <= 2.0 * r8
    assert cm.ratio(16) <= 1.5 * r16


def test_load_during_calibration():
    quiet = {1: [12900.0, 13100.0, 12950.0], 4: [29000.0, 31000.0, 29500.0]}
    assert load_during_calibration(quiet, 0.97) is None
    assert load_during_calibration(quiet, None) is None  # GPU: no CPU-share check
    assert "45%" in load_during_calibration(quiet, 0.45)
    # one stalled sample of three: the median drops it, as it drops the other sizes' one
    stall = {1: [12900.0, 42000.0, 13000.0], 4: quiet[4]}
    assert load_during_calibration(stall, 0.97) is None
    lasted = {1: [12900.0, 42000.0, 17500.0], 4: quiet[4]}  # two of three slow: the median moved
    assert "12.9-42.0 ms" in load_during_calibration(lasted, 0.97)
    assert "12.9-42.0 ms" in load_during_calibration(lasted, None)
    assert "12.9-17.0 ms" in load_during_calibration({1: [12900.0, 17000.0]}, None)  # two rounds: either way


# -- real calibrations (3 sizes, 2 rounds) with scripted clocks -----------------------------


@pytest.fixture(scope="module")
def ctx(model):
    from localspec.backend import Context

    c = Context(model, n_ctx=512)
    yield c
    c.close()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path))
    return tmp_path / "costs.json"


class Scripted:
    """A clock for ``calibrate``, read just before and just after each timed decode: each
    decode takes the next of ``seconds`` (cycled)."""

    def __init__(self, seconds):
        self.seconds, self.now, self.reads = list(seconds), 1000.0, 0

    def __call__(self) -> float:
        if self.reads % 2:
            self.now += self.seconds[(self.reads // 2) % len(self.seconds)]
        self.reads += 1
        return self.now


def never() -> float:
    raise AssertionError("measured instead of using the cache")


SIZES = (1, 2, 4)
QUIET_S = [0.0129, 0.0267, 0.0328]  # one round: b = 1, 2, 4


def clocks(wall_s, share, ctx):
    """Scripted wall and CPU clocks: the CPU time is ``share`` of what the decode's threads
    could have had."""
    cpus = min(ctx.n_threads, len(os.sched_getaffinity(0)))
    return Scripted(wall_s), Scripted([w * cpus * share for w in wall_s])


def entries(cache):
    return json.loads(cache.read_text()) if cache.exists() else {}


def test_a_table_measured_under_contention_is_used_but_not_cached(ctx, cache):
    wall, cpu = clocks(QUIET_S, 0.45, ctx)
    cm = calibrate(ctx, sizes=SIZES, reps=2, clock=wall, cpu_clock=cpu)
    assert "45%" in cm.contended
    assert cm.table_us == pytest.approx({1: 12900.0, 2: 26700.0, 4: 32800.0})  # used for this run
    assert entries(cache) == {}
    wall, cpu = clocks(QUIET_S, 0.95, ctx)
    quiet = calibrate(ctx, sizes=SIZES, reps=2, clock=wall, cpu_clock=cpu)
    assert quiet.contended is None and len(entries(cache)) == 1
    again = calibrate(ctx, sizes=SIZES, reps=2, clock=never, cpu_clock=never)
    assert again.table_us == quiet.table_us and again.cache_ref is not None


def test_a_calibration_whose_single_token_times_disagree_is_not_cached(ctx, cache):
    """A burst during the second round: t(1) took 12.9 ms, then 42 ms (the CPU share alone
    would not tell: the burst did not take this process's CPU time)."""
    wall, cpu = clocks(QUIET_S + [0.042] + QUIET_S[1:], 1.0, ctx)
    cm = calibrate(ctx, sizes=SIZES, reps=2, clock=wall, cpu_clock=cpu)
    assert "12.9-42.0 ms" in cm.contended and entries(cache) == {}


def test_a_cached_table_that_the_machine_beats_for_long_expires(ctx, cache):
    """A table measured 3.3x slow under a load the calibration did not see (t(1) = 42 ms,
    12.9 ms quiet) was cached. The machine runs 12.9 ms steps: after ``expire_after`` of them
    in a row the run uses the online-corrected table, and the cache entry is gone so that
    the next run measures again; one step fewer keeps both, and so does a run of them that a
    loaded spell interrupted."""
    wall, cpu = clocks([3.26 * s for s in QUIET_S], 1.0, ctx)
    calibrate(ctx, sizes=SIZES, reps=2, clock=wall, cpu_clock=cpu)
    cm = calibrate(ctx, sizes=SIZES, reps=2, clock=never, cpu_clock=never)
    assert cm.table_us[1] == pytest.approx(42054.0) and len(entries(cache)) == 1
    for _ in range(cm.expire_after // 2):
        cm.observe(1, 12900.0)
    while cm.load() < cm.expire_below:  # a loaded spell interrupts the run: counting restarts
        cm.observe(1, 42000.0)
    while cm.load() >= cm.expire_below:
        cm.observe(1, 12900.0)
    for _ in range(cm.expire_after - 2):
        cm.observe(1, 12900.0)
    assert cm.rebased == 0 and len(entries(cache)) == 1
    cm.observe(1, 12900.0)
    assert cm.rebased == 1 and entries(cache) == {}
    assert cm.table_us[1] == pytest.approx(12900.0, rel=0.01)
    assert cm.table_us[4] / cm.table_us[1] == pytest.approx(32800.0 / 12900.0)  # the ratios kept
    assert cm.load() == 1.0


def test_a_cached_table_is_kept_while_the_machine_is_loaded(ctx, cache):
    """Slower than its table for long is load now (or a longer context): the quiet table stays
    in the cache and in the run, as what the online state returns to."""
    wall, cpu = clocks(QUIET_S, 1.0, ctx)
    calibrate(ctx, sizes=SIZES, reps=2, clock=wall, cpu_clock=cpu)
    cm = calibrate(ctx, sizes=SIZES, reps=2, clock=never, cpu_clock=never)
    table = dict(cm.table_us)
    for _ in range(5 * cm.expire_after):
        cm.observe(1, 3.26 * 12900.0)
    assert cm.rebased == 0 and cm.table_us == table and len(entries(cache)) == 1
    assert cm.load() == pytest.approx(3.26)


def test_an_entry_measured_again_meanwhile_is_not_dropped(ctx, cache):
    """Another process measured the key again after this run loaded it: this run's expiry
    must not drop the new entry."""
    wall, cpu = clocks([3.26 * s for s in QUIET_S], 1.0, ctx)
    calibrate(ctx, sizes=SIZES, reps=2, clock=wall, cpu_clock=cpu)
    cm = calibrate(ctx, sizes=SIZES, reps=2, clock=never, cpu_clock=never)
    wall, cpu = clocks(QUIET_S, 1.0, ctx)
    calibrate(ctx, sizes=SIZES, reps=2, use_cache=False, clock=wall, cpu_clock=cpu)
    data = entries(cache)
    (key,) = data
    data[key]["table_us"]["1"] = 12900.0
    cache.write_text(json.dumps(data))
    for _ in range(cm.expire_after):
        cm.observe(1, 12900.0)
    assert cm.rebased == 1 and entries(cache) == data


def test_calibration_schedule_rounds_on_the_cpu_and_runs_of_a_size_on_a_gpu():
    from localspec.costmodel import calibration_schedule

    assert calibration_schedule([1, 2, 4], 2, cpu_only=True) == [(1, True), (2, True), (4, True)] * 2
    gpu = calibration_schedule([1, 2], 2, cpu_only=False)
    assert gpu == [(1, False), (1, False), (1, True), (1, True), (2, False), (2, False), (2, True), (2, True)]
    assert calibration_schedule([1, 2], 1, cpu_only=False, order="rounds") == [(1, True), (2, True)]
    with pytest.raises(ValueError, match="rounds"):
        calibration_schedule([1], 1, cpu_only=True, order="sideways")


def test_a_gpu_calibration_times_each_size_in_a_row_after_an_untimed_decode(ctx, cache, monkeypatch):
    """Layers on a GPU: each size is timed in a run of its own (CUDA graphs are replayed only
    between decodes of one shape), so the k-th timed decode of the table is size-major."""
    monkeypatch.setattr(ctx.model, "on_local_gpu", True)
    # per timed decode, in the order decoded: b = 1, 1, 2, 2, 4, 4
    wall = Scripted([0.0015, 0.0015, 0.0040, 0.0040, 0.0042, 0.0042])
    cpu = Scripted([0.0] * 6)
    seen = []
    cm = calibrate(ctx, sizes=SIZES, reps=2, clock=wall, cpu_clock=cpu, progress=lambda d, n: seen.append((d, n)))
    assert cm.table_us == pytest.approx({1: 1500.0, 2: 4000.0, 4: 4200.0})
    assert wall.reads == 2 * 6  # the untimed decodes read no clock
    assert seen[-1] == (6, 6) and len(seen) == 6


# A quiet 2-core Intel Xeon (AVX-512, 2026-12-06), every candidate size: t(1) is about t(2), so
# the power law through the table puts t(1) 2.6x below what each of three rounds measured
# (docs/results/cost-table-xeon-2026-12-06.json; the rounds' t(1): 22.4, 24.2, 21.9 ms)
XEON_TABLE_US = {
    1: 22400.0, 2: 21000.0, 3: 24800.0, 4: 27400.0, 5: 32200.0, 6: 34700.0, 7: 39400.0, 8: 40000.0,
    9: 47400.0, 10: 48900.0, 11: 52500.0, 12: 61900.0, 13: 62000.0, 14: 63100.0, 15: 67300.0,
    16: 69300.0, 20: 87500.0, 24: 102600.0, 28: 129900.0, 32: 137400.0, 40: 169800.0,
    48: 217700.0, 56: 236900.0, 64: 276100.0,
}  # fmt: skip


def test_repeated_sizes():
    from localspec.costmodel import repeated_sizes

    assert repeated_sizes({1: [22400.0, 24200.0, 21900.0], 4: [27400.0, 27000.0, 28100.0]}) == {1, 4}
    assert repeated_sizes({1: [9800.0, 22000.0, 23000.0]}) == frozenset()  # two of three in a burst
    assert repeated_sizes({1: [9800.0, 30000.0, 9900.0]}) == {1}  # one: the median drops it
    assert repeated_sizes({1: [22400.0, 22500.0]}) == frozenset()  # too few to tell


def test_a_flat_start_cpu_keeps_the_single_token_time_it_measured():
    """The power law through the Xeon's table takes its t(1) for a burst and prices it at
    8.7 ms, so that a tree of 2 looks 2.4x a plain step where it costs 0.94x. Its samples
    repeated, so it is kept; the same entry whose samples disagree is still replaced."""
    from localspec.costmodel import CostModel

    assert CostModel(dict(XEON_TABLE_US)).outliers == [1]  # the table alone cannot tell
    cm = CostModel(dict(XEON_TABLE_US), repeated=frozenset({1}))
    assert cm.outliers == [] and cm.t_decode_us(1) == pytest.approx(22400.0)
    assert cm.ratio(2) == 1.0 and cm.ratio(8) == pytest.approx(40000.0 / 22400.0)
    assert cm.to_json()["repeated"] == [1]


def test_a_calibration_keeps_and_caches_what_repeated(ctx, cache):
    """A calibration in rounds records the sizes whose samples repeated, the cache keeps
    them, and a table loaded from the cache is judged with them (a table with an outlier
    would be measured again on every run)."""
    rounds = [0.0224, 0.0210, 0.0274, 0.0242, 0.0212, 0.0270, 0.0219, 0.0208, 0.0281]
    wall, cpu = clocks(rounds, 1.0, ctx)
    cm = calibrate(ctx, sizes=SIZES, reps=3, clock=wall, cpu_clock=cpu)
    assert cm.contended is None and cm.repeated == {1, 2, 4}
    (entry,) = entries(cache).values()
    assert entry["repeated"] == [1, 2, 4]
    again = calibrate(ctx, sizes=SIZES, reps=3, clock=never, cpu_clock=never)
    assert again.repeated == {1, 2, 4} and again.table_us == cm.table_us
    # two of three t(1) in a burst: not repeated (and not cached: load_during_calibration)
    wall, cpu = clocks([0.0098, 0.0210, 0.0274, 0.0220, 0.0212, 0.0270, 0.0230, 0.0208, 0.0281], 1.0, ctx)
    burst = calibrate(ctx, sizes=SIZES, reps=3, use_cache=False, clock=wall, cpu_clock=cpu)
    assert burst.repeated == {2, 4} and burst.contended is not None


def test_an_expired_table_keeps_the_single_token_time_the_plain_steps_measured():
    """A table measured 5x slow whose t(1) the fit replaced (no samples to tell: a cache entry
    from before, or a calibration in runs) expires after the machine beat it for long; the
    new table's t(1) is the average of those plain steps, which is kept."""
    from localspec.costmodel import CostModel

    cm = CostModel({b: 5 * t for b, t in XEON_TABLE_US.items()})
    assert cm.outliers == [1]
    for _ in range(cm.expire_after):
        cm.observe(1, 22400.0)
    assert cm.rebased == 1 and cm.outliers == [] and 1 in cm.repeated
    assert cm.t_decode_us(1) == pytest.approx(22400.0)
