"""The process clock behind the stages' start-up/exit accounting."""

import subprocess
import sys


def test_process_age_counts_from_the_process_start():
    """A process that sleeps 1.5 s before asking reports at least that, plus its imports, and not
    minutes."""
    code = ("import time; time.sleep(1.5); from halo_dist.train.profiling import process_age_s; "
            "t = time.time(); print(process_age_s(), time.time() - t)")
    age, _ = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True, timeout=120).stdout.split())
    assert 1.5 <= age < 60, age


def test_kernel_groups_name_the_kernels_of_a_training_step():
    """Kernel names as the H200's profiles of stage 2 and the decode step print them land in the
    right group."""
    from halo_dist.train.profiling import kernel_group

    assert kernel_group("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert (kernel_group("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16>")
            == "gemm")
    assert kernel_group("triton_red_fused__log_softmax_exp_sub_sum_0") == "fused (inductor)"
    assert kernel_group("chunk_simple_gla_fwd_kernel_o") == "fla rnn"
    assert kernel_group("triton_tem_fused_flex_attention_0") == "attention"
    assert (kernel_group("void at::native::vectorized_elementwise_kernel<4, "
                         "at::native::exp_kernel_cuda>")
            == "eager elementwise")
    assert (kernel_group("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>")
            == "reduce")
    assert kernel_group("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "nccl"
    assert (kernel_group("void at::native::(anonymous namespace)::"
                         "multi_tensor_apply_kernel<FusedAdamMathFunctor>")
            == "optimizer")
    assert kernel_group("Memcpy DtoD (Device -> Device)") == "copy/cast"
    assert kernel_group("some_new_kernel") == "other"


def _trace(*events):
    return {"traceEvents": [dict(ph="X", **e) for e in events]}


def test_idle_gaps_name_the_launch_that_ends_each_gap_and_the_sync_before_it():
    """A hand-laid trace in torch's Chrome format: two streams overlap (no gap), then the host
    syncs inside ``aten::item`` and the GPU idles 300 us until ``aten::mm`` (inside a backward)
    launches; a 10 us hole is below the threshold."""
    from halo_dist.train.profile_gaps import format_gaps, idle_gaps

    trace = _trace(
        dict(cat="cpu_op", name="CompiledFunctionBackward", ts=0, dur=2000, tid=1,
             args={"External id": 1}),
        dict(cat="cpu_op", name="aten::mm", ts=1500, dur=20, tid=1, args={"External id": 2}),
        dict(cat="cpu_op", name="aten::item", ts=2100, dur=400, tid=1, args={"External id": 3}),
        dict(cat="cuda_runtime", name="cudaStreamSynchronize", ts=2110, dur=380, tid=1,
             args={"External id": 3}),
        dict(cat="kernel", name="k0", ts=0, dur=1000, tid=7, args={"External id": 1}),
        dict(cat="kernel", name="k1", ts=900, dur=1300, tid=8, args={"External id": 1}),
        dict(cat="gpu_memcpy", name="copy", ts=2210, dur=280, tid=7, args={"External id": 3}),
        dict(cat="kernel", name="gemm", ts=2790, dur=100, tid=7, args={"External id": 2}),
    )
    g = idle_gaps(trace, steps=1, min_gap_us=20)
    assert g["gaps_per_step"] == 1 and abs(g["idle_ms_per_step"] - 0.3) < 1e-9
    assert g["by_launch"][0]["name"] == "aten::mm < CompiledFunctionBackward"
    assert g["after_sync"][0]["name"] == "aten::item"
    assert abs(g["device_span_ms_per_step"] - 2.89) < 1e-9
    text = "\n".join(format_gaps(g))
    assert "0.30" in text and "aten::mm < CompiledFunctionBackward" in text
    # two steps' worth: per-step figures halve
    assert abs(idle_gaps(trace, steps=2)["idle_ms_per_step"] - 0.15) < 1e-9


def test_idle_gaps_of_a_trace_without_device_events_are_empty(tmp_path):
    """A CPU profile (no kernels) gives zero idle time; the command line reads an exported trace
    and names a file it cannot read."""
    import json

    import pytest
    import torch

    from halo_dist.train.profile_gaps import idle_gaps, main

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    assert idle_gaps(json.loads(path.read_text()))["idle_ms_per_step"] == 0.0
    main([str(path)])
    with pytest.raises(SystemExit, match="cannot read the trace"):
        main([str(tmp_path / "missing.json")])
