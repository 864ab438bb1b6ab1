"""Attention-layer selection: score formula, ranking, alternative methods, results-file IO.

The HALO score of layer i, from M(i) = the teacher with only layer i replaced by its stage-1 RNN::

    s_i = (max_j R_j - R_i) / (max_j C_j - C_i + 1e-6)

R = recall, C = commonsense (CSR), both in [0, 1]. A large s_i means that replacing layer i costs
much recall for little CSR, so layer i stays softmax attention: keep the top k (default floor(L/4)).

The 1e-6 is the paper's and the default (it reproduces the paper's kept sets). With it the layer of
the best CSR proxy always wins a slot, whatever its recall: its denominator is ~1e-6, so any recall
drop, even one prompt of 64, scores ~1e4; a layer whose replacement costs no recall at all but the
least CSR is kept, and a recall-critical layer can lose its slot to CSR-proxy noise in the fourth
digit. ``csr_offset`` (``--csr-offset``) replaces the 1e-6 by a CSR drop below which differences
are not resolved: on four stage-1 runs of SmolLM2-135M (two machines, two corpus mixes) every offset
from 0.01 to 0.05 kept the same layers within a corpus mix, where 1e-6 kept three different sets.

A *results file* is JSON ``{"<layer>": {"recall": r, "csr": c, ...extra keys}}``; evaluation writes
it incrementally (:func:`save_results` is atomic) and ranking only reads it, so the two are
separable and resumable. The evaluation loop itself lives in :mod:`halo_dist.eval.layerwise`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .errors import EvalError

EPS = 1e-6
METHODS = ("halo", "even", "latter-half", "given")


# ------------------------------------------------------------------------------------------------
# Results files
# ------------------------------------------------------------------------------------------------


def validate_results(raw: dict, num_layers: int | None = None,
                     source: str = "results") -> dict[int, dict]:
    """Check a ``{"<layer>": {"recall", "csr", ...}}`` mapping and return it keyed by int layer.

    With ``num_layers`` every layer 0..L-1 must be present (and no other). Raises
    :class:`EvalError`.
    """
    if not isinstance(raw, dict) or not raw:
        raise EvalError(f"{source}: expected a non-empty JSON object {{\"<layer>\": {{\"recall\": "
                        ".., \"csr\": ..}}")
    out: dict[int, dict] = {}
    for key, entry in raw.items():
        layer = _layer_key(key, source)
        if not isinstance(entry, dict):
            raise EvalError(f"{source}: layer {key}: expected an object with 'recall' and 'csr', "
                            f"got {entry!r}")
        for metric in ("recall", "csr"):
            _check_unit(entry.get(metric), f"{source}: layer {key}: {metric!r}")
        out[layer] = dict(entry)
    if num_layers is not None:
        _check_layer_set(out, num_layers, source)
    return dict(sorted(out.items()))


def _layer_key(key, source: str) -> int:
    try:
        layer = int(key)
    except (TypeError, ValueError):
        raise EvalError(f"{source}: key {key!r} is not a layer index") from None
    if layer < 0 or str(layer) != str(key).strip():
        raise EvalError(f"{source}: key {key!r} is not a non-negative integer layer index")
    return layer


def _check_unit(value, what: str) -> None:
    if value is None:
        raise EvalError(f"{what} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EvalError(f"{what} must be a number in [0, 1], got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise EvalError(f"{what} = {value} is outside [0, 1]")


def _check_layer_set(results: dict[int, dict], num_layers: int, source: str) -> None:
    missing = [i for i in range(num_layers) if i not in results]
    extra = [i for i in results if i >= num_layers]
    if extra:
        raise EvalError(f"{source}: layers {extra} are out of range for a {num_layers}-layer model")
    if missing:
        raise EvalError(f"{source}: missing layers {missing} (a {num_layers}-layer model needs all "
                        f"of 0..{num_layers - 1})")


def load_results(path: str | os.PathLike, num_layers: int | None = None) -> dict[int, dict]:
    """Read and validate a per-layer results file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"results file {path} does not exist")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EvalError(f"results file {path} is not valid JSON: {e}") from None
    return validate_results(raw, num_layers, source=str(path))


def save_results(path: str | os.PathLike, results: dict[int, dict]) -> Path:
    """Write ``results`` as JSON atomically (temp file + rename): a crash never leaves half a
    file."""
    payload = {str(i): results[i] for i in sorted(results)}
    return write_json_atomic(path, payload)


def write_json_atomic(path: str | os.PathLike, payload) -> Path:
    """``payload`` as indented JSON at ``path`` (``outputs.write_text_atomic``: whole or not at
    all, under the umask; a folder there is refused)."""
    from ..outputs import write_text_atomic

    return write_text_atomic(path, json.dumps(payload, indent=2, default=_json_default) + "\n")


def _json_default(x):
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


# ------------------------------------------------------------------------------------------------
# Scores and ranking
# ------------------------------------------------------------------------------------------------


def halo_scores(results: dict[int, dict], csr_offset: float = EPS) -> dict[int, float]:
    """s_i = (max_j R_j - R_i) / (max_j C_j - C_i + csr_offset) for every layer of ``results``."""
    check_csr_offset(csr_offset)
    max_r = max(r["recall"] for r in results.values())
    max_c = max(r["csr"] for r in results.values())
    return {i: (max_r - r["recall"]) / (max_c - r["csr"] + csr_offset)
            for i, r in sorted(results.items())}


def check_csr_offset(csr_offset: float) -> float:
    if not (math.isfinite(csr_offset) and 0 < csr_offset <= 1):
        raise EvalError(f"--csr-offset must lie in (0, 1], got {csr_offset}")
    return csr_offset


def top_k(scores: dict[int, float], k: int) -> list[int]:
    """The k layers with the largest score (ties: the lower layer index first), sorted ascending."""
    order = sorted(scores, key=lambda i: (-scores[i], i))
    return sorted(order[:k])


def default_num_attn(num_layers: int) -> int:
    return num_layers // 4


def check_k(k: int, num_layers: int) -> int:
    if k < 0:
        raise EvalError(f"--num-attn must be >= 0, got {k}")
    if k > num_layers:
        raise EvalError(f"--num-attn {k} is larger than the layer count {num_layers}")
    return k


def even_layers(num_layers: int, k: int) -> list[int]:
    """k evenly spaced layers over 0..L-1 (the same placement as HypeNetConfig's default)."""
    return sorted({round(i * num_layers / k) for i in range(k)}) if k else []


def latter_half_layers(num_layers: int, k: int) -> list[int]:
    """k evenly spaced layers over the latter half L//2..L-1."""
    start = num_layers // 2
    span = num_layers - start
    if k > span:
        raise EvalError(f"latter-half selection: {k} attention layers do not fit in the {span} "
                        f"layers {start}..{num_layers - 1}")
    return sorted({start + round(i * span / k) for i in range(k)}) if k else []


def check_given(given: list[int], num_layers: int) -> list[int]:
    bad = [i for i in given if not 0 <= i < num_layers]
    if bad:
        raise EvalError(f"--given layers {bad} are out of range for a {num_layers}-layer model")
    if len(set(given)) != len(given):
        raise EvalError(f"--given layers repeat an index: {given}")
    return sorted(given)


def select_layers(
    method: str, num_layers: int, k: int | None = None, results: dict[int, dict] | None = None,
    given: list[int] | None = None, csr_offset: float = EPS,
) -> dict:
    """Run one selection method and return the selection payload (``attn_layers``, ``scores``, ...).

    ``halo`` needs ``results`` for all layers; ``given`` needs ``given``; ``even`` / ``latter-half``
    need only L and k. ``scores`` is filled for ``halo`` and empty otherwise.
    """
    if method not in METHODS:
        raise EvalError(f"unknown selection method {method!r}; choose from {', '.join(METHODS)}")
    if method == "given":
        if not given:
            raise EvalError("method 'given' needs --given LAYERS (e.g. --given 2,3,6)")
        layers, scores = check_given(given, num_layers), {}
        k = len(layers)
    else:
        k = check_k(default_num_attn(num_layers) if k is None else k, num_layers)
        scores = {}
        if method == "halo":
            if results is None:
                raise EvalError("method 'halo' needs per-layer results (--from-results FILE or an "
                                "evaluator)")
            _check_layer_set(results, num_layers, "results")
            scores = halo_scores(results, csr_offset)
            layers = top_k(scores, k)
        elif method == "even":
            layers = even_layers(num_layers, k)
        else:
            layers = latter_half_layers(num_layers, k)
    return {
        "method": method,
        "num_layers": num_layers,
        "num_attn": k,
        "attn_layers": layers,
        "scores": {str(i): s for i, s in scores.items()},
        "csr_offset": csr_offset if method == "halo" else None,
        "ranking": [int(i) for i in sorted(scores, key=lambda i: (-scores[i], i))],
    }


def select_from_results_file(path, k: int | None = None, num_layers: int | None = None,
                             csr_offset: float = EPS) -> dict:
    """``--from-results``: rank a saved results file (L = its layer count unless given)."""
    results = load_results(path)
    L = num_layers if num_layers is not None else max(results) + 1
    _check_layer_set(results, L, str(path))
    payload = select_layers("halo", L, k, results, csr_offset=csr_offset)
    payload["results"] = {str(i): r for i, r in results.items()}
    payload["results_file"] = str(path)
    return payload
