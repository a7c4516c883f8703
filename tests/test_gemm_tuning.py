"""kernels/gemm_tuning.py and kernels/cublaslt.py on the CPU: which timed way is kept, the fallbacks, the operand
checks. The timing itself and cuBLASLt's algorithms need a GPU (benchmarks/bench_gemm_algos.py runs them there)."""

import types

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


# ---------------------------------------------------------------- quack-kernels' GEMMs among the tuner's candidates
def test_quack_config_names_parse_to_quack_tiles_and_a_bad_name_is_refused_with_the_form(monkeypatch):
    import sys

    from omni_accel.errors import AccelError
    from omni_accel.kernels import quack_gemm

    stand_in = types.SimpleNamespace(GemmConfig=lambda **kw: kw, default_config=lambda device: "quack's default")
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.gemm_config", stand_in)
    assert quack_gemm.config("default") == "quack's default"
    assert quack_gemm.config("256x208_coop_c1x2") == {"tile_m": 256, "tile_n": 208, "pingpong": False, "cluster_m": 1,
                                                     "cluster_n": 2, "is_dynamic_persistent": False,
                                                     "device_capacity": 9}
    assert quack_gemm.config("128x192_pp_c2x1")["pingpong"] is True
    with pytest.raises(AccelError) as err:
        quack_gemm.config("256x192_coop")
    assert str(err.value) == ("quack GEMM config '256x192_coop' is not a config name: use 'default' or "
                              "'<tile_m>x<tile_n>_<pp|coop>_c<cluster_m>x<cluster_n>', e.g. '256x192_coop_c2x1'")
    assert quack_gemm.available(torch.device("cpu")) == "quack's GEMMs need a CUDA GPU, not cpu"


def test_quack_ways_time_the_configs_that_run_and_leave_out_a_failing_one_with_a_warning(monkeypatch, caplog):
    from omni_accel.kernels import quack_gemm

    calls = []

    def fake_linear(x, w_t, bias, epilogue, out, config):
        if config == "broken":
            raise RuntimeError("compile failed")
        calls.append((config, epilogue))
        return x @ w_t

    monkeypatch.setattr(gemm_tuning, "QUACK_CONFIGS", ("256x192_coop_c2x1", "128x192_pp_c2x1"))
    monkeypatch.setattr(quack_gemm, "available", lambda device: None)
    monkeypatch.setattr(quack_gemm, "config", lambda name, device=None: "broken" if name.startswith("128") else name)
    monkeypatch.setattr(quack_gemm, "linear", fake_linear)
    x, w = torch.randn(4, 8).to(BF16), torch.randn(6, 8).to(BF16)
    with caplog.at_level("WARNING"):
        ways = gemm_tuning._quack_ways(x, w.t(), None, "none", None)
    assert list(ways) == ["quack_256x192_coop_c2x1"]
    choice, call = ways["quack_256x192_coop_c2x1"]
    assert choice == gemm_tuning.QuackChoice("256x192_coop_c2x1", "256x192_coop_c2x1")
    assert torch.equal(call(), x @ w.t()) and calls == [("256x192_coop_c2x1", "none")] * 2  # first call + this one
    assert ("quack GEMM 128x192_pp_c2x1 left out for the none epilogue (first at (4, 8) x 6; RuntimeError: compile "
            "failed)") in caplog.text
    caplog.clear()  # the failed (config, epilogue) is not compiled again for the next shape, nor warned about
    assert list(gemm_tuning._quack_ways(torch.randn(2, 8).to(BF16), w.t(), None, "none", None)) == [
        "quack_256x192_coop_c2x1"] and "left out" not in caplog.text
    gemm_tuning.reset()
    assert gemm_tuning._quack_failed == set()
    # none listed, or quack not runnable here: no quack way
    monkeypatch.setattr(gemm_tuning, "QUACK_CONFIGS", ())
    assert gemm_tuning._quack_ways(x, w.t(), None, "none", None) == {}
    monkeypatch.setattr(gemm_tuning, "QUACK_CONFIGS", ("default",))
    monkeypatch.setattr(quack_gemm, "available", lambda device: "quack-kernels is not installed")
    assert gemm_tuning._quack_ways(x, w.t(), None, "none", None) == {}


def test_choices_name_a_quack_pick_by_its_config(monkeypatch):
    key = (0, (4608, 3072), 9216, 3072, 3072, BF16, "bias", (256, 256, 256))
    monkeypatch.setitem(gemm_tuning._choices, key, gemm_tuning.QuackChoice("256x192_coop_c2x1", object()))
    monkeypatch.setitem(gemm_tuning._ratios, key, 1.051)
    assert gemm_tuning.choices() == {"(4608, 3072) x 9216 bfloat16 bias": "quack_256x192_coop_c2x1 (1.051x)"}


@pytest.mark.parametrize("bad, shown", [("256x192_coop_c2x1", "'256x192_coop_c2x1'"), (("256x192",), "('256x192',)"),
                                        ([], "[]")])
def test_a_bad_quack_config_list_is_refused_before_anything_is_patched(monkeypatch, bad, shown):
    import omni_accel
    from omni_accel.errors import AccelError
    from omni_accel.testing import tiny_pipeline

    monkeypatch.setattr(gemm_tuning, "QUACK_CONFIGS", bad)
    pipe, _ = tiny_pipeline("flux")
    with pytest.raises(AccelError) as err:
        omni_accel.accelerate(pipe, compile=True)
    if isinstance(bad, tuple):
        assert str(err.value) == ("quack GEMM config '256x192' is not a config name: use 'default' or "
                                  "'<tile_m>x<tile_n>_<pp|coop>_c<cluster_m>x<cluster_n>', e.g. '256x192_coop_c2x1'")
    else:
        assert str(err.value) == (f"gemm_tuning.QUACK_CONFIGS={shown} is not a tuple of config names: set it to () "
                                  "(off, the default) or to names such as ('256x192_coop_c2x1',).")
    assert "omni_accel" not in vars(pipe)


class _RefusingQuack(gemm_tuning.QuackChoice):
    def run(self, x, w_t, bias, epilogue, out):
        raise self.config  # the exception to raise, in the config's place


def test_a_refused_quack_call_goes_back_to_torchs_call_once_and_for_good_but_out_of_memory_raises(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x, w, start = torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(4, 6, generator=g)
    key = ("shape",)
    monkeypatch.setitem(gemm_tuning._choices, key, "tuned")
    out = start.clone()
    refusing = _RefusingQuack("128x192_pp_c2x1", RuntimeError("quack refused the layout"))
    assert gemm_tuning.run_choice(key, refusing, x, w.t(), None, "accumulate", out) is out
    torch.testing.assert_close(out, start + x @ w.t())  # torch's call added the product once
    assert gemm_tuning._choices[key] is None  # and serves the shape from now on
    monkeypatch.setitem(gemm_tuning._choices, key, "tuned")
    with pytest.raises(torch.OutOfMemoryError):
        gemm_tuning.run_choice(key, _RefusingQuack("default", torch.OutOfMemoryError("no memory")), x, w.t(), None,
                               "none", None)
    assert gemm_tuning._choices[key] == "tuned"  # the next call may have the memory: the pick stays
    assert torch.equal(gemm_tuning.run_choice(key, None, x, w.t(), None, "none", None), x @ w.t())


@pytest.mark.parametrize("error, outcome", [(RuntimeError("quack failed at launch"), "timed without quack"),
                                            (torch.OutOfMemoryError("no memory"), "raised")])
def test_a_quack_error_while_timing_a_shape_times_it_again_without_quack_but_out_of_memory_raises(
        monkeypatch, caplog, error, outcome):
    timed = []

    def time_rounds(ways, calls, rounds, device):
        timed.append(sorted(ways))
        if "quack_128x192_pp_c2x1" in ways:
            raise error
        return {"torch": [2.0, 2.0, 2.0], "algo_0": [1.0, 1.0, 1.0]}

    monkeypatch.setattr(cublaslt, "algorithms", lambda *args, **kwargs: [types.SimpleNamespace(rank=0)])
    monkeypatch.setattr(gemm_tuning, "_quack_ways", lambda *args: {
        "quack_128x192_pp_c2x1": (gemm_tuning.QuackChoice("128x192_pp_c2x1", None), lambda: None)})
    monkeypatch.setattr(gemm_tuning, "_time_rounds", time_rounds)
    monkeypatch.setattr(gemm_tuning, "_quack_failed", set())  # this test's own: the refusals it adds stay here
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with caplog.at_level("WARNING"):
        if outcome == "raised":
            with pytest.raises(torch.OutOfMemoryError):
                gemm_tuning._tune(("shape",), x, w.t(), None, "none", None)
            assert timed == [["algo_0", "quack_128x192_pp_c2x1", "torch"]]
            return
        picked = gemm_tuning._tune(("shape",), x, w.t(), None, "none", None)
    assert picked.rank == 0  # cuBLASLt's candidate, timed in the second pass
    assert timed == [["algo_0", "quack_128x192_pp_c2x1", "torch"], ["algo_0", "torch"]]
    assert ("an error while timing ('shape',) with quack's GEMMs among the ways (RuntimeError: quack failed at "
            "launch); timed again without them, and quack left out for the none epilogue") in caplog.text
    assert ("128x192_pp_c2x1", "none") in gemm_tuning._quack_failed  # not compiled again for the next shape


def test_an_error_while_timing_a_shape_without_quack_is_raised(monkeypatch):
    monkeypatch.setattr(cublaslt, "algorithms", lambda *args, **kwargs: [])
    monkeypatch.setattr(gemm_tuning, "_quack_ways", lambda *args: {})

    def time_rounds(ways, calls, rounds, device):
        raise ValueError("a bug")

    monkeypatch.setattr(gemm_tuning, "_time_rounds", time_rounds)
    with pytest.raises(ValueError, match="a bug"):
        gemm_tuning._tune(("shape",), torch.randn(4, 8), torch.randn(8, 6), None, "none", None)


def test_a_cublaslt_pick_falls_back_on_its_refusal_and_raises_any_other_error(monkeypatch):
    from omni_accel.errors import AccelError

    x, w = torch.randn(4, 8), torch.randn(6, 8)
    key = ("shape",)
    errors = iter([AccelError("cuBLASLt refused"), ValueError("a bug")])

    def matmul(*args, **kwargs):
        raise next(errors)

    monkeypatch.setattr(cublaslt, "matmul", matmul)
    monkeypatch.setitem(gemm_tuning._choices, key, "algo")
    assert torch.equal(gemm_tuning.run_choice(key, "algo", x, w.t(), None, "none", None), x @ w.t())
    assert gemm_tuning._choices[key] is None
    with pytest.raises(ValueError, match="a bug"):
        gemm_tuning.run_choice(key, "algo", x, w.t(), None, "none", None)
