# One-off check (issue 13): run from the repository root, `python scripts/prompt_cache_mutation.py`.
"""Mutations of the prompt cache and the moved compaction; each must fail a test of
tests/test_scheduler.py (their outputs then differ from decoding alone):

* ``whole-seq-state``: save a sequence in one piece (``llama_state_seq_get_data`` of the whole
  sequence), not window by window: the sliding-window layers' cells older than the window are
  not saved, and a prefix shared after a move lacks them;
* ``free-dropped-entry``: forget a prompt-cache entry by freeing its cells (``seq_rm`` alone)
  instead of re-tagging them to the junk sequence: a running request's next cells then land in
  the hole, before its own earlier cells.
"""
import subprocess
import sys

TESTS = {
    "whole-seq-state": "compaction_moves or cache_hit",
    "free-dropped-entry": "dropped_entry",
}
PATCH = {
    "whole-seq-state": """
from localspec.backend import context as C
def save_cells(self, seq_id, p0, p1, *, scratch):
    self.seq_cp(seq_id, scratch, p0, p1)
    try:
        return [self.seq_state(scratch)]
    finally:
        self.seq_rm(scratch, -1, -1)
C.Context.save_cells = save_cells
""",
    "free-dropped-entry": """
from localspec import scheduler as S
def _drop_entry(self, e):
    self.cache.remove(e)
    self.ctx.seq_rm(e.seq, -1, -1)
    self._free_entry_seqs.append(e.seq)
S.BatchScheduler._drop_entry = _drop_entry
""",
}

for name, sel in TESTS.items():
    conftest = "tests/conftest_mutation.py"
    with open(conftest, "w") as f:
        f.write(PATCH[name])
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest_mutation", "tests/test_scheduler.py",
                            "-k", sel], capture_output=True, text=True, env={**__import__("os").environ, "PYTHONPATH": "tests"})
    finally:
        __import__("os").remove(conftest)
    last = [ln for ln in r.stdout.splitlines() if ln.strip()][-1]
    print(f"{name}: {'caught' if r.returncode else 'NOT caught'} ({last})")
