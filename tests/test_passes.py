"""Lossless passes across every family's tiny pipeline: outputs equal to the plain pipeline, restore exact."""

import pytest
import torch

import omni_accel
from omni_accel.testing import TINY_BUILDERS, run, tiny_pipeline

FAMILIES = sorted(TINY_BUILDERS)
LOSSLESS = [
    pytest.param(dict(attention="auto"), 1e-4, id="attention-auto"),
    pytest.param(dict(offload="model"), 1e-4, id="offload-model"),
    pytest.param(dict(offload="block"), 1e-4, id="offload-block"),
    pytest.param(dict(vae_slicing=True, attention="sdpa"), 1e-4, id="vae-slicing"),
]


@pytest.fixture(scope="module", params=FAMILIES)
def family_pipe(request):
    pipe, kwargs = tiny_pipeline(request.param)
    return request.param, pipe, kwargs, run(pipe, kwargs)


@pytest.mark.parametrize("knobs, tolerance", LOSSLESS)
def test_lossless_pass_matches_plain_and_restores(family_pipe, knobs, tolerance):
    family, pipe, kwargs, plain = family_pipe
    omni_accel.accelerate(pipe, **knobs)
    try:
        out = run(pipe, kwargs)
        report = pipe.omni_accel.report()
    finally:
        omni_accel.restore(pipe)
    assert out.shape == plain.shape
    assert (out - plain).abs().max().item() <= tolerance, f"{family} {knobs}"
    assert report["last_call"]["transformer_forwards"] >= kwargs["num_inference_steps"]
    assert torch.equal(run(pipe, kwargs), plain), f"{family}: restore() did not bring the plain output back"


def test_block_offload_reports_groups_per_component():
    pipe, kwargs = tiny_pipeline("flux")
    omni_accel.accelerate(pipe, offload="block")
    try:
        applied = pipe.omni_accel.report()["applied"]
    finally:
        omni_accel.restore(pipe)
    components = {a["component"] for a in applied if a["pass"] == "offload"}
    assert {"transformer", "vae", "text_encoder", "text_encoder_2"} <= components
    assert all(a["mode"] == "block" for a in applied if a["pass"] == "offload")


def test_compile_does_not_recompile_across_calls_with_the_same_shapes():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    pipe, kwargs = tiny_pipeline("flux", num_single_layers=2)  # a second single-stream block: the one that recompiled
    plain = run(pipe, kwargs)
    before = counters["stats"]["unique_graphs"]  # the process's count so far: dynamo.reset() keeps its counters
    omni_accel.accelerate(pipe, compile=True)
    try:
        first = run(pipe, kwargs)
        graphs_after_first = counters["stats"]["unique_graphs"]
        # one graph per block kind: the first single-stream block gets its streams as views of one tensor, as the
        # later ones do (JointStreams), so its strides do not ask for a graph of its own
        built = graphs_after_first - before
        assert built == 2, f"compile=True built {built} graphs for FLUX's two block kinds"
        second = run(pipe, kwargs)
        assert counters["stats"]["unique_graphs"] == graphs_after_first, "a second call with the same shapes recompiled"
        applied = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "compile"]
    finally:
        omni_accel.restore(pipe)
    assert (first - plain).abs().max().item() <= 1e-3
    assert torch.equal(first, second)
    assert applied[0]["blocks"] == len(list(pipe.transformer.transformer_blocks)) + len(
        list(pipe.transformer.single_transformer_blocks))
    assert applied[0]["joint_streams"] == ["single_transformer_blocks"]
    assert torch.equal(run(pipe, kwargs), plain)

    # without the joint views the first single-stream block takes a graph of its own, and the output is the same
    from omni_accel import compiler

    torch._dynamo.reset()
    compiler.JOINT_STREAMS = False
    try:
        omni_accel.accelerate(pipe, compile=True)
        split = run(pipe, kwargs)
        assert counters["stats"]["unique_graphs"] - graphs_after_first == 3
        omni_accel.restore(pipe)
    finally:
        compiler.JOINT_STREAMS = True
    assert torch.equal(split, first)


def test_joint_streams_hook_hands_over_views_of_one_tensor_by_keyword_or_position():
    from omni_accel import compiler
    from omni_accel.pipelines.base import JointStreams

    hook = compiler._JointStreamsHook(JointStreams("single_transformer_blocks"))
    text, image, temb = torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 8)
    args, kwargs = hook.pre_forward(None, hidden_states=image, encoder_hidden_states=text, temb=temb)
    new_text, new_image = kwargs["encoder_hidden_states"], kwargs["hidden_states"]
    assert args == () and kwargs["temb"] is temb
    assert torch.equal(new_text, text) and torch.equal(new_image, image)
    assert compiler._adjacent_views(new_text, new_image) and not compiler._adjacent_views(text, image)
    assert new_image.stride() == (64, 8, 1) and new_image.storage_offset() == 3 * 8
    # what a single-stream block returns already is such a pair: handed on as it is, no copy
    args, kwargs = hook.pre_forward(None, new_image, new_text, temb)
    assert args[0] is new_image and args[1] is new_text and args[2] is temb and kwargs == {}
    # positional
    args, _ = hook.pre_forward(None, image, text, temb)
    assert compiler._adjacent_views(args[1], args[0]) and torch.equal(args[0], image) and torch.equal(args[1], text)
    # a call without the text stream is left as it is
    args, kwargs = hook.pre_forward(None, hidden_states=image, temb=temb)
    assert args == () and kwargs["hidden_states"] is image


def test_compile_raises_dynamos_recompile_limit_while_applied():
    """Re-accelerating in one process must keep compiling: past dynamo's limit of 8 guard entries per code object
    it silently runs eager (measured on an H200), so the pass lifts the limit and puts it back on restore."""
    import torch._dynamo.config as dynamo_config

    from omni_accel.compiler import RECOMPILE_LIMIT

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    before = getattr(dynamo_config, name)
    pipe, _ = tiny_pipeline("flux")
    omni_accel.accelerate(pipe, compile=True)
    assert getattr(dynamo_config, name) == max(before, RECOMPILE_LIMIT)
    omni_accel.restore(pipe)
    assert getattr(dynamo_config, name) == before


def test_compile_never_asks_inductor_for_cuda_graphs_or_autotuning(monkeypatch):
    """Regional CUDA graphs of repeated blocks overwrite each other's outputs, and autotuned Triton GEMMs lost to
    cuBLAS (both measured on an H200): True and "max" compile blocks the same way; on a GPU with the measured
    multi-kernel and programmatic-dependent-launch options, which benchmarks can override for their A/B rows; a torch
    whose inductor lacks PDL gets multi-kernel alone (torch.compile refuses unknown options)."""
    from omni_accel import compiler

    from omni_accel.kernels.epilogue_fusion import GRAPH_PASS

    assert compiler.inductor_has_pdl()  # this torch has it
    graph_pass = {compiler.POST_GRAD_PASS: GRAPH_PASS}
    for mode in (True, "max"):
        assert compiler.compile_options(mode, torch.device("cpu")) == {"dynamic": False}
        assert compiler.compile_options(mode, torch.device("cuda")) == {
            "dynamic": False, "options": {"triton.multi_kernel": 1, "triton.enable_pdl": True, **graph_pass}}
    monkeypatch.setattr(compiler, "inductor_has_pdl", lambda: False)
    assert compiler.compile_options(True, torch.device("cuda")) == {
        "dynamic": False, "options": {"triton.multi_kernel": 1, **graph_pass}}
    monkeypatch.setattr(compiler, "INDUCTOR_OPTIONS", {})  # a benchmark's A/B row without the defaults
    assert compiler.compile_options(True, torch.device("cuda")) == {"dynamic": False, "options": graph_pass}
    monkeypatch.setattr(compiler, "EPILOGUE_FUSION", False)
    assert compiler.compile_options(True, torch.device("cuda")) == {"dynamic": False}


def test_multi_kernel_gets_back_the_kernel_lock_pickling_stripped():
    """torch 2.11's inductor strips JITFunction._hash_lock to pickle a worker-compiled kernel and may not restore
    it; multi-kernel's cache lookup then crashed on a GPU. Asking for multi-kernel installs a guard that restores it
    before the lookup and leaves a kernel with a lock alone."""
    import pathlib
    import threading
    from types import SimpleNamespace

    from torch._inductor.codegen.multi_kernel import MultiKernelCall

    from omni_accel import compiler

    compiler.compile_options(True, torch.device("cuda"))
    assert compiler.repair_multi_kernel_locks() is True
    stripped, kept = SimpleNamespace(_hash_lock=None), SimpleNamespace(_hash_lock=threading.RLock())
    lock_of_kept = kept._hash_lock
    call = object.__new__(MultiKernelCall)
    call._kernels, call.picked_kernel = [SimpleNamespace(fn=stripped), SimpleNamespace(fn=kept)], None
    call.cache_file_path = lambda: pathlib.Path("/nonexistent/picked_kernel")
    MultiKernelCall.load_cache(call)
    assert isinstance(stripped._hash_lock, type(threading.RLock())) and kept._hash_lock is lock_of_kept


# tiny FLUX: one dual block (ff, ff_context) and one single block (act_mlp); Z-Image uses SwiGLU: nothing to rewrite
@pytest.mark.parametrize("family, expected", [("flux", 3), ("wan", 2), ("qwen_image", 4), ("z_image", 0)])
def test_sigmoid_gelu_is_the_tanh_gelu_and_comes_off_again(family, expected):
    """compile=True on a GPU computes the blocks' tanh-GELU as x * sigmoid(2z) (cheaper for inductor's kernels):
    the same function to float32 rounding, on every tanh-GELU inside the blocks (torch's nn.GELU and diffusers'
    GELU projections), and the undo puts back exactly what was there."""
    import torch.nn.functional as F

    import omni_accel.compiler as compiler
    from omni_accel.pipelines import adapter_for

    x = torch.linspace(-8, 8, 4001)
    assert (compiler.sigmoid_gelu(x) - F.gelu(x, approximate="tanh")).abs().max().item() < 1e-6
    bf16 = x.to(torch.bfloat16)
    assert (compiler.sigmoid_gelu(bf16).float() - F.gelu(bf16, approximate="tanh").float()).abs().max().item() < 0.04
    pipe, kwargs = tiny_pipeline(family)
    blocks = [block for _, block in adapter_for(pipe).blocks_of(pipe.transformer)]
    before = [list(block.modules()) for block in blocks]
    plain = run(pipe, dict(kwargs, num_inference_steps=2))
    undos, count = [], 0
    for block in blocks:
        n, undo = compiler.use_sigmoid_gelu(block)
        count, undos = count + n, undos + [undo]
    assert count == expected
    rewritten = run(pipe, dict(kwargs, num_inference_steps=2))
    for undo in undos:
        undo()
    assert (rewritten - plain).abs().max().item() < 1e-4
    assert [list(block.modules()) for block in blocks] == before
    assert not any("gelu" in vars(m) for block in blocks for m in block.modules())
    assert torch.equal(run(pipe, dict(kwargs, num_inference_steps=2)), plain)


def test_pair_swap_rotary_equals_diffusers_rotary_bit_for_bit():
    """compile=True on a GPU applies diffusers' interleaved rotary embedding through a pair swap (one load per value
    for inductor instead of masked gathers): the same products and sums, so the same bits, in both sequence layouts
    and dtypes; other layouts are handed to diffusers' function."""
    from diffusers.models.embeddings import apply_rotary_emb

    from omni_accel import compiler

    swapped = compiler._pair_swap_rotary(apply_rotary_emb)
    g = torch.Generator().manual_seed(0)
    angles = torch.randn(7, 8, generator=g).repeat_interleave(2, dim=-1)  # (S, D) interleaved pairs
    table = (angles.cos(), angles.sin())
    for dtype in (torch.float32, torch.bfloat16):
        for sequence_dim, shape in ((1, (2, 7, 3, 16)), (2, (2, 3, 7, 16))):
            x = torch.randn(*shape, generator=g).to(dtype)
            assert torch.equal(swapped(x, table, sequence_dim=sequence_dim),
                               apply_rotary_emb(x, table, sequence_dim=sequence_dim))
    halves = torch.randn(2, 3, 7, 16, generator=g)
    assert torch.equal(swapped(halves, table, use_real_unbind_dim=-2), apply_rotary_emb(halves, table,
                                                                                           use_real_unbind_dim=-2))


@pytest.mark.parametrize("family, expected", [("flux", 1), ("wan", 0), ("qwen_image", 0)])
def test_pair_swap_rotary_reaches_the_modules_that_call_diffusers_rotary_and_comes_off_again(family, expected):
    """Only modules that call diffusers' own apply_rotary_emb get the swap (Wan and Qwen-Image have their own); two
    transformers of one family share the swapped global, which goes back with the last undo; the pipeline's output
    is unchanged."""
    import sys

    from diffusers.models import embeddings

    from omni_accel import compiler

    pipe, kwargs = tiny_pipeline(family)
    other, _ = tiny_pipeline(family)
    module = sys.modules[type(pipe.transformer).__module__]
    plain = run(pipe, dict(kwargs, num_inference_steps=2))
    count, undo = compiler.use_rotary_pair_swap(pipe.transformer)
    assert count == expected
    if not expected:
        undo()
        return
    assert module.apply_rotary_emb._omni_accel_original is embeddings.apply_rotary_emb
    second_count, undo_other = compiler.use_rotary_pair_swap(other.transformer)
    assert second_count == 1 and compiler._ROTARY_SWAPPED[module.__name__][1] == 2
    assert torch.equal(run(pipe, dict(kwargs, num_inference_steps=2)), plain)
    undo()
    assert module.apply_rotary_emb is not embeddings.apply_rotary_emb  # the other transformer still uses it
    undo_other()
    assert module.apply_rotary_emb is embeddings.apply_rotary_emb and module.__name__ not in compiler._ROTARY_SWAPPED


def test_complex_rotary_in_real_arithmetic_equals_the_family_rotary():
    """compile=True on a GPU applies Qwen-Image's complex-table rotary (``apply_rotary_emb_qwen(..., use_real=False)``)
    as a real-arithmetic pair swap, which inductor can fuse: the same values (bit for bit eagerly), in both dtypes;
    real tables go to the family's function."""
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    from omni_accel import compiler

    swapped = compiler._pair_swap_complex_rotary(apply_rotary_emb_qwen)
    g = torch.Generator().manual_seed(1)
    angles = torch.randn(7, 8, generator=g)
    freqs = torch.polar(torch.ones_like(angles), angles)  # (S, D / 2) complex
    compiled = torch.compile(lambda x, f: swapped(x, f, use_real=False), dynamic=False)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 7, 3, 16, generator=g).to(dtype)
        want = apply_rotary_emb_qwen(x, freqs, use_real=False)
        assert torch.equal(swapped(x, freqs, use_real=False), want)
        # compiled, inductor may contract a product and a sum into one FMA: float32 rounding apart at most
        torch.testing.assert_close(compiled(x, freqs), want, rtol=2e-6, atol=2e-6)
    table = (angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1))
    x = torch.randn(2, 3, 7, 16, generator=g)  # (B, H, S, D), as the real-table form takes it
    assert torch.equal(swapped(x, table, use_real=True), apply_rotary_emb_qwen(x, table, use_real=True))


@pytest.mark.parametrize("family, expected", [("qwen_image", 1), ("flux", 0)])
def test_complex_rotary_swap_reaches_the_family_that_declares_it_and_comes_off_again(family, expected):
    """The adapter's ``complex_rotary`` names are swapped in the modules that define the transformer (Qwen-Image's
    ``apply_rotary_emb_qwen``; FLUX declares none), shared by two transformers and put back with the last undo; the
    pipeline's output is the same."""
    import sys

    from omni_accel import compiler
    from omni_accel.pipelines import adapter_for

    pipe, kwargs = tiny_pipeline(family)
    other, _ = tiny_pipeline(family)
    names = adapter_for(pipe).complex_rotary
    module = sys.modules[type(pipe.transformer).__module__]
    plain = run(pipe, dict(kwargs, num_inference_steps=2))
    count, undo = compiler.use_complex_rotary_pair_swap(pipe.transformer, names)
    assert count == expected
    if not expected:
        undo()
        return
    original = module.apply_rotary_emb_qwen._omni_accel_original
    second_count, undo_other = compiler.use_complex_rotary_pair_swap(other.transformer, names)
    assert second_count == 1
    torch.testing.assert_close(run(pipe, dict(kwargs, num_inference_steps=2)), plain, rtol=1e-5, atol=1e-5)
    undo()
    assert module.apply_rotary_emb_qwen is not original  # the other transformer still uses it
    undo_other()
    assert module.apply_rotary_emb_qwen is original
    assert module.__name__ not in compiler._COMPLEX_ROTARY_SWAPPED["apply_rotary_emb_qwen"]
