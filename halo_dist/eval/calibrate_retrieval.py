"""Calibrate the logits-scaling base a by retrieval at long lengths (``calibrate-scaling
--objective retrieval``).

The held-out loss at 16K (``calibrate.py``) weighs every token alike, and few tokens of natural text
need far context: a base that helps recall at 32K-64K may not move it. Here each prompt is a row of
held-out filler tokens of the target length with one fact (an entity's attribute and its value)
spliced in at a random depth and, at its end, a recall question followed by the answer. A base a is
scored on a prompt by the teacher-forced negative log-likelihood of the answer's tokens (summed:
the log-probability of the whole value) and by exact match (every answer token the argmax). One
forward per prompt and base; logits only at the answer's positions, never ``[T, V]``.

The facts and questions are ``data_prep.retrieval``'s (its templates, names, attributes and value
formats), never the NIAH evaluation's, and the filler is the ``--data`` manifest's ``heldout``
split, never the Wikipedia extracts NIAH hides its needles in: a tuned on the evaluation's prompts
or haystack would be tuned on the test.

The choice is ``calibrate.choose``'s rule, paired per prompt on the answer NLL, every length's
prompts pooled: the trained a stays unless the best base lowers the mean answer NLL by more than
the 95% interval of the paired difference.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from data_prep.retrieval import ATTRS, FACTS, RECALLS, entity, value

from .calibrate import _fmt_a, choose, load_folder, write_scale_base
from .errors import EvalError
from .stats import format_rate, rate


@dataclass
class Prompt:
    ids: list[int]  # the row: filler with the fact spliced in, the question, the answer (last)
    fact_at: int  # index of the fact's first token
    answer_start: int  # index of the answer's first token
    depth: float  # share of the filler before the fact
    entity: str
    attr: str
    value: str
    filler_row: int  # which held-out row gave the filler


def _capital(line: str) -> str:
    # data_prep.retrieval capitalizes its lines ("the Ashford depot" opens a sentence)
    return line[0].upper() + line[1:]


def recall_split(template: str, fields: dict) -> tuple[str, str]:
    """A RECALLS template -> (question: its text before the value, answer: the value). The space
    before the value goes with the answer, as a tokenizer joins it to the word it precedes."""
    head = template.split("{value}")[0].format(**fields)
    question = head.rstrip()
    return _capital(question), head[len(question):] + fields["value"]


def splice(filler: list[int], fact: list[int], question: list[int], answer: list[int],
           length: int, depth: float) -> tuple[list[int], int]:
    """``length`` ids: filler with ``fact`` after ``depth`` of it, then ``question`` and ``answer``;
    and the fact's index."""
    n_fill = length - len(fact) - len(question) - len(answer)
    if n_fill < 1:
        raise EvalError(f"--lengths {length} is too short for a fact, its question and answer "
                        f"({length - n_fill} tokens)")
    if len(filler) < n_fill:
        raise EvalError(f"--data: a held-out row of {len(filler)} tokens cannot fill {n_fill}")
    at = round(depth * n_fill)
    ids = filler[:at] + fact + filler[at:n_fill] + question + answer
    return ids, at


def make_prompt(tokenizer, filler: list[int], length: int, rng: random.Random,
                filler_row: int = 0, depth: float | None = None) -> Prompt:
    """One prompt of ``length`` tokens from ``data_prep.retrieval``'s phrasings (drawn from
    ``rng``)."""
    fields = dict(entity=entity(rng), attr=rng.choice(ATTRS), value=value(rng))
    fact = _capital(rng.choice(FACTS).format(**fields))
    question, answer = recall_split(rng.choice(RECALLS), fields)
    depth = rng.random() if depth is None else depth

    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    # paragraph breaks, as data_prep.retrieval sets its lines apart from the filler
    answer_ids = enc(answer)
    ids, at = splice(filler, enc(f"\n\n{fact}\n\n"), enc(f"\n\n{question}"), answer_ids, length,
                     depth)
    return Prompt(ids, at, length - len(answer_ids), depth, fields["entity"], fields["attr"],
                  fields["value"], filler_row)


def make_prompts(tokenizer, rows: list[list[int]], length: int, n: int, seed: int) -> list[Prompt]:
    """``n`` prompts at ``length``, deterministic in ``seed``: prompt i fills with row i (the rows
    repeat, with other facts and depths, when there are fewer)."""
    rng = random.Random(f"calibrate-retrieval/{seed}/{length}")
    return [make_prompt(tokenizer, rows[i % len(rows)], length, rng, i % len(rows))
            for i in range(n)]


# ------------------------------------------------------------------------------------------------
# Filler
# ------------------------------------------------------------------------------------------------


def check_filler_data(data: str) -> None:
    """Refuse filler that is no held-out text of the user's, or that is the NIAH haystack."""
    if data == "wiki":
        raise EvalError("--data wiki: the retrieval objective needs a shard manifest (its heldout "
                        "split); the Wikipedia extracts are the NIAH haystack, not calibration "
                        "data")
    if data == "random":
        raise EvalError("--data random: the retrieval objective needs a shard manifest (its "
                        "heldout split); random tokens are no text to hide a fact in")
    if not Path(data).exists():
        raise FileNotFoundError(f"--data {data}: no such manifest")
    from ..data import DataError
    from ..data.manifest import read_manifest_json

    try:
        source = read_manifest_json(data).get("source") or {}
    except DataError:
        return  # bare shards or a broken manifest: the loader says what is wrong
    if isinstance(source, dict) and source.get("kind") == "wiki-offline":
        raise EvalError(f"--data {data} was tokenized from the Wikipedia extracts, the NIAH "
                        "haystack: give held-out shards of other text for the retrieval objective")


def check_same_tokenizer(data: str, tokenizer) -> None:
    """The facts are tokenized by the model's tokenizer and spliced between the shards' ids: the
    two must be one tokenizer (the loss objective reads ids alone and never mixes them)."""
    from ..data import DataError, check_tokenizer

    try:
        check_tokenizer(data, tokenizer)
    except DataError as e:
        raise EvalError(f"--data {data}: {e}") from None


def filler_rows(data: str, length: int, n: int) -> list[list[int]]:
    """Up to ``n`` held-out rows of ``length`` token ids, read as the loss objective reads them
    but taken as one continuous text each (a fact must stay visible across document
    boundaries, as in the NIAH haystack)."""
    from .proxies import heldout_shard_batches

    batches = heldout_shard_batches(data, length, n, 1)
    return [b["input_ids"][0].tolist() for b in batches]


# ------------------------------------------------------------------------------------------------
# Scores and the grid search
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def answer_score(model, prompt: Prompt) -> tuple[float, bool]:
    """(answer NLL summed over its tokens, every answer token the argmax) under teacher forcing."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt.ids], device=device)  # [1, T]
    hidden = model(ids, return_hidden_only=True)  # [1, T, d]
    s, n = prompt.answer_start, len(prompt.ids) - prompt.answer_start
    # positions s-1 .. s+n-2 predict the n answer tokens: [n, V] logits, never [T, V]
    logits = model.lm_head(hidden[0, s - 1 : s + n - 1]).float()
    target = ids[0, s : s + n]
    nll = F.cross_entropy(logits, target, reduction="sum")
    return float(nll), bool((logits.argmax(-1) == target).all())


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation over sqrt(n); nan for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1) / n)


def curve_point(a: float | None, scores: list[tuple[float, bool]]) -> dict:
    nll = [s[0] for s in scores]
    exact = [int(s[1]) for s in scores]
    mean, se = mean_se(nll)
    return {"a": a, "nll": mean, "nll_se": se, "exact": rate(sum(exact), len(exact)),
            "prompt_nll": nll, "prompt_exact": exact}


def retrieval_curve(model, prompts: list[Prompt], grid: list[float | None],
                    log=print) -> list[dict]:
    """One curve point per a of ``grid`` (the model's own a is restored afterwards)."""
    original = model.config.attn_logits_scale_base
    curve = []
    try:
        for a in grid:
            model.config.attn_logits_scale_base = a  # read by every attention layer at forward time
            curve.append(curve_point(a, [answer_score(model, p) for p in prompts]))
            log(f"  a = {_fmt_a(a):>6}: answer NLL {curve[-1]['nll']:.4f}  exact "
                f"{format_rate(curve[-1]['exact'])}")
    finally:
        model.config.attn_logits_scale_base = original
    return curve


def choose_retrieval(curves: dict[int, list[dict]], trained_a) -> dict:
    """``calibrate.choose`` on the answer NLL, paired per prompt over every length's prompts."""
    lengths = sorted(curves)
    pooled = []
    for i, point in enumerate(curves[lengths[0]]):
        nll = [x for t in lengths for x in curves[t][i]["prompt_nll"]]
        pooled.append({"a": point["a"], "loss": sum(nll) / len(nll), "row_losses": nll})
    choice = choose(pooled, trained_a, "loss", unit="prompts")
    return {"chosen_a": choice["point"]["a"], "pooled": pooled, "gain": choice["gain"],
            "why": f"answer NLL at {','.join(map(str, lengths))}: {choice['why']}"}


def format_table(curves: dict[int, list[dict]], chosen_a) -> str:
    """Per length: a | mean answer NLL +- se | exact match [95% interval] n (the chosen a
    starred)."""
    lines = []
    for length, curve in sorted(curves.items()):
        lines += [f"length {length}:", f"{'a':>6} | {'answer NLL +- se':>20} | exact match"]
        lines += [f"{_fmt_a(p['a']):>6} | {p['nll']:9.4f} +- {p['nll_se']:7.4f} | "
                  f"{format_rate(p['exact'])}{' *' if p['a'] == chosen_a else ''}" for p in curve]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------


def parse_lengths(text: str, default: int) -> list[int]:
    """``32K,64K`` -> ``[32768, 65536]`` (K = 1024); empty -> ``[default]``."""
    out = []
    for t in (x.strip().upper() for x in str(text).split(",")):
        if not t:
            continue
        mult = {"K": 1024, "M": 1024 * 1024}.get(t[-1:], 1)
        try:
            out.append(int(float(t[:-1] if mult > 1 else t) * mult))
        except ValueError:
            raise EvalError(f"--lengths: bad length {t!r} (use e.g. 32K,64K or 4096)") from None
    return out or [default]


def calibrate_retrieval(folder: str | Path, grid: list[float | None], data: str,
                        lengths: list[int], n_prompts: int, seed: int = 0, write: bool = True,
                        device: str = "cpu", dtype=torch.float32, log=print,
                        trust_remote_code: bool = False) -> dict:
    """Load ``folder``, score every a of ``grid`` on retrieval prompts at each length, write the
    chosen a into its config.json (unless not ``write``); returns the report."""
    check_filler_data(data)
    model, tokenizer = load_folder(folder, device, dtype, trust_remote_code)
    if tokenizer is None:
        raise EvalError(f"--objective retrieval needs a tokenizer in {folder} (the facts are text)")
    check_same_tokenizer(data, tokenizer)
    trained_a = model.config.attn_logits_scale_base
    curves, prompts = {}, {}
    for length in lengths:
        prompts[length] = make_prompts(tokenizer, filler_rows(data, length, n_prompts), length,
                                       n_prompts, seed)
        log(f"length {length}: {n_prompts} prompts")
        curves[length] = retrieval_curve(model, prompts[length], grid, log)
    choice = choose_retrieval(curves, trained_a)
    log(format_table(curves, choice["chosen_a"]))
    log(choice["why"])
    if write:
        write_scale_base(folder, choice["chosen_a"])
        log(f"wrote attn_logits_scale_base = {_fmt_a(choice['chosen_a'])} into "
            f"{Path(folder) / 'config.json'}")
    return {"model": str(folder), "objective": "retrieval", "data": data, "lengths": lengths,
            "prompts_per_length": n_prompts, "seed": seed, "trained_a": trained_a,
            "curves": {str(t): c for t, c in curves.items()},
            "prompts": {str(t): [_prompt_record(p) for p in ps] for t, ps in prompts.items()},
            **choice}


def _prompt_record(p: Prompt) -> dict:
    # the ids are the filler's and the tokenizer's: the record says where, what and which row
    record = asdict(p)
    record["length"] = len(record.pop("ids"))
    return record


def run_from_args(args, grid: list[float | None]) -> dict:
    """``calibrate-scaling --objective retrieval`` (arguments checked before the model loads)."""
    lengths = parse_lengths(args.lengths, args.seq_len)
    if args.prompts < 1 or min(lengths) < 2:
        raise EvalError("--prompts must be >= 1 and every --lengths value >= 2")
    check_filler_data(args.data)
    from .loading import parse_dtype

    return calibrate_retrieval(args.model, grid, args.data, lengths, args.prompts, args.seed,
                               write=not args.dry_run, device=args.device,
                               dtype=parse_dtype(args.dtype),
                               trust_remote_code=args.trust_remote_code)
