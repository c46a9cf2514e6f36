import numpy as np

from conftest import fixed_cost_model
from localspec.policy import AcceptanceTracker, SpeculationPolicy
from localspec.tree import TokenSource, TokenTree


def chain_with(p_each, n):
    scores = [p_each ** (i + 1) for i in range(n)]
    return TokenTree.chain(1, list(range(10, 10 + n)), TokenSource.NGRAM, scores)


def test_confident_long_chain_is_verified_whole():
    pol = SpeculationPolicy(fixed_cost_model(), max_nodes=64)
    c = pol.choose(chain_with(0.999, 40))
    assert c.n_nodes >= 24
    assert c.expected_tokens > 20


def test_weak_drafts_are_not_verified():
    pol = SpeculationPolicy(fixed_cost_model(), max_nodes=64)
    assert pol.choose(chain_with(0.3, 10)).n_nodes == 1
    assert pol.choose(TokenTree.root_only(5)).n_nodes == 1


def test_choice_maximises_expected_rate_over_the_cost_table():
    cm = fixed_cost_model()
    pol = SpeculationPolicy(cm, max_nodes=64, min_gain=0.0)
    tree = chain_with(0.9, 30)
    c = pol.choose(tree)
    rates = {}
    for b in cm.sizes:
        e = 1 + sum(0.9 ** (i + 1) for i in range(b - 1))
        rates[b] = e / (cm.t_decode_us(b) + pol.host_us(b))
    assert c.n_nodes == max(rates, key=rates.get)


def test_min_gain_guards_marginal_choices():
    cm = fixed_cost_model()
    tight = SpeculationPolicy(cm, max_nodes=64, min_gain=0.5)
    loose = SpeculationPolicy(cm, max_nodes=64, min_gain=0.0)
    tree = chain_with(0.8, 8)
    assert loose.choose(tree).n_nodes > 1
    assert tight.choose(tree).n_nodes == 1


def test_online_costs_replace_the_table():
    cm = fixed_cost_model()
    pol = SpeculationPolicy(cm, max_nodes=64)
    for _ in range(5):
        pol.observe_step(8, 200000.0, 1000.0)  # a suddenly slow machine for b = 8
    assert cm.t_decode_us(8) > 150000


def test_tracker_learns_per_request_and_long_run():
    t = AcceptanceTracker(np.array([0.5, 0.5]))
    for _ in range(20):
        t.record(0, True)
        t.record(1, False)
        t.end_step()
    assert t.estimate(0) > 0.9 and t.estimate(1) < 0.2
    t.reset_request()
    # the long-run rate keeps what was learned, less strongly than the request did
    assert 0.5 < t.estimate(0) < 0.99 and t.estimate(1) < 0.5
    assert np.allclose(t.estimates(), [t.estimate(0), t.estimate(1)])
