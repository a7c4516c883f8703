"""attention="fa4" (FlashAttention-4) and auto's long-sequence route to it, tested without a GPU: the decision table
with a faked capability, the refusals, the route (with SDPA standing in for the kernel: outputs must equal the plain
pipeline's), the key-count threshold, and the op's fake implementation that compiled blocks trace."""

from __future__ import annotations

import dataclasses
import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import omni_accel
from omni_accel import AccelError
from omni_accel.kernels import attention as attn
from omni_accel.kernels import fa4_attention as fa4
from omni_accel.kernels import fp8_attention as route
from omni_accel.kernels import timing as kernel_timing
from omni_accel.testing import (check_route_takes_every_call, check_sdpa_fallback, run, run_compiled_twice,
                                tiny_pipeline)

HOPPER = (9, 0)
CUDA = torch.device("cuda")


def _fa4_available(monkeypatch) -> None:
    monkeypatch.setattr(attn, "_fa4_refusal", lambda device, capability=None: None)


# ------------------------------------------------------------------------------------------ decision table
def test_auto_keeps_cudnn_and_sends_long_sequences_to_fa4_where_it_runs(monkeypatch):
    _fa4_available(monkeypatch)
    rule = attn.choose_auto(CUDA, torch.bfloat16, True, 128, False, HOPPER)
    assert (rule.backend, rule.long_backend, rule.long_min_tokens) == ("cudnn", "fa4", fa4.AUTO_MIN_TOKENS)
    assert fa4.AUTO_MIN_TOKENS == 8192
    assert fa4.TIMED_MIN_TOKENS is None  # the per-shape timing below it: a switch, off (measured no gain)


@pytest.mark.parametrize("dtype, compiled, fp8_stack, capability, backend", [
    (torch.bfloat16, False, False, HOPPER, "sdpa"),  # eager: the plain pipeline's own kernel, nothing routed
    (torch.bfloat16, True, True, HOPPER, "fp8"),  # the FP8 stack: cuDNN FP8 attention at every length
    (torch.bfloat16, True, False, (8, 0), "sdpa"),
    (torch.float32, True, False, HOPPER, "sdpa"),
])
def test_auto_routes_nothing_to_fa4_outside_compiled_16_bit_hopper(monkeypatch, dtype, compiled, fp8_stack,
                                                                  capability, backend):
    _fa4_available(monkeypatch)
    monkeypatch.setattr(attn, "_fp8_stack_attention_refusal", lambda device: None)
    rule = attn.choose_auto(CUDA, dtype, compiled, 128, fp8_stack, capability)
    assert (rule.backend, rule.long_backend) == (backend, None)


def test_auto_drops_the_fa4_route_where_flash_attn_4_cannot_run(monkeypatch):
    monkeypatch.setattr(attn, "_fa4_refusal", lambda device, capability=None: "not installed")
    rule = attn.choose_auto(CUDA, torch.bfloat16, True, 128, False, HOPPER)
    assert (rule.backend, rule.long_backend, rule.long_min_tokens) == ("cudnn", None, 0)


# ------------------------------------------------------------------------------------------------ refusals
def test_fa4_without_the_package_is_refused_before_anything_is_patched(monkeypatch):
    monkeypatch.setattr(fa4, "installed", lambda module: False)
    pipe, _ = tiny_pipeline("flux")
    with pytest.raises(AccelError) as err:
        omni_accel.accelerate(pipe, attention="fa4")
    assert str(err.value) == (
        "attention='fa4' needs the 'flash_attn.cute' package, which is not installed: pip install flash-attn-4 "
        "(with a CUDA 13 build of torch: pip install 'flash-attn-4[cu13]'); or use attention='auto'.")
    assert "omni_accel" not in vars(pipe)


def test_fa4_on_a_cpu_or_an_older_gpu_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(fa4, "installed", lambda module: True)
    pipe, _ = tiny_pipeline("flux")
    with pytest.raises(AccelError) as err:
        omni_accel.accelerate(pipe, attention="flash4")  # the alias names the same backend
    assert str(err.value) == "attention='fa4' needs a CUDA GPU but the pipeline runs on cpu; use attention='auto'."
    assert fa4.unavailable_reason(CUDA, (8, 0)) == (
        "attention='fa4' needs a GPU with compute capability 9.0 or newer (Hopper, Blackwell); this GPU has 8.0. "
        "Use attention='auto'.")
    assert fa4.unavailable_reason(CUDA, HOPPER) is None


@pytest.mark.parametrize("change, served", [
    ({}, True),
    ({"attn_mask": torch.ones(1)}, False),
    ({"is_causal": True}, False),
    ({"dropout_p": 0.1}, False),
    ({"dtype": torch.float32}, False),
    ({"head_dim": 12}, False),  # not a multiple of 8
    ({"head_dim": 264}, False),  # over FA4's 256
    ({"kv_heads": 3}, False),  # 8 query heads do not group over 3
    ({"kv_heads": 2}, True),  # grouped-query attention
    ({"min_tokens": 40}, True),  # the keys, not the queries, count
    ({"min_tokens": 41}, False),
])
def test_eligible_calls(change, served):
    dtype, head_dim, kv_heads = change.get("dtype", torch.bfloat16), change.get("head_dim", 64), change.get("kv_heads", 8)
    q = torch.zeros(1, 24, 8, head_dim, dtype=dtype)
    kv = torch.zeros(1, 40, kv_heads, head_dim, dtype=dtype)
    assert fa4.eligible(q, kv, kv, change.get("attn_mask"), change.get("dropout_p", 0.0),
                        change.get("is_causal", False), change.get("min_tokens", 0)) is served


# --------------------------------------------------------------------------------------------------- route
def _sdpa_in_fa4_layout(calls, timed_calls=None):
    def kernel(query, key, value, scale, timed=False):
        calls.append(key.shape[1])
        if timed_calls is not None:
            timed_calls.append(timed)
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                             scale=scale)
        return out.transpose(1, 2)

    return kernel


@pytest.fixture
def fa4_on_cpu(monkeypatch):
    """FA4 as if it ran here: the kernel replaced by SDPA in its layout (recording each call's key count), and the
    tiny model's float32 accepted."""
    calls = []
    _fa4_available(monkeypatch)
    monkeypatch.setattr(fa4, "fa4_attention", _sdpa_in_fa4_layout(calls))
    monkeypatch.setattr(fa4, "DTYPES", (torch.float32,))
    return calls


def test_fa4_takes_every_call_and_restore_puts_the_dispatcher_back(fa4_on_cpu):
    pipe, kwargs = tiny_pipeline("flux")
    assert check_route_takes_every_call(pipe, kwargs, fa4_on_cpu, attention="fa4")["backend"] == "fa4"


def test_the_route_takes_only_calls_with_enough_keys(fa4_on_cpu):
    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    undo = route.route_transformer(pipe.transformer, "fa4")
    run(pipe, kwargs)
    undo()
    (keys,) = set(fa4_on_cpu)  # the tiny FLUX model's joint attention: text + image tokens
    fa4_on_cpu.clear()
    undo = route.route_transformer(pipe.transformer, "fa4", min_tokens=keys + 1)
    assert torch.equal(run(pipe, kwargs), plain) and not fa4_on_cpu  # every call too short: all to the dispatcher
    undo()
    undo = route.route_transformer(pipe.transformer, "fa4", min_tokens=keys)
    assert torch.allclose(run(pipe, kwargs), plain, atol=1e-5) and fa4_on_cpu
    undo()


def test_the_ops_fake_implementation_gives_the_output_shape_without_the_package():
    with FakeTensorMode():
        q, k = torch.empty(1, 4608, 24, 128, dtype=torch.bfloat16), torch.empty(1, 512, 24, 128, dtype=torch.bfloat16)
        v = torch.empty(1, 512, 24, 64, dtype=torch.bfloat16)
        out = torch.ops.omni_accel.fa4_attention(q, k, v, None)
    assert out.shape == (1, 4608, 24, 64) and out.dtype == torch.bfloat16


def test_auto_applies_cudnn_and_the_long_sequence_route_together_and_restores(fa4_on_cpu, monkeypatch):
    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    hopper_rule = attn.choose_auto(CUDA, torch.bfloat16, True, 128, False, HOPPER)
    monkeypatch.setattr(attn, "choose_auto", lambda *a, **k: dataclasses.replace(hopper_rule, long_min_tokens=1))
    omni_accel.accelerate(pipe, attention="auto")
    (applied,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "attention"]
    assert (applied["backend"], applied["long_sequences"]) == ("cudnn", "fa4 from 1 keys")
    hooks = pipe.transformer._diffusers_hook._hook_order
    assert any("sdpa_kernel" in name for name in hooks) and "omni_accel.attention_route.fa4" in hooks
    assert torch.allclose(run(pipe, kwargs), plain, atol=1e-5) and fa4_on_cpu
    omni_accel.restore(pipe)
    fa4_on_cpu.clear()
    assert torch.equal(run(pipe, kwargs), plain) and not fa4_on_cpu
    assert not hasattr(pipe.transformer, "_diffusers_hook") or not pipe.transformer._diffusers_hook._hook_order


@pytest.mark.parametrize("knobs", [
    dict(compile="max"),  # the forward is captured: the op runs between the graph's segments
    dict(compile="max", cache="tea_cache"),  # a cache rules the graph out
    dict(compile=True),  # bf16 compile=True captures no graph
])
def test_auto_keeps_the_fa4_route_with_and_without_a_cuda_graph(fa4_on_cpu, monkeypatch, knobs):
    from omni_accel import compiler

    pipe, _ = tiny_pipeline("flux")
    hopper_rule = attn.choose_auto(CUDA, torch.bfloat16, True, 128, False, HOPPER)
    monkeypatch.setattr(attn, "choose_auto", lambda *a, **k: dataclasses.replace(hopper_rule, long_min_tokens=1))
    # as on a GPU: only the cache (of the real blocker's reasons) rules the graph out here
    monkeypatch.setattr(compiler, "cuda_graphs_blocker", lambda ctx: "a cache" if ctx.config.cache else None)
    omni_accel.accelerate(pipe, attention="auto", **knobs)
    (applied,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "attention"]
    assert (applied["backend"], applied["long_sequences"]) == ("cudnn", "fa4 from 1 keys")
    assert pipe.omni_accel.report()["attention_fallbacks"].keys() == {"FlashAttention-4"}
    assert "attention_timed" not in pipe.omni_accel.report()  # the timing switch is off
    omni_accel.restore(pipe)


def test_auto_names_flash_attn_4_as_passed_over_under_a_cuda_graph_too(monkeypatch):
    """Without flash-attn-4, a graphed forward would take FA4 as well once it is installed: the report says so."""
    from omni_accel import compiler

    monkeypatch.setattr(attn, "_fa4_refusal", lambda device, capability=None: "refused")
    monkeypatch.setattr(attn, "_installed", lambda package: package != "flash_attn.cute")
    rule = attn.choose_auto(CUDA, torch.bfloat16, True, 128, False, HOPPER)
    assert rule.long_backend is None and rule.passed_over[0].startswith("fa4 from 8192 keys: flash-attn-4 is not")
    monkeypatch.setattr(attn, "choose_auto", lambda *a, **k: rule)
    monkeypatch.setattr(compiler, "cuda_graphs_blocker", lambda ctx: None)  # as on a GPU: the forward is captured
    pipe, _ = tiny_pipeline("flux")
    omni_accel.accelerate(pipe, attention="auto", compile="max")
    (applied,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "attention"]
    assert applied["passed_over"] == list(rule.passed_over)
    omni_accel.restore(pipe)


@pytest.mark.parametrize("in_graph", [False, True])
def test_the_op_runs_between_graph_segments_unless_told_to_stay_in_the_graph(fa4_import_fails, monkeypatch,
                                                                             in_graph):
    """FA4's launches inside a capture are unverified: by default the op hands its call to ``run_outside_graph`` (a
    segment boundary under a capture, a plain call otherwise) with the output's shape and dtype; ``IN_GRAPH`` calls
    the kernel directly."""
    handed = []

    def outside(call, args, shape, dtype, writes_out=False):
        handed.append((shape, dtype, writes_out))
        out = torch.full(shape, float("nan"), dtype=dtype)  # the next segment's buffer
        assert call(*args, out=out) is out
        return out

    monkeypatch.setattr(fa4, "run_outside_graph", outside)
    monkeypatch.setattr(fa4, "IN_GRAPH", in_graph)
    # grouped keys and a narrower value: the declared output takes q's tokens and heads and v's head dim
    q, k, v = torch.randn(1, 24, 4, 16), torch.randn(1, 40, 2, 16), torch.randn(1, 40, 2, 8)
    out = torch.ops.omni_accel.fa4_attention(q, k, v, None)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, want)  # SDPA served: the package does not import here
    assert out.shape == (1, 24, 4, 8) and out.is_contiguous()
    assert handed == ([] if in_graph else [((1, 24, 4, 8), torch.float32, True)])


@pytest.fixture
def fake_fa4_interface(monkeypatch):
    """flash_attn.cute.interface as a stand-in module whose internal forward records its keyword arguments and
    writes ones (into ``out`` where given)."""
    calls = []
    unset = object()

    # FA4 4.0.0b40's keywords (a release without them is called through flash_attn_func)
    def forward(q, k, v, softmax_scale=unset, causal=unset, out=unset, tile_mn=unset, mma_pv_is_rs=unset,
                intra_wg_overlap=unset):
        kwargs = dict(softmax_scale=softmax_scale, causal=causal, out=out, tile_mn=tile_mn, mma_pv_is_rs=mma_pv_is_rs,
                      intra_wg_overlap=intra_wg_overlap)
        calls.append({name: value for name, value in kwargs.items() if value is not unset})
        if forward.fails_with_tile and tile_mn is not unset:
            raise ValueError("tile does not fit")
        out = out if out is not None else q.new_empty(q.shape)
        return out.fill_(1), None, None, None, None

    forward.fails_with_tile = False

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd = forward
    interface.flash_attn_func = lambda q, k, v, **kwargs: (torch.full_like(q, 2), None)
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    for name, module in (("flash_attn", types.ModuleType("flash_attn")), ("flash_attn.cute", cute),
                         ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, module)
    return interface, calls


@pytest.mark.parametrize("tile, asked", [
    (None, {}),  # FA4's own choice: nothing asked
    ((128, 176, True, True), dict(tile_mn=(128, 176), mma_pv_is_rs=True, intra_wg_overlap=True)),
    ((192, 128, True, False), dict(tile_mn=(192, 128), mma_pv_is_rs=True, intra_wg_overlap=False)),
])
def test_the_kernel_call_asks_for_the_tile_and_writes_into_the_buffer_given(fake_fa4_interface, monkeypatch, tile,
                                                                          asked):
    _, calls = fake_fa4_interface
    monkeypatch.setattr(fa4, "TILE", tile)
    monkeypatch.setattr(fa4, "_hopper", lambda tensor: True)
    q = torch.zeros(1, 8, 2, 16)
    out = torch.zeros(1, 8, 2, 16)
    assert fa4._fa4_call(q, q, q, 0.5, out) is out and bool((out == 1).all())
    assert calls == [dict(softmax_scale=0.5, causal=False, out=out, **asked)]
    assert bool((fa4._fa4_call(q, q, q, None) == 1).all()) and calls[-1]["out"] is None


def test_the_op_counts_the_calls_the_kernel_computed(fake_fa4_interface, monkeypatch):
    monkeypatch.setattr(fa4, "_REFUSED", {})
    before = fa4.served_calls("FlashAttention-4")
    q = torch.zeros(1, 8, 2, 16)
    for _ in range(3):
        assert bool((torch.ops.omni_accel.fa4_attention(q, q, q, None) == 1).all())  # the stand-in kernel's ones
    assert fa4.served_calls("FlashAttention-4") == before + 3 and not fa4.refused_shapes()


@pytest.mark.parametrize("release", ["no internal forward", "other keywords"])
def test_a_release_without_the_internal_forward_is_called_through_the_public_one(fake_fa4_interface, monkeypatch,
                                                                                release):
    interface, calls = fake_fa4_interface
    if release == "no internal forward":
        del interface._flash_attn_fwd
    else:  # an older release's keywords (m_block_size, ...): no out=, no tile_mn
        interface._flash_attn_fwd = lambda q, k, v, softmax_scale=None, causal=False, m_block_size=128: calls.append(1)
    monkeypatch.setattr(fa4, "TILE", (128, 144, True, True))
    monkeypatch.setattr(fa4, "_hopper", lambda tensor: True)  # a tile would be asked for: the public call drops it
    q, out = torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 2, 16)
    assert fa4._fa4_call(q, q, q, None, out) is out and bool((out == 2).all())
    assert bool((fa4._fa4_call(q, q, q, None) == 2).all()) and not calls


def test_a_tile_fa4_fails_on_falls_back_to_its_own_tile_for_that_shape(fake_fa4_interface, monkeypatch, caplog):
    interface, calls = fake_fa4_interface
    interface._flash_attn_fwd.fails_with_tile = True
    monkeypatch.setattr(fa4, "_TILE_FAILED", {})
    monkeypatch.setattr(fa4, "TILE", (128, 176, True, True))
    monkeypatch.setattr(fa4, "_hopper", lambda tensor: True)
    caplog.set_level(logging.WARNING, logger=fa4.__name__)
    q = torch.zeros(1, 8, 2, 16)
    for _ in range(2):
        assert bool((fa4._fa4_call(q, q, q, None) == 1).all())  # the kernel served, with its own tile
    assert ["tile_mn" in call for call in calls] == [True, False, False]  # the tile tried once, then left out
    assert [r.getMessage() for r in caplog.records] == [
        "omni_accel: FlashAttention-4 failed with the 128x176 tile for q (1, 8, 2, 16), k (1, 8, 2, 16) "
        "(ValueError: tile does not fit); its own tile serves this shape from now on"]
    assert not fa4.refused_shapes()  # the shape keeps FA4


def test_long_calls_at_head_dim_128_ask_for_the_long_tile_on_hopper_only(fake_fa4_interface, monkeypatch):
    _, calls = fake_fa4_interface
    long_tile = dict(tile_mn=(192, 128), mma_pv_is_rs=True, intra_wg_overlap=False)
    assert fa4.tile_for(fa4.LONG_TILE_MIN_KEYS, 128) == fa4.LONG_TILE == (192, 128, True, False)
    assert fa4.tile_for(fa4.LONG_TILE_MIN_KEYS - 1, 128) is None  # measured slower at 17,160 keys
    assert fa4.tile_for(32760, 64) is None  # measured at head dim 128 only
    assert fa4.tile_for(32760, 128, value_head_dim=64) is None and fa4.tile_for(32760, 128, grouped=True) is None
    monkeypatch.setattr(fa4, "TILE", (128, 144, True, True))
    assert fa4.tile_for(32760, 128) == fa4.tile_for(100, 64) == (128, 144, True, True)  # the switch overrides
    monkeypatch.setattr(fa4, "TILE", None)
    q, k = torch.zeros(1, 8, 2, 128), torch.zeros(1, fa4.LONG_TILE_MIN_KEYS, 2, 128)
    fa4._fa4_call(q, k, k, None)  # a CPU tensor: no Hopper, FA4 picks
    monkeypatch.setattr(fa4, "TILE", (128, 144, True, True))
    fa4._fa4_call(q, k, k, None)  # the switch does not apply off Hopper either
    monkeypatch.setattr(fa4, "TILE", None)
    monkeypatch.setattr(fa4, "_hopper", lambda tensor: True)
    fa4._fa4_call(q, k, k, None)
    fa4._fa4_call(q, k[:, :-1], k[:, :-1], None)
    fa4._fa4_call(q, k[:, :, :1], k[:, :, :1], None)  # grouped keys
    assert [{key: c[key] for key in long_tile if key in c} for c in calls] == [{}, {}, long_tile, {}, {}]


def test_tile_candidates_are_named_and_start_with_fa4s_default():
    assert fa4.TILE_CANDIDATES[0] == (128, 128, True, True)
    assert [fa4.tile_name(t) for t in fa4.TILE_CANDIDATES[5:7]] == ["128x176_nooverlap", "192x128_nooverlap"]
    assert fa4.tile_name((128, 128, False, True)) == "128x128_pvsmem"
    assert fa4.TILE is None  # the library's default: FA4 picks


# ------------------------------------------------------------- the real op where FA4 cannot run: SDPA serves
@pytest.fixture
def fa4_import_fails(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # as if the package were found but would not import
    monkeypatch.setattr(fa4, "_REFUSED", {})
    caplog.set_level(logging.WARNING, logger=fa4.__name__)
    return caplog


def test_the_op_falls_back_to_sdpa_once_per_shape_and_says_why(fa4_import_fails):
    check_sdpa_fallback(torch.ops.omni_accel.fa4_attention, fa4.refused_shapes, fa4_import_fails.records,
                        "FlashAttention-4")


def test_compiled_blocks_trace_the_route_and_the_op_without_graph_breaks(fa4_import_fails, monkeypatch):
    _fa4_available(monkeypatch)
    monkeypatch.setattr(fa4, "DTYPES", (torch.float32,))
    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    compiled, counts = run_compiled_twice(pipe, kwargs, attention="fa4", compile=True)
    assert counts["graphs_second_call"] == counts["graphs_first_call"] > 0  # no recompile on the second call
    assert counts["graph_breaks"] == 0
    assert fa4.refused_shapes()  # the compiled blocks called the op
    assert ((compiled - plain).norm() / plain.norm()).item() < 1e-4


def test_the_report_lists_the_shapes_fa4_failed_on(fa4_import_fails, monkeypatch):
    """A package that is found but fails at its first call must not look like the fast kernel at work: report()
    names the routed kernel with no shapes before the first call and, after it, each shape SDPA computed instead
    with the reason."""
    _fa4_available(monkeypatch)
    monkeypatch.setattr(fa4, "DTYPES", (torch.float32,))
    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    omni_accel.accelerate(pipe, attention="fa4")
    served = fa4.served_calls("FlashAttention-4")
    assert pipe.omni_accel.report()["attention_fallbacks"] == {"FlashAttention-4": {}}
    assert pipe.omni_accel.report()["attention_served"] == {"FlashAttention-4": served}
    assert torch.allclose(run(pipe, kwargs), plain, atol=1e-5)
    (shape, why), = pipe.omni_accel.report()["attention_fallbacks"]["FlashAttention-4"].items()
    assert shape.startswith("((1, ") and why.startswith(("ImportError", "ModuleNotFoundError")), (shape, why)
    assert pipe.omni_accel.report()["attention_served"] == {"FlashAttention-4": served}  # SDPA computed every call
    assert "attention_timed" not in pipe.omni_accel.report()  # attention="fa4" times nothing
    omni_accel.restore(pipe)


def test_a_pipeline_without_a_packaged_kernel_has_no_fallback_section():
    pipe, _ = tiny_pipeline("flux")
    omni_accel.accelerate(pipe, attention="sdpa")
    assert "attention_fallbacks" not in pipe.omni_accel.report()
    omni_accel.restore(pipe)


# ------------------------------------ the switch TIMED_MIN_TOKENS: auto's timed choice between FA4 and SDPA per shape
@pytest.fixture
def timed_flags(monkeypatch):
    """FA4 as if it ran here (SDPA in its layout), recording each call's key count and its ``timed`` flag."""
    calls, timed = [], []
    _fa4_available(monkeypatch)
    monkeypatch.setattr(fa4, "fa4_attention", _sdpa_in_fa4_layout(calls, timed))
    monkeypatch.setattr(fa4, "DTYPES", (torch.float32,))
    return calls, timed


def test_the_timing_switch_starts_auto_s_route_lower_and_times_each_shape_once(raced_kernels, monkeypatch):
    _fa4_available(monkeypatch)
    monkeypatch.setattr(fa4, "DTYPES", (torch.float32,))
    monkeypatch.setattr(fa4, "TIMED_MIN_TOKENS", 1)
    raced_kernels["fa4_ms"] = 2.0  # SDPA wins: the pipeline's output stays SDPA's
    hopper_rule = attn.choose_auto(CUDA, torch.bfloat16, True, 128, False, HOPPER)
    assert hopper_rule.long_min_tokens == fa4.AUTO_MIN_TOKENS  # the table is the same; the pass applies the switch
    monkeypatch.setattr(attn, "choose_auto", lambda *a, **k: hopper_rule)
    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    omni_accel.accelerate(pipe, attention="auto")
    (applied,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "attention"]
    assert applied["long_sequences"] == "fa4 from 1 keys (below 8192: the faster of it and cudnn, timed per shape)"
    assert pipe.omni_accel.report()["attention_timed"] == {}  # nothing timed before the first call
    torch.testing.assert_close(run(pipe, kwargs), plain)
    (shape, choice), = pipe.omni_accel.report()["attention_timed"].items()  # the joint attention's one shape
    assert choice.startswith("sdpa (fa4 2.000 ms, sdpa 1.000 ms per call)"), (shape, choice)
    timing_calls = raced_kernels["fa4_calls"]
    run(pipe, kwargs)
    assert raced_kernels["fa4_calls"] == timing_calls  # timed once for the process
    omni_accel.restore(pipe)
    fa4.reset_timed_choices()
    assert fa4.timed_choices() == {}


@pytest.mark.parametrize("bad", [0, -1, "4096", 4096.0, True])
def test_a_bad_timing_switch_is_refused_before_anything_is_patched(monkeypatch, bad):
    _fa4_available(monkeypatch)
    monkeypatch.setattr(fa4, "TIMED_MIN_TOKENS", bad)
    hopper_rule = attn.choose_auto(CUDA, torch.bfloat16, True, 128, False, HOPPER)
    monkeypatch.setattr(attn, "choose_auto", lambda *a, **k: hopper_rule)
    pipe, _ = tiny_pipeline("flux")
    with pytest.raises(AccelError) as err:
        omni_accel.accelerate(pipe, attention="auto")
    assert str(err.value) == (f"fa4_attention.TIMED_MIN_TOKENS={bad!r} is not a key count: set it to None (off, the "
                              "default) or to a positive int such as 4096.")
    assert "omni_accel" not in vars(pipe)


@pytest.mark.parametrize("sdpa_ms, kernel", [
    (1.0, "fa4"),  # a tie goes to FA4: SDPA from inside the op costs host time the GPU timing does not see
    (0.98, "fa4"),  # within TIMED_SDPA_MARGIN (3 %)
    (0.9, "sdpa"),
])
def test_sdpa_takes_a_shape_only_when_faster_by_the_margin(raced_kernels, sdpa_ms, kernel):
    raced_kernels["sdpa_ms"] = sdpa_ms
    assert fa4.TIMED_SDPA_MARGIN == 0.03
    assert fa4.faster_kernel(*_qkv(), None) == kernel


def test_the_route_asks_for_the_timed_choice_below_its_threshold_only(timed_flags):  # the route's flag alone
    calls, timed = timed_flags
    pipe, kwargs = tiny_pipeline("flux")
    undo = route.route_transformer(pipe.transformer, "fa4", min_tokens=1)
    run(pipe, kwargs)
    undo()
    (keys,) = set(calls)
    assert set(timed) == {False}  # attention="fa4"'s route: no timing
    for timed_below, want in ((keys, False), (keys + 1, True)):
        timed.clear()
        undo = route.route_transformer(pipe.transformer, "fa4", min_tokens=1, timed_below=timed_below)
        run(pipe, kwargs)
        undo()
        assert set(timed) == {want}


@pytest.fixture
def raced_kernels(monkeypatch):
    """FA4's call replaced by one that writes ones and takes ``fa4_ms``, SDPA by the real one taking ``sdpa_ms``, on a
    fake clock that only the two advance (kernels.timing reads ``time.perf_counter`` on a CPU), so the race's outcome
    does not depend on this machine's load; the timing shortened; no earlier choices or failures."""
    monkeypatch.setattr(fa4, "_CHOICES", {})
    monkeypatch.setattr(fa4, "_REFUSED", {})
    monkeypatch.setattr(fa4, "TIMED_ROUNDS", 3)
    monkeypatch.setattr(fa4, "TIMED_CALLS", 2)
    state = {"fa4_ms": 1.0, "sdpa_ms": 1.0, "fa4_calls": 0, "sdpa_calls": 0, "fa4_fails": False, "clock_ms": 0.0}
    plain_sdpa = fa4._sdpa

    def fake_fa4(query, key, value, scale, out=None):
        state["fa4_calls"] += 1
        if state["fa4_fails"]:
            raise RuntimeError("no kernel for this shape")
        state["clock_ms"] += state["fa4_ms"]
        ones = torch.ones_like(query)
        return ones if out is None else out.copy_(ones)

    def timed_sdpa(query, key, value, scale):
        state["sdpa_calls"] += 1
        state["clock_ms"] += state["sdpa_ms"]
        return plain_sdpa(query, key, value, scale)

    monkeypatch.setattr(fa4, "_fa4_call", fake_fa4)
    monkeypatch.setattr(fa4, "_sdpa", timed_sdpa)
    monkeypatch.setattr(kernel_timing, "time", types.SimpleNamespace(perf_counter=lambda: state["clock_ms"] / 1e3))
    return state


def _qkv():
    torch.manual_seed(0)
    return torch.randn(1, 24, 2, 16), torch.randn(1, 24, 2, 16), torch.randn(1, 24, 2, 16)


def test_a_shape_faster_on_sdpa_is_served_by_sdpa_after_one_timing(raced_kernels, caplog):
    raced_kernels["fa4_ms"] = 2.0
    caplog.set_level(logging.INFO, logger=fa4.__name__)
    q, k, v = _qkv()
    served_before = fa4.served_calls("FlashAttention-4")
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(torch.ops.omni_accel.fa4_attention(q, k, v, None, True), want)
    timing_calls = raced_kernels["fa4_calls"]
    assert timing_calls == 1 + 3 * 2  # a first call, then three rounds of two
    for _ in range(3):
        torch.testing.assert_close(torch.ops.omni_accel.fa4_attention(q, k, v, None, True), want)
    assert raced_kernels["fa4_calls"] == timing_calls  # timed once per shape
    assert fa4.served_calls("FlashAttention-4") == served_before  # timing calls do not count as served
    (shape, choice), = fa4.timed_choices().items()
    assert shape.startswith("((1, 24, 2, 16), (1, 24, 2, 16), (1, 24, 2, 16), 'float32', 'cpu')")
    assert choice.startswith("sdpa (fa4 ") and choice.endswith(" ms per call)")
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("omni_accel: attention='auto' timed q (1, 24, 2, 16), k (1, 24, 2, 16) on cpu: sdpa")


def test_a_shape_faster_on_fa4_is_served_by_fa4_and_counted(raced_kernels):
    raced_kernels["sdpa_ms"] = 2.0
    q, k, v = _qkv()
    served_before = fa4.served_calls("FlashAttention-4")
    for _ in range(2):
        assert bool((torch.ops.omni_accel.fa4_attention(q, k, v, None, True) == 1).all())  # the stand-in's ones
    assert fa4.served_calls("FlashAttention-4") == served_before + 2
    assert list(fa4.timed_choices().values())[0].startswith("fa4 (fa4 ")


def test_a_shape_fa4_fails_on_goes_to_sdpa_without_a_race(raced_kernels):
    raced_kernels["fa4_fails"] = True
    q, k, v = _qkv()
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(torch.ops.omni_accel.fa4_attention(q, k, v, None, True), want)
    assert raced_kernels["fa4_calls"] == 1  # the failed first call; no timing of a kernel that cannot run
    assert list(fa4.timed_choices().values())[0].startswith("sdpa (fa4 failed, sdpa ")
    assert list(fa4.refused_shapes().values()) == ["RuntimeError: no kernel for this shape"]


def test_nothing_is_timed_while_a_graph_is_captured(raced_kernels, monkeypatch):
    """Inside a capture the kernels would be recorded, not run: an untimed shape gets FA4 there and is timed at its
    next call outside the capture."""
    raced_kernels["fa4_ms"] = 2.0
    q, k, v = _qkv()
    monkeypatch.setattr(fa4, "_capturing", lambda tensor: True)
    assert fa4.faster_kernel(q, k, v, None) == "fa4" and not fa4.timed_choices()
    assert raced_kernels["fa4_calls"] == 0
    monkeypatch.setattr(fa4, "_capturing", lambda tensor: False)
    assert fa4.faster_kernel(q, k, v, None) == "sdpa" and len(fa4.timed_choices()) == 1
    monkeypatch.setattr(fa4, "_capturing", lambda tensor: True)
    assert fa4.faster_kernel(q, k, v, None) == "sdpa"  # timed before the capture: its choice holds inside


def test_without_timed_the_op_never_times(raced_kernels):
    raced_kernels["fa4_ms"] = 2.0
    q, k, v = _qkv()
    assert bool((torch.ops.omni_accel.fa4_attention(q, k, v, None) == 1).all())
    assert raced_kernels["fa4_calls"] == 1 and raced_kernels["sdpa_calls"] == 0 and not fa4.timed_choices()
