"""Worker for tests/test_parallel.py, launched by torchrun (gloo, CPU): each rank builds every tiny pipeline,
computes the single-process reference *before* accelerate, then the parallel output, and writes its results to
``$OUT_DIR/<suite>.rank<R>.json`` (the pytest side asserts per case).

    torchrun --standalone --nproc_per_node=2 tests/parallel_worker.py two OUT_DIR     # suite_2 + errors + diffusers
    torchrun --standalone --nproc_per_node=4 tests/parallel_worker.py four OUT_DIR    # suite_4
    torchrun --standalone --nproc_per_node=8 tests/parallel_worker.py eight OUT_DIR   # suite_8

OMNI_ACCEL_PARALLEL_CASES=name,name runs only those cases of the suite.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback

import torch

os.environ.setdefault("OMNI_ACCEL_PG_TIMEOUT", "60")  # a collective out of step fails in a minute, not ten
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import omni_accel  # noqa: E402
from omni_accel import AccelError  # noqa: E402
from omni_accel.testing import TINY_BUILDERS, run, tiny_pipeline  # noqa: E402
from omni_accel.testing.lora import random_lora  # noqa: E402
# the comparison with diffusers' context parallelism: one source for the test and the results file
from benchmarks.parallel_vs_diffusers_cpu import compare_rows  # noqa: E402

ODD = {  # overrides giving an odd image token count per family (the default text lengths are odd already)
    "flux": dict(height=48, width=80), "flux_kontext": dict(height=48, width=80), "flux2": dict(height=48, width=80),
    "qwen_image": dict(height=24, width=40),
    "z_image": dict(height=48, width=80), "sd3": dict(height=12, width=20),
    "wan": dict(num_frames=9, height=48, width=16),
}


def available(family: str) -> bool:
    return importlib.util.find_spec(f"omni_accel.testing.{TINY_BUILDERS[family]}") is not None


def case(name, family, knobs, overrides=None, tol=1e-4, restore=False, vae_attention=False, call=None,
         reference=None, decode_rows=None, lora=None):
    """``reference``: knobs of the single-process reference (default: the plain pipeline), e.g. the same cache.
    ``decode_rows``: no pipeline call, ``pipe.vae.decode`` of a latent with that many rows (see run_decode_case).
    ``lora``: a seeded random LoRA loaded on every rank "before" accelerate() or "after" it (the reference has it)."""
    return dict(name=name, family=family, knobs=knobs, overrides=overrides or {}, tol=tol, restore=restore,
                vae_attention=vae_attention, call=call or {}, reference=reference, decode_rows=decode_rows,
                lora=lora)


TEA = dict(cache="tea_cache", cache_config={"threshold": 0.3})  # reuses some of 6 steps on every tiny family
CACHE_STEPS = dict(num_inference_steps=6)


def cache_cases():
    """Cache with parallelism: output and per-step decisions equal to the same cache in one process."""
    out = []
    for fam in ("flux", "qwen_image", "wan", "z_image"):
        out.append(case(f"cache-tea-ulysses-{fam}-odd", fam, dict(sp=2, **TEA), dict(ODD[fam], **CACHE_STEPS),
                        reference=TEA, restore=fam == "flux"))
    out.append(case("cache-tea-ring-sd3-odd", "sd3", dict(ring=2, **TEA), dict(ODD["sd3"], **CACHE_STEPS),
                    reference=TEA))
    for fam in ("qwen_image", "wan", "sd3"):  # true CFG (qwen_image, wan) and batched CFG (sd3)
        out.append(case(f"cache-tea-cfg-{fam}", fam, dict(cfg_parallel=2, **TEA), CACHE_STEPS, reference=TEA))
    for backend, label in (("cache_dit", "dit"), ("fb_cache", "fb")):  # cache-dit composes with tp (not sp/cfg)
        knobs = dict(cache=backend, cache_config={"residual_diff_threshold": 0.3, "max_warmup_steps": 1})
        out.append(case(f"cache-{label}-tp-flux", "flux", dict(tp=2, **knobs), CACHE_STEPS, reference=knobs))
    return out


def suite_2():
    cases = []
    for fam in ("flux", "flux2", "qwen_image", "qwen_image_edit", "z_image", "sd3", "wan", "wan_i2v", "wan22",
                "flux_kontext"):
        cases.append(case(f"ulysses-{fam}", fam, dict(sp=2), restore=fam == "flux"))
        if fam in ODD:
            cases.append(case(f"ulysses-{fam}-odd", fam, dict(sp=2), ODD.get(fam)))
    for fam in ("flux", "flux2", "qwen_image", "z_image", "sd3", "wan"):
        cases.append(case(f"ring-{fam}-odd", fam, dict(ring=2), ODD.get(fam)))
    for fam in ("qwen_image", "qwen_image_edit", "wan", "wan22"):
        cases.append(case(f"cfg-{fam}", fam, dict(cfg_parallel=2), dict(num_inference_steps=3), restore=True))
    for fam in ("flux", "flux2", "qwen_image", "wan", "wan_i2v", "sd3"):  # wan_i2v: the image K/V projections too
        cases.append(case(f"tp-{fam}", fam, dict(tp=2), restore=fam in ("flux", "wan")))
    # SD3.5 layout: dual attention (attn2) in block 0, per-head RMS qk-norm
    cases.append(case("tp-sd3_5", "sd3", dict(tp=2), dict(dual_attention_layers=(0,), qk_norm="rms_norm")))
    # Z-Image: the FFN width int(dim / 3 * 8) must divide by tp (the default dim 32 gives 85): dim 48, 2 heads of 24
    cases.append(case("tp-z_image", "z_image", dict(tp=2), dict(dim=48, axes_dims=[8, 8, 8])))
    for fam in ("flux", "z_image", "sd3", "flux2"):
        cases.append(case(f"vae-{fam}-odd", fam, dict(vae_parallel=2), ODD.get(fam)))
    # 5 latent rows on 2 ranks (bands of 3 and 2): no tiny pipeline makes an odd latent height, so decode directly
    cases.append(case("vae-flux-5rows", "flux", dict(vae_parallel=2), decode_rows=5))
    cases.append(case("vae-flux-attention", "flux", dict(vae_parallel=2), ODD["flux"], vae_attention=True,
                      restore=True))
    cases.append(case("ulysses+vae-flux-odd", "flux", dict(sp=2, vae_parallel=2), ODD["flux"], restore=True))
    cases.append(case("ulysses-flux-compile", "flux", dict(sp=2, compile=True), ODD["flux"]))
    # LoRA: every rank loads the same adapter (before accelerate, or after it: restore, load, accelerate again)
    cases.append(case("ulysses-flux-odd-lora-after", "flux", dict(sp=2), ODD["flux"], lora="after"))
    cases.append(case("cfg-qwen_image-lora-before", "qwen_image", dict(cfg_parallel=2), dict(num_inference_steps=3),
                      lora="before"))
    # batched CFG (one forward on [uncond, cond]): the doubled batch is split over the two CFG ranks
    cases.append(case("cfg-sd3-odd", "sd3", dict(cfg_parallel=2), dict(ODD["sd3"], num_inference_steps=3),
                      restore=True))
    cases.append(case("cfg-z_image-odd", "z_image", dict(cfg_parallel=2), dict(ODD["z_image"], num_inference_steps=3)))
    return cases + cache_cases()


def suite_4():
    return [
        case("usp-flux-odd", "flux", dict(ulysses=2, ring=2), ODD["flux"]),
        case("sp2xcfg2-qwen_image-odd", "qwen_image", dict(sp=2, cfg_parallel=2), dict(ODD["qwen_image"],
                                                                                     num_inference_steps=3)),
        case("tp2xring2-flux", "flux", dict(tp=2, ring=2)),
        case("vae4-flux", "flux", dict(vae_parallel=4), dict(height=64, width=48)),
        case("tp2xulysses2-flux-odd", "flux", dict(tp=2, sp=2), dict(ODD["flux"], num_attention_heads=4)),
        case("tp4-flux", "flux", dict(tp=4), dict(num_attention_heads=4)),
        # 4-way sequence split of 11 text + 15 image tokens (flux), 93 + 15 (sd3, 4 heads), 143 + 15 (qwen_image)
        case("ulysses4-flux-odd", "flux", dict(ulysses=4), dict(ODD["flux"], num_attention_heads=4)),
        case("ring4-flux-odd", "flux", dict(ring=4), ODD["flux"]),
        case("ulysses4-sd3-odd", "sd3", dict(ulysses=4), ODD["sd3"]),
        case("ring4-qwen_image-odd", "qwen_image", dict(ring=4), ODD["qwen_image"]),
        case("usp-qwen_image-odd", "qwen_image", dict(ulysses=2, ring=2), ODD["qwen_image"]),
        case("usp-wan-odd", "wan", dict(ulysses=2, ring=2), ODD["wan"]),
        case("cfg2xring2-wan-odd", "wan", dict(cfg_parallel=2, ring=2), dict(ODD["wan"], num_inference_steps=3)),
        case("sp2xcfg2-sd3-odd", "sd3", dict(sp=2, cfg_parallel=2), dict(ODD["sd3"], num_inference_steps=3)),
        # 6 latent rows on 4 ranks: bands of 2, 2, 1, 1 rows
        case("vae4-flux-6rows", "flux", dict(vae_parallel=4), ODD["flux"]),
        case("cfg2xring2-qwen_image-odd-compile", "qwen_image", dict(cfg_parallel=2, ring=2, compile=True),
             dict(ODD["qwen_image"], num_inference_steps=3)),
        case("cache-tea-sp2xcfg2-qwen_image-odd", "qwen_image", dict(sp=2, cfg_parallel=2, **TEA),
             dict(ODD["qwen_image"], **CACHE_STEPS), reference=TEA),
    ]


def suite_8():
    """cfg x ulysses x tp in one mesh (8 ranks): 4 heads, so tp=2 leaves 2 per rank for ulysses=2."""
    heads = dict(ODD["qwen_image"], num_attention_heads=4)
    knobs = dict(cfg_parallel=2, ulysses=2, tp=2)
    return [
        case("cfg2xulysses2xtp2-qwen_image-odd", "qwen_image", knobs, dict(heads, num_inference_steps=3)),
        case("cache-tea-cfg2xulysses2xtp2-qwen_image-odd", "qwen_image", dict(knobs, **TEA),
             dict(heads, **CACHE_STEPS), reference=TEA),
    ]


def errors_2():
    """Bad input: each must raise AccelError on this rank (every rank runs the same checks: no hang)."""
    out = []

    def expect(name, fn):
        try:
            fn()
        except AccelError as exc:
            out.append(dict(name=name, raised=True, message=str(exc)))
        except Exception as exc:  # the wrong error type
            out.append(dict(name=name, raised=False, message=f"{type(exc).__name__}: {exc}"))
        else:
            out.append(dict(name=name, raised=False, message="no error"))

    pipe, kw = tiny_pipeline("flux")
    expect("degrees-vs-world", lambda: omni_accel.accelerate(pipe, ring=4))
    expect("degrees-vs-world-product", lambda: omni_accel.accelerate(pipe, sp=2, tp=2))
    expect("cfg-without-true-cfg", lambda: omni_accel.accelerate(pipe, cfg_parallel=2))
    one_head, _ = tiny_pipeline("flux", num_attention_heads=1, attention_head_dim=16)
    expect("ulysses-vs-heads", lambda: omni_accel.accelerate(one_head, sp=2))
    expect("tp-vs-heads", lambda: omni_accel.accelerate(one_head, tp=2))
    expect("cache-dit-with-sp", lambda: omni_accel.accelerate(pipe, sp=2, cache="cache_dit"))
    assert "omni_accel" not in vars(pipe) and "omni_accel" not in vars(one_head)
    qpipe, qkw = tiny_pipeline("qwen_image")
    omni_accel.accelerate(qpipe, cfg_parallel=2)
    no_negative = {k: v for k, v in qkw.items() if k != "negative_prompt"}
    expect("cfg-call-without-negative", lambda: run(qpipe, no_negative))
    # the pipeline still works afterwards (the refused call left no state behind)
    ref_ok = run(qpipe, qkw).shape
    out.append(dict(name="cfg-after-refusal", raised=True, message=str(tuple(ref_ok))))
    omni_accel.restore(qpipe)
    # batched CFG runs one branch when the scale does not enable CFG (SD3: > 1, Z-Image: > 0): refused per call
    for fam, scale in (("sd3", 1.0), ("z_image", 0.0)):
        bpipe, bkw = tiny_pipeline(fam)
        omni_accel.accelerate(bpipe, cfg_parallel=2)
        expect(f"cfg-batched-call-without-cfg-{fam}", lambda: run(bpipe, dict(bkw, guidance_scale=scale)))
        omni_accel.restore(bpipe)
    for fam in ("wan", "qwen_image"):  # video VAEs (causal 3-D convolutions) cannot be split into bands
        vpipe, _ = tiny_pipeline(fam)
        expect(f"vae-parallel-{fam}", lambda: omni_accel.accelerate(vpipe, vae_parallel=2))
        assert "omni_accel" not in vars(vpipe)
    return out


def run_decode_case(c) -> dict:
    """vae_parallel on a latent whose row count does not divide the ranks: ``pipe.vae.decode`` of a seeded latent
    with ``decode_rows`` rows, accelerated vs plain. Records the rows each rank's decoder saw (its band)."""
    pipe, _ = tiny_pipeline(c["family"], **c["overrides"])
    latent = torch.randn(1, pipe.vae.config.latent_channels, c["decode_rows"], 7,
                         generator=torch.Generator().manual_seed(0))
    band_rows = []
    handle = pipe.vae.decoder.conv_in.register_forward_pre_hook(lambda m, a: band_rows.append(a[0].shape[2]))
    with torch.no_grad():
        ref = pipe.vae.decode(latent).sample
        band_rows.clear()
        omni_accel.accelerate(pipe, **c["knobs"])
        try:
            out = pipe.vae.decode(latent).sample
        finally:
            omni_accel.restore(pipe)
            handle.remove()
    return dict(name=c["name"], status="ran", knobs=c["knobs"], tol=c["tol"], shape=list(out.shape),
                max_abs_diff=float((out - ref).abs().max()), sp_attention_calls=0, counters={}, applied=[],
                checksum=float(out.double().sum()), transformer_max_abs_diff=0.0, transformer_scale=0.0,
                band_rows=band_rows)


def run_case(c) -> dict:
    if c["decode_rows"]:
        return run_decode_case(c)
    t0 = time.perf_counter()
    fam = c["family"]
    if not available(fam):
        return dict(name=c["name"], status="skipped", reason=f"no tiny builder for {fam} yet")
    pipe, kwargs = tiny_pipeline(fam, **c["overrides"])
    if c["vae_attention"]:
        from diffusers import AutoencoderKL

        torch.manual_seed(0)
        pipe.vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
            latent_channels=pipe.vae.config.latent_channels, norm_num_groups=4, sample_size=32,
            use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True,
            shift_factor=0.0609, scaling_factor=1.5035).eval()
    kwargs = dict(kwargs, **c["call"])
    captured = []  # every transformer output of a call: the end-to-end image of some tiny models barely moves

    def capture(module, args, output):
        t = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
        t = t[0] if isinstance(t, (tuple, list)) else t
        captured.append(t)

    lora = random_lora(pipe, seed=1) if c["lora"] else None
    if lora is not None:
        pipe.load_lora_weights(dict(lora), adapter_name="a")
    handles = [getattr(pipe, n).register_forward_hook(capture) for n in ("transformer", "transformer_2")
               if getattr(pipe, n, None) is not None]
    ref_cache = None
    if c["reference"]:
        omni_accel.accelerate(pipe, **c["reference"])
        ref = run(pipe, kwargs)
        ref_cache = pipe.omni_accel.report().get("cache")
        omni_accel.restore(pipe)
    else:
        ref = run(pipe, kwargs)
    ref_preds, captured[:] = [t.detach().clone() for t in captured], []
    if c["lora"] == "after":
        pipe.unload_lora_weights()
    try:
        omni_accel.accelerate(pipe, **c["knobs"])
        if c["lora"] == "after":
            pipe.load_lora_weights(dict(lora), adapter_name="a")
    except Exception as exc:
        exc.omni_stage = "accelerate"
        raise
    try:
        try:
            out = run(pipe, kwargs)
            preds = [t.detach().clone() for t in captured]
        except Exception as exc:
            exc.omni_stage = "accelerated"
            raise
        report = pipe.omni_accel.report()
        counters = pipe.omni_accel.last_call.counters
        from omni_accel.parallel import sequence

        sp_calls = sum(x.calls for x in sequence._CONTEXTS)
    finally:
        omni_accel.restore(pipe)
        for h in handles:
            h.remove()
    pred_diff = max((float((a.float() - b.float()).abs().max()) for a, b in zip(preds, ref_preds)), default=0.0)
    pred_scale = max((float(b.float().abs().max()) for b in ref_preds), default=0.0)
    res = dict(name=c["name"], status="ran", knobs=c["knobs"], tol=c["tol"], shape=list(out.shape),
               max_abs_diff=float((out - ref).abs().max()), sp_attention_calls=sp_calls,
               counters=dict(counters), applied=[a["pass"] for a in report["applied"]],
               checksum=float(out.double().sum()), transformer_max_abs_diff=pred_diff,
               transformer_scale=pred_scale, transformer_calls=[len(ref_preds), len(preds)],
               cache=report.get("cache"), reference_cache=ref_cache)
    if c["restore"] and c["reference"]:  # after restore(), the same cache alone gives the reference again
        omni_accel.accelerate(pipe, **c["reference"])
        res["restore_exact"] = bool(torch.equal(run(pipe, kwargs), ref))
        omni_accel.restore(pipe)
    elif c["restore"]:
        res["restore_exact"] = bool(torch.equal(run(pipe, kwargs), ref))
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def main():
    suite, out_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    only = os.environ.get("OMNI_ACCEL_PARALLEL_CASES")
    results = []
    cases = {"two": suite_2, "four": suite_4, "eight": suite_8}.get(suite, lambda: [])()
    if only:
        cases = [c for c in cases if c["name"] in only.split(",")]
    for c in cases:
        try:
            results.append(run_case(c))
        except Exception as exc:
            stage = getattr(exc, "omni_stage", "reference")
            results.append(dict(name=c["name"], status="error", stage=stage, error=f"{type(exc).__name__}: {exc}",
                                traceback=traceback.format_exc()[-3000:]))
            if not isinstance(exc, AccelError) and stage == "accelerated":
                break  # a collective may now be out of step: stop this launch
        print(f"rank {rank}: {results[-1]['name']} {results[-1]['status']} "
              f"{results[-1].get('max_abs_diff', results[-1].get('error', ''))}", flush=True)
    errors = errors_2() if suite == "two" and not only else []
    compare = compare_rows() if suite == "two" and not only else []
    with open(os.path.join(out_dir, f"{suite}.rank{rank}.json"), "w") as f:
        json.dump(dict(rank=rank, results=results, errors=errors, diffusers=compare), f, indent=1)
    omni_accel.distributed.shutdown()


if __name__ == "__main__":
    import omni_accel.distributed  # noqa: F401

    main()
