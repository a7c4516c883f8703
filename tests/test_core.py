"""accelerate()/restore()/report(): validation before patching, exact errors, clean undo, per-call stats."""

import re

import pytest
import torch

import omni_accel
from omni_accel import AccelConfig, AccelError, NotAvailableYet
from omni_accel.testing import run, tiny_pipeline


@pytest.fixture(scope="module")
def flux():
    pipe, kwargs = tiny_pipeline("flux")
    return pipe, kwargs, run(pipe, kwargs)


def _fingerprint(pipe):
    """Everything a pass may patch: the pipeline class, forwards, instance attributes, hooks and processors."""
    t = pipe.transformer
    return (
        type(pipe),
        sorted(vars(pipe)),
        t.forward,
        getattr(t, "_diffusers_hook", None) and sorted(t._diffusers_hook.hooks),
        [getattr(m.processor, "_attention_backend", None) for m in t.modules() if hasattr(m, "processor")],
        [b._compiled_call_impl for b in t.modules() if hasattr(b, "_compiled_call_impl")],
        sorted(vars(pipe.vae)),
    )


# ---------------------------------------------------------------------------------------------------------------
# Config validation: exact messages that name the value and the fix.
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sp=0), "sp=0 is invalid: sp must be a positive integer (1 turns it off)."),
        (dict(tp=-2), "tp=-2 is invalid: tp must be a positive integer (1 turns it off)."),
        (dict(cfg_parallel=1.5), "cfg_parallel=1.5 is invalid: cfg_parallel must be a positive integer (1 turns it off)."),
        (dict(cache="teacache"), "cache='teacache' is not known. Use one of: 'tea_cache', 'cache_dit', 'fb_cache', 'mag_cache'."),
        (dict(offload="disk"), "offload='disk' is not known. Use one of: 'model', 'block'."),
        (dict(quant="int4"), "quant='int4' is not known. Use one of: 'fp8', 'fp8_weight_only', 'int8'."),
        (dict(compile="fast"), "compile='fast' is not known. Use False / 'off', True / 'on' (regional) or 'max'."),
        (dict(ulysses=2, ring=2, sp=8), "ulysses=2 x ring=2 = 4 does not match sp=8; set sp=4 or leave sp out."),
        (dict(ulysses=3, sp=4), "ulysses=3 does not divide sp=4; choose ulysses among the divisors of sp."),
        (dict(cache_config={"threshold": 0.1}), "cache_config was given without cache=...; pick a backend, e.g. cache='tea_cache'."),
        (dict(offload="block", sp=2), "offload='block' cannot be combined with parallelism (world size 2): parallel runs split the model over GPUs already; drop offload or the parallel degrees."),
    ],
)
def test_bad_config_values_raise_with_the_fix(kwargs, message):
    with pytest.raises(AccelError) as info:
        AccelConfig(**kwargs).validate()
    assert str(info.value) == message


def test_accel_error_is_a_value_error():
    assert issubclass(AccelError, ValueError)
    assert issubclass(NotAvailableYet, AccelError)


def test_sequence_degrees_resolve():
    assert (AccelConfig(sp=4).ulysses_degree, AccelConfig(sp=4).ring_degree) == (4, 1)
    cfg = AccelConfig(ulysses=2, ring=2)
    assert (cfg.sequence_degree, cfg.world_size) == (4, 4)
    assert AccelConfig(sp=4, ring=2).ulysses_degree == 2
    assert AccelConfig(sp=2, cfg_parallel=2, tp=2).world_size == 8


# ---------------------------------------------------------------------------------------------------------------
# Bad input to accelerate(): refused before the first patch.
def test_not_a_pipeline():
    with pytest.raises(AccelError, match=r"needs a diffusers pipeline \(a DiffusionPipeline\), got Linear"):
        omni_accel.accelerate(torch.nn.Linear(2, 2))


def test_pipeline_without_transformer():
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 8), layers_per_block=1,
                       down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                       norm_num_groups=4)
    pipe = DDPMPipeline(unet=unet, scheduler=DDPMScheduler())
    with pytest.raises(AccelError) as info:
        omni_accel.accelerate(pipe)
    assert str(info.value) == (
        "DDPMPipeline is a UNet pipeline (unet: UNet2DModel); omni_accel accelerates DiT pipelines (a transformer "
        "denoiser) of these families: flux, flux2, qwen_image, wan, sd3, z_image.")


def test_unsupported_transformer_lists_families_and_docs():
    from diffusers import AutoencoderKL, DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    transformer = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1,
                                        sample_size=8, patch_size=2, num_embeds_ada_norm=10)
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)
    pipe = DiTPipeline(transformer=transformer, vae=vae, scheduler=DDIMScheduler())
    with pytest.raises(AccelError) as info:
        omni_accel.accelerate(pipe)
    message = str(info.value)
    assert "DiTPipeline with transformer DiTTransformer2DModel is not supported" in message
    assert "flux, flux2, qwen_image, wan, sd3, z_image" in message
    assert "docs/adding_a_model.md" in message


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(sp=2), r"ulysses=2 runs on 2 processes, one per rank: launch with torchrun"),
        (dict(quant="fp8", quant_config={"skip": "*.ff.*"}), r"quant_config\['skip'\]='\*\.ff\.\*' must be a list"),
        (dict(text_encoder="vllm"), r"text_encoder='vllm' is not supported for flux pipelines yet"),
        (dict(attention="nope"), r"attention='nope' is not a known backend\. Available here: auto, sdpa"),
        (dict(attention="cudnn", device="cpu"), r"attention='cudnn' needs a CUDA GPU .* use attention='auto' or 'sdpa'"),
        # a valid pass first in the order, then a refused one: the valid one must not be applied either
        (dict(compile=True, attention="math", quant="fp8_weight_only", text_encoder="vllm"),
         r"text_encoder='vllm' is not supported for flux"),
    ],
)
def test_refused_calls_leave_the_pipeline_untouched(flux, kwargs, pattern):
    pipe, _, _ = flux
    before = _fingerprint(pipe)
    with pytest.raises(AccelError, match=pattern):
        omni_accel.accelerate(pipe, **kwargs)
    assert _fingerprint(pipe) == before
    assert not hasattr(pipe, "omni_accel")


def test_failure_during_apply_undoes_what_was_applied(flux, monkeypatch):
    from omni_accel.compiler import CompilePass

    pipe, kwargs, plain = flux
    before = _fingerprint(pipe)

    def broken(self, ctx):
        raise RuntimeError("simulated failure inside the last pass")

    monkeypatch.setattr(CompilePass, "apply", broken)
    with pytest.raises(RuntimeError, match="simulated failure"):
        omni_accel.accelerate(pipe, attention="math", vae_slicing=True, compile=True)
    assert _fingerprint(pipe) == before
    assert torch.equal(run(pipe, kwargs), plain)


def test_accelerate_twice_and_restore_twice_are_refused(flux):
    pipe, _, _ = flux
    omni_accel.accelerate(pipe)
    try:
        with pytest.raises(AccelError, match=r"already accelerated; call omni_accel.restore\(pipe\) first"):
            omni_accel.accelerate(pipe, attention="math")
    finally:
        omni_accel.restore(pipe)
    with pytest.raises(AccelError, match="has not accelerated; nothing to undo"):
        omni_accel.restore(pipe)


def test_config_object_and_keywords(flux):
    pipe, _, _ = flux
    with pytest.raises(AccelError, match=r"config=.* must be an omni_accel.AccelConfig"):
        omni_accel.accelerate(pipe, config={"sp": 2})
    omni_accel.accelerate(pipe, config=AccelConfig(attention="math"), vae_slicing=True)
    try:
        report = pipe.omni_accel.report()
        assert report["config"]["attention"] == "math" and report["config"]["vae_slicing"] is True
    finally:
        omni_accel.restore(pipe)


# ---------------------------------------------------------------------------------------------------------------
# Same object back, report, restore.
def test_returns_same_object_reports_and_restores_exactly(flux):
    pipe, kwargs, plain = flux
    before = _fingerprint(pipe)
    assert omni_accel.accelerate(pipe, attention="math", vae_slicing=True) is pipe
    out = run(pipe, kwargs)
    assert (out - plain).abs().max().item() <= 1e-4

    report = pipe.omni_accel.report()
    assert report["family"] == "flux" and report["pipeline"] == "FluxPipeline"
    assert [a["pass"] for a in report["applied"]] == ["attention", "vae_slicing"]
    assert report["applied"][0]["backend"] == "math"
    # every wanted pass's setup time, in the order accelerate() applied them
    assert list(report["setup_s"]) == ["stats", "lora", "attention", "vae", "diffusers_compat"] and min(report["setup_s"].values()) >= 0
    call = report["last_call"]
    assert report["calls"] == 1
    assert call["transformer_forwards"] == kwargs["num_inference_steps"]
    times = call["time_s"]
    assert times["text_encoding"] > 0 and times["vae_decode"] > 0 and times["denoising"] > 0
    assert times["total"] >= times["text_encoding"] + times["vae_decode"]
    assert re.fullmatch(r"<omni_accel on FluxPipeline \(flux\): attention, vae_slicing>", repr(pipe.omni_accel))

    assert omni_accel.restore(pipe) is pipe
    assert _fingerprint(pipe) == before
    assert torch.equal(run(pipe, kwargs), plain)


def test_report_counts_each_call_separately(flux):
    pipe, kwargs, _ = flux
    omni_accel.accelerate(pipe)
    try:
        run(pipe, kwargs)
        run(pipe, kwargs, num_inference_steps=3)
        report = pipe.omni_accel.report()
        assert report["calls"] == 2
        assert report["last_call"]["transformer_forwards"] == 3
    finally:
        omni_accel.restore(pipe)


@pytest.mark.parametrize("kwargs, message", [
    # sp=3 on 2 heads advises ring=3, and ring=3 then asked for 2 processes: each message now holds after the other
    (dict(sp=3), "ulysses=3 does not divide the 2 attention heads of the transformer; choose ulysses among the "
                 "divisors of 2 and use ring for the rest, e.g. ulysses=1, ring=3."),
    (dict(ring=3), "ring=3 runs on 3 processes, one per rank: launch with torchrun, e.g. `torchrun --nproc_per_node=3 "
                   "your_script.py` (no torch.distributed environment was found)."),
    (dict(sp=4, ring=2), "ring=2, ulysses=2 runs on 4 processes, one per rank: launch with torchrun, e.g. "
                         "`torchrun --nproc_per_node=4 your_script.py` (no torch.distributed environment was found)."),
])
def test_parallel_degrees_without_torchrun_name_the_process_count(flux, kwargs, message):
    pipe, _, _ = flux
    with pytest.raises(AccelError) as info:
        omni_accel.accelerate(pipe, **kwargs)
    assert str(info.value) == message


def test_compile_takes_the_command_line_words_too():
    assert [AccelConfig(compile=v).validate().compile for v in ("on", "off", "max", True, False)] == \
        [True, False, "max", True, False]
