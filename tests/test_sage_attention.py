"""attention="sage" (SageAttention) tested without a GPU: the route sends every call it can serve to the op
omni_accel::sage_attention (SDPA standing in for the package's kernel: outputs must equal the plain pipeline's),
compiled blocks keep the op whole (no graph breaks: diffusers' own sage backend broke them), the op falls back to
SDPA where the package fails, and with sequence parallelism the pass keeps diffusers' backend."""

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
from omni_accel.kernels import fp8_attention as route
from omni_accel.kernels import sage_attention as sage
from omni_accel.testing import check_route_takes_every_call, check_sdpa_fallback, run, run_compiled_twice, tiny_pipeline


@pytest.fixture
def sage_on_cpu(monkeypatch, caplog):
    """A stand-in ``sageattention`` package whose ``sageattn`` is SDPA in the NHD layout (recording each call), the
    backend's CUDA requirement lifted, and the tiny model's float32 accepted."""
    calls = []

    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None):
        assert tensor_layout == "NHD" and not is_causal
        calls.append(tuple(q.shape))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=sm_scale)
        return out.transpose(1, 2)

    monkeypatch.setitem(sys.modules, "sageattention", types.SimpleNamespace(sageattn=sageattn))
    monkeypatch.setitem(attn.BACKENDS, "sage", attn.BACKENDS["sage"].__class__(
        **{**attn.BACKENDS["sage"].__dict__, "needs_cuda": False}))
    monkeypatch.setattr(attn, "_installed", lambda package: True)
    monkeypatch.setattr(sage, "DTYPES", (torch.float32,))
    monkeypatch.setattr(sage, "_REFUSED", {})
    caplog.set_level(logging.WARNING)
    return calls


def test_sage_takes_every_call_through_its_op_and_restore_puts_the_dispatcher_back(sage_on_cpu):
    pipe, kwargs = tiny_pipeline("flux")
    applied = check_route_takes_every_call(pipe, kwargs, sage_on_cpu, attention="sage")
    assert (applied["backend"], applied["route"]) == ("sage", "omni_accel::sage_attention")


def test_compiled_blocks_keep_the_sage_op_whole(sage_on_cpu):
    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    compiled, counts = run_compiled_twice(pipe, kwargs, attention="sage", compile=True)
    assert counts["graph_breaks"] == 0
    assert counts["graphs_second_call"] == counts["graphs_first_call"] > 0
    assert sage_on_cpu  # the compiled blocks called the package through the op
    assert ((compiled - plain).norm() / plain.norm()).item() < 1e-4


@pytest.mark.parametrize("change, served", [
    ({}, True),
    ({"attn_mask": torch.ones(1)}, False),
    ({"is_causal": True}, False),
    ({"dropout_p": 0.1}, False),
    ({"dtype": torch.float32}, False),
    ({"head_dim": 160}, False),  # over the package's 128
    ({"head_dim": 32}, True),  # padded to 64 by the package
    ({"kv_heads": 2}, False),  # grouped heads: not served
    ({"min_tokens": 40}, True),  # the keys, not the queries, count
    ({"min_tokens": 41}, False),
])
def test_eligible_calls(change, served):
    dtype, head_dim = change.get("dtype", torch.bfloat16), change.get("head_dim", 64)
    kv_heads = change.get("kv_heads", 8)
    q = torch.zeros(1, 24, 8, head_dim, dtype=dtype)
    kv = torch.zeros(1, 40, kv_heads, head_dim, dtype=dtype)
    assert sage.eligible(q, kv, kv, change.get("attn_mask"), change.get("dropout_p", 0.0),
                         change.get("is_causal", False), change.get("min_tokens", 0)) is served


def test_the_op_falls_back_to_sdpa_once_per_shape_and_says_why(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "sageattention", None)  # found but would not import
    monkeypatch.setattr(sage, "_REFUSED", {})
    caplog.set_level(logging.WARNING)
    check_sdpa_fallback(torch.ops.omni_accel.sage_attention, sage.refused_shapes, caplog.records, "SageAttention")


def test_the_ops_fake_implementation_gives_the_output_shape_without_the_package():
    with FakeTensorMode():
        q = torch.empty(1, 4608, 24, 128, dtype=torch.bfloat16)
        out = torch.ops.omni_accel.sage_attention(q, q, q, None)
    assert out.shape == (1, 4608, 24, 128) and out.is_contiguous()


def test_sage_on_a_cpu_is_refused_before_anything_is_patched(monkeypatch):
    monkeypatch.setattr(attn, "_installed", lambda package: True)
    pipe, _ = tiny_pipeline("flux")
    with pytest.raises(AccelError) as err:
        omni_accel.accelerate(pipe, attention="sageattention")  # the alias names the same backend
    assert str(err.value) == ("attention='sageattention' needs a CUDA GPU but the pipeline runs on cpu; use "
                              "attention='auto' or 'sdpa'.")
    assert "omni_accel" not in vars(pipe)


def test_keys_smoothed_in_the_graph_reach_the_hopper_entry_without_a_second_smoothing(sage_on_cpu, monkeypatch):
    """SMOOTH_KEYS_IN_GRAPH: the route hands the op K minus its token mean (the output is the plain pipeline's:
    softmax ignores the shift), and on Hopper the op calls the package's Hopper entry with smooth_k=False."""
    hopper_calls = []

    def hopper_entry(q, k, v, tensor_layout, is_causal, sm_scale, pv_accum_dtype, smooth_k):
        hopper_calls.append((smooth_k, pv_accum_dtype, float(k.float().mean(dim=1).abs().max())))
        return sys.modules["sageattention"].sageattn(q, k, v, tensor_layout=tensor_layout, sm_scale=sm_scale)

    monkeypatch.setattr(sys.modules["sageattention"], sage._HOPPER_ENTRY, hopper_entry, raising=False)
    monkeypatch.setattr(sage, "_hopper", lambda query: True)
    monkeypatch.setattr(sage, "SMOOTH_KEYS_IN_GRAPH", True)
    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    omni_accel.accelerate(pipe, attention="sage")
    try:
        out = run(pipe, kwargs)
    finally:
        omni_accel.restore(pipe)
    assert hopper_calls and all(s is False and acc == "fp32+fp32" and m < 1e-4 for s, acc, m in hopper_calls)
    assert ((out - plain).norm() / plain.norm()).item() < 1e-4


class _RecordingCapture:
    """Stands in for a whole-forward capture in progress: records the host steps the op asks for, and runs them
    as a replay would (the CPU has no CUDA graphs)."""

    def __init__(self):
        self.steps = []

    def host_step(self, call, args, shape, dtype):
        self.steps.append((call, args, shape, dtype))
        return call(*args)


def test_under_a_graph_capture_the_op_asks_to_run_between_graphs_with_its_inputs(sage_on_cpu, monkeypatch):
    """SageAttention's CUDA kernels go to the legacy default stream, which a CUDA graph capture never sees: inside
    a capture the op must hand its call to the capture as a host step (q, k, v and the output's shape), and with
    the switch off it runs inline as before (the benchmark row that shows the fault)."""
    from omni_accel import cuda_graphs

    q, k, v = (torch.randn(1, 16, 2, 32) for _ in range(3))
    v = v[..., :24]
    capture = _RecordingCapture()
    monkeypatch.setattr(cuda_graphs._ACTIVE, "capture", capture, raising=False)
    out = sage.sage_attention(q, k, v, None)
    [(_, args, shape, dtype)] = capture.steps
    assert all(a is b for a, b in zip(args, (q, k, v)))
    assert shape == (1, 16, 2, 24) and dtype == torch.float32 and out.shape == shape
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("graph_captured", [False, True])
def test_auto_routes_long_calls_to_sage_beside_cudnn_also_under_a_graph_and_restores(sage_on_cpu, monkeypatch,
                                                                                     graph_captured):
    """auto's int8 row on Hopper: cuDNN for every call, SageAttention for calls from ``long_min_tokens`` keys. Unlike
    FlashAttention-4's route it stays when the forward is captured in a CUDA graph (the op runs between graph
    segments). A threshold one above the tiny model's key count routes none."""
    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    undo = route.route_transformer(pipe.transformer, "sage")
    run(pipe, kwargs)
    undo()
    keys = {shape[1] for shape in sage_on_cpu}.pop()  # NHD: (batch, tokens, heads, head dim)
    monkeypatch.setattr(sage, "installed", lambda package: True)
    rule = attn.choose_auto(torch.device("cuda"), torch.bfloat16, True, 128, False, (9, 0), int8_stack=True)
    assert (rule.backend, rule.long_backend) == ("cudnn", "sage")
    monkeypatch.setattr(attn, "_graph_captured", lambda ctx: graph_captured)
    for min_tokens, routed in ((keys, True), (keys + 1, False)):
        sage_on_cpu.clear()
        monkeypatch.setattr(attn, "choose_auto", lambda *a, **k: dataclasses.replace(rule, long_min_tokens=min_tokens))
        omni_accel.accelerate(pipe, attention="auto")
        (applied,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "attention"]
        assert (applied["backend"], applied["long_sequences"]) == ("cudnn", f"sage from {min_tokens} keys")
        assert torch.allclose(run(pipe, kwargs), plain, atol=1e-5)
        assert bool(sage_on_cpu) is routed
        omni_accel.restore(pipe)
    sage_on_cpu.clear()
    assert torch.equal(run(pipe, kwargs), plain) and not sage_on_cpu
