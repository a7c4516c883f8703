"""Transformer step-time benchmark: full-size random-weight bf16 DiTs, plain diffusers vs omni_accel configs.

    # on one H200 (no weights are downloaded: each model is built from its config dict on the GPU)
    python benchmarks/bench_transformer.py --out benchmarks/results/bench_transformer_h200.json
    # smoke test of the same code on tiny configs on the CPU (seconds)
    python benchmarks/bench_transformer.py --device cpu --tiny --out /tmp/bench_tiny.json

Models (batch 1): FLUX.1-dev-shaped at 1024² (4096 image + 512 text tokens), Qwen-Image-shaped at 1024²
(4096 image + 256 text tokens, true CFG: one forward per branch, two per step) and Wan-2.1-14B-shaped at
480x832 with 21 frames (6 latent frames, 9360 tokens; CFG: two forwards per step) and 512 text tokens.

Configs per model, most important first: plain diffusers eager (default SDPA, no omni_accel), then
``accelerate(attention="auto", compile=True)`` (the lossless stack), ``accelerate(attention="auto")``,
``accelerate(attention="sdpa", compile=True)`` (compile alone), and for FLUX ``accelerate(offload="block")``.
``accelerate()`` patches ``pipe.transformer`` in place, so the forwards are timed on the transformer directly
(inside a real diffusers pipeline object with no VAE / text encoders); ``omni_accel.restore(pipe)`` runs between
configs and every config's output is compared with plain eager's on the same inputs.

Timing: CUDA events around each forward, after warm-up (the first call, which includes compilation, is timed
on its own and reported as ``cold_start_s``), median of ``--iters`` forwards, under ``torch.no_grad``.
TFLOP/s = analytic FLOPs / time: linear 2 x tokens x params of the block linears (the per-sample modulation
linears see one token and are left out) + attention 4 x Nq x Nkv x (heads x head_dim) per attention layer.
MFU is against an 8192³ bf16 GEMM measured in the same run. The JSON is rewritten after every row, and the run
stops starting rows when ``--time-budget`` seconds are spent (skipped rows are listed in the JSON).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import GcPauses, sample_ms, write_result  # noqa: E402

T_START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------- model specs
def flux_spec(tiny: bool) -> dict:
    if tiny:
        cfg = dict(in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                   joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
        lat_h = lat_w = 8  # packed 2x2 latent grid -> 64 image tokens
        n_txt = 16
    else:
        cfg = dict(in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                   joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                   axes_dims_rope=(16, 56, 56))
        lat_h = lat_w = 64  # 1024 / 8 (VAE) / 2 (packing)
        n_txt = 512
    n_img = lat_h * lat_w
    return dict(model="flux", cls="FluxTransformer2DModel", pipe="FluxPipeline", cfg=cfg, lat=(lat_h, lat_w),
                n_img=n_img, n_txt=n_txt, forwards_per_step=1,
                shape=f"{'tiny' if tiny else '1024x1024'}: {n_img} img + {n_txt} txt tokens, batch 1")


def qwen_spec(tiny: bool) -> dict:
    if tiny:
        cfg = dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, in_channels=64,
                   out_channels=16, axes_dims_rope=(4, 6, 6))
        lat_h = lat_w = 8
        n_txt = 16
    else:
        cfg = dict(num_layers=60, attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                   in_channels=64, out_channels=16, axes_dims_rope=(16, 56, 56))
        lat_h = lat_w = 64
        n_txt = 256
    n_img = lat_h * lat_w
    return dict(model="qwen_image", cls="QwenImageTransformer2DModel", pipe="QwenImagePipeline", cfg=cfg,
                lat=(lat_h, lat_w), n_img=n_img, n_txt=n_txt, forwards_per_step=2,
                shape=f"{'tiny' if tiny else '1024x1024'}: {n_img} img + {n_txt} txt tokens, batch 1, "
                      "true CFG (2 forwards/step)")


def wan_spec(tiny: bool) -> dict:
    if tiny:
        cfg = dict(num_layers=2, num_attention_heads=2, attention_head_dim=16, ffn_dim=64, in_channels=16,
                   out_channels=16, text_dim=32, freq_dim=16, patch_size=(1, 2, 2), cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
        frames, lat_f, lat_h, lat_w, n_txt = 5, 2, 8, 8, 16
        size = "tiny"
    else:
        cfg = dict(num_layers=40, num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, in_channels=16,
                   out_channels=16, text_dim=4096, freq_dim=256, patch_size=(1, 2, 2), cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
        frames, lat_f, lat_h, lat_w, n_txt = 21, 6, 60, 104, 512  # 480x832 / 8; (21 - 1) / 4 + 1 = 6
        size = "480x832x21f"
    n_img = lat_f * (lat_h // 2) * (lat_w // 2)
    return dict(model="wan", cls="WanTransformer3DModel", pipe="WanPipeline", cfg=cfg, lat=(lat_f, lat_h, lat_w),
                n_img=n_img, n_txt=n_txt, forwards_per_step=2,
                shape=f"{size}: {frames} frames -> {lat_f} latent frames, {n_img} video + {n_txt} txt tokens, "
                      "batch 1, CFG (2 forwards/step)")


SPECS = {"flux": flux_spec, "qwen_image": qwen_spec, "wan": wan_spec}


def analytic_flops(spec: dict) -> dict:
    """FLOPs of one transformer forward: block linears (2 x tokens x params) + attention (4 x Nq x Nkv x D)."""
    cfg, n_img, n_txt = spec["cfg"], spec["n_img"], spec["n_txt"]
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    n = n_img + n_txt
    if spec["model"] in ("flux", "qwen_image"):
        # dual-stream block, per stream: qkv 3D² + out D² + MLP 2 x 4D² = 12D²; each token passes its own stream.
        # FLUX single block: qkv 3D² + proj_mlp 4D² + proj_out 5D² = 12D² over all tokens. Same count.
        blocks = cfg["num_layers"] + cfg.get("num_single_layers", 0)
        linear = blocks * 2 * n * 12 * d * d
        attention = blocks * 4 * n * n * d
    else:  # wan: self-attn 4D², cross-attn q/o 2D² over video tokens and k/v 2D² over text tokens, FFN 2DF
        f = cfg["ffn_dim"]
        blocks = cfg["num_layers"]
        linear = blocks * 2 * (n_img * (4 * d * d + 2 * d * d + 2 * d * f) + n_txt * 2 * d * d)
        attention = blocks * (4 * n_img * n_img * d + 4 * n_img * n_txt * d)
    return {"linear": float(linear), "attention": float(attention), "total": float(linear + attention)}


def build_transformer(spec: dict, device: torch.device, dtype: torch.dtype):
    import diffusers

    cls = getattr(diffusers, spec["cls"])
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(**spec["cfg"])
    model = model.to(dtype).eval().requires_grad_(False)
    # what from_pretrained(torch_dtype=bf16) does: keep the class's _keep_in_fp32_modules in float32 (Wan: rope,
    # time embedder, modulation tables, norms)
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if keep and any(k in name.split(".") for k in keep) and tensor.is_floating_point():
            tensor.data = tensor.data.float()
    return model


def build_pipeline(spec: dict, transformer):
    import diffusers

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler()
    cls = getattr(diffusers, spec["pipe"])
    if spec["model"] == "flux":
        return cls(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                   tokenizer_2=None, transformer=transformer)
    if spec["model"] == "qwen_image":
        return cls(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None, transformer=transformer)
    return cls(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None, transformer=transformer)


def make_inputs(spec: dict, device: torch.device, dtype: torch.dtype) -> dict:
    g = torch.Generator(device="cpu").manual_seed(1234)
    cfg = spec["cfg"]

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    t = torch.tensor([0.7], device=device, dtype=dtype)  # sigma in (0, 1]: what the pipelines pass (t / 1000)
    if spec["model"] == "flux":
        h, w = spec["lat"]
        img_ids = torch.zeros(h, w, 3)
        img_ids[..., 1] = torch.arange(h)[:, None]
        img_ids[..., 2] = torch.arange(w)[None, :]
        return dict(hidden_states=randn(1, h * w, cfg["in_channels"]),
                    encoder_hidden_states=randn(1, spec["n_txt"], cfg["joint_attention_dim"]),
                    pooled_projections=randn(1, cfg["pooled_projection_dim"]), timestep=t,
                    img_ids=img_ids.reshape(-1, 3).to(device=device, dtype=dtype),
                    txt_ids=torch.zeros(spec["n_txt"], 3, device=device, dtype=dtype),
                    guidance=torch.tensor([3.5], device=device, dtype=torch.float32), return_dict=False)
    if spec["model"] == "qwen_image":
        h, w = spec["lat"]
        # encoder_hidden_states_mask=None: QwenImagePipeline drops an all-ones mask for batch 1 too
        return dict(hidden_states=randn(1, h * w, cfg["in_channels"]),
                    encoder_hidden_states=randn(1, spec["n_txt"], cfg["joint_attention_dim"]),
                    encoder_hidden_states_mask=None, timestep=t, img_shapes=[[(1, h, w)]], return_dict=False)
    f, h, w = spec["lat"]
    return dict(hidden_states=randn(1, cfg["in_channels"], f, h, w), timestep=t * 1000,
                encoder_hidden_states=randn(1, spec["n_txt"], cfg["text_dim"]), return_dict=False)


def count_linear_flops(transformer, blocks, inputs) -> float:
    """One eager forward with hooks on every nn.Linear inside the blocks: sum of 2 x tokens x in x out."""
    total = [0.0]

    def hook(mod, args, out):
        x = args[0]
        total[0] += 2.0 * (x.numel() // x.shape[-1]) * mod.in_features * mod.out_features

    forward_with_hooks(transformer, inputs, [m.register_forward_hook(hook) for b in blocks for m in b.modules()
                                             if isinstance(m, torch.nn.Linear)])
    return total[0]


def forward_with_hooks(transformer, inputs: dict, handles: list) -> None:
    """One no-grad forward with hooks that are removed afterwards, whatever happens."""
    try:
        with torch.no_grad():
            transformer(**inputs)
    finally:
        for h in handles:
            h.remove()


# ------------------------------------------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_tensor(out):
    while isinstance(out, (tuple, list)):
        out = out[0]
    if hasattr(out, "sample"):
        out = out.sample
    return out


def time_forwards(fn, device: torch.device, iters: int, warmup: int, on_warm=None) -> dict:
    sync(device)
    t0 = time.perf_counter()
    out = first_tensor(fn())
    sync(device)
    cold = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        fn()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if on_warm is not None:
        on_warm()  # the clock log's window: timed forwards only, not compilation
    with GcPauses() as pauses:
        times = sample_ms(fn, device, iters)
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times), "cold_start_s": cold,
            "peak_mem_gib": peak, "out": out, "ms_each": [round(t, 3) for t in times],
            "gc_while_timed": pauses.summary()}


def measure_gemm_tflops(device: torch.device, tiny: bool) -> float | None:
    n = 512 if tiny else 8192
    dtype = torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    reps = 3 if tiny else 20
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            a @ b
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        else:
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e12


def measure_sustained_gemm(device: torch.device, clocks: "ClockLog", seconds: float) -> dict | None:
    """bf16 8192^3 GEMMs back to back for ``seconds``: TFLOP/s over the first and the last second, with the clocks
    of the whole window -- the matrix rate a step-long dense load can expect, not a 20-product burst's."""
    if device.type != "cuda":
        return None
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    per_s = []
    clocks.mark()
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(50):
            a @ b
        e.record()
        e.synchronize()
        per_s.append(50 * 2 * n**3 / (s.elapsed_time(e) / 1e3) / 1e12)
    return {"seconds": seconds, "first_tflops": round(per_s[0], 1), "last_tflops": round(per_s[-1], 1),
            "median_tflops": round(statistics.median(per_s), 1), **clocks.since_mark()}


def measure_h2d_gbps(device: torch.device, tiny: bool) -> float | None:
    if device.type != "cuda":
        return None
    nbytes = (64 if tiny else 1024) * 2**20
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(2):
        dev.copy_(host, non_blocking=True)
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dev.copy_(host, non_blocking=True)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del host, dev
    return nbytes / statistics.median(times) / 1e9


# ------------------------------------------------------------------------------------------- GPU clocks
# quantity -> nvidia-smi query fields that report it, preferred first. Drivers differ: power.draw.instant is newer than
# power.draw (which recent drivers average over 1 s, too slow for 100 ms samples), and clocks_event_reasons.* was
# called clocks_throttle_reasons.* before.
CLOCK_QUERIES: dict[str, tuple[str, ...]] = {
    "sm_mhz": ("clocks.sm",),
    "power_w": ("power.draw.instant", "power.draw"),
    "sw_power_cap": ("clocks_event_reasons.sw_power_cap", "clocks_throttle_reasons.sw_power_cap"),
    "hw_slowdown": ("clocks_event_reasons.hw_slowdown", "clocks_throttle_reasons.hw_slowdown"),
    "sw_thermal": ("clocks_event_reasons.sw_thermal_slowdown", "clocks_throttle_reasons.sw_thermal_slowdown"),
    "temp_c": ("temperature.gpu",),
}


def parse_smi_value(text: str) -> float | None:
    """One csv,nounits cell: a number, "Active" (1.0) / "Not Active" (0.0), or None ("[N/A]", "[Not Supported]")."""
    text = text.strip()
    if text == "Active":
        return 1.0
    if text == "Not Active":
        return 0.0
    try:
        return float(text)
    except ValueError:
        return None


def query_smi_once(fields: list[str]) -> list[float | None] | None:
    """The first GPU's values of ``fields`` from one nvidia-smi call; None when the call fails (an unknown field
    makes nvidia-smi reject the whole query, so the caller can fall back field by field)."""
    import subprocess

    try:
        res = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    if res.returncode != 0 or not lines:
        return None
    values = [parse_smi_value(v) for v in lines[0].split(",")]
    return values if len(values) == len(fields) else None


def choose_smi_fields(query=query_smi_once) -> dict[str, str]:
    """quantity -> the query field this driver answers for it. One call with every first choice; only when it fails
    or leaves a quantity without a value are the candidates of the missing quantities tried alone. A quantity no
    candidate answers is dropped (the others are still logged)."""
    first = {qty: fields[0] for qty, fields in CLOCK_QUERIES.items()}
    values = query(list(first.values()))
    chosen = {}
    if values is not None:
        chosen = {qty: field for (qty, field), v in zip(first.items(), values) if v is not None}
    for qty, candidates in CLOCK_QUERIES.items():
        if qty in chosen:
            continue
        for field in candidates:
            got = query([field])
            if got is not None and got[0] is not None:
                chosen[qty] = field
                break
    return chosen


def summarize_clock_samples(samples: list[dict[str, float | None]]) -> dict:
    """A row's clock fields from the samples of its window; a quantity with no value in any sample is left out."""

    def known(qty: str) -> list[float]:
        return [s[qty] for s in samples if s.get(qty) is not None]

    out: dict = {}
    if mhz := known("sm_mhz"):
        out.update(sm_clock_mhz=round(statistics.mean(mhz)), sm_clock_min_mhz=round(min(mhz)))
    if watts := known("power_w"):
        out.update(power_w=round(statistics.mean(watts)), power_max_w=round(max(watts)))
    if cap := known("sw_power_cap"):
        out["sw_power_cap_frac"] = round(statistics.mean(cap), 3)
    # thermal: the SW thermal slowdown or HW slowdown (which the board raises when hot, or on a power-brake signal)
    thermal = [max(v for v in (s.get("sw_thermal"), s.get("hw_slowdown")) if v is not None) for s in samples
               if s.get("sw_thermal") is not None or s.get("hw_slowdown") is not None]
    if thermal:
        out["thermal_slowdown_frac"] = round(statistics.mean(thermal), 3)
    if hw := known("hw_slowdown"):
        out["hw_slowdown_frac"] = round(statistics.mean(hw), 3)
    if temp := known("temp_c"):
        out["temp_c"] = round(statistics.mean(temp), 1)
    out["clock_samples"] = len(samples)
    return out


class ClockLog:
    """SM clock, board power, throttle reasons and temperature sampled by ``nvidia-smi`` every 100 ms in a
    background process.

    Why: the same cuBLAS kernels ran 12 % slower inside compiled steps than in eager ones (2026-12-02 profile);
    a denser load can lower the clocks under the power limit, and this records whether it did -- the SW power cap
    reason says whether the power limit was what held the clock down, the thermal reasons rule heat in or out.
    Every visible GPU's lines are pooled: the benchmark is meant for a machine with one GPU."""

    def __init__(self, enabled: bool):
        import shutil
        import subprocess
        import threading

        self.samples: list[tuple[float, dict[str, float | None]]] = []  # (perf_counter, quantity -> value)
        self.fields: dict[str, str] = {}  # quantity -> nvidia-smi query field in use
        self._mark = time.perf_counter()
        self._proc = None
        if not enabled:
            return
        if shutil.which("nvidia-smi") is None:
            log("clock log off: nvidia-smi not found")
            return
        self.fields = choose_smi_fields()
        if not self.fields:
            log("clock log off: nvidia-smi answered none of the clock/power fields")
            return
        dropped = [q for q in CLOCK_QUERIES if q not in self.fields]
        log(f"clock log fields: {self.fields}" + (f"; not available: {dropped}" if dropped else ""))
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={','.join(self.fields.values())}", "--format=csv,noheader,nounits",
                 "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError as exc:
            log(f"clock log off: {exc!r}")
            self.fields = {}
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        names = list(self.fields)
        for line in self._proc.stdout:
            values = [parse_smi_value(v) for v in line.split(",")]
            if len(values) != len(names):  # a warning or error line, not a sample
                continue
            self.samples.append((time.perf_counter(), dict(zip(names, values))))

    def mark(self) -> None:
        self._mark = time.perf_counter()

    def since_mark(self) -> dict:
        window = [s for t, s in list(self.samples) if t >= self._mark]
        self.mark()
        return summarize_clock_samples(window) if window else {}

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()


# ------------------------------------------------------------------------------------- kernel attribution
def kernel_kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "sdpa", "attention", "attn")):
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "xmma", "cutlass", "matmul", "gemv", "scaled_mm")):
        return "gemm"
    if n.startswith("triton"):
        return "triton (fused)"
    return "other (elementwise, copies)"


def profile_kernels(fn, top: int = 12) -> dict:
    """GPU time of one forward by kernel (torch.profiler, CUDA activity only): where the milliseconds go."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    kernels = []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0)
        if us > 0:
            kernels.append((evt.key, us / 1e3, evt.count))
    kernels.sort(key=lambda k: -k[1])
    by_kind: dict[str, float] = {}
    for name, ms, _ in kernels:
        by_kind[kernel_kind(name)] = round(by_kind.get(kernel_kind(name), 0.0) + ms, 3)
    return {"by_kind_ms": by_kind, "total_ms": round(sum(k[1] for k in kernels), 3),
            "top": [{"kernel": n[:120], "ms": round(ms, 3), "calls": c, "kind": kernel_kind(n)}
                    for n, ms, c in kernels[:top]]}


# ------------------------------------------------------------------------------------------ FP8 block error
def fp8_block_errors(omni_accel, pipe, transformer, blocks_named, inputs) -> dict:
    """Relative error of every block's outputs under quant="fp8", each block fed the *same* bf16 inputs (captured
    from a bf16 forward), so errors do not compound along the depth."""
    captured = {}

    def grab(name):
        def hook(_mod, args, kwargs):
            clone = lambda v: v.clone() if torch.is_tensor(v) else v  # noqa: E731
            captured[name] = (tuple(clone(a) for a in args), {k: clone(v) for k, v in kwargs.items()})
        return hook

    forward_with_hooks(transformer, inputs,
                       [b.register_forward_pre_hook(grab(n), with_kwargs=True) for n, b in blocks_named])

    def outputs(block, name):
        args, kwargs = captured[name]
        out = block(*args, **kwargs)
        return [o.float() for o in (out if isinstance(out, (tuple, list)) else (out,)) if torch.is_tensor(o)]

    rows = []
    with torch.no_grad():
        reference = {n: outputs(b, n) for n, b in blocks_named}
        omni_accel.accelerate(pipe, quant="fp8")
        try:
            for n, b in blocks_named:
                got = outputs(b, n)
                errs = [((g - r).norm() / r.norm().clamp_min(1e-12)).item() for g, r in zip(got, reference[n])]
                rows.append({"block": n, "rel_err": [round(e, 5) for e in errs]})
        finally:
            omni_accel.restore(pipe)
    flat = [e for r in rows for e in r["rel_err"]]
    return {"blocks": rows, "max": max(flat), "mean": sum(flat) / len(flat),
            "note": "each block's outputs (all returned tensors) under quant='fp8' vs bf16, same bf16 inputs"}


# --------------------------------------------------------------------------------- whole denoising loops
STEP_CONFIGS = {
    # name: accelerate kwargs (None = plain diffusers)
    "plain": None,
    "auto+compile": dict(attention="auto", compile=True),
    "tea_cache": dict(attention="auto", cache="tea_cache"),
    "cache_dit": dict(attention="auto", cache="cache_dit"),
    "fb_cache": dict(attention="auto", cache="fb_cache"),
    "cache_dit+compile": dict(attention="auto", cache="cache_dit", compile=True),
    "tea_cache+compile": dict(attention="auto", cache="tea_cache", compile=True),
    "fp8+auto+compile": dict(attention="auto", quant="fp8", compile=True),
    "fp8+tea_cache+compile": dict(attention="auto", quant="fp8", cache="tea_cache", compile=True),
    "fuse+auto+compile": dict(attention="auto", fuse_qkv=True, compile=True),
    "fp8+fuse+auto+compile": dict(attention="auto", quant="fp8", fuse_qkv=True, compile=True),
    # threshold 0 never reuses: its wall time over plain's is what the TeaCache decisions cost per step
    "tea_cache_never_reuse": dict(attention="auto", cache="tea_cache", cache_config={"threshold": 0.0}),
    # random weights: looser residual thresholds than the defaults, to see the cache-dit paths reuse and what it saves
    "cache_dit_0.6": dict(attention="auto", cache="cache_dit", cache_config={"residual_diff_threshold": 0.6}),
    "fb_cache_0.6": dict(attention="auto", cache="fb_cache", cache_config={"residual_diff_threshold": 0.6}),
    "fuse+tea_cache+compile": dict(attention="auto", fuse_qkv=True, cache="tea_cache", compile=True),
    "fp8+fuse+tea_cache+compile": dict(attention="auto", quant="fp8", fuse_qkv=True, cache="tea_cache", compile=True),
    "max": dict(attention="auto", compile="max"),
    "fp8+max": dict(attention="auto", quant="fp8", compile="max"),
    "fp8+fp8attn+compile": dict(attention="fp8", quant="fp8", compile=True),
    "fp8+fp8attn+tea_cache+compile": dict(attention="fp8", quant="fp8", cache="tea_cache", compile=True),
}


def loop_rows(omni_accel, spec: dict, pipe, device, dtype, steps: int, names: list[str], budget_left) -> list[dict]:
    """Wall time of whole FLUX denoising loops (``steps`` steps, 1024², latents out) per config, one process.
    Random weights: the cache rows measure time and skipped forwards, not quality (that is bench_cache.py's job,
    on the trained built-in model)."""
    g = torch.Generator("cpu").manual_seed(7)
    cfg = spec["cfg"]
    h, w = spec["lat"]
    call = dict(prompt_embeds=torch.randn(1, spec["n_txt"], cfg["joint_attention_dim"], generator=g).to(device, dtype),
                pooled_prompt_embeds=torch.randn(1, cfg["pooled_projection_dim"], generator=g).to(device, dtype),
                height=h * 16, width=w * 16, num_inference_steps=steps, guidance_scale=3.5, output_type="latent",
                max_sequence_length=spec["n_txt"])
    rows, ref = [], None
    for name in names:
        if budget_left() < 60:
            rows.append({"config": name, "skipped": "time budget"})
            continue
        kwargs = STEP_CONFIGS[name]
        try:
            if kwargs:
                omni_accel.accelerate(pipe, **kwargs)
            run = lambda: pipe(**call, generator=torch.Generator("cpu").manual_seed(0)).images  # noqa: E731
            sync(device)
            t0 = time.perf_counter()
            run()  # warm-up: compilation, cache-dit's first-call setup
            sync(device)
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = run().float()
            sync(device)
            wall = time.perf_counter() - t0
            report = pipe.omni_accel.report()["last_call"] if kwargs else None
            ref = out if ref is None else ref
            rel = ((out - ref).norm() / ref.norm()).item()
            row = {"config": name, "steps": steps, "wall_s": round(wall, 3), "ms_per_step": round(wall / steps * 1e3, 2),
                   "cold_s": round(cold, 2), "accelerate_kwargs": kwargs, "rel_err_vs_plain": round(rel, 5),
                   "transformer_forwards": report and report.get("transformer_forwards"),
                   "cache": report and {k: v for k, v in report.items() if k.startswith("cache")}}
            rows.append(row)
            log(f"loop {name:24s} {steps} steps {wall:7.3f} s ({row['ms_per_step']} ms/step) cold {cold:.1f}s "
                f"rel {rel:.3g} forwards {row['transformer_forwards']} cache {row['cache']}")
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"config": name, "error": repr(exc)})
        finally:
            if kwargs and "omni_accel" in vars(pipe):
                omni_accel.restore(pipe)
            torch._dynamo.reset()
    plain = next((r for r in rows if r.get("config") == "plain" and "wall_s" in r), None)
    for r in rows:
        if plain and "wall_s" in r:
            r["speedup_vs_plain"] = round(plain["wall_s"] / r["wall_s"], 3)
    return rows


# --------------------------------------------------------------------------------------- adapters stand-in
def ensure_adapters() -> str:
    """Use the real adapters; if some family module cannot be imported yet, stand in for the three we need."""
    from omni_accel import pipelines as P

    try:
        P.supported_families()
        return "real"
    except Exception as exc:  # noqa: BLE001 -- a missing/broken adapter module of another family
        log(f"adapters: supported_families() failed ({exc!r}); using stand-in adapters where needed")
    import importlib

    from omni_accel.pipelines.base import ModelAdapter, SequenceInput

    P._ADAPTERS.clear()
    for family, module_name in P.FAMILY_MODULES.items():
        try:
            P._ADAPTERS[family] = importlib.import_module(f"omni_accel.pipelines.{module_name}").ADAPTER
        except Exception:  # noqa: BLE001
            pass
    stand_ins = {
        "flux": ModelAdapter("flux", "stand-in", ("FluxTransformer2DModel",), ("FluxPipeline",),
                             ("transformer_blocks", "single_transformer_blocks"),
                             (SequenceInput("hidden_states", 1, "image"),), "distilled"),
        "qwen_image": ModelAdapter("qwen_image", "stand-in", ("QwenImageTransformer2DModel",),
                                   ("QwenImagePipeline",), ("transformer_blocks",),
                                   (SequenceInput("hidden_states", 1, "image"),), "true_cfg"),
        "wan": ModelAdapter("wan", "stand-in", ("WanTransformer3DModel",), ("WanPipeline",), ("blocks",),
                            (SequenceInput("hidden_states", 1, "image"),), "batched_cfg"),
    }
    used = []
    for family, adapter in stand_ins.items():
        if family not in P._ADAPTERS:
            P._ADAPTERS[family] = adapter
            used.append(family)
    return "stand-in for " + ",".join(used) if used else "real (loaded one by one)"


# --------------------------------------------------------------------------------------------------- main
PLAIN_COMPILE = "torch.compile(transformer)"
CONFIGS = {
    # name: (accelerate kwargs or None for plain diffusers, lossless?, rough cost in seconds on the H200)
    "eager": (None, True, 10),
    "auto+compile": (dict(attention="auto", compile=True), True, 90),
    "auto": (dict(attention="auto"), True, 10),
    "compile": (dict(attention="sdpa", compile=True), True, 90),
    "offload_block": (dict(attention="auto", offload="block"), True, 60),
    "auto+compile_max": (dict(attention="auto", compile="max"), True, 300),
    "sdpa_flash": (dict(attention="sdpa_flash"), True, 10),
    "kernels+auto": (dict(attention="auto", kernels=True), True, 15),
    "kernels+auto+compile": (dict(attention="auto", kernels=True, compile=True), True, 90),
    "fp8+auto": (dict(attention="auto", quant="fp8"), False, 20),
    "fp8+auto+compile": (dict(attention="auto", quant="fp8", compile=True), False, 90),
    "fp8+kernels+auto+compile": (dict(attention="auto", quant="fp8", kernels=True, compile=True), False, 90),
    "fp8_weight_only+auto+compile": (dict(attention="auto", quant="fp8_weight_only", compile=True), False, 90),
    "fuse+auto+compile": (dict(attention="auto", fuse_qkv=True, compile=True), True, 90),
    "fp8+fuse+auto+compile": (dict(attention="auto", quant="fp8", fuse_qkv=True, compile=True), False, 90),
    # the peer baseline: plain torch.compile of the whole transformer, no omni_accel (default SDPA)
    "plain_compile": (PLAIN_COMPILE, True, 120),
    # SageAttention (INT8 Q/K, lossy) through diffusers' dispatcher; needs the sageattention package
    "sage+auto+compile": (dict(attention="sage", compile=True), False, 90),
    "fp8+sage+compile": (dict(attention="sage", quant="fp8", compile=True), False, 90),
    # compile="max": max-autotune GEMMs plus CUDA graphs of the whole transformer forward (long cold start)
    "max": (dict(attention="auto", compile="max"), True, 240),
    "fp8+max": (dict(attention="auto", quant="fp8", compile="max"), False, 300),
    # the same two with OMNI_ACCEL_CUDA_GRAPHS=0 (set around accelerate()): what the graphs themselves add; inductor's
    # caches make their autotuning cheap after the rows above
    "max_no_graphs": (dict(attention="auto", compile="max"), True, 60),
    "fp8+max_no_graphs": (dict(attention="auto", quant="fp8", compile="max"), False, 60),
    # omni_accel's FP8 attention (Triton: int8 Q K^T per token, e4m3 P V), lossy
    "fp8attn+compile": (dict(attention="fp8", compile=True), False, 60),
    "fp8+fp8attn+compile": (dict(attention="fp8", quant="fp8", compile=True), False, 60),
    "fp8+fp8attn+max": (dict(attention="fp8", quant="fp8", compile="max"), False, 200),
}
MODEL_CONFIGS = {
    "flux": ["eager", "auto+compile", "fuse+auto+compile", "plain_compile", "fp8+auto+compile",
             "fp8+fuse+auto+compile", "auto", "sdpa_flash", "compile", "kernels+auto", "kernels+auto+compile",
             "fp8+auto", "fp8+kernels+auto+compile", "fp8_weight_only+auto+compile", "offload_block",
             "sage+auto+compile", "fp8+sage+compile", "max", "fp8+max", "max_no_graphs", "fp8+max_no_graphs",
             "fp8attn+compile", "fp8+fp8attn+compile", "fp8+fp8attn+max"],
    "qwen_image": ["eager", "auto+compile", "fp8+auto+compile", "plain_compile", "auto", "compile",
                   "kernels+auto+compile", "fp8+kernels+auto+compile"],
    "wan": ["eager", "auto+compile", "fuse+auto+compile", "fp8+fuse+auto+compile", "fp8+auto+compile",
            "plain_compile", "auto", "compile", "kernels+auto+compile", "fp8+kernels+auto+compile"],
}
# FP8 rows are lossy: their output error against bf16 eager is reported, with this bound for "ok"
LOSSY_REL_ERR_OK = 0.1
MODEL_BUILD_COST = {"flux": 15, "qwen_image": 25, "wan": 20}


def compiles(name: str) -> bool:
    """Whether a config compiles: by its kwargs, not its name ("max" and "fp8+max" do not say "compile")."""
    kwargs = CONFIGS[name][0]
    return kwargs == PLAIN_COMPILE or (isinstance(kwargs, dict) and bool(kwargs.get("compile")))


def needs_skip(name: str, device: torch.device) -> str | None:
    """Why a config cannot run here (None: it can): CUDA-only attention kernels, SageAttention not installed."""
    import importlib.util

    kwargs = CONFIGS[name][0]
    attention = kwargs.get("attention") if isinstance(kwargs, dict) else None
    if device.type == "cpu" and attention in ("sdpa_flash", "cudnn", "sage", "fp8"):
        return "needs CUDA"
    if attention == "sage" and importlib.util.find_spec("sageattention") is None:
        return "needs sageattention"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny configs (CPU smoke test)")
    ap.add_argument("--models", default="flux,qwen_image,wan")
    ap.add_argument("--configs", default=None, help="comma list to keep (default: all per model)")
    ap.add_argument("--no-compile", action="store_true", help="skip the compile configs (fast CPU smoke test)")
    ap.add_argument("--with-max", action="store_true", help="add compile='max' for FLUX (long cold start)")
    ap.add_argument("--iters", type=int, default=None, help="timed forwards per config (default 10; tiny 2)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up forwards incl. the cold one (default 3)")
    ap.add_argument("--time-budget", type=float, default=480.0, help="seconds; rows that would start later skip")
    ap.add_argument("--profile", action="store_true", help="per-row GPU kernel time by kind (torch.profiler)")
    ap.add_argument("--fp8-block-errors", action="store_true", help="per-block FP8 relative error (FLUX)")
    ap.add_argument("--loop-steps", type=int, default=0, help="also time whole FLUX loops of N steps (e.g. 28)")
    ap.add_argument("--loop-configs", default="plain,auto+compile,tea_cache,cache_dit,fb_cache,cache_dit+compile,"
                    "tea_cache+compile,fp8+auto+compile,fp8+tea_cache+compile")
    ap.add_argument("--log-clocks", action="store_true",
                    help="sample SM clock, board power, throttle reasons and temperature with nvidia-smi; each row "
                         "gets their summary over its timed forwards (and energy_j_per_step)")
    ap.add_argument("--sustain-gemm-s", type=float, default=0.0,
                    help="also run 8192^3 bf16 GEMMs back to back for S seconds: the rate under sustained load")
    ap.add_argument("--out", default="bench_transformer.json")
    ap.add_argument("--plot", default=None, help="PNG bar chart path (default: next to --out)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no GPU; use --device cpu --tiny", file=sys.stderr)
        return 2
    iters = args.iters or (2 if args.tiny else 10)
    warmup = args.warmup or (1 if args.tiny else 3)
    dtype = torch.bfloat16

    import diffusers

    import omni_accel

    adapters = ensure_adapters()
    log(f"adapters: {adapters}")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    env = {"gpu": gpu, "torch": torch.__version__, "diffusers": diffusers.__version__,
           "omni_accel": omni_accel.__version__, "python": platform.python_version(), "adapters": adapters}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    clocks = ClockLog(enabled=args.log_clocks and device.type == "cuda")
    gemm = measure_gemm_tflops(device, args.tiny)
    gemm_clocks = clocks.since_mark()
    h2d = measure_h2d_gbps(device, args.tiny)
    log(f"env {env}; bf16 GEMM {gemm:.1f} TFLOP/s; pinned H2D {h2d and round(h2d, 2)} GB/s")
    sustained = measure_sustained_gemm(device, clocks, seconds=args.sustain_gemm_s) if args.sustain_gemm_s else None
    if sustained:
        log(f"sustained bf16 GEMM: {sustained}")
    result = {"env": env, "gemm_bf16_tflops": gemm, "gemm_clocks": gemm_clocks, "gemm_sustained": sustained,
              "h2d_pinned_gbps": h2d, "iters": iters, "warmup": warmup, "clock_fields": clocks.fields,
              "rows": [], "skipped": [], "errors": [], "flops": {}}

    def write() -> None:
        write_result(args.out, result)

    write()
    budget = args.time_budget
    elapsed = lambda: time.perf_counter() - T_START  # noqa: E731

    for model_name in [m for m in args.models.split(",") if m]:
        spec = SPECS[model_name](args.tiny)
        names = list(MODEL_CONFIGS[model_name])
        if args.with_max and model_name == "flux":
            names.append("auto+compile_max")
        if args.configs:
            # in the order given (eager first): under a time budget the rows that matter most go first
            keep = [n for n in args.configs.split(",") if n in names and n != "eager"]
            names = ["eager"] + keep
        if args.no_compile:
            names = [n for n in names if not compiles(n)]
        scale = 0.05 if args.tiny else 1.0
        if elapsed() + scale * (MODEL_BUILD_COST[model_name] + CONFIGS["eager"][2]) > budget:
            result["skipped"] += [f"{model_name}/{n}" for n in names]
            log(f"time budget: skipping {model_name}")
            write()
            continue
        flops = analytic_flops(spec)
        transformer = pipe = ref = forward = None
        mem_before = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
        if mem_before:
            log(f"{model_name}: {mem_before:.2f} GiB still allocated before building it")
        try:
            t0 = time.perf_counter()
            transformer = build_transformer(spec, device, dtype)
            sync(device)
            build_s = time.perf_counter() - t0
            n_params = sum(p.numel() for p in transformer.parameters())
            t_bytes = sum(p.numel() * p.element_size() for p in transformer.parameters())
            pipe = build_pipeline(spec, transformer)
            inputs = make_inputs(spec, device, dtype)
            adapter = omni_accel.pipelines.adapter_for(pipe)
            blocks = [b for _, b in adapter.blocks_of(transformer)]
            hooked = count_linear_flops(transformer, blocks, inputs)
            flops["linear_hooked"] = hooked
            result["flops"][model_name] = flops
            log(f"{model_name}: {n_params / 1e9:.2f} B params ({t_bytes / 2**30:.1f} GiB) built in {build_s:.1f}s; "
                f"analytic {flops['total'] / 1e12:.2f} TFLOP/forward (linear {flops['linear'] / 1e12:.2f}, hooked "
                f"linear {hooked / 1e12:.2f}, attention {flops['attention'] / 1e12:.2f})")
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            result["errors"].append(f"{model_name}: build failed: {exc!r}")
            result["skipped"] += [f"{model_name}/{n}" for n in names]
            write()
            transformer = pipe = None
            names = []
        unoffloaded_peak = None
        if transformer is not None and args.fp8_block_errors and model_name == "flux":
            try:
                result["fp8_block_errors"] = fp8_block_errors(omni_accel, pipe, transformer,
                                                              adapter.blocks_of(transformer), inputs)
                log(f"fp8 per-block rel err: max {result['fp8_block_errors']['max']:.4f} "
                    f"mean {result['fp8_block_errors']['mean']:.4f}")
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                result["errors"].append(f"fp8_block_errors: {exc!r}")
            write()
        if transformer is not None and args.loop_steps and model_name == "flux":
            result["loops"] = loop_rows(omni_accel, spec, pipe, device, dtype, args.loop_steps,
                                        [n for n in args.loop_configs.split(",") if n],
                                        lambda: budget - elapsed())
            write()
        for name in names:
            kwargs, lossless, cost = CONFIGS[name]
            if elapsed() + scale * cost > budget:
                result["skipped"].append(f"{model_name}/{name}")
                log(f"time budget: skipping {model_name}/{name} (elapsed {elapsed():.0f}s)")
                write()
                continue
            why_not = needs_skip(name, device)
            if why_not:
                result["skipped"].append(f"{model_name}/{name} ({why_not})")
                log(f"skipping {model_name}/{name}: {why_not}")
                continue
            accelerated = False
            forward = pipe.transformer
            try:
                if kwargs == PLAIN_COMPILE:
                    forward = torch.compile(pipe.transformer, dynamic=False)
                    applied, backend = ["torch.compile (whole model)"], "diffusers default (SDPA)"
                elif kwargs is not None:
                    if name.endswith("_no_graphs"):
                        os.environ["OMNI_ACCEL_CUDA_GRAPHS"] = "0"  # read once, inside accelerate()
                    try:
                        omni_accel.accelerate(pipe, **kwargs)
                    finally:
                        os.environ.pop("OMNI_ACCEL_CUDA_GRAPHS", None)
                    accelerated = True
                    applied = [p["pass"] for p in pipe.omni_accel.report()["applied"]]
                    backend = next((p.get("backend") for p in pipe.omni_accel.report()["applied"]
                                    if p["pass"] == "attention"), None)
                else:
                    applied, backend = [], "diffusers default (SDPA)"
                with torch.no_grad():
                    timing = time_forwards(lambda: forward(**inputs), device, iters, warmup, on_warm=clocks.mark)
                clock_stats = clocks.since_mark()
                out = timing.pop("out").float()
                if ref is None:
                    ref = out
                diff = (out - ref).abs()
                max_abs = diff.max().item()
                rel = (diff.norm() / ref.norm().clamp_min(1e-12)).item()
                finite = bool(torch.isfinite(out).all())
                fps = spec["forwards_per_step"]
                ms_step = timing["ms"] * fps
                tflops = flops["total"] / (timing["ms"] / 1e3) / 1e12
                row = {"model": model_name, "config": name, "world_size": 1, "ms_per_step": round(ms_step, 3),
                       "ms_per_forward": round(timing["ms"], 3), "forwards_per_step": fps,
                       "tflops": round(tflops, 2), "mfu": round(tflops / gemm, 4) if gemm else None,
                       "peak_mem_gib": None if timing["peak_mem_gib"] is None else round(timing["peak_mem_gib"], 3),
                       "gpu": env["gpu"], "torch": env["torch"], "diffusers": env["diffusers"], "shape": spec["shape"],
                       "accelerate_kwargs": kwargs, "applied": applied, "attention_backend": backend,
                       "max_abs_err": max_abs, "rel_err": rel, "finite": finite,
                       "lossless": lossless,
                       "rel_err_ok": bool(finite and rel < (2e-2 if lossless else LOSSY_REL_ERR_OK)),
                       "cold_start_s": round(timing["cold_start_s"], 3),
                       "ms_min": round(timing["ms_min"], 3), "ms_max": round(timing["ms_max"], 3),
                       "tflop_per_forward": round(flops["total"] / 1e12, 3), "params_b": round(n_params / 1e9, 3),
                       "transformer_gib": round(t_bytes / 2**30, 3),
                       "mem_before_build_gib": None if mem_before is None else round(mem_before, 3),
                       **clock_stats}
                if clock_stats.get("power_w") is not None:
                    # whole-board energy of one denoising step at the mean power of the timed forwards
                    row["energy_j_per_step"] = round(clock_stats["power_w"] * ms_step / 1000, 2)
                if args.profile and device.type == "cuda":
                    row["kernels"] = profile_kernels(lambda: forward(**inputs))
                    log(f"  kernel time by kind (ms/forward): {row['kernels']['by_kind_ms']}")
                if name == "auto":
                    unoffloaded_peak = row["peak_mem_gib"]
                if name == "offload_block":
                    if h2d:
                        bound_ms = t_bytes / (h2d * 1e9) * 1e3
                        row["h2d_bound_ms_per_step"] = round(bound_ms * fps, 3)
                        row["h2d_pinned_gbps"] = round(h2d, 3)
                        row["ms_over_h2d_bound"] = round(ms_step / (bound_ms * fps), 3)
                    ref_peak = unoffloaded_peak or next((r["peak_mem_gib"] for r in result["rows"]
                                                         if r["model"] == model_name), None)
                    if ref_peak and row["peak_mem_gib"] is not None:
                        row["peak_mem_vs_unoffloaded"] = round(row["peak_mem_gib"] / ref_peak, 4)
                result["rows"].append(row)
                log(f"{model_name:10s} {name:16s} {ms_step:9.2f} ms/step ({timing['ms']:.2f} ms/fwd) "
                    f"{tflops:7.1f} TFLOP/s mfu {row['mfu']} peak {row['peak_mem_gib']} GiB cold "
                    f"{timing['cold_start_s']:.1f}s max_abs {max_abs:.3g} rel {rel:.3g} [{backend}] {clock_stats}")
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                result["errors"].append(f"{model_name}/{name}: {exc!r}")
            finally:
                if accelerated:
                    try:
                        omni_accel.restore(pipe)
                    except Exception as exc:  # noqa: BLE001
                        traceback.print_exc()
                        result["errors"].append(f"{model_name}/{name}: restore failed: {exc!r}")
                # Every compiled config adds guards to the same block code objects; past dynamo's recompile limit
                # (8) later configs silently run eager -- the 2026-12-02 second H200 run lost its last FP8+compile
                # rows that way (cold start 0.2 s). A reset between configs keeps each row's compile its own.
                torch._dynamo.reset()
                write()
        # ``forward`` too: it holds the transformer (or its compiled wrapper) -- the 2026-12-03 run kept Qwen-Image's
        # 38.1 GiB alive into Wan's first rows this way
        del transformer, pipe, ref, forward
        # dynamo first: its caches hold the compiled blocks, and a module with hooks sits in reference cycles, so
        # only a gc.collect() *after* the reset frees its weights (the 2026-12-02 H200 run collected before the
        # reset, and the Qwen-Image rows' peak memory still counted the 22.2 GiB of FLUX weights)
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["total_s"] = round(elapsed(), 1)
    clocks.stop()
    write()
    print_table(result)
    plot_path = args.plot or os.path.splitext(args.out)[0] + ".png"
    try:
        plot(result, plot_path)
    except Exception as exc:  # noqa: BLE001 -- matplotlib missing: the JSON is what matters
        log(f"plot skipped: {exc!r}")
    return 0


def print_table(result: dict) -> None:
    print(f"\n{'model':10s} {'config':16s} {'ms/step':>9s} {'TFLOP/s':>8s} {'MFU':>6s} {'peak GiB':>9s} "
          f"{'max_abs':>9s} {'rel':>8s} {'cold s':>7s}")
    for r in result["rows"]:
        print(f"{r['model']:10s} {r['config']:16s} {r['ms_per_step']:9.2f} {r['tflops']:8.1f} "
              f"{(r['mfu'] or 0):6.3f} {str(r['peak_mem_gib']):>9s} {r['max_abs_err']:9.3g} {r['rel_err']:8.3g} "
              f"{r['cold_start_s']:7.1f}")
    if result["skipped"]:
        print("skipped:", ", ".join(result["skipped"]))
    if result["errors"]:
        print("errors:", *result["errors"], sep="\n  ")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in result["rows"] if r["model"] == model]
        bars = ax.bar([r["config"] for r in rows], [r["ms_per_step"] for r in rows],
                      color=["#888" if r["config"] == "eager" else "#3a7" for r in rows])
        for bar, r in zip(bars, rows):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{r['ms_per_step']:.0f}", ha="center",
                    va="bottom", fontsize=8)
        ax.set_title(f"{model} ({rows[0]['shape'].split(':')[0]})", fontsize=9)
        ax.set_ylabel("ms / denoising step")
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle(f"transformer step time, bf16, {result['env']['gpu']}, torch {result['env']['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
