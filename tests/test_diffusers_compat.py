"""Living beside diffusers: what users (and diffusers' own tests) do with a pipeline around accelerate() -- pipelines
sharing modules, one-expert Wan 2.2, diffusers' own caches and q/k/v fusion, save_pretrained / LoRA / .to(), copies
and pickling. Each either works or is refused before anything breaks, with the exact message."""

import copy
import io
import logging
import pickle

import pytest
import torch

import omni_accel
from omni_accel import AccelError
from omni_accel.testing import run, tiny_pipeline

FIX = ("Call omni_accel.restore(pipe) first (pickle or copy the plain pipeline, then accelerate the copy), or keep the "
       "weights with save_pretrained() / state_dict().")


@pytest.fixture(scope="module")
def flux():
    pipe, kwargs = tiny_pipeline("flux")
    return pipe, kwargs, run(pipe, kwargs)


@pytest.fixture
def plain(flux):
    """The module's pipeline, guaranteed plain again after the test (whatever it left accelerated)."""
    pipe = flux[0]
    yield flux
    if "omni_accel" in vars(pipe):
        omni_accel.restore(pipe)


# -- pipelines built over the same modules -----------------------------------------------------------------------
@pytest.mark.parametrize("knobs", [{}, {"quant": "fp8_weight_only"}])
def test_second_pipeline_over_shared_modules_is_refused_until_the_first_is_restored(plain, knobs):
    from diffusers import FluxPipeline

    pipe, kwargs, reference = plain
    twin = FluxPipeline(**pipe.components)  # as diffusers' own tests (and many users) build one
    omni_accel.accelerate(pipe, **knobs)
    with pytest.raises(AccelError) as info:
        omni_accel.accelerate(twin, **knobs)
    assert str(info.value) == (
        "the transformer of this FluxPipeline is shared with another pipeline that omni_accel has accelerated "
        "(FluxPipeline, e.g. built with FluxPipeline(**pipe.components)): a module carries one acceleration at a "
        "time. Call the accelerated pipeline instead (it is the same model), or omni_accel.restore() the other "
        "pipeline first.")
    assert "omni_accel" not in vars(twin)
    omni_accel.restore(pipe)
    omni_accel.accelerate(twin, attention="math")  # the modules are free again
    torch.testing.assert_close(run(twin, kwargs), reference, rtol=0, atol=1e-5)
    omni_accel.restore(twin)
    assert torch.equal(run(pipe, kwargs), reference)


# -- Wan 2.2 with one expert; pipelines without a denoiser ------------------------------------------------------
def test_wan22_with_only_transformer_2_is_accelerated_and_a_pipeline_without_transformer_is_named_so():
    from diffusers import UniPCMultistepScheduler, WanPipeline

    pipe, kwargs = tiny_pipeline("wan22")
    components = dict(pipe.components, transformer=None,  # one expert, as diffusers' Wan 2.2 tests build it
                      scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                        flow_shift=3.0))
    one_expert = WanPipeline(**components, boundary_ratio=1.0)
    reference = run(one_expert, kwargs)
    omni_accel.accelerate(one_expert, attention="math", cache="tea_cache", cache_config={"threshold": 0.0})
    try:
        out = run(one_expert, kwargs)
        report = one_expert.omni_accel.report()
    finally:
        omni_accel.restore(one_expert)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)
    assert report["family"] == "wan" and report["last_call"]["transformer_forwards"] == 4  # 2 steps x 2 CFG branches
    with pytest.raises(AccelError) as info:
        omni_accel.accelerate(WanPipeline(**dict(components, transformer_2=None)))
    assert str(info.value) == (
        "WanPipeline has no denoiser to accelerate (no transformer component is set); omni_accel accelerates DiT "
        "pipelines of these families: flux, flux2, qwen_image, wan, sd3, z_image.")


# -- diffusers' own caches and q/k/v fusion ---------------------------------------------------------------------
def test_diffusers_cache_and_omni_accel_cache_refuse_each_other(plain):
    from diffusers.hooks import FirstBlockCacheConfig

    pipe, kwargs, reference = plain
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    try:
        with pytest.raises(AccelError) as info:
            omni_accel.accelerate(pipe, cache="tea_cache")
    finally:
        pipe.transformer.disable_cache()
    assert str(info.value) == (
        "cache='tea_cache': the transformer already runs diffusers' FirstBlockCacheConfig "
        "(transformer.enable_cache()); two step caches on one transformer would skip each other's work. Call "
        "pipe.transformer.disable_cache() first, or leave cache= out to keep diffusers' cache.")
    omni_accel.accelerate(pipe, cache="fb_cache")
    with pytest.raises(AccelError) as info:
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    assert str(info.value) == (
        "transformer.enable_cache() after accelerate(cache='fb_cache') would stack diffusers' step cache on "
        "omni_accel's: call omni_accel.restore(pipe) first, or keep one of the two.")
    omni_accel.restore(pipe)
    assert not pipe.transformer.is_cache_enabled and torch.equal(run(pipe, kwargs), reference)


# -- save_pretrained, LoRA, .to() after weight-changing passes ---------------------------------------------------
@pytest.mark.parametrize("knobs, saved, why", [
    ({"quant": "fp8_weight_only"}, "quantized layers", "they are quantized layers now"),
    ({"quant": "int8"}, "quantized layers", "they are quantized layers now"),
    ({"fuse_qkv": True}, "fused q/k/v projections", "q, k and v are one fused projection now"),
])
def test_weight_changing_passes_refuse_save_transformer_lora_and_moves_with_the_fix(plain, tmp_path, knobs, saved, why):
    pipe, kwargs, reference = plain
    omni_accel.accelerate(pipe, **knobs)
    shown = ", ".join(f"{k}={v!r}" for k, v in knobs.items())
    save = (f"save_pretrained() after accelerate({shown}) would write {saved}, which diffusers cannot load back: call "
            "omni_accel.restore(pipe) first, save the plain weights, and accelerate() again after loading them (an "
            "acceleration is applied after loading, it is not saved).")
    for call in (lambda: pipe.save_pretrained(tmp_path / "p"), lambda: pipe.transformer.save_pretrained(tmp_path)):
        with pytest.raises(AccelError) as info:
            call()
        assert str(info.value) == save
    with pytest.raises(AccelError) as info:  # the pipeline's load_lora_weights goes through the lora pass instead
        pipe.transformer.load_lora_adapter(tmp_path)
    assert str(info.value) == (
        f"loading a LoRA into the transformer after accelerate({shown}) cannot reach the layers it adapts ({why}): "
        "use pipe.load_lora_weights(...), which restores, loads and accelerates again, or call "
        "omni_accel.restore(pipe) first.")
    with pytest.raises(AccelError, match=r"^pipe\.to\(torch\.bfloat16\) after accelerate\(.*\) would move or cast"):
        pipe.to(torch.bfloat16)
    pipe.to("cpu")  # where it already is: allowed
    with pytest.raises(AccelError) as info:
        pipe.transformer.unfuse_qkv_projections()
    assert str(info.value) == (f"transformer.unfuse_qkv_projections() after accelerate({shown}) would rebuild "
                               "projections omni_accel replaced; omni_accel.restore(pipe) puts the original ones back.")
    if "quant" in knobs:  # diffusers' fusion of FP8 layers raised AttributeError: 'Fp8Linear' has no 'weight'
        with pytest.raises(AccelError) as info:
            pipe.transformer.fuse_qkv_projections()
        assert str(info.value) == (
            f"transformer.fuse_qkv_projections() after accelerate({shown}) cannot fuse quantized layers: "
            "use accelerate(fuse_qkv=True, quant=...), which fuses before quantizing, or fuse before accelerate().")
    omni_accel.restore(pipe)
    assert torch.equal(run(pipe, kwargs), reference)
    assert "save_pretrained" not in vars(pipe) and "to" not in vars(pipe)


def test_save_pretrained_round_trips_after_passes_that_keep_the_weights(plain, tmp_path):
    from diffusers import DiffusionPipeline

    pipe, kwargs, _ = plain
    pipe.save_pretrained(tmp_path / "plain")
    omni_accel.accelerate(pipe, attention="math", cache="tea_cache", kernels=True)
    pipe.save_pretrained(tmp_path / "accelerated")
    omni_accel.restore(pipe)
    saved = [DiffusionPipeline.from_pretrained(tmp_path / name) for name in ("plain", "accelerated")]
    assert torch.equal(run(saved[0], kwargs), run(saved[1], kwargs))


# -- copies and pickling ----------------------------------------------------------------------------------------
def test_deepcopy_of_a_component_runs_its_own_weights_and_pickling_is_refused_with_the_fix(plain):
    pipe, kwargs, reference = plain
    omni_accel.accelerate(pipe, cache="tea_cache")
    vae = copy.deepcopy(pipe.vae)  # its decode wrapper follows the copy (it used to call the original's)
    with torch.no_grad():
        for p in vae.parameters():
            p.mul_(0.5)
        latents = torch.randn(1, pipe.vae.config.latent_channels, 4, 4)
        assert not torch.equal(vae.decode(latents).sample, pipe.vae.decode(latents).sample)
    copy.deepcopy(pipe.transformer)  # its hooks keep reporting to the one state: no copy of the pipeline dragged
    cases = [
        (lambda: pickle.dumps(pipe), "an accelerated FluxPipeline cannot be pickled"),
        (lambda: torch.save(pipe, io.BytesIO()), "an accelerated FluxPipeline cannot be pickled"),
        (lambda: copy.deepcopy(pipe), "an accelerated FluxPipeline cannot be deep-copied"),
        (lambda: torch.save(pipe.vae, io.BytesIO()),
         "AutoencoderKL (its decode is wrapped by omni_accel) cannot be pickled"),
    ]
    for call, start in cases:
        with pytest.raises(AccelError) as info:
            call()
        assert str(info.value) == (
            f"{start} while omni_accel's patches are on it (hooks and wrappers that belong to this process and to "
            f"the accelerated pipeline). {FIX}")
    omni_accel.restore(pipe)
    omni_accel.accelerate(pipe, attention="math")  # no tea_cache: the transformer's hooks refer to the state only
    with pytest.raises(AccelError, match=r"^a module of an accelerated FluxPipeline \(it carries omni_accel's hooks\) "
                                         r"cannot be pickled"):
        pickle.dumps(pipe.transformer)
    omni_accel.restore(pipe)
    assert torch.equal(run(pickle.loads(pickle.dumps(pipe)), kwargs), reference)  # plain pipelines pickle


# -- call-time arguments ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, message", [
    ({"num_inference_steps": 0}, "num_inference_steps=0 is invalid: FluxPipeline needs a positive whole number of "
                                 "denoising steps, e.g. num_inference_steps=20."),
    ({"height": 8}, "height=8 is too small: FluxPipeline needs at least 16 pixels per side (sides are multiples of "
                    "16: the VAE's down-sampling x 2x2 patches)."),
    ({"width": 20.5}, "width=20.5 is invalid: FluxPipeline needs a whole number of pixels, e.g. width=128."),
])
def test_bad_call_arguments_are_refused_before_the_pipeline_runs(plain, bad, message):
    pipe, kwargs, _ = plain
    omni_accel.accelerate(pipe)
    with pytest.raises(AccelError) as info:
        pipe(**dict(kwargs, **bad))
    assert str(info.value) == message
    assert pipe.omni_accel.calls == 0 and not pipe.omni_accel.in_call


def test_true_cfg_scale_without_negative_prompt_warns_once(plain, caplog):
    pipe, kwargs, _ = plain
    omni_accel.accelerate(pipe)
    with caplog.at_level(logging.WARNING, logger="omni_accel"):
        run(pipe, dict(kwargs, true_cfg_scale=4.0))
        run(pipe, dict(kwargs, true_cfg_scale=4.0))
    warnings = [r.getMessage() for r in caplog.records if "true_cfg_scale" in r.getMessage()]
    assert warnings == [
        "omni_accel: true_cfg_scale=4.0 has no effect without negative_prompt: FluxPipeline runs true CFG only with "
        "negative_prompt=... (or negative_prompt_embeds); pass negative_prompt='' for an empty negative prompt, or "
        "leave true_cfg_scale out."]
    assert pipe.omni_accel.last_call.transformer_forwards == kwargs["num_inference_steps"]  # no negative branch ran


def test_a_lora_loads_after_passes_that_keep_the_layers(plain, tmp_path):
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe, kwargs, _ = plain
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"],
                                            init_lora_weights=False))
    FluxPipeline.save_lora_weights(tmp_path, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer))
    pipe.transformer.delete_adapters("default")
    pipe.load_lora_weights(tmp_path)
    with_lora = run(pipe, kwargs)
    pipe.unload_lora_weights()
    omni_accel.accelerate(pipe, attention="math", cache="tea_cache", kernels=True)
    try:
        pipe.load_lora_weights(tmp_path)
        torch.testing.assert_close(run(pipe, kwargs), with_lora, rtol=0, atol=1e-5)
        pipe.unload_lora_weights()
    finally:
        omni_accel.restore(pipe)


def test_quant_over_diffusers_layerwise_casting_is_refused():
    pipe, _ = tiny_pipeline("flux")  # its own pipeline: the casting stays on the weights
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    with pytest.raises(AccelError) as info:  # it failed inside the quant pass with NotImplementedError
        omni_accel.accelerate(pipe, quant="fp8_weight_only")
    assert str(info.value) == (
        "quant='fp8_weight_only': the transformer stores its weights in a low-precision dtype already (diffusers' "
        "transformer.enable_layerwise_casting()); quantized layers cannot be made from them. Load the model without "
        "layerwise casting to use quant, or leave quant out to keep diffusers' casting.")
    assert "omni_accel" not in vars(pipe)
    omni_accel.accelerate(pipe, attention="math")  # the lossless passes compose with it
    omni_accel.restore(pipe)
