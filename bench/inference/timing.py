"""Timing one model's inference at one context: the fit check, the chunked prefill, a random cache
of a given size, and the eager and CUDA-graph decode timed from the same position."""

from __future__ import annotations

import time

import torch

from bench.common import sync
from halo_dist.models.hypenet.cache_hypenet import HypeNetCache
from halo_dist.models.hypenet.configuration_hypenet import HypeNetConfig
from halo_dist.models.hypenet.static_decode import StaticDecoder

GiB = 1 << 30


def kv_bytes(cfg: HypeNetConfig, T: int, itemsize: int) -> int:
    attn = sum(m == "attention" for m in cfg.mixer_types)
    return 2 * attn * T * cfg.num_key_value_heads * cfg.head_dim * itemsize


def activation_bytes(cfg: HypeNetConfig, chunk: int, itemsize: int) -> int:
    """Rough peak of one chunk's transient tensors: the MLP's gate/up/act (3 x F) plus q/k/v/o and
    the residual stream (~8 x d), plus a repeated copy of the cache's keys/values for GQA (bounded
    by the attention call) -- an estimate used only to skip contexts that cannot fit."""
    return chunk * (3 * cfg.intermediate_size + 8 * cfg.hidden_size) * itemsize


def fits(cfg, T, chunk, device, itemsize) -> tuple[bool, float]:
    """Allocate (for real) the cache plus one chunk's activations; True if that succeeds."""
    need = kv_bytes(cfg, T, itemsize) + activation_bytes(cfg, min(chunk, T), itemsize)
    if device.type != "cuda":
        return True, need / GiB
    try:
        block = torch.empty(need, dtype=torch.uint8, device=device)
        del block
        return True, need / GiB
    except torch.OutOfMemoryError:
        return False, need / GiB
    finally:
        torch.cuda.empty_cache()


@torch.inference_mode()
def prefill(model, T: int, chunk: int, device, decode_room: int,
            ids: torch.Tensor | None = None) -> tuple[float, HypeNetCache, torch.Tensor, list]:
    """Chunked prefill of T tokens (``ids`` [1, T] on ``device``, random when None):
    ``(seconds, cache, greedy next token, seconds per chunk)``."""
    cache = HypeNetCache(model.config.num_hidden_layers, reserve_tokens=decode_room)
    if ids is None:
        ids = torch.randint(0, model.config.vocab_size, (1, T), device=device)
    sync(device)
    t0 = time.perf_counter()
    marks = [t0]
    for start in range(0, T, chunk):
        out = model(ids[:, start:start + chunk], cache=cache, use_cache=True, logits_to_keep=1)
        sync(device)
        marks.append(time.perf_counter())
    chunk_s = [round(b - a, 3) for a, b in zip(marks[:-1], marks[1:])]
    return marks[-1] - t0, out.cache, out.logits[:, -1].argmax(-1), chunk_s


@torch.inference_mode()
def random_cache(model, T: int, device, dtype, decode_room: int, rows: int = 1) -> HypeNetCache:
    """A cache of ``rows`` x T tokens with random keys/values/states (decode cost depends on the
    cache's size, not its values)."""
    cfg = model.config
    cache = HypeNetCache(cfg.num_hidden_layers, reserve_tokens=decode_room)
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for i, kind in enumerate(cfg.mixer_types):
        if kind == "attention":
            k = torch.randn(rows, T, Hkv, D, device=device, dtype=dtype)
            cache.append_kv(i, k, k)
        else:
            cache.layers[i] = torch.randn(rows, H, D, D, device=device, dtype=torch.float32) * 0.01
    cache.seen_tokens = T
    return cache


def rnn_states(cache: HypeNetCache) -> list:
    return [e for e in cache.layers if e is not None and not isinstance(e, tuple)]


def rewind(cache: HypeNetCache, T: int, states: list) -> None:
    """Put a cache back to T tokens: attention views shortened, RNN states restored from copies."""
    for i, entry in enumerate(cache.layers):
        if isinstance(entry, tuple):
            cache.layers[i] = (entry[0][:, :T], entry[1][:, :T])
    for live, saved in zip(rnn_states(cache), states):
        live.copy_(saved)
    cache.seen_tokens = T


def timed_steps(step, token: torch.Tensor, steps: int, device) -> tuple[float, torch.Tensor]:
    """Median ms per token of ``steps`` greedy steps (``step(tokens [1]) -> logits [1, V]``); the
    first step's logits come back for the graph-vs-eager check."""
    times, nxt, first = [], token.view(1), None
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        logits = step(nxt)
        nxt = logits.argmax(-1)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        first = logits.float().clone() if first is None else first
    times = sorted(times[1:] if len(times) > 2 else times)  # the first step may grow buffers
    return times[len(times) // 2], first


@torch.inference_mode()
def decode_ms(model, cache: HypeNetCache, token: torch.Tensor, steps: int, device,
              graph: bool = True) -> dict:
    """Eager dynamic-cache decode, then (``graph``) the static CUDA-graph decode from the same
    position."""
    T, saved = cache.seen_tokens, [s.clone() for s in rnn_states(cache)]

    def eager(nxt):
        return model(nxt.view(1, 1), cache=cache, use_cache=True).logits[:, -1]

    out = {}
    out["decode_eager_ms"], first_eager = timed_steps(eager, token, steps, device)
    if not graph:
        return out
    rewind(cache, T, saved)
    dec = StaticDecoder(model, cache)
    out["decode_graph_ms"], first_graph = timed_steps(dec.step, token, steps, device)
    out["graph"] = dec.graph is not None if device.type == "cuda" else "cpu (eager static step)"
    if dec.graph_error:
        out["graph_error"] = dec.graph_error
    out["graph_rel_err"] = float((first_graph - first_eager).norm() / first_eager.norm())
    return out


def warm_up(model, chunk: int, device, graph: bool) -> None:
    """Kernel compilation / autotune, untimed, on a short prompt in two chunks: the second carries
    the RNN state and attends lower-right causally over the cache, as every later chunk does."""
    w = min(chunk, 4096)
    _, cache, last, _ = prefill(model, 2 * w, w, device, 8)
    decode_ms(model, cache, last, 3, device, graph=graph)
