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
from omni_accel import AccelError, deps
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
    monkeypatch.setattr(sage, "PREP_IN_GRAPH", False)  # the package's own entry, which these tests follow
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


def test_the_op_counts_the_calls_the_package_computed_and_not_the_fallbacks(monkeypatch):
    from omni_accel.kernels import fa4_attention

    monkeypatch.setattr(sage, "_REFUSED", {})
    monkeypatch.setattr(sage, "_sage_call", lambda q, k, v, scale, smoothed: torch.full_like(q, 3.0))
    before = fa4_attention.served_calls(sage.KERNEL_NAME)
    q = torch.zeros(1, 8, 2, 16)
    for _ in range(2):
        assert bool((torch.ops.omni_accel.sage_attention(q, q, q, None) == 3).all())
    assert fa4_attention.served_calls(sage.KERNEL_NAME) == before + 2

    def fails(q, k, v, scale, smoothed):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(sage, "_sage_call", fails)
    torch.ops.omni_accel.sage_attention(q, q, q, None)  # SDPA computes it: not counted
    assert fa4_attention.served_calls(sage.KERNEL_NAME) == before + 2 and sage.refused_shapes()


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

    def host_step(self, call, args, shape, dtype, writes_out=False):
        self.steps.append((call, args, shape, dtype, writes_out))
        if writes_out:  # the capture's static output, written by the call itself
            return call(*args, out=torch.full(shape, float("nan"), dtype=dtype))
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
    [(_, args, shape, dtype, writes_out)] = capture.steps
    assert not writes_out  # the package allocates its output: the capture copies it
    assert all(a is b for a, b in zip(args, (q, k, v)))
    assert shape == (1, 16, 2, 24) and dtype == torch.float32 and out.shape == shape
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(out, want)


def test_auto_routes_long_calls_to_sage_beside_cudnn_and_restores(sage_on_cpu, monkeypatch):
    """auto's int8 row on Hopper: cuDNN for every call, SageAttention for calls from ``long_min_tokens`` keys. A
    threshold one above the tiny model's key count routes none."""
    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    undo = route.route_transformer(pipe.transformer, "sage")
    run(pipe, kwargs)
    undo()
    keys = {shape[1] for shape in sage_on_cpu}.pop()  # NHD: (batch, tokens, heads, head dim)
    monkeypatch.setattr(sage, "installed", lambda package: True)
    monkeypatch.setattr(sage, "hopper_kernel_built", lambda: True)
    rule = attn.choose_auto(torch.device("cuda"), torch.bfloat16, True, 128, False, (9, 0), int8_stack=True)
    assert (rule.backend, rule.long_backend) == ("cudnn", "sage")
    for min_tokens, routed in ((keys, True), (keys + 1, False)):
        sage_on_cpu.clear()
        monkeypatch.setattr(attn, "choose_auto", lambda *a, **k: dataclasses.replace(rule, long_min_tokens=min_tokens))
        omni_accel.accelerate(pipe, attention="auto")
        (applied,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "attention"]
        assert (applied["backend"], applied["long_sequences"]) == ("cudnn", f"sage from {min_tokens} keys")
        assert set(pipe.omni_accel.report()["attention_fallbacks"]) == {"SageAttention"}
        assert torch.allclose(run(pipe, kwargs), plain, atol=1e-5)
        assert bool(sage_on_cpu) is routed
        omni_accel.restore(pipe)
    sage_on_cpu.clear()
    assert torch.equal(run(pipe, kwargs), plain) and not sage_on_cpu


# ------------------------------------------------------------------- Q, K and V quantized in the compiled graph
_V_ORDER = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)  # key stored at each of 16 positions


def _half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, torch.floor(x + 0.5), torch.ceil(x - 0.5)).to(torch.int8)


def _per_thread_reference(x: torch.Tensor, programs: int, rows_of) -> tuple[torch.Tensor, torch.Tensor]:
    """The package's per-thread Triton quantization as loops over its programs: program p of a (batch, head) takes
    the tokens ``rows_of(p)`` (those below the length), scale = amax / 127 + 1e-7, int8 = round half away."""
    b, n, h, _ = x.shape
    q8, scales = torch.zeros(x.shape, dtype=torch.int8), torch.empty(b, h, programs)
    for bi in range(b):
        for hi in range(h):
            for p in range(programs):
                rows = [r for r in rows_of(p) if r < n]
                block = x[bi, rows, hi].float()
                scales[bi, hi, p] = (block.abs().max() if rows else torch.tensor(0.0)) / 127.0 + 1e-7
                if rows:
                    q8[bi, rows, hi] = _half_away(block / scales[bi, hi, p])
    return q8, scales


@pytest.mark.parametrize("tokens", [64, 150])
def test_queries_and_keys_are_quantized_as_the_hopper_kernel_reads_them(tokens):
    """Scales and int8 values equal the package's per-thread kernels' (quant_query / quant_key_per_thread_int8),
    written out as loops: a query scale per program (16-query block w, lane t: queries 16 w + t and 16 w + 8 + t),
    a key scale per program (128-key block, thread t: keys 8 i + 2 t and 8 i + 2 t + 1, i < 16), K smoothed first."""
    g = torch.Generator().manual_seed(tokens)
    q, k = (torch.randn(1, tokens, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    q8, q_scale = sage.quantize_queries(q)
    want_q8, want_q_scale = _per_thread_reference(
        q, -(-tokens // 64) * 32, lambda p: [p // 8 * 16 + j * 8 + p % 8 for j in range(2)])
    assert q_scale.shape == want_q_scale.shape and torch.equal(q_scale, want_q_scale)
    assert q_scale.is_contiguous()  # the kernel refuses strided scales
    assert q8.shape == q.shape and torch.equal(q8, want_q8)
    k8, k_scale = sage.quantize_keys(k)
    want_k8, want_k_scale = _per_thread_reference(
        k - k.mean(dim=1, keepdim=True), -(-tokens // 128) * 4,
        lambda p: [p // 4 * 128 + 8 * i + 2 * (p % 4) + e for i in range(16) for e in range(2)])
    assert k_scale.shape == want_k_scale.shape and torch.equal(k_scale, want_k_scale) and k_scale.is_contiguous()
    assert torch.equal(k8, want_k8)


def test_values_are_transposed_reordered_and_scaled_per_channel_as_the_kernel_reads_them():
    """V as the package's transpose-pad-permute and per-channel FP8 kernels leave it: (batch, D, heads, keys padded
    to 128), position 16 g + p holding key 16 g + _V_ORDER[p] (zeros past the keys), scaled by 448 / channel amax."""
    g = torch.Generator().manual_seed(3)
    v = (torch.randn(1, 150, 2, 64, generator=g) * 3).to(torch.bfloat16)
    v8, v_scale = sage.quantize_values(v)
    assert v8.shape == (1, 64, 2, 256) and v8.dtype == torch.float8_e4m3fn and v8.is_contiguous()
    amax = v.float().abs().amax(dim=1)
    assert torch.equal(v_scale, amax / 448.0)
    padded = torch.cat([v.float(), torch.zeros(1, 106, 2, 64)], dim=1)
    order = torch.tensor([16 * (p // 16) + _V_ORDER[p % 16] for p in range(256)])
    want = (padded[:, order] * (448.0 / amax)[:, None]).to(torch.float8_e4m3fn).permute(0, 3, 2, 1)
    assert torch.equal(v8.view(torch.uint8), want.contiguous().view(torch.uint8))


def test_dequantized_operands_are_the_inputs_within_half_a_step():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 150, 3, 64, generator=g) for _ in range(3))
    q8, qs = sage.quantize_queries(q)
    k8, ks = sage.quantize_keys(k)
    v8, vs = sage.quantize_values(v)
    dq, dk, dv = sage.dequantized(q8, qs, k8, ks, v8, vs)
    assert dq.shape == dk.shape == dv.shape == q.shape
    k_smooth = k - k.mean(dim=1, keepdim=True)
    for x, back, step in ((q, dq, qs.max()), (k_smooth, dk, ks.max())):
        assert (x - back).abs().max() <= step / 2 + 1e-6
    assert ((v - dv).abs() <= 2.0 ** -4 * v.abs() + vs.max() * 2.0 ** -9).all()  # e4m3: 3 mantissa bits


def test_the_quantized_op_off_hopper_computes_its_operands_attention(monkeypatch):
    """Without the package's Hopper kernel the op computes the attention of the operands it was given (dequantized,
    float32): close to exact attention, and not equal to it (the rounding is really in the path)."""
    monkeypatch.setitem(sys.modules, "sageattention", None)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 200, 2, 128, generator=g).to(torch.bfloat16) for _ in range(3))
    out = sage.prepared_attention(q, k, v, None)
    want = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    err = ((out.float() - want).norm() / want.norm()).item()
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and 0 < err < 0.03, err


@pytest.mark.parametrize("capability, runs", [((9, 0), True), ((8, 9), True), ((8, 6), False), ((8, 0), False)])
def test_the_prep_kernels_run_only_where_triton_casts_to_e4m3(monkeypatch, capability, runs):
    """The preparation kernels store V in e4m3, which Triton lowers from compute capability 8.9 on; an A100 or an
    RTX 30xx (SageAttention serves them too) takes the PyTorch expressions instead; the CPU always does."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert sage.prep_kernels_run_on(torch.device("cuda", 0)) is runs
    assert sage.prep_kernels_run_on(torch.device("cpu")) is False


def test_the_hopper_kernel_is_found_by_its_extension_file_without_importing_the_package(monkeypatch, tmp_path):
    """PyPI's sageattention 1.x and builds made on other GPUs lack SageAttention 2's _qattn_sm90 extension, the kernel
    the quantized route calls: auto refuses its Hopper route there, naming the source build."""
    package = tmp_path / "sageattention"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('the check must not import the package')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sageattention", raising=False)
    assert sage.hopper_kernel_built() is False
    assert sage.auto_refusal((9, 0)) == (
        "the installed sageattention has no Hopper kernel (its _qattn_sm90 extension: PyPI's sageattention 1.x ships "
        "none, and a build on another GPU leaves it out); build SageAttention 2 from source on the GPU machine: pip "
        "install --no-build-isolation git+https://github.com/thu-ml/SageAttention.git")
    (package / "_qattn_sm90.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
    assert sage.hopper_kernel_built() is True and sage.auto_refusal((9, 0)) is None
    monkeypatch.setitem(sys.modules, "sageattention", None)  # how tests hide a package
    assert sage.hopper_kernel_built() is False


@pytest.mark.parametrize("capability, built, implementation", [
    ((9, 0), True, "sage"), ((9, 0), False, "sage_package"), ((8, 9), True, "sage_package"),
    ((8, 0), False, "sage_package")])
def test_the_quantized_route_is_taken_only_where_the_hopper_kernel_is_built(monkeypatch, capability, built,
                                                                           implementation):
    """Elsewhere the quantized operands would have no kernel and be attended in float32 by PyTorch (many times
    slower): an RTX 4090 or an A100 gets the package's own sageattn, which picks its kernels for the GPU."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(sage, "hopper_kernel_built", lambda: built)
    assert sage.route_implementation(torch.device("cuda", 0)) == implementation
    assert sage.route_implementation(torch.device("cpu")) == "sage"  # the float32 stand-in the CPU tests run


def test_on_a_gpu_without_the_hopper_kernel_the_route_calls_the_package_even_with_prep_in_the_graph(
        sage_on_cpu, monkeypatch):
    """PREP_IN_GRAPH is on by default; on the package route every eligible call still reaches sageattn itself, the
    quantized op never runs, and the report names the route."""
    monkeypatch.setattr(sage, "PREP_IN_GRAPH", True)
    asked = []
    monkeypatch.setattr(sage, "route_implementation", lambda device: asked.append(device) or "sage_package")
    quantized = []
    monkeypatch.setattr(sage, "_quantized_call", lambda *args, **kwargs: quantized.append(args))
    pipe, kwargs = tiny_pipeline("flux")
    # every call reached the stand-in sageattn, with the plain output (the quantized route's would be 8-bit off)
    applied = check_route_takes_every_call(pipe, kwargs, sage_on_cpu, attention="sage")
    assert (applied["route"], applied["implementation"]) == ("omni_accel::sage_attention", "sage_package")
    assert not quantized and asked == [pipe.transformer.device]  # decided from the device the weights are on


def test_auto_reports_the_kernels_it_passed_over_and_why(monkeypatch, caplog):
    """On a compiled Hopper int8 pipeline without sageattention or flash-attn-4, auto keeps cuDNN everywhere and the
    report (and the log) say which long-sequence kernels it would have taken from how many keys, and the fix."""
    monkeypatch.setattr(sage, "installed", lambda package: False)
    monkeypatch.setattr(attn, "_fa4_refusal", lambda device, capability=None: "refused")
    monkeypatch.setattr(attn, "_installed", lambda package: package != "flash_attn.cute")
    rule = attn.choose_auto(torch.device("cuda"), torch.bfloat16, True, 128, False, (9, 0), int8_stack=True)
    assert (rule.backend, rule.long_backend) == ("cudnn", None)
    assert rule.passed_over == (
        f"sage from 16384 keys: sageattention is not installed; {deps.INSTALL['sageattention']}",
        f"fa4 from 8192 keys: flash-attn-4 is not installed; {deps.INSTALL['flash_attn.cute']}")
    blackwell = attn.choose_auto(torch.device("cuda"), torch.bfloat16, True, 128, False, (10, 0), int8_stack=True)
    assert not any(line.startswith("sage ") for line in blackwell.passed_over)  # never measured there: no hint
    monkeypatch.setattr(attn, "choose_auto", lambda *a, **k: rule)
    pipe, _ = tiny_pipeline("flux")
    caplog.set_level(logging.INFO, logger="omni_accel")
    omni_accel.accelerate(pipe, attention="auto")
    (applied,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "attention"]
    assert applied["passed_over"] == list(rule.passed_over)
    assert f"attention='auto' passed over {rule.passed_over[0]}" in caplog.text
    omni_accel.restore(pipe)
    omni_accel.accelerate(pipe, attention="sdpa")  # a backend asked for by name: nothing passed over
    (applied,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "attention"]
    assert "passed_over" not in applied


def test_the_quantized_ops_fake_implementation_gives_the_output_shape():
    with FakeTensorMode():
        q8 = torch.empty(1, 4608, 24, 128, dtype=torch.int8)
        scales = torch.empty(1, 24, 8)
        v8 = torch.empty(1, 128, 24, 4608, dtype=torch.float8_e4m3fn)
        out = torch.ops.omni_accel.sage_attention_quantized(q8, scales, q8, scales, v8, scales, 0.1, torch.bfloat16)
    assert out.shape == (1, 4608, 24, 128) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("prep_kernels", [False, True], ids=["traced", "prep_op"])
def test_with_prep_in_the_graph_compiled_blocks_quantize_and_call_only_the_kernel(sage_on_cpu, monkeypatch,
                                                                                 prep_kernels):
    """PREP_IN_GRAPH: the route quantizes Q, K and V inside the compiled blocks (no graph break, no recompile) and
    hands the operands to the quantized op (the package's sageattn is not called); the tiny model's output stays
    within the 8-bit attention's error of the plain pipeline's (head dim 16, padded to 64 as the package does).
    With PREP_KERNELS the quantization is one opaque op (omni_accel::sage_quantize, on the CPU the same expressions)
    that runs at every attention call; traced, the expressions are inductor's kernels and the op never runs."""
    quantized_calls, quantize_calls = [], []
    original, original_operands = sage._quantized_call, sage._reference_operands

    def recording(q8, *rest, **out):
        quantized_calls.append((q8.dtype, tuple(q8.shape)))
        return original(q8, *rest, **out)

    def recording_operands(*qkv):
        quantize_calls.append(tuple(qkv[0].shape))
        return original_operands(*qkv)

    monkeypatch.setattr(sage, "_quantized_call", recording)
    monkeypatch.setattr(sage, "_reference_operands", recording_operands)
    monkeypatch.setattr(sage, "PREP_IN_GRAPH", True)
    monkeypatch.setattr(sage, "PREP_KERNELS", prep_kernels)
    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    compiled, counts = run_compiled_twice(pipe, kwargs, attention="sage", compile=True)
    assert counts["graph_breaks"] == 0
    assert counts["graphs_second_call"] == counts["graphs_first_call"] > 0
    assert not sage_on_cpu and quantized_calls and all(dtype == torch.int8 for dtype, _ in quantized_calls)
    assert len(quantize_calls) == (len(quantized_calls) if prep_kernels else 0), (quantize_calls, quantized_calls)
    err = ((compiled - plain).norm() / plain.norm()).item()
    assert 0 < err < 0.05, err


def test_under_a_graph_capture_the_quantized_op_runs_between_graphs_with_its_operands(monkeypatch):
    from omni_accel import cuda_graphs

    monkeypatch.setitem(sys.modules, "sageattention", None)
    q, k, v = (torch.randn(1, 16, 2, 64) for _ in range(3))
    operands = (*sage.quantize_queries(q), *sage.quantize_keys(k), *sage.quantize_values(v))
    capture = _RecordingCapture()
    monkeypatch.setattr(cuda_graphs._ACTIVE, "capture", capture, raising=False)
    out = sage.sage_attention_quantized(*operands, 0.125, torch.float32)
    [(_, args, shape, dtype, writes_out)] = capture.steps
    assert writes_out and not out.isnan().any()  # the kernel writes the capture's buffer, every element of it
    assert all(a is b for a, b in zip(args, operands)) and len(args) == 6
    assert shape == (1, 16, 2, 64) and dtype == torch.float32 and out.shape == shape


@pytest.mark.parametrize("kind", ["single", "dual"])
def test_the_preparation_takes_the_q_k_kernels_inputs_in_flux_blocks_with_the_same_operands(monkeypatch, kind):
    """epilogue_fusion.SAGE_FROM_NORMS: in diffusers' FLUX blocks (bf16, head dim 64, the pair-swap rotary
    compile=True installs, SageAttention's preparation as one op), the op whose q and k are the 16-bit q / k kernels'
    outputs becomes one op that reads the kernels' inputs (both streams in the dual block); off the GPU it computes
    the same operations, so the block's output equals the compile without the switch bit for bit. Off, nothing more
    is replaced."""
    from diffusers.models.transformers import transformer_flux

    from omni_accel import compiler
    from omni_accel.kernels import epilogue_fusion

    monkeypatch.setitem(sys.modules, "sageattention", None)  # the quantized op's float32 attention stands in
    for name, value in (("PREP_IN_GRAPH", True), ("PREP_KERNELS", True), ("SMOOTH_KEYS_IN_GRAPH", False)):
        monkeypatch.setattr(sage, name, value)
    monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE_16", True)
    monkeypatch.setattr(epilogue_fusion, "QK_NORM_ROPE_JOINT", True)
    heads, head_dim = 2, 64  # a head dim the package's kernel takes unpadded (FLUX's is 128)
    dim = heads * head_dim
    kinds = {"single": transformer_flux.FluxSingleTransformerBlock, "dual": transformer_flux.FluxTransformerBlock}
    torch.manual_seed(0)
    block = kinds[kind](dim, heads, head_dim).to(torch.bfloat16).eval()
    undo_rope = compiler.use_rotary_pair_swap(block)[1]
    undo_route = route.route_transformer(block, "sage")
    g = torch.Generator().manual_seed(21)
    streams = [torch.randn(1, n, dim, generator=g).to(torch.bfloat16) for n in (16, 6)]
    temb = torch.randn(1, dim, generator=g).to(torch.bfloat16)
    angles = torch.rand(22, head_dim // 2, generator=g) * 6.28
    rotary = (angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1))

    def compiled(fused: bool):
        monkeypatch.setattr(epilogue_fusion, "SAGE_FROM_NORMS", fused)
        torch._dynamo.reset()
        before = dict(epilogue_fusion.REWRITES)
        options = {"fx_graph_cache": False, compiler.POST_GRAD_PASS: epilogue_fusion.GRAPH_PASS}
        with torch.no_grad():
            out = torch.compile(block, options=options)(*streams, temb, image_rotary_emb=rotary)
        return out, epilogue_fusion.rewrites_since(before)

    try:
        unfused, unfused_delta = compiled(False)
        fused, fused_delta = compiled(True)
    finally:
        undo_route()
        undo_rope()
    assert unfused_delta == {"qk_norm_rope": 2}
    assert fused_delta == {"qk_norm_rope": 2, "sage_quantize_normed": 1}
    for f, u in zip(fused, unfused):
        assert torch.equal(f, u)
