"""modulation_prefetch.py on the CPU: the modulation linears computed ahead from the embedding module's output give the
plain pipeline's output, fall back to computing themselves for any other input, and undo cleanly. (The side stream
and its events exist on GPUs only; here the same slots are filled in order on the one CPU stream.)"""

import contextlib
import logging

import pytest
import torch

from omni_accel import compiler, modulation_prefetch, modulation_table
from omni_accel.pipelines import adapter_for
from omni_accel.testing import record_modulation_takes, run, run_compiled_twice, tiny_pipeline


@pytest.fixture(scope="module")
def flux():
    return tiny_pipeline("flux")


def _computed_in_place(linear, x) -> torch.Tensor:
    """What ``linear`` computes for ``x`` without any prefetched output: the plain linear."""
    return torch.nn.functional.linear(x, linear.weight, linear.bias)


@contextlib.contextmanager
def _prefetched(pipe):
    """The family's modulation linears prefetched while inside; yields how many, undone after."""
    count, undo = modulation_prefetch.use_modulation_prefetch(pipe.transformer, adapter_for(pipe).modulation_prefetch)
    try:
        yield count
    finally:
        undo()


def _linear_count(transformer) -> int:
    return 2 * len(transformer.transformer_blocks) + len(transformer.single_transformer_blocks) + 1


def test_flux_modulation_linears_taken_from_the_prefetch_give_the_plain_output_and_undo(flux, monkeypatch):
    pipe, kwargs = flux
    transformer = pipe.transformer
    plain = run(pipe, kwargs)
    outcomes = record_modulation_takes(monkeypatch)
    with _prefetched(pipe) as count:
        assert count == _linear_count(transformer)
        assert type(transformer.transformer_blocks[0].norm1.linear) is modulation_prefetch.PrefetchedLinear
        prefetched = run(pipe, kwargs)
    assert torch.equal(prefetched, plain)
    # every modulation linear of every step took its prefetched output
    assert outcomes and all(outcomes) and len(outcomes) == count * kwargs["num_inference_steps"]
    assert type(transformer.norm_out.linear) is torch.nn.Linear and not modulation_prefetch._slots
    assert "omni_accel.modulation_prefetch" not in transformer.time_text_embed._diffusers_hook.hooks
    outcomes.clear()
    assert torch.equal(run(pipe, kwargs), plain) and not outcomes


def test_qwen_image_img_and_txt_mod_linears_are_prefetched_with_the_plain_output():
    pipe, kwargs = tiny_pipeline("qwen_image")
    transformer = pipe.transformer
    plain = run(pipe, kwargs)
    with _prefetched(pipe) as count:
        assert count == 2 * len(transformer.transformer_blocks) + 1
        assert type(transformer.transformer_blocks[0].img_mod[1]) is modulation_prefetch.PrefetchedLinear
        prefetched = run(pipe, kwargs)
    assert torch.equal(prefetched, plain)


def test_a_linear_called_with_another_input_computes_itself_and_is_never_prefetched_again(flux, caplog):
    pipe, _ = flux
    transformer = pipe.transformer
    linear = transformer.transformer_blocks[0].norm1.linear
    with _prefetched(pipe):
        temb = torch.randn(1, linear.in_features)
        modulation_prefetch.prefetch(temb, [linear])
        other = torch.randn(1, linear.in_features)
        with caplog.at_level(logging.WARNING, logger="omni_accel.modulation_prefetch"):
            out = linear(other)
        assert torch.equal(out, _computed_in_place(linear, other))
        assert "input other than silu(temb)" in caplog.text
        modulation_prefetch.prefetch(temb, [linear])  # refused: not computed ahead any more
        assert linear.weight.data_ptr() not in modulation_prefetch._slots
        # the right input now computes in place too, with the linear's output
        act = torch.nn.functional.silu(temb)
        assert torch.equal(linear(act), _computed_in_place(linear, act))
    assert linear.weight.data_ptr() not in modulation_prefetch._refused


def test_a_linear_with_nothing_prefetched_or_another_shape_computes_itself(flux):
    pipe, _ = flux
    transformer = pipe.transformer
    linear = transformer.single_transformer_blocks[0].norm.linear
    with _prefetched(pipe):
        act = torch.randn(2, linear.in_features)
        assert torch.equal(linear(act), _computed_in_place(linear, act))
        modulation_prefetch.prefetch(torch.randn(1, linear.in_features), [linear])
        assert torch.equal(linear(act), _computed_in_place(linear, act))
        assert linear.weight.data_ptr() in modulation_prefetch._refused


def test_absent_embedding_or_linears_prefetch_nothing(flux):
    pipe, _ = flux
    spec = adapter_for(pipe).modulation_prefetch
    for other in (type(spec)("no_such_module", spec.linears), type(spec)(spec.embedding, ("no.such.*",)), None):
        count, undo = modulation_prefetch.use_modulation_prefetch(pipe.transformer, other)
        undo()
        assert count == 0
    assert all(type(m) is not modulation_prefetch.PrefetchedLinear for m in pipe.transformer.modules())


def test_compiled_blocks_take_the_prefetched_outputs_in_one_graph_per_block_kind(flux, monkeypatch):
    """The compile pass applies it (here forced on the CPU): no graph break, no recompiles across blocks or calls,
    the report counts the linears, and the output is the plain compiled one's."""
    pipe, kwargs = flux
    monkeypatch.setattr(modulation_table, "MODULATION_TABLE", False)  # the table would stand in for the prefetch
    monkeypatch.setattr(modulation_prefetch, "MODULATION_PREFETCH", "off")
    reference, reference_counts = run_compiled_twice(pipe, kwargs, compile=True)
    monkeypatch.setattr(compiler, "_prefetches_modulation", lambda ctx: ctx.adapter.modulation_prefetch is not None)
    outcomes = record_modulation_takes(monkeypatch)
    out, counts = run_compiled_twice(pipe, kwargs, compile=True)
    assert counts == reference_counts and counts["graph_breaks"] == 0
    assert counts["graphs_first_call"] == counts["graphs_second_call"]
    assert outcomes and all(outcomes)
    torch.testing.assert_close(out, reference, atol=2e-3, rtol=0)


@pytest.mark.parametrize("knobs, wanted", [
    ({"compile": "max"}, True), ({"compile": True, "quant": "int8"}, True), ({"compile": True}, False),
    ({"compile": "max", "offload": "model"}, False), ({"compile": "max", "cache": "tea_cache"}, False)])
def test_the_compile_pass_prefetches_inside_the_whole_forward_cuda_graph_only(flux, knobs, wanted, monkeypatch):
    from omni_accel.config import AccelConfig
    from omni_accel.pass_base import PassContext

    pipe, _ = flux
    ctx = PassContext(pipe=pipe, adapter=adapter_for(pipe), config=AccelConfig(**knobs), device=torch.device("cuda"),
                      state=None)
    assert compiler._prefetches_modulation(ctx) is wanted
    monkeypatch.setattr(modulation_prefetch, "MODULATION_PREFETCH", "always")
    assert compiler._prefetches_modulation(ctx) is ("offload" not in knobs)
    monkeypatch.setattr(modulation_prefetch, "MODULATION_PREFETCH", "off")
    assert compiler._prefetches_modulation(ctx) is False
    cpu = PassContext(pipe=pipe, adapter=ctx.adapter, config=ctx.config, device=torch.device("cpu"), state=None)
    monkeypatch.setattr(modulation_prefetch, "MODULATION_PREFETCH", "always")
    assert compiler._prefetches_modulation(cpu) is False


def test_a_capture_segment_ends_joined_to_the_side_stream_only_when_it_forked_work_there(monkeypatch):
    """Before each graph of a capture ends (cuda_graphs.SEGMENT_END_JOINS), the capturing stream waits for its side
    stream if this capture forked onto it, and its outputs left untaken need no event wait in the next graph; another
    stream's (another thread's forward) keep theirs."""
    from types import SimpleNamespace

    from omni_accel import cuda_graphs

    assert modulation_prefetch._join_side_stream in cuda_graphs.SEGMENT_END_JOINS
    waits = []
    side = SimpleNamespace(name="side of stream 7")
    capturing = SimpleNamespace(cuda_stream=7, wait_stream=waits.append)
    monkeypatch.setattr(modulation_prefetch, "_side_streams", {7: side, 9: SimpleNamespace(name="other")})
    monkeypatch.setattr(modulation_prefetch, "_forked_in_capture", set())
    mine = modulation_prefetch._Slot(torch.zeros(1), object(), torch.zeros(1), owner=7)
    other = modulation_prefetch._Slot(torch.zeros(1), object(), torch.zeros(1), owner=9)
    monkeypatch.setattr(modulation_prefetch, "_slots", {1: mine, 2: other})
    modulation_prefetch._join_side_stream(capturing)
    assert waits == [] and mine.event is not None  # nothing of this capture went to the side stream
    modulation_prefetch._forked_in_capture.update({7, 9})
    modulation_prefetch._join_side_stream(capturing)
    assert waits == [side] and mine.event is None and other.event is not None
    assert modulation_prefetch._forked_in_capture == {9}


def test_a_verified_linear_still_computes_itself_for_an_input_of_another_shape(flux):
    pipe, _ = flux
    transformer = pipe.transformer
    linear = transformer.transformer_blocks[0].norm1_context.linear
    with _prefetched(pipe):
        temb = torch.randn(1, linear.in_features)
        modulation_prefetch.prefetch(temb, [linear])
        linear(torch.nn.functional.silu(temb))  # verified
        assert linear.weight.data_ptr() in modulation_prefetch._verified
        modulation_prefetch.prefetch(temb, [linear])
        half = torch.randn(2, linear.in_features)
        assert torch.equal(linear(half), _computed_in_place(linear, half))


def test_an_unknown_prefetch_setting_is_refused_before_anything_is_patched(flux, monkeypatch):
    import omni_accel
    from omni_accel.errors import AccelError

    pipe, _ = flux
    monkeypatch.setattr(modulation_prefetch, "MODULATION_PREFETCH", "Graphs")
    with pytest.raises(AccelError, match=r"MODULATION_PREFETCH='Graphs' is not one of \('graphs', 'always', 'off'\); "
                                         r"set it to \"graphs\" \(the default\)"):
        omni_accel.accelerate(pipe, compile=True)
    assert not hasattr(pipe, "omni_accel") or pipe.omni_accel is None
    assert type(pipe.transformer.norm_out.linear) is torch.nn.Linear
