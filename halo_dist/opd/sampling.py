"""The next token of every decode row, drawn from its logits on the device, with no host sync.

OPD rollouts sample 256 rows x a 151,936-token vocabulary per step. Written as torch operations
(softmax, an exponential draw per logit, a division, an argmax) that is ~8 kernels and ~1.9 GB of
memory traffic per step, about 0.5 ms of a ~9 ms rollout step on an H200.

* ``exponential_race_torch``: the reference, any device, with ``top_p``: a draw is
  ``argmax_v p_v / E_v`` with ``E_v ~ Exp(1)`` independent, so token v wins with probability
  ``p_v / sum(p)`` (the arithmetic of ``torch.multinomial``'s one-sample path without its validity
  check, which reads the device: a host sync per step).
* ``gumbel_argmax_triton``: CUDA, ``top_p = 1``: the same distribution by the Gumbel-max trick,
  ``argmax_v (x_v / T - log(-log U_v))`` with ``U_v`` uniform, in one read of the logits. The
  uniforms come from Philox (``tl.rand4x``, four per call) keyed by a 64-bit seed drawn from the
  caller's generator on the device: the draws are a function of that generator's state (a run
  resumed with its generator state draws the same tokens), though not the same draws as the
  reference's. Each row's vocabulary is split across a few programs (enough to fill the GPU); a
  small torch step picks each row's best split. On CUDA the two logarithms per token are one
  ``lg2.approx`` each (relative error ~2^-22, far below what could move a draw), in base 2, which
  keeps the argmax. (``TRITON_INTERPRET=1`` runs it on CPU with Triton's polynomial log: that is
  how the CPU tests check it.)

``sample_tokens`` dispatches (``kernel_applies`` says when the kernel runs): the kernel wherever it
applies (for 256 x 151,936 bf16 logits on an H100: 0.106 ms against the reference's 0.85; 0.15
with the polynomial logs; the first version, one Philox call per token, took 0.21 ms against 0.66
on an H200, and OPD rollouts at horizon 2048 gained 8.5%: BENCHMARKS.md), the reference elsewhere.
"""

from __future__ import annotations

import math

import torch

from ..models.hypenet.decode_attention import sm_count

LOG2_E = 1.0 / math.log(2.0)
# tokens per loop iteration of the kernel: 8 per thread at 4 warps, loaded 16 bytes at a time. On an
# H100 (bench/tune_decode_kernels.py --sampler) 0.106 / 0.135 / 0.192 ms at 256 / 512 / 768
# rows x 151,936 against 0.111 / 0.155 / 0.223 ms with blocks of 1,024
SAMPLER_BLOCK = 4096

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    _HAS_TRITON = False


def exponential_race_torch(logits: torch.Tensor, temperature: float, top_p: float,
                           generator: torch.Generator | None) -> torch.Tensor:
    """logits ``[B, V]`` -> ``[B]`` token ids drawn from softmax(logits / temperature) restricted
    to the smallest set of tokens whose probability reaches ``top_p`` (``temperature > 0``)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    race = torch.empty_like(probs).exponential_(generator=generator)  # [B, V]
    # an Exp(1) draw of exactly 0 would make its token win whatever its probability
    return probs.div_(race.clamp_min_(torch.finfo(race.dtype).tiny)).argmax(-1)


if _HAS_TRITON:
    try:  # lg2.approx through libdevice: CUDA only (Triton's interpreter has no libdevice)
        from triton.language.extra.cuda.libdevice import fast_log2f
    except ImportError:  # pragma: no cover - depends on the Triton version
        fast_log2f = None

    @triton.jit
    def _log2(x, FAST: tl.constexpr):
        """log2 x: one MUFU instruction (``lg2.approx``, relative error ~2^-22) with FAST, else
        Triton's polynomial (~20 instructions; the interpreter's path)."""
        if FAST:
            return fast_log2f(x)
        return tl.log2(x)

    @triton.jit
    def _race(base, offs, hi, u, scale, best, arg, MASKED: tl.constexpr, FAST: tl.constexpr):
        """One slice of tokens ``offs`` against the running best: the Gumbel-max perturbed logits
        ``x / T - ln(-ln U)`` in base 2, ``x log2(e) / T - log2(-log2 U)`` (the same over ln 2,
        less a constant: the same argmax; ``scale`` = log2(e) / T). U = 0 gives -inf, a token that
        cannot win; the floor keeps a U rounded up to 1 from winning whatever its logit (the
        reference's clamp of its Exp(1) draws). MASKED: the slice may pass ``hi`` (a row's last,
        partial block); whole blocks load without a mask, which lets the loads vectorize."""
        if MASKED:
            ok = offs < hi
            x = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32)
        else:
            x = tl.load(base + offs).to(tl.float32)
        e = tl.maximum(-_log2(u, FAST), 1e-30)  # Exp(1) / ln 2
        s = x * scale - _log2(e, FAST)
        if MASKED:
            s = tl.where(ok, s, float("-inf"))
        take = s > best
        return tl.where(take, s, best), tl.where(take, offs, arg)

    @triton.jit
    def _block(base, start, hi, seed, first_key, scale, best, arg, Q: tl.constexpr,
               MASKED: tl.constexpr, FAST: tl.constexpr):
        """The 4Q tokens from ``start``: one Philox call per 4 of them (keys ``first_key + j``),
        its k-th uniform for token ``start + k Q + j``."""
        j = tl.arange(0, Q)
        u0, u1, u2, u3 = tl.rand4x(seed, first_key + j)
        best, arg = _race(base, start + j, hi, u0, scale, best, arg, MASKED, FAST)
        best, arg = _race(base, start + Q + j, hi, u1, scale, best, arg, MASKED, FAST)
        best, arg = _race(base, start + 2 * Q + j, hi, u2, scale, best, arg, MASKED, FAST)
        return _race(base, start + 3 * Q + j, hi, u3, scale, best, arg, MASKED, FAST)

    @triton.jit
    def _gumbel_argmax_kernel(Logits, Seed, Val, Idx, stride_row, V, chunk, keys_per_row,
                              scale, BLOCK: tl.constexpr, FAST: tl.constexpr):
        """One program: row ``row``, vocabulary ``[split * chunk, +chunk)``. Writes the best
        perturbed logit of its range (base 2, ``_race``) and that token's id.

        The uniforms come four per Philox call (``tl.rand4x``): a call costs ~100 integer
        operations, which bound the kernel when each token took one call of its own (0.21 ms for
        256 x 151,936 logits on an H200, where the logits' bytes take ~0.02 ms). Block ``b`` of
        ``BLOCK`` tokens uses the keys ``row * keys_per_row + b * BLOCK / 4 + j``, ``j`` <
        ``BLOCK / 4``; the call's k-th uniform goes to token ``b * BLOCK + k * BLOCK / 4 + j``.
        So every (row, token) has its own uniform, and the blocks of every split of a row use
        disjoint keys. The two logarithms per token were the other half of the work: Triton's
        polynomial log is ~20 instructions, ``lg2.approx`` one (FAST)."""
        Q: tl.constexpr = BLOCK // 4
        row = tl.program_id(0)
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        seed = tl.load(Seed)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, V)
        whole = lo + (hi - lo) // BLOCK * BLOCK  # lo and chunk are whole blocks
        base = Logits + row.to(tl.int64) * stride_row
        keys = row * keys_per_row
        best = tl.full([Q], float("-inf"), tl.float32)
        arg = tl.zeros([Q], tl.int32)
        for start in range(lo, whole, BLOCK):
            best, arg = _block(base, start, hi, seed, keys + start // 4, scale, best, arg, Q,
                               False, FAST)
        if whole < hi:  # the vocabulary's last, partial block
            best, arg = _block(base, whole, hi, seed, keys + whole // 4, scale, best, arg, Q,
                               True, FAST)
        top = tl.max(best, 0)
        tl.store(Val + row * splits + split, top)
        tl.store(Idx + row * splits + split, tl.min(tl.where(best == top, arg, V), 0))


def gumbel_argmax_triton(logits: torch.Tensor, temperature: float,
                         generator: torch.Generator | None, block: int = SAMPLER_BLOCK,
                         programs_per_sm: int = 8) -> torch.Tensor:
    """Same contract as ``exponential_race_torch`` with ``top_p = 1``, for ``[B, V]`` logits with
    ``B * V < 2^31``. ``block`` tokens per loop iteration; about ``programs_per_sm`` programs per SM
    (each row's vocabulary split into that many ranges, whole blocks each)."""
    val, idx = gumbel_splits(logits, temperature, generator, block, programs_per_sm)
    best = val.argmax(-1, keepdim=True)  # [B, 1] the winning split of each row
    return idx.gather(1, best).view(-1).long()


def gumbel_splits(logits: torch.Tensor, temperature: float, generator: torch.Generator | None,
                  block: int = SAMPLER_BLOCK, programs_per_sm: int = 8
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's launch: per row and vocabulary split, the best perturbed logit ``[B, splits]``
    (fp32, base 2: ``_race``) and its token ``[B, splits]`` (int32); splits of ``chunk`` tokens,
    whole blocks."""
    B, V = logits.shape
    if block < 4 or block & (block - 1):
        raise ValueError(f"gumbel_argmax_triton: block must be a power of 2 >= 4, got {block}")
    if B * V >= 2 ** 31:
        raise ValueError(f"gumbel_argmax_triton: {B} x {V} logits are 2^31 or more; the kernel "
                         "indexes rows and tokens with 32-bit integers")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    device = logits.device
    # enough programs to fill the GPU, each over whole blocks of the vocabulary
    blocks = math.ceil(V / block)
    splits = max(1, min(blocks, math.ceil(programs_per_sm * sm_count(device) / B)))
    chunk = math.ceil(blocks / splits) * block
    splits = math.ceil(V / chunk)
    # the draw's key, from the caller's generator, on the device (nothing is read on the host);
    # 64 bits, so that a run's ~10^5 draws do not repeat one (31 bits would, by the birthday bound)
    seed = torch.randint(-2 ** 63, 2 ** 63 - 1, (1,), dtype=torch.int64, device=device,
                         generator=generator)
    val = torch.empty(B, splits, device=device, dtype=torch.float32)
    idx = torch.empty(B, splits, device=device, dtype=torch.int32)
    keys_per_row = blocks * block // 4  # one Philox key per 4 tokens of the row's whole blocks
    fast = device.type == "cuda" and fast_log2f is not None
    _gumbel_argmax_kernel[(B, splits)](logits, seed, val, idx, logits.stride(0), V, chunk,
                                       keys_per_row, LOG2_E / temperature, BLOCK=block,
                                       FAST=fast)
    return val, idx


def kernel_applies(device_type: str, top_p: float, numel: int) -> bool:
    """Whether ``sample_tokens`` draws through the Triton kernel: CUDA logits, no nucleus cut,
    fewer than 2^31 logits."""
    return _HAS_TRITON and device_type == "cuda" and top_p >= 1.0 and numel < 2 ** 31


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None) -> torch.Tensor:
    """logits ``[B, V]`` -> ``[B]`` token ids: argmax when ``temperature`` is 0, else a draw from
    softmax(logits / temperature) restricted to the smallest set of tokens whose probability
    reaches ``top_p``; ``generator`` (on the logits' device) makes the draws reproducible. The
    Triton kernel in one pass on CUDA when ``top_p`` is 1, else the torch reference."""
    if temperature == 0:
        return logits.argmax(-1)
    if logits.dim() == 2 and kernel_applies(logits.device.type, top_p, logits.numel()):
        return gumbel_argmax_triton(logits, temperature, generator)
    return exponential_race_torch(logits, temperature, top_p, generator)
