"""The decode kernels compile for an H100/H200 (sm_90) on a machine without a GPU.

Triton's interpreter (the CPU tests of the kernels' numbers) runs a kernel as Python and never
sees the code generator's rules: a jit function whose constexpr branches return different types,
for one, runs in the interpreter and fails to compile on a GPU. Here each kernel goes through
Triton's whole compiler to PTX and a cubin (the ptxas that ships with Triton) for every branch
its constexprs choose, so such a kernel fails on CPU, not in a device session."""

import re
import subprocess
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - depends on the Triton version
    pytest.skip("this Triton has no ahead-of-time compile API", allow_module_level=True)

H100 = GPUTarget("cuda", 90, 32)


def compile_for_sm90(fn, types: dict, constexprs: dict, num_warps: int,
                     floats: str = "fp32", aligned: bool = False) -> str:
    """``fn`` compiled with pointer/scalar ``types`` by argument name and ``constexprs``; scalars
    not named are i64 strides or ``floats`` -> its PTX. A direct launch passes Python floats as
    fp32; Inductor, re-launching a kernel inside a compiled step, passes them as fp64.
    ``aligned``: pointers and strides marked divisible by 16, as a launch with torch's allocations
    and contiguous tensors specializes them (what lets Triton vectorize the state's loads)."""
    sig, const, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            const[(i,)] = constexprs[name]
            continue
        sig[name] = types.get(name, "i64" if name.startswith("stride") else floats)
        if aligned and (sig[name].startswith("*") or name.startswith("stride")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=H100,
                            options={"num_warps": num_warps})
    return kernel.asm["ptx"]


def ptxas_spills(ptx: str, tmp_path) -> int:
    """Bytes a thread spills to local memory when the PTX is assembled for sm_90a (ptxas -v of a
    ptxas that ships with Triton and reads this PTX version)."""
    src = tmp_path / "kernel.ptx"
    src.write_text(ptx)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for ptxas in sorted(tools.glob("ptxas*")):
        run = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(src), "-o",
                              str(tmp_path / "kernel.cubin")], capture_output=True, text=True)
        if run.returncode == 0:
            spills = re.findall(r"(\d+) bytes spill stores", run.stdout + run.stderr)
            assert spills, run.stdout + run.stderr
            return sum(int(n) for n in spills)
    pytest.skip(f"no ptxas in {tools} assembles this Triton's PTX")


LIGHTNING_POINTERS = dict(Q="*bf16", K="*bf16", V="*bf16", G="*bf16", Pos="*i64",
                          InvFreq="*fp32", QW="*bf16", KW="*bf16", OW="*bf16", LogDecay="*fp32",
                          O="*bf16", Cur="*i64", Base="*i64", PK="*fp32", PV="*fp32")


def fp64_ops(ptx: str) -> list[str]:
    """The fp64 instructions of a PTX listing, by opcode (parameters and their loads aside)."""
    return sorted(line.split()[0] for line in ptx.splitlines()
                  if ".f64" in line and not line.strip().startswith((".param", "ld.param")))


# (written every n tokens, the state's pointer type, fused layer step, prefetch)
@pytest.mark.parametrize("every,state,fused,prefetch", [
    (1, "*fp32", False, False), (1, "*fp32", True, True), (1, "*bf16", True, True),
    (4, "*bf16", False, False), (4, "*fp32", True, False), (2, "*bf16", True, False)])
def test_lightning_decode_kernel_compiles(every, state, fused, prefetch):
    """Every branch compiles with fp32 scalars (a direct launch) and with fp64 ones (Inductor's),
    and the two compute alike: an fp64 scale or epsilon must not carry the state's update into
    fp64 (twice the registers). The fp64 both share is libdevice's reduction of large sin/cos
    arguments (RoPE at positions past ~100K)."""
    from halo_dist.models.hypenet import decode_lightning as dl

    dv = 128
    ptx = {floats: compile_for_sm90(
        dl._lightning_decode_kernel, {**LIGHTNING_POINTERS, "S": state},
        dict(H=16, KV_GROUP=1, DK=128, DV=dv, BLOCK_V=dv if fused else 64, QK_NORM=fused,
             ROPE=fused, OUT_NORM=fused, GATE=fused, PREFETCH=prefetch, EVERY=every),
        num_warps=2 if fused else 8, floats=floats)
        for floats in ("fp32", "fp64")}
    assert ".entry _lightning_decode_kernel" in ptx["fp32"]
    extra = fp64_ops(ptx["fp64"])
    for op in fp64_ops(ptx["fp32"]):
        extra.remove(op)
    # what is left: the conversions of the 4 scalars to fp32
    assert all(op.startswith("cvt.") for op in extra), extra


@pytest.mark.parametrize("bias", [False, True])
def test_gemv_kernel_compiles(bias):
    from halo_dist.models.hypenet import decode_gemv

    ptx = compile_for_sm90(decode_gemv._gemv_kernel,
                           dict(X="*bf16", W="*bf16", Bias="*bf16", Y="*bf16", N="i32"),
                           dict(K=2048, BLOCK_N=8, BLOCK_K=512, HAS_BIAS=bias), num_warps=4)
    assert ".entry _gemv_kernel" in ptx


def test_split_kv_kernel_computes_in_fp32_under_either_scale_type():
    """The split-KV attention kernel compiles, and an fp64 ``scale`` (Inductor's) adds nothing
    but its conversion: the logits tile, running max and sum stay fp32."""
    from halo_dist.models.hypenet import decode_attention as da

    ptx = {floats: compile_for_sm90(
        da._split_kv_kernel,
        dict(Q="*bf16", K="*bf16", V="*bf16", Length="*i64", Start="*i64", O_part="*fp32",
             M_part="*fp32", L_part="*fp32", num_splits="i32"),
        dict(KV_HEADS=8, G=2, BLOCK_G=16, D=128, BLOCK_N=64), num_warps=4, floats=floats)
        for floats in ("fp32", "fp64")}
    assert ".entry _split_kv_kernel" in ptx["fp32"]
    assert fp64_ops(ptx["fp32"]) == []
    assert all(op.startswith("cvt.") for op in fp64_ops(ptx["fp64"])), fp64_ops(ptx["fp64"])


@pytest.mark.parametrize("state", ["float32", "bfloat16"])
@pytest.mark.parametrize("every", [1, 4])
def test_fused_lightning_step_does_not_spill_at_its_shipped_launch(state, every, tmp_path):
    """The fused step at the launch a batched rollout step uses (one program per row and head,
    ``LAUNCH[dtype]``'s fused warps) keeps its state tile in registers. A spill moves the tile
    through local memory every token: at 2 warps a 24-bit state (since removed) spilled ~1.5 KB
    per thread and its kernel ran at 591 µs per layer against fp32's 370 (H100, 512 rows); a bf16
    state written every 4 tokens spills 32 B a thread at 2 warps, so it takes 4."""
    import torch

    from halo_dist.models.hypenet import decode_lightning as dl

    cfg = dl.LAUNCH[getattr(torch, state)]
    dv = 128
    ptx = compile_for_sm90(
        dl._lightning_decode_kernel,
        {**LIGHTNING_POINTERS, "S": {"float32": "*fp32", "bfloat16": "*bf16"}[state]},
        dict(H=16, KV_GROUP=1, DK=128, DV=dv, BLOCK_V=dv, QK_NORM=True, ROPE=True,
             OUT_NORM=True, GATE=True, PREFETCH=cfg["fused_prefetch"] and every == 1,
             EVERY=every),
        num_warps=cfg["fused_warps"], aligned=True)
    assert ptxas_spills(ptx, tmp_path) == 0


def test_sampler_kernel_runs_one_philox_call_per_four_tokens_without_spilling(tmp_path):
    """The rollout sampler at its launch (``SAMPLER_BLOCK`` tokens per loop, 4 warps), as CUDA
    compiles it: Philox-4x32 (10 rounds, two 32-bit high multiplies each) once per 4 tokens, so
    at most 20 ``mul.hi`` per 4 tokens of a thread's share of a block (one call per token, the
    first kernel, bound by that integer work: 0.21 ms for 256 x 151,936 logits on an H200,
    compiled to 112), and its two logarithms per token as one ``lg2.approx`` each (Triton's own
    log is a ~20-instruction polynomial). The block's body is compiled twice: whole blocks, and
    the row's last one, masked."""
    from halo_dist.opd import sampling as rs

    block, warps = rs.SAMPLER_BLOCK, 4
    ptx = compile_for_sm90(
        rs._gumbel_argmax_kernel,
        dict(Logits="*bf16", Seed="*i64", Val="*fp32", Idx="*i32", stride_row="i32", V="i32",
             chunk="i32", keys_per_row="i32"),
        dict(BLOCK=block, FAST=True), num_warps=warps, aligned=True)
    tokens = block // (32 * warps)  # a thread's tokens per block
    bodies = 2
    # at least half the rounds' multiplies (a few fold into constants): the count means something
    assert (10 * tokens // 4 * bodies <= len(re.findall(r"mul\.hi\.u32", ptx))
            <= 20 * tokens // 4 * bodies)
    assert len(re.findall(r"lg2\.approx", ptx)) == 2 * tokens * bodies
    assert ptxas_spills(ptx, tmp_path) == 0
