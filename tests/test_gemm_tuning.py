"""kernels/gemm_tuning.py and kernels/cublaslt.py on the CPU: which timed way is kept, the fallbacks, the operand
checks. The timing itself and cuBLASLt's algorithms need a GPU (benchmarks/bench_gemm_algos.py runs them there)."""

import pytest
import torch

from omni_accel.kernels import cublaslt, gemm_tuning

BF16 = torch.bfloat16


def test_pick_keeps_the_largest_median_paired_ratio_at_or_above_the_gain():
    # rounds drift (torch's own time goes 100 -> 130); algo_2 beats torch in every round by ~5 %, algo_1 by ~1 %
    per_round = {"torch": [100.0, 110.0, 130.0], "algo_1": [99.0, 109.0, 128.7], "algo_2": [95.0, 104.8, 123.8],
                 "algo_3": [90.0, 130.0, 140.0]}  # one fast round, slower in the others: its median ratio < 1
    way, ratio = gemm_tuning.pick(per_round, 1.02)
    assert way == "algo_2" and ratio == pytest.approx(130.0 / 123.8)  # the median of 1.053, 1.050, 1.050
    # nothing reaches the gain: torch's call stays
    assert gemm_tuning.pick(per_round, 1.1) == ("torch", 1.0)


def test_linear_off_a_gpu_is_torchs_call_for_every_epilogue_and_refuses_an_unknown_one(monkeypatch):
    monkeypatch.setattr(gemm_tuning, "TUNED_GEMMS", True)  # on, and every size timed: only the device keeps torch's
    monkeypatch.setattr(gemm_tuning, "MIN_GFLOP", 0.0)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 16, generator=g).to(BF16), torch.randn(24, 16, generator=g).to(BF16)
    bias, start = torch.randn(24, generator=g).to(BF16), torch.randn(8, 24, generator=g).to(BF16)
    assert torch.equal(gemm_tuning.linear(x, w.t(), None, "none"), x @ w.t())
    assert torch.equal(gemm_tuning.linear(x, w.t(), bias, "bias"), torch.addmm(bias, x, w.t()))
    assert torch.equal(gemm_tuning.linear(x, w.t(), bias, "gelu_bias"),
                       torch._addmm_activation(bias, x, w.t(), use_gelu=True))
    out = start.clone()
    assert gemm_tuning.linear(x, w.t(), None, "accumulate", out=out) is out
    assert torch.equal(out, start.clone().addmm_(x, w.t()))
    refusal = r"epilogue='relu' is not one of \('none', 'bias', 'gelu_bias', 'accumulate'\)"
    with pytest.raises(ValueError, match=refusal):
        gemm_tuning.linear(x, w.t(), bias, "relu")
    assert gemm_tuning.choices() == {}  # nothing timed off a GPU


def test_cublaslt_takes_unit_inner_strides_in_16_bits_with_aligned_rows_and_a_whole_bias_only():
    w = torch.zeros(64, 96, dtype=BF16)  # (N, K_total): its transposed column slices keep the row stride 96
    x = torch.zeros(32, 64, dtype=BF16)
    bias = torch.zeros(64, dtype=BF16)
    assert cublaslt.takes(x, w[:, :64].t(), bias) and cublaslt.leading_dims(x, w[:, :64].t()) == (96, 64)
    assert cublaslt.takes(torch.zeros(32, 96, dtype=BF16)[:, :32], w[:, 64:].t())  # offsets of 64 elements: aligned
    assert not cublaslt.takes(x, w.t()[:64].contiguous())  # a row-major (K, N) copy: the rows are not unit stride
    assert not cublaslt.takes(x.float(), w[:, :64].t().float())
    assert not cublaslt.takes(torch.zeros(32, 72, dtype=BF16)[:, 1:65], w[:, :64].t())  # x 2 bytes off alignment
    assert not cublaslt.takes(x, w[:, 1:65].t())  # the weight 2 bytes off alignment
    assert not cublaslt.takes(torch.zeros(1, 64, dtype=BF16).expand(32, 64), w[:, :64].t())  # broadcast rows
    assert not cublaslt.takes(torch.zeros(32, 64, dtype=BF16)[:, :48], w[:, :64].t())  # K 48 against 64
    assert not cublaslt.takes(x, w[:, :64].t(), torch.zeros(1, dtype=BF16).expand(64))  # a broadcast bias
    assert not cublaslt.takes(x, w[:, :64].t(), torch.zeros(64))  # a float32 bias
    assert not cublaslt.takes(x, w[:, :64].t(), torch.zeros(128, dtype=BF16)[::2])  # a strided bias


def test_cublaslt_alignment_is_the_largest_power_of_two_up_to_256_dividing_the_address():
    base = torch.zeros(1024, dtype=BF16)
    offset = (-base.data_ptr() % 256) // 2  # the first element at a 256-byte boundary
    assert cublaslt.alignment(base[offset:]) == 256
    assert cublaslt.alignment(base[offset + 8:]) == 16
    assert cublaslt.alignment(base[offset + 1:]) == 2


def test_operand_alignments_take_the_least_of_output_and_bias_with_or_without_a_bias():
    base = torch.zeros(4096, dtype=torch.bfloat16)
    x, w_t = base[:64].view(8, 8), base[:64].view(8, 8)
    bias = base[1:9]  # 2-byte aligned
    # a new output is 256-byte aligned; without a bias that is the third alignment
    assert gemm_tuning.operand_alignments(x, w_t, None, "bias", None)[2] == 256
    assert gemm_tuning.operand_alignments(x, w_t, bias, "bias", None)[2] == 2
    out = base[4:68].view(8, 8)  # 8-byte aligned
    assert gemm_tuning.operand_alignments(x, w_t, None, "accumulate", out)[2] == 8
    assert gemm_tuning.operand_alignments(x, w_t, bias, "accumulate", out)[2] == 2
