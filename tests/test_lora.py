"""LoRA adapters (diffusers' loader, peft layers) with accelerate(): before / after, quant, compile hotswap,
refusals; the shipped built-in adapter."""

import pytest
import torch

import omni_accel
from omni_accel import AccelError
from omni_accel.kernels.fp8 import Fp8Linear
from omni_accel.kernels.int8 import Int8Linear, Int8WeightOnlyLinear
from omni_accel.lora import adapters_of, set_lora_scale
from omni_accel.testing import run, tiny_pipeline
from omni_accel.testing.lora import random_lora


def _lora_layers(pipe):
    from peft.tuners.lora import LoraLayer

    return [m for m in pipe.transformer.modules() if isinstance(m, LoraLayer)]


def test_lora_loaded_before_accelerate_keeps_the_delta_beside_fp8_base_layers():
    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    pipe.load_lora_weights(random_lora(pipe, seed=1), adapter_name="a")
    with_lora = run(pipe, kwargs)
    assert (with_lora - plain).abs().max() > 0.05  # the adapter does something
    omni_accel.accelerate(pipe, quant="fp8")
    out = run(pipe, kwargs)
    layers = _lora_layers(pipe)
    assert layers and all(isinstance(m.base_layer, Fp8Linear) for m in layers)
    assert all(type(m.lora_A["a"]) is torch.nn.Linear and m.lora_A["a"].weight.dtype == torch.float32 for m in layers)
    assert ((out - with_lora).norm() / with_lora.norm()) < 0.03
    (quant,) = [a for a in pipe.omni_accel.report()["applied"] if a["pass"] == "quant"]
    assert "transformer_blocks.0.norm1.linear" in quant["skipped"]  # skip patterns still match under a wrapper
    assert pipe.omni_accel.report()["lora"] == {"transformer": ["a"]}
    omni_accel.restore(pipe)
    assert torch.equal(run(pipe, kwargs), with_lora)


def test_lora_beside_int8_bases_and_int8_modulation_weights():
    """quant="int8" with the modulation linears in int8 too: each peft wrapper's base layer becomes the int8 layer
    of its kind (the LoRA matrices stay as they are) and the adapter still applies."""
    pipe, kwargs = tiny_pipeline("flux")
    pipe.load_lora_weights(random_lora(pipe, seed=1, targets=("*attn.to_q", "*norm1.linear")), adapter_name="a")
    with_lora = run(pipe, kwargs)
    omni_accel.accelerate(pipe, quant="int8", quant_config={"modulation": "int8"})
    bases = {type(m.base_layer) for m in _lora_layers(pipe)}
    assert bases == {Int8Linear, Int8WeightOnlyLinear}
    assert isinstance(pipe.transformer.transformer_blocks[0].norm1.linear.base_layer, Int8WeightOnlyLinear)
    assert ((run(pipe, kwargs) - with_lora).norm() / with_lora.norm()) < 0.02
    omni_accel.restore(pipe)
    assert torch.equal(run(pipe, kwargs), with_lora)


def test_lora_loaded_after_accelerate_reaccelerates_and_unload_restores_the_base():
    pipe, kwargs = tiny_pipeline("flux")
    plain = run(pipe, kwargs)
    state = random_lora(pipe, seed=1)
    pipe.load_lora_weights(dict(state), adapter_name="a")
    with_lora = run(pipe, kwargs)
    pipe.unload_lora_weights()
    omni_accel.accelerate(pipe, quant="fp8_weight_only")
    quantized_plain = run(pipe, kwargs)
    pipe.load_lora_weights(dict(state), adapter_name="a")  # restore, load, accelerate again
    assert all(isinstance(m.base_layer, Fp8Linear) for m in _lora_layers(pipe))
    assert ((run(pipe, kwargs) - with_lora).norm() / with_lora.norm()) < 0.03
    set_lora_scale(pipe, "a", 0.0)
    assert torch.equal(run(pipe, kwargs), quantized_plain)  # scale 0 = the (quantized) base, bit for bit
    pipe.unload_lora_weights()
    assert not _lora_layers(pipe) and "omni_accel" in vars(pipe)
    omni_accel.restore(pipe)
    assert torch.equal(run(pipe, kwargs), plain)


def test_hotswap_under_compile_does_not_recompile_nor_does_sleep():
    from torch._dynamo.utils import counters

    pipe, kwargs = tiny_pipeline("flux")
    a, b = random_lora(pipe, rank=4, seed=1), random_lora(pipe, rank=2, seed=2)
    references = {}
    for name, state in (("a", a), ("b", b)):  # eager references
        pipe.load_lora_weights(dict(state), adapter_name=name)
        references[name] = run(pipe, kwargs)
        pipe.unload_lora_weights()
    plain = run(pipe, kwargs)
    pipe.enable_lora_hotswap(target_rank=8)  # ranks padded to 8, scalings as tensors
    pipe.load_lora_weights(dict(a), adapter_name="slot")
    torch._dynamo.reset()
    counters.clear()
    omni_accel.accelerate(pipe, compile=True)
    try:
        first = run(pipe, kwargs)
        graphs = counters["stats"]["unique_graphs"]
        pipe.load_lora_weights(dict(b), adapter_name="slot", hotswap=True)
        second = run(pipe, kwargs)
        set_lora_scale(pipe, "slot", 0.0)
        base = run(pipe, kwargs)
        assert counters["stats"]["unique_graphs"] == graphs, "switching adapters or scales recompiled"
        omni_accel.sleep(pipe)  # the weights (LoRA's too) leave and come back: same graphs, same output
        omni_accel.wake_up(pipe)
        assert torch.equal(run(pipe, kwargs), base)
        assert counters["stats"]["unique_graphs"] == graphs, "waking up recompiled"
        assert adapters_of(pipe) == {"transformer": ["slot"]}
    finally:
        omni_accel.restore(pipe)
    assert graphs == 2  # one graph per block type
    assert (first - references["a"]).abs().max() <= 1e-3
    assert (second - references["b"]).abs().max() <= 1e-3
    assert (base - plain).abs().max() <= 1e-3


@pytest.mark.parametrize("knobs, message", [
    (dict(fuse_qkv=True), "this pipeline carries LoRA adapters {'transformer': ['a']}: fuse_qkv=True concatenates the "
                          "q/k/v weights and would drop their LoRA deltas; use fuse_qkv=False with LoRA adapters."),
])
def test_knobs_that_cannot_carry_an_adapter_are_refused(knobs, message):
    pipe, _ = tiny_pipeline("flux")
    pipe.load_lora_weights(random_lora(pipe), adapter_name="a")
    with pytest.raises(AccelError) as err:
        omni_accel.accelerate(pipe, **knobs)
    assert str(err.value) == message
    assert "omni_accel" not in vars(pipe)


def test_loading_an_adapter_into_a_fuse_qkv_pipeline_is_refused_before_anything_changes():
    pipe, kwargs = tiny_pipeline("flux")
    omni_accel.accelerate(pipe, fuse_qkv=True)
    before = run(pipe, kwargs)
    with pytest.raises(AccelError, match=r"^pipe.load_lora_weights\(\) on a pipeline accelerated with .*fuse_qkv=True "
                                         r"concatenates the q/k/v weights"):
        pipe.load_lora_weights(random_lora(pipe), adapter_name="a")
    assert not _lora_layers(pipe) and "omni_accel" in vars(pipe)
    assert torch.equal(run(pipe, kwargs), before)


def test_builtin_adapter_swaps_the_colours_and_scale_zero_is_the_base():
    """The shipped adapter (trained by omni_accel.builtin.train_lora): at scale 0 the base model's images bit for
    bit; at scale 1 the background takes the caption's shape colour (scored by the built-in metric)."""
    import numpy as np

    from omni_accel.builtin import BUILTIN_DEFAULTS, builtin_lora_path, load_builtin
    from omni_accel.builtin.train_lora import evaluation_captions, swap_scores

    pipe = load_builtin()
    captions = evaluation_captions(6)

    def images():
        kwargs = dict(BUILTIN_DEFAULTS, num_inference_steps=10, output_type="np")
        return pipe(captions, **kwargs, generator=torch.Generator().manual_seed(0)).images

    base = images()
    pipe.load_lora_weights(builtin_lora_path(), adapter_name="swap")
    pipe.set_adapters("swap", adapter_weights=0.0)
    assert np.array_equal(images(), base)
    pipe.set_adapters("swap", adapter_weights=1.0)
    swapped = swap_scores([(im * 255).round().astype(np.uint8) for im in images()], captions)
    plain = swap_scores([(im * 255).round().astype(np.uint8) for im in base], captions)
    assert plain["bg_is_caption_bg_colour"] >= 5 / 6 and plain["bg_is_caption_shape_colour"] == 0.0
    assert swapped["bg_is_caption_shape_colour"] >= 4 / 6, swapped
