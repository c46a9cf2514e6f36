# One-off check (issue 13): run from the repository root, `python scripts/scheduler_mutation.py`.
"""Mutation: free rejected cells (as the single-request cache does) instead of re-tagging them
to the junk sequence; batched logprobs must then differ from alone."""
import dataclasses, sys
sys.path.insert(0, "tests")
from conftest import fixed_cost_model
from localspec import Engine, SamplingParams
from localspec.backend import Model
from localspec.models import default_model_path
from localspec import scheduler as S
from test_scheduler import PROMPTS, N
m = Model(default_model_path())
g = dataclasses.replace(SamplingParams.greedy(), logprobs=0)
eng = Engine(m, drafter="ngram", n_ctx=2048, cost_model=fixed_cost_model())
ref = []
for p in PROMPTS:
    eng.reset(); r = eng.generate(p, max_tokens=N, sampling=g); ref.append([x.logprob for x in r.logprobs])
eng.close()
def run():
    sch = S.BatchScheduler(m, parallel=3, n_ctx=256, cost_model=fixed_cost_model(), adaptive=False)
    jobs = [sch.submit(m.tokenize(p), max_tokens=N, sampling=g) for p in PROMPTS]
    sch.run_until_idle(); out = [[x.logprob for x in j.wait().logprobs] for j in jobs]; sch.close(); return out
print("correct:", run() == ref)
orig = S.BatchScheduler._commit
def freeing_commit(self, s, tree, lay, path):
    junk = self.junk_seq
    class NoJunk:  # route the junk copies nowhere: rejected cells are freed
        pass
    real_cp = self.ctx.seq_cp
    self.ctx.seq_cp = lambda a, b, p0=-1, p1=-1: None if b == junk else real_cp(a, b, p0, p1)
    try:
        orig(self, s, tree, lay, path)
    finally:
        self.ctx.seq_cp = real_cp
S.BatchScheduler._commit = freeing_commit
mut = run()
print("mutant equal:", mut == ref, "rows differing:", sum(a != b for x, y in zip(mut, ref) for a, b in zip(x, y)))
