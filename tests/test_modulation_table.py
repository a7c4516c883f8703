"""modulation_table.py on the CPU: the modulation linears of a whole pipeline call computed once from the scheduler's
schedule give the plain pipeline's output (up to one batched GEMM's rounding against per-step GEMVs), every forward
takes its rows, true CFG's second conditioning gets its own rows, a forward off the schedule or outside a call gets
its own rows (the plain output exactly), a miss raises after the call, and the undo is exact."""

import dataclasses

import pytest
import torch

import omni_accel
from omni_accel import compiler, modulation_prefetch, modulation_table
from omni_accel.pipelines import adapter_for
from omni_accel.testing import RerunGraphBackend, record_modulation_takes, run, run_compiled_twice, tiny_pipeline


@pytest.fixture(scope="module")
def flux():
    return tiny_pipeline("flux")


@pytest.fixture(scope="module")
def plain(flux):
    """The plain pipeline's output for the default call."""
    pipe, kwargs = flux
    return run(pipe, kwargs)


def _with_table(pipe, state=None):
    return modulation_table.use_modulation_table(pipe, pipe.transformer, adapter_for(pipe).modulation_prefetch, state)


@pytest.fixture
def accelerated(flux):
    """The tiny FLUX pipeline accelerated with no knobs (its calls bracketed) and the table applied; undone after."""
    pipe, kwargs = flux
    omni_accel.accelerate(pipe)
    count, undo = _with_table(pipe, pipe.omni_accel)
    try:
        yield pipe, kwargs, count
    finally:
        undo()
        omni_accel.restore(pipe)


def _table(pipe) -> modulation_table.ModulationTable:
    return pipe.transformer._diffusers_hook.get_hook("omni_accel.modulation_table").table


def _filled_rows(pipe) -> int:
    temb = pipe.transformer.time_text_embed._buffers[modulation_table._TEMB_BUFFER]
    return int((~torch.isinf(temb).all(dim=-1)).sum())


def _compile_details(pipe) -> dict:
    """What the compile pass recorded in the accelerated ``pipe``'s report (its served linears among them)."""
    return next(a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "compile")


def _linear_count(transformer) -> int:
    return 2 * len(transformer.transformer_blocks) + len(transformer.single_transformer_blocks) + 1


def test_a_call_fills_one_row_per_step_and_every_forward_takes_its_rows(plain, accelerated, monkeypatch):
    pipe, kwargs, count = accelerated
    outcomes = record_modulation_takes(monkeypatch)
    out = run(pipe, kwargs)
    assert count == _linear_count(pipe.transformer)
    assert outcomes and all(outcomes) and len(outcomes) == count * kwargs["num_inference_steps"]
    assert _filled_rows(pipe) == kwargs["num_inference_steps"]
    table = _table(pipe)
    assert table.call == 0 and list(table.filled.values()) == [True] and not table.own_rows_only
    # one GEMM over the steps rounds differently from one GEMV per step (float32 here: ~1e-6)
    torch.testing.assert_close(out, plain, rtol=1e-4, atol=1e-5)
    outcomes.clear()
    torch.testing.assert_close(run(pipe, kwargs), out)  # the next call fills its rows again
    assert _table(pipe).call == 1 and len(outcomes) == count * kwargs["num_inference_steps"] and all(outcomes)


def test_true_cfg_fills_rows_for_each_conditioning(flux):
    pipe, kwargs = flux
    cfg = dict(kwargs, true_cfg_scale=2.0, negative_prompt="blurry", num_inference_steps=3)
    plain_cfg = run(pipe, cfg)
    omni_accel.accelerate(pipe)
    _, undo = _with_table(pipe, pipe.omni_accel)
    try:
        out = run(pipe, cfg)
        assert _filled_rows(pipe) == 2 * 3 and list(_table(pipe).filled.values()) == [True, True]
    finally:
        undo()
        omni_accel.restore(pipe)
    torch.testing.assert_close(out, plain_cfg, rtol=1e-4, atol=1e-5)


def test_a_forward_off_the_schedule_gets_its_own_rows_and_the_plain_output(plain, accelerated):
    pipe, kwargs, _ = accelerated
    table = _table(pipe)
    right = table.spec
    table.spec = dataclasses.replace(right, schedule_timestep=lambda t, n, d: right.schedule_timestep(t + 7, n, d))
    out = run(pipe, kwargs)
    assert table.own_rows_this_call and not table.filled and table.rows == 1 and _filled_rows(pipe) == 1
    assert torch.equal(out, plain)


def test_outside_a_pipeline_call_each_forward_gets_its_own_rows(flux):
    pipe, kwargs = flux
    inputs = {}
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, k: inputs.update(k), with_kwargs=True)
    run(pipe, kwargs)
    hook.remove()
    with torch.no_grad():
        plain_forward = pipe.transformer(**inputs)[0]
        count, undo = _with_table(pipe)
        try:
            out = pipe.transformer(**inputs)[0]
            assert _filled_rows(pipe) == 1 and _table(pipe).rows == 1
        finally:
            undo()
    assert count == _linear_count(pipe.transformer) and torch.equal(out, plain_forward)


def test_without_own_rows_a_forward_outside_a_call_computes_its_linears_in_place(flux, plain, monkeypatch):
    """fill_own_rows=False (no CUDA graph to replay lookups): off a call nothing is filled or handed out, and the
    linears compute themselves; inside a call the schedule's rows serve as before."""
    pipe, kwargs = flux
    inputs = {}
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, k: inputs.update(k), with_kwargs=True)
    run(pipe, kwargs)
    hook.remove()
    omni_accel.accelerate(pipe)
    count, undo = modulation_table.use_modulation_table(pipe, pipe.transformer, adapter_for(pipe).modulation_prefetch,
                                                        pipe.omni_accel, fill_own_rows=False)
    outcomes = record_modulation_takes(monkeypatch)
    try:
        with torch.no_grad():
            out = pipe.transformer(**inputs)[0]
        assert outcomes == [False] * count and _table(pipe).rows == 0
        assert modulation_table._TEMB_BUFFER not in pipe.transformer.time_text_embed._buffers
        outcomes.clear()
        torch.testing.assert_close(run(pipe, kwargs), plain, rtol=1e-4, atol=1e-5)
        assert outcomes == [True] * (count * kwargs["num_inference_steps"])
    finally:
        undo()
        omni_accel.restore(pipe)
    with torch.no_grad():
        assert torch.equal(out, pipe.transformer(**inputs)[0])


def test_a_miss_raises_after_the_call_and_the_table_serves_own_rows_from_then_on(plain, accelerated):
    pipe, kwargs, _ = accelerated
    table = _table(pipe)
    _losing_later_steps(pipe)
    with pytest.raises(omni_accel.AccelError) as raised:
        run(pipe, kwargs)
    assert str(raised.value) == (
        "omni_accel: 1 forward(s) of this pipeline call ran with a timestep or conditioning that the modulation "
        "table did not hold (a scheduler that calls the transformer between its steps?), so their AdaLN modulation "
        "came from another step and this call's output is wrong. The table now computes each forward's own rows; "
        "to turn it off, set omni_accel.modulation_table.MODULATION_TABLE = False before accelerate().")
    assert not pipe.omni_accel.in_call and table.own_rows_only
    del table._fill
    assert torch.equal(run(pipe, kwargs), plain)  # own rows: the plain output
    assert _filled_rows(pipe) == 1


def test_the_undo_puts_the_linears_hooks_and_buffers_back(flux, plain):
    pipe, kwargs = flux
    omni_accel.accelerate(pipe)
    transformer = pipe.transformer
    count, undo = _with_table(pipe, pipe.omni_accel)
    run(pipe, kwargs)
    undo()
    assert torch.equal(run(pipe, kwargs), plain)
    omni_accel.restore(pipe)
    spec = adapter_for(pipe).modulation_prefetch
    linears = [m for _, m in modulation_prefetch.modulation_linears(transformer, spec.linears)]
    assert len(linears) == count and all(type(m) is torch.nn.Linear for m in linears)
    assert all(modulation_table._ROWS_BUFFER not in m._buffers for m in linears)
    left = set(transformer.time_text_embed._buffers)
    assert not {modulation_table._TEMB_BUFFER, modulation_table._MISS_BUFFER} & left
    assert "omni_accel.modulation_table" not in transformer._diffusers_hook.hooks and not modulation_prefetch._slots


def test_a_family_without_a_table_or_a_spec_gets_none():
    pipe, _ = tiny_pipeline("sd3")
    assert adapter_for(pipe).modulation_prefetch is None
    assert _with_table(pipe)[0] == 0 and not hasattr(pipe.transformer, "_diffusers_hook")
    assert modulation_table.use_modulation_table(pipe, pipe.transformer, None, None)[0] == 0


def _qwen_linear_count(transformer) -> int:
    return 2 * len(transformer.transformer_blocks) + 1


def test_qwen_image_true_cfg_shares_one_row_per_step_and_every_forward_takes_its_rows(monkeypatch):
    """Qwen-Image's temb is the timestep's embedding alone: the negative prompt's forward takes the same rows."""
    pipe, kwargs = tiny_pipeline("qwen_image", num_inference_steps=3)
    assert kwargs["true_cfg_scale"] > 1 and kwargs["negative_prompt"]  # two forwards per step
    plain = run(pipe, kwargs)
    out, fills, outcomes = _served(pipe, kwargs, monkeypatch)
    assert fills == [(3, 0)]
    assert len(outcomes) == 2 * 3 * _qwen_linear_count(pipe.transformer) and all(outcomes)
    torch.testing.assert_close(out, plain, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("images_per_prompt", [1, 2])
def test_qwen_image_with_additional_t_cond_fills_rows_per_value(monkeypatch, images_per_prompt):
    """additional_t_cond (Qwen-Image-Layered's RGB flag) enters temb: it is part of the conditioning, repeated per
    step, and a different flag fills rows of its own. Layered passes one flag per prompt, which the embedding
    broadcasts over num_images_per_prompt samples."""
    pipe, kwargs = tiny_pipeline("qwen_image", num_inference_steps=2, use_additional_t_cond=True)
    kwargs = dict(kwargs, num_images_per_prompt=images_per_prompt)

    def flags():
        return iter([torch.tensor([0]), torch.tensor([1])] * 2)

    current = flags()
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, call_kwargs: (args, dict(call_kwargs, additional_t_cond=next(current))), with_kwargs=True)
    try:
        plain = run(pipe, kwargs)
        current = flags()
        out, fills, outcomes = _served(pipe, kwargs, monkeypatch)
    finally:
        hook.remove()
    rows = 2 * images_per_prompt
    assert fills == [(rows, 0), (rows, rows)] and outcomes and all(outcomes)
    torch.testing.assert_close(out, plain, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen_image_edit", "qwen_image_edit_plus"])
def test_qwen_image_edit_pipelines_take_their_rows(monkeypatch, family):
    """The edit pipelines append the reference image's tokens to hidden_states; the batch and the timesteps are the
    text-to-image pipeline's."""
    pipe, kwargs = tiny_pipeline(family, num_inference_steps=2)
    plain = run(pipe, kwargs)
    out, fills, outcomes = _served(pipe, kwargs, monkeypatch)
    assert fills == [(2, 0)] and len(outcomes) == 2 * 2 * _qwen_linear_count(pipe.transformer) and all(outcomes)
    torch.testing.assert_close(out, plain, rtol=1e-4, atol=1e-5)


def test_a_spec_without_a_table_or_a_guidance_embedding_qwen_gets_none(flux):
    pipe, _ = flux
    spec = dataclasses.replace(adapter_for(pipe).modulation_prefetch, table=None)
    assert not modulation_table.tabulates(spec, pipe.transformer)
    assert modulation_table.use_modulation_table(pipe, pipe.transformer, spec, None)[0] == 0
    qwen, _ = tiny_pipeline("qwen_image", guidance_embeds=True)  # the forward would pass the guidance to temb too
    assert not modulation_table.tabulates(adapter_for(qwen).modulation_prefetch, qwen.transformer)


def test_qwen_image_with_zero_cond_t_is_left_to_the_prefetch(monkeypatch):
    """zero_cond_t appends a zero timestep per sample inside the forward: the table does not describe that temb, so
    the compile pass does not put it in (the prefetch serves such a model where it runs)."""
    pipe, _ = tiny_pipeline("qwen_image", zero_cond_t=True)
    assert not modulation_table.tabulates(adapter_for(pipe).modulation_prefetch, pipe.transformer)
    assert _with_table(pipe)[0] == 0
    monkeypatch.setattr(compiler, "_prefetches_modulation", lambda ctx: True)
    omni_accel.accelerate(pipe, compile=True)
    try:
        details = _compile_details(pipe)
        assert details["modulation_table"] == 0
        assert details["modulation_prefetch"] == _qwen_linear_count(pipe.transformer)
    finally:
        omni_accel.restore(pipe)


def test_the_compile_pass_serves_the_table_instead_of_the_prefetch_when_switched_on(flux, monkeypatch):
    pipe, kwargs = flux
    monkeypatch.setattr(modulation_table, "MODULATION_TABLE", True)
    monkeypatch.setattr(compiler, "_prefetches_modulation", lambda ctx: True)  # would prefetch (GPU graphs)
    omni_accel.accelerate(pipe, compile=True)
    try:
        details = _compile_details(pipe)
        assert details["modulation_table"] == _linear_count(pipe.transformer) and details["modulation_prefetch"] == 0
        run(pipe, kwargs)
        assert _filled_rows(pipe) == kwargs["num_inference_steps"]
    finally:
        omni_accel.restore(pipe)
    monkeypatch.setattr(modulation_table, "MODULATION_TABLE", False)
    omni_accel.accelerate(pipe, compile=True)
    try:
        details = _compile_details(pipe)
        assert details["modulation_table"] == 0
    finally:
        omni_accel.restore(pipe)


def _served(pipe, kwargs, monkeypatch) -> tuple[torch.Tensor, list, list]:
    """``pipe`` (plain) accelerated with the table for one call of ``kwargs``: (output, the fills as (rows, start),
    each modulation linear call's outcome); undone after."""
    fills = []
    fill = modulation_table.ModulationTable._fill

    def recording_fill(table, bound, timestep, start):
        fills.append((timestep.shape[0], start))
        return fill(table, bound, timestep, start)

    monkeypatch.setattr(modulation_table.ModulationTable, "_fill", recording_fill)
    outcomes = record_modulation_takes(monkeypatch)
    omni_accel.accelerate(pipe)
    _, undo = _with_table(pipe, pipe.omni_accel)
    try:
        return run(pipe, kwargs), fills, outcomes
    finally:
        undo()
        omni_accel.restore(pipe)


def test_a_batch_of_prompts_on_a_model_without_guidance_gets_one_row_per_step_and_sample(monkeypatch):
    pipe, kwargs = tiny_pipeline("flux", guidance_embeds=False)  # FLUX.1-schnell's kind: guidance is None
    kwargs = dict(kwargs, prompt=["a red fox", "a blue bird"], num_inference_steps=3)
    plain = run(pipe, kwargs)
    out, fills, outcomes = _served(pipe, kwargs, monkeypatch)
    assert fills == [(3 * 2, 0)] and outcomes and all(outcomes)
    torch.testing.assert_close(out, plain, rtol=1e-4, atol=1e-5)


def test_img2img_takes_the_later_rows_of_the_whole_schedule(flux, monkeypatch):
    from diffusers import FluxImg2ImgPipeline
    from PIL import Image

    base, kwargs = flux
    pipe = FluxImg2ImgPipeline(**base.components)
    pipe.set_progress_bar_config(disable=True)
    image = Image.new("RGB", (kwargs["width"], kwargs["height"]), (200, 40, 40))
    kwargs = dict(kwargs, image=image, strength=0.5, num_inference_steps=4)
    plain = run(pipe, kwargs)
    out, fills, outcomes = _served(pipe, kwargs, monkeypatch)
    # the schedule's 4 rows filled once; the 2 forwards of strength 0.5 took theirs
    assert fills == [(4, 0)] and len(outcomes) == 2 * _linear_count(pipe.transformer) and all(outcomes)
    torch.testing.assert_close(out, plain, rtol=1e-4, atol=1e-5)


def test_a_conditioning_rebuilt_every_step_is_recognised_by_its_values(flux, plain, monkeypatch):
    """FLUX's ControlNet pipelines build the guidance tensor anew every step: a new address, the same values; the
    table compares the values (once per new address) instead of filling again."""
    pipe, kwargs = flux
    kwargs = dict(kwargs, num_inference_steps=3)
    reference = run(pipe, kwargs)

    def fresh_guidance(module, args, call_kwargs):
        return args, dict(call_kwargs, guidance=call_kwargs["guidance"].clone())

    hook = pipe.transformer.register_forward_pre_hook(fresh_guidance, with_kwargs=True)
    try:
        out, fills, outcomes = _served(pipe, kwargs, monkeypatch)
    finally:
        hook.remove()
    assert fills == [(3, 0)] and len(outcomes) == 3 * _linear_count(pipe.transformer) and all(outcomes)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)


def _losing_later_steps(pipe) -> None:
    """Make the pipe's table lose every row but the first after its fill: the call's second step misses."""
    table = _table(pipe)
    fill = table._fill

    def fill_then_lose(bound, timestep, start):
        fill(bound, timestep, start)
        table.embedding._buffers[modulation_table._TEMB_BUFFER][1:] = float("inf")

    table._fill = fill_then_lose


def test_a_miss_raises_in_a_call_made_while_handling_an_exception_and_is_logged_when_the_call_raised(
        flux, accelerated, monkeypatch, caplog):
    pipe, kwargs, _ = accelerated
    _losing_later_steps(pipe)
    try:
        raise KeyError("a failed batch")  # a server retrying each job of a failed batch calls from here
    except KeyError:
        with pytest.raises(omni_accel.AccelError, match="this call's output is wrong"):
            run(pipe, kwargs)
    table = _table(pipe)
    table.own_rows_only = False
    monkeypatch.setattr(pipe, "vae", None)  # the call fails after the denoising loop, at the decode
    with pytest.raises(AttributeError), caplog.at_level("ERROR", logger="omni_accel"):
        run(pipe, dict(kwargs, output_type="pil"))
    assert "this call's output is wrong" in caplog.text and not pipe.omni_accel.in_call


def test_compiled_blocks_take_the_table_in_one_graph_per_block_kind(flux, monkeypatch):
    pipe, kwargs = flux
    monkeypatch.setattr(modulation_table, "MODULATION_TABLE", False)
    reference, reference_counts = run_compiled_twice(pipe, kwargs, compile=True)
    monkeypatch.setattr(modulation_table, "MODULATION_TABLE", True)
    outcomes = record_modulation_takes(monkeypatch)
    out, counts = run_compiled_twice(pipe, kwargs, compile=True)
    assert counts == reference_counts and counts["graph_breaks"] == 0
    assert counts["graphs_first_call"] == counts["graphs_second_call"]
    assert len(outcomes) == 2 * kwargs["num_inference_steps"] * _linear_count(pipe.transformer) and all(outcomes)
    torch.testing.assert_close(out, reference, atol=2e-3, rtol=0)


def test_a_call_in_inference_mode_then_one_outside_it(flux, plain, accelerated):
    """The table's tensors made during a call under torch.inference_mode are ordinary ones: a later call outside it
    writes them in place (an inference tensor refuses that)."""
    pipe, kwargs, _ = accelerated
    with torch.inference_mode():
        first = run(pipe, kwargs)
    second = run(pipe, kwargs)
    assert not pipe.transformer.time_text_embed._buffers[modulation_table._TEMB_BUFFER].is_inference()
    torch.testing.assert_close(first, plain, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(second, first)


def test_a_growing_table_makes_the_whole_forward_graph_capture_again(flux):
    """Under the whole-forward graph (cuda_graphs.GraphedForward, installed as the compile pass does) a call with
    more steps than the table holds moves its buffers: the graph, which would read the old ones, is captured again."""
    from omni_accel import cuda_graphs

    pipe, kwargs = flux
    plain = run(pipe, dict(kwargs, num_inference_steps=4))
    omni_accel.accelerate(pipe)
    _, undo = _with_table(pipe, pipe.omni_accel)
    get_forward, set_forward = compiler._innermost_forward(pipe.transformer)
    eager = get_forward()
    backend = RerunGraphBackend()
    graphed = cuda_graphs.GraphedForward(eager, pipe.transformer, torch.device("cpu"), backend=backend)
    set_forward(graphed)
    try:
        run(pipe, dict(kwargs, num_inference_steps=2))  # 2 rows; the second forward is captured
        assert backend.captures == 1 and graphed.stats["replays"] == 1
        out = run(pipe, dict(kwargs, num_inference_steps=4))  # 4 rows: the buffers move
        assert backend.captures == 2 and _filled_rows(pipe) == 4
    finally:
        set_forward(eager)
        graphed.reset()
        undo()
        omni_accel.restore(pipe)
    torch.testing.assert_close(out, plain, rtol=1e-4, atol=1e-5)


def test_qwen_image_takes_the_table_only_inside_the_whole_forward_graph(monkeypatch):
    """Qwen-Image's table is ``graphed_only`` (without the graph it measured no gain in the 16-bit forward): a compiled
    forward without the graph keeps plain linears; with it, the table serves them."""
    pipe, kwargs = tiny_pipeline("qwen_image", num_inference_steps=2)
    plain = run(pipe, kwargs)
    count = _qwen_linear_count(pipe.transformer)
    monkeypatch.setattr(modulation_table, "MODULATION_TABLE", True)
    outcomes = record_modulation_takes(monkeypatch)
    for graphed, want in ((False, 0), (True, count)):
        monkeypatch.setattr(compiler, "_graphed", lambda ctx, graphed=graphed: graphed)
        outcomes.clear()
        omni_accel.accelerate(pipe, compile=True)
        try:
            details = _compile_details(pipe)
            assert details["modulation_table"] == want
            torch.testing.assert_close(run(pipe, kwargs), plain, atol=2e-3, rtol=0)
        finally:
            omni_accel.restore(pipe)
        # without the graph the linears are plain (nothing recorded); with it every call takes its rows
        assert outcomes == [True] * (2 * 2 * count if graphed else 0)

