"""Host time of a step whose drafter drafts nothing, against a plain step (issue 31).

Decodes one prompt with ``--drafter none`` and with ``--drafter ngram`` at temperature 1.5 over
the whole vocabulary (seed 5: sampled text that repeats nothing, so the n-gram drafter drafts
nothing and both runs emit the same tokens), twice each, and prints per step: host time (the
generation loop minus the time inside ``llama_decode``), ``llama_decode`` time, draft tokens,
steps, and the engine's draft / verify / other split (µs).

Usage: python scripts/host_no_draft.py
"""

from localspec.bench.host import _DecodeTimer
from localspec.engine import Engine
from localspec.sampling import SamplingParams

PROMPT = "Write a story about a dragon who learns to paint, with vivid colours:"
SAMPLING = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=5)


def main() -> None:
    for name in ("none", "ngram"):
        eng = Engine(drafter=name, n_ctx=2048)
        eng.generate(PROMPT, max_tokens=8, sampling=SamplingParams.greedy())  # warm-up
        rows = []
        for _ in range(2):
            eng.reset()
            with _DecodeTimer(eng.ctx) as tm:
                r = eng.generate(PROMPT, max_tokens=96, sampling=SAMPLING)
            st = r.stats
            llama = sum(tm.calls_us[len(tm.calls_us) - st.n_steps :])
            rows.append(dict(host_us=(st.t_generate_us - llama) / st.n_steps, decode_us=llama / st.n_steps,
                             drafted=st.num_draft_tokens, steps=st.n_steps, draft_us=st.t_draft_us / st.n_steps,
                             verify_us=st.t_verify_us / st.n_steps, other_us=st.t_other_us / st.n_steps))  # fmt: skip
        print(name, [{k: round(v) for k, v in row.items()} for row in rows])
        eng.close()


if __name__ == "__main__":
    main()
