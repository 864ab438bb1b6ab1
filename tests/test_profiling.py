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
