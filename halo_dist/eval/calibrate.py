"""Calibrate the logits-scaling base a of a trained HypeNet.

Attention layers scale queries by s_t = ln(t + a) / ln(a). After training, a is grid-searched by the
held-out next-token loss on long documents at a target length; the chosen a is written into the
exported folder's ``config.json`` (atomically) and the loss curve is printed.

The choice resists noise: the a the model was trained with (its config's) stays unless another base
lowers the loss by more than two standard errors of the row-by-row difference (the same rows score
every base, so the difference is paired). A few thousand tokens cannot tell bases 0.01 nats apart,
and swapping the trained value for noise is a change nobody asked for.

Data (``--data``): a manifest of pre-tokenized shards (its ``heldout`` split, packed at the target
length with document boundaries: use a long-document set so positions reach the target), ``wiki``
(offline Wikipedia extracts, EOS-separated, packed into rows with continuous positions — always
available; rows come from the last extracts), or
``random`` (smoke runs only). The loss is computed chunk-wise from hidden states, never as full
``[T, V]`` logits; ``tail_loss`` covers the second half of each row (the long positions).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import EvalError

DEFAULT_GRID = ("none", 50, 100, 200, 300, 500, 700, 1000, 2000, 5000)
IGNORE = -100


def parse_grid(text: str) -> list[float | None]:
    """``none,100,300,500`` -> ``[None, 100.0, 300.0, 500.0]`` (``none`` = scaling off). Every a
    must be > 1."""
    grid = []
    for t in str(text).split(","):
        t = t.strip().lower()
        if not t:
            continue
        if t in ("none", "off", "0"):
            grid.append(None)
            continue
        try:
            a = float(t)
        except ValueError:
            raise EvalError(f"--grid values must be numbers > 1 or 'none', got {t!r}") from None
        if not math.isfinite(a) or a <= 1:
            raise EvalError(f"--grid value {t} must be > 1 (the base of a logarithm) or 'none'")
        grid.append(a)
    if not grid:
        raise EvalError("--grid is empty")
    return grid


def check_hypenet_folder(folder: str | Path) -> dict:
    """The folder's ``config.json`` as a dict; refuses non-HypeNet models and models without
    attention."""
    cfg_path = Path(folder) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: --model must be an exported HypeNet folder")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("model_type") != "hypenet":
        raise EvalError(f"{folder} holds a {cfg.get('model_type')!r} model; logits scaling exists "
                        "only in HypeNet")
    if "attention" not in cfg.get("mixer_types", []):
        raise EvalError(f"{folder} has no attention layers: the logits-scaling base a has no "
                        "effect")
    return cfg


def write_scale_base(folder: str | Path, a: float | None) -> Path:
    """Set ``attn_logits_scale_base`` in ``<folder>/config.json`` (``outputs.write_text_atomic``:
    temp file + rename, under the umask: the export stays readable to whom it was), and in the
    model card of a folder halo_dist wrote."""
    from ..models.export import write_model_card
    from ..outputs import read_marker, write_text_atomic

    path = Path(folder) / "config.json"
    cfg = json.loads(path.read_text())
    cfg["attn_logits_scale_base"] = a
    write_text_atomic(path, json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if read_marker(Path(folder)) is not None:
        write_model_card(folder)
    return path


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------


def long_batches(data: str, tokenizer, seq_len: int, n_rows: int, batch_size: int,
                 vocab_size: int) -> list[dict]:
    """``[{"input_ids", "labels", (packed: "position_ids", "cu_seqlens", "max_seqlen")}]`` at
    ``seq_len``."""
    if data == "random":
        from .proxies import random_token_batches

        batches = random_token_batches(vocab_size, seq_len, n_rows, batch_size)
    elif data == "wiki":
        if tokenizer is None:
            raise EvalError("--data wiki needs a tokenizer in the model folder")
        from .proxies import heldout_text_batches

        batches = heldout_text_batches(tokenizer, seq_len, n_rows, batch_size)
    else:
        if not Path(data).exists():
            raise FileNotFoundError(f"--data {data}: no such manifest (or use 'wiki' / 'random')")
        from .proxies import heldout_shard_batches

        batches = heldout_shard_batches(data, seq_len, max(1, n_rows // batch_size), batch_size)
    for b in batches:
        if "labels" not in b:
            ids = b["input_ids"]
            b["labels"] = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)
    return batches


# ------------------------------------------------------------------------------------------------
# Loss and the grid search
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def heldout_loss(model, batches: list[dict], chunk_tokens: int = 4096) -> dict:
    """Mean next-token CE over all tokens and over the second half of each row (``tail_loss``), and
    each row's mean CE (``row_losses``, in batch order: the rows are the independent units a
    standard error or a paired comparison of two models counts)."""
    device = next(model.parameters()).device
    total, count, tail_total, tail_count = 0.0, 0, 0.0, 0
    rows, tail_rows = [], []
    for batch in batches:
        kwargs = {k: batch[k].to(device) for k in ("position_ids", "cu_seqlens") if k in batch}
        if "max_seqlen" in batch:
            kwargs["max_seqlen"] = batch["max_seqlen"]
        # [B, T, d]
        hidden = model(batch["input_ids"].to(device), return_hidden_only=True, **kwargs)
        labels = batch["labels"].to(device)
        T = labels.shape[1]
        # [B * T] per-token losses, 0 where ignored
        losses = _token_losses(model, hidden.flatten(0, 1), labels.flatten(), chunk_tokens)
        valid = (labels != IGNORE).flatten()
        tail = torch.zeros_like(labels, dtype=torch.bool)
        tail[:, T // 2 :] = True
        in_tail = valid & tail.flatten()
        total += float(losses.sum())
        count += int(valid.sum())
        tail_total += float(losses[in_tail].sum())
        tail_count += int(in_tail.sum())
        # [B * T] -> [B, T]: one mean per row, over the row and over its second half
        rows += _row_means(losses.view(-1, T), valid.view(-1, T))
        tail_rows += _row_means(losses.view(-1, T), in_tail.view(-1, T))
    if count == 0:
        raise EvalError("the calibration batches hold no scored tokens")
    return {"loss": total / count, "tail_loss": tail_total / max(1, tail_count), "tokens": count,
            "row_losses": rows, "row_tail_losses": tail_rows}


def _row_means(losses: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """[B, T] losses and mask -> the mean loss of each row's masked positions (rows with none
    left out)."""
    sums, counts = (losses * mask).sum(1), mask.sum(1)
    return [float(x / c) for x, c in zip(sums, counts) if c > 0]


def _token_losses(model, hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int):
    """Next-token CE of every position ([N, d] hidden states, [N] labels) in float32, through the
    head a chunk of positions at a time (a full [N, vocab] logits tensor would not fit at 16K)."""
    out = torch.zeros(labels.shape[0], dtype=torch.float32, device=labels.device)
    for s in range(0, hidden.shape[0], chunk_tokens):
        out[s : s + chunk_tokens] = F.cross_entropy(
            model.lm_head(hidden[s : s + chunk_tokens]).float(), labels[s : s + chunk_tokens],
            ignore_index=IGNORE, reduction="none")
    return out


def grid_search(model, batches: list[dict], grid: list[float | None], log=print) -> list[dict]:
    """Held-out loss for every a of ``grid`` (the model's own a is restored afterwards)."""
    original = model.config.attn_logits_scale_base
    curve = []
    try:
        for a in grid:
            model.config.attn_logits_scale_base = a  # read by every attention layer at forward time
            point = {"a": a, **heldout_loss(model, batches)}
            curve.append(point)
            log(f"a = {_fmt_a(a):>6}: loss {point['loss']:.4f}  tail {point['tail_loss']:.4f}")
    finally:
        model.config.attn_logits_scale_base = original
    return curve


def best_point(curve: list[dict], by: str = "loss") -> dict:
    if by not in ("loss", "tail_loss"):
        raise EvalError(f"--select-by must be 'loss' or 'tail_loss', got {by!r}")
    return min(curve, key=lambda p: p[by])


def choose(curve: list[dict], trained_a, by: str = "loss", unit: str = "rows") -> dict:
    """The chosen point and why: the lowest loss replaces the trained a (or no scaling, when the
    trained a is not in the grid) only when its paired row-by-row gain exceeds two standard
    errors. ``unit`` names the paired items in ``why`` (the retrieval objective's are prompts)."""
    from .stats import paired_difference

    best = best_point(curve, by)
    reference = next((p for p in curve if p["a"] == trained_a), None) or next(
        (p for p in curve if p["a"] is None), best)
    rows = "row_losses" if by == "loss" else "row_tail_losses"
    if best is reference or len(best.get(rows, [])) < 2:
        return {"point": best, "reference_a": reference["a"], "gain": None,
                "why": "the lowest loss" + (" is the reference" if best is reference else "")}
    # loss(best) - loss(reference), row by row: negative is a gain
    diff = paired_difference(best[rows], reference[rows])
    clears = diff["ci95"][1] < 0
    why = (f"a = {_fmt_a(best['a'])} beats a = {_fmt_a(reference['a'])} by "
           f"{-diff['diff']:.4f} nats (95% CI {-diff['ci95'][1]:.4f} to {-diff['ci95'][0]:.4f}, "
           f"{diff['n']} {unit}): " + ("outside the noise" if clears else "within the noise, kept "
                                    f"a = {_fmt_a(reference['a'])}"))
    return {"point": best if clears else reference, "reference_a": reference["a"],
            "gain": {"nats": -diff["diff"], "se": diff["se"], "rows": diff["n"]}, "why": why}


def format_curve(curve: list[dict], by: str = "loss", chosen: dict | None = None,
                 width: int = 40) -> str:
    """A text plot of the loss curve (one bar per a; the chosen a, by default the lowest, is
    starred)."""
    best = chosen or best_point(curve, by)
    lo, hi = min(p[by] for p in curve), max(p[by] for p in curve)
    lines = [f"{'a':>6} | {by:>9} | "]
    for p in curve:
        bar = "#" * (1 + int((width - 1) * (p[by] - lo) / (hi - lo))) if hi > lo else "#"
        star = " *" if p is best else ""
        lines.append(f"{_fmt_a(p['a']):>6} | {p[by]:9.4f} | {bar}{star}")
    return "\n".join(lines)


def _fmt_a(a) -> str:
    return "none" if a is None else f"{a:g}"


def calibrate(folder: str | Path, grid: list[float | None], data: str = "wiki", seq_len: int = 4096,
              n_rows: int = 4, batch_size: int = 1, by: str = "loss", write: bool = True,
              device: str = "cpu", dtype=torch.float32, log=print,
              trust_remote_code: bool = False) -> dict:
    """Load ``folder``, grid-search a, write the best into its config.json; returns the report."""
    check_hypenet_folder(folder)
    model, tokenizer = load_folder(folder, device, dtype, trust_remote_code)
    batches = long_batches(data, tokenizer, seq_len, n_rows, batch_size, model.config.vocab_size)
    trained_a = model.config.attn_logits_scale_base
    curve = grid_search(model, batches, grid, log)
    choice = choose(curve, trained_a, by)
    log(format_curve(curve, by, choice["point"]))
    log(choice["why"])
    if write:
        write_scale_base(folder, choice["point"]["a"])
        log(f"wrote attn_logits_scale_base = {_fmt_a(choice['point']['a'])} into "
            f"{Path(folder) / 'config.json'}")
    return {"model": str(folder), "seq_len": seq_len, "data": data, "select_by": by, "curve": curve,
            "trained_a": trained_a, "chosen_a": choice["point"]["a"],
            "lowest_loss_a": best_point(curve, by)["a"], "gain": choice["gain"],
            "why": choice["why"]}


def load_folder(folder, device: str = "cpu", dtype=torch.float32, trust_remote_code: bool = False):
    """HypeNet model (our class, no remote code needed) and the folder's tokenizer (or None)."""
    from ..models.hypenet import HypeNetForCausalLM
    from ..models.trust import UntrustedCodeError, load_tokenizer

    model = HypeNetForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    try:
        tokenizer = load_tokenizer(folder, trust_remote_code)
    except UntrustedCodeError:
        raise
    except Exception:  # noqa: BLE001
        # a folder without a tokenizer still calibrates on shards/random
        tokenizer = None
    return model, tokenizer
