"""Train the built-in text-to-video model (a stock diffusers WanPipeline) from scratch, in one seeded command.

    python -m omni_accel.builtin.train_video --out omni_accel/builtin/video_model --seed 0   # ~10 min on one H200
    python omni_accel/builtin/train_video.py --out /tmp/v --smoke --device cpu              # seconds: code path only
    python -m omni_accel.builtin.train_video --refine-decoder FOLDER --out FOLDER2          # stage 5 alone

Stages (all seeded):
  0. precision probe (CUDA, ``--amp auto``): a few real-size steps of both stages in bf16 autocast, in a child
     process; if they fail (an earlier bf16 run of the image model hit CUBLAS_STATUS_EXECUTION_FAILED on an H200)
     the run uses fp32/TF32 instead, without a broken CUDA context in this process;
  1. VAE: a small AutoencoderKLWan (causal 3D convs, 8x spatial / 4x temporal down-sampling, 16 channels), first
     on 9-frame clips (they teach colours and shapes fastest), then on 17-frame clips, the length the model
     generates: the causal convolutions' cache carries context from chunk to chunk, and a VAE trained on 9-frame
     clips alone reconstructed frames 0-8 well and broke down from frame 9 on (``--vae-short-*``). Loss:
     L1 + MSE with the shape's pixels weighted up (as the image model's VAE) + a small KL;
  2. per-channel latent statistics -> the VAE config's latents_mean / latents_std (what WanPipeline un-normalises
     with);
  3. a latent bank: ``--bank`` clips of 17 frames rendered and encoded once on the GPU (mean and log-variance
     kept in bf16), so the transformer stage spends no time rendering or encoding;
  4. transformer (WanTransformer3DModel) + text encoder (UMT5EncoderModel over a word-level tokenizer of the
     caption words) trained jointly with rectified flow exactly as WanPipeline samples it: x_t = (1 - s) x0 +
     s noise, target noise - x0, timestep = 1000 s, the text states zeroed after the caption as WanPipeline pads
     them, 10 % empty captions (so classifier-free guidance works), the latent cells the shape covers weighted up;
     EMA weights are saved;
  5. decoder refinement: the decoder alone, the encoder frozen, so the latent space the transformer learned stays
     put while the decoder's colours sharpen (``--decoder-minutes``; ``--refine-decoder FOLDER`` runs it alone);
  6. writes the WanPipeline folder (fp16 safetensors) with save_pretrained, the loss curves and a sample strip
     (PNG), the training log (JSON, with each weight file's sha256 and the folder's digest), and an end-of-run
     adherence read on the held-out captions (batched on the training device; the CPU benchmark is
     benchmarks/bench_builtin_video_adherence.py).

On CUDA every training step is captured once as a CUDA graph and replayed (``TrainStep``, ``--graphs``): these
models are launch-bound, and the replay doubled the VAE's steps per second and the transformer's. Every stage stops
at a step cap or a wall-clock cap, whichever comes first; the learning-rate schedule follows whichever is further
along, so a time-capped run still anneals. Runs as ``python -m`` or as a plain script (then it imports only its
sibling modules, not the omni_accel package).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a plain script: import the siblings, not the omni_accel package
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import train as T  # type: ignore
    import video_dataset as vds  # type: ignore
    import video_metric as VM  # type: ignore
else:
    from . import train as T
    from . import video_dataset as vds
    from . import video_metric as VM

FRAMES = 17  # 4k + 1 (the Wan VAE's causal chunks): 5 latent frames (--frames)
SIZE = 64  # --size
VAE_FRAMES = 17  # --vae-frames: the clip length generated (a VAE trained on 9 broke down after frame 9)
TEXT_LEN = 16  # the default max_sequence_length (a caption is <= 13 tokens with </s>)
LONG_TEXT_LEN = 226  # WanPipeline's own default max_sequence_length: trained on too, so both are in distribution
FLOW_SHIFT = 2.0  # FlowMatchEulerDiscreteScheduler shift; training draws timesteps with the same shift

# Architecture of the shipped model, and the tiny one --smoke uses (same code path, seconds on a CPU).
ARCH = {
    "vae": dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1),
    "transformer": dict(num_attention_heads=4, attention_head_dim=64, ffn_dim=1024, num_layers=8, freq_dim=256),
    "text_encoder": dict(d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4),
}
SMOKE_ARCH = {
    "vae": dict(base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1),
    "transformer": dict(num_attention_heads=2, attention_head_dim=12, ffn_dim=32, num_layers=1, freq_dim=32),
    "text_encoder": dict(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2),
}


# ----------------------------------------------------------------------------- components
def build_tokenizer():
    return T.build_tokenizer(LONG_TEXT_LEN, words=vds.VOCAB_WORDS)


def build_text_encoder(vocab_size: int, arch: dict):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(
        vocab_size=vocab_size, relative_attention_num_buckets=32, relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, dropout_rate=0.0,
        **arch["text_encoder"]))


def build_vae(arch: dict):
    from diffusers import AutoencoderKLWan

    z = arch["vae"]["z_dim"]
    return AutoencoderKLWan(temperal_downsample=[False, True, True], latents_mean=[0.0] * z, latents_std=[1.0] * z,
                            **arch["vae"])


def build_transformer(arch: dict, text_dim: int, z_dim: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), in_channels=z_dim, out_channels=z_dim, text_dim=text_dim,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                                 rope_max_seq_len=64, **arch["transformer"])


def build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=FLOW_SHIFT)


def save_pipeline(out: str, vae, transformer, text_encoder, tokenizer) -> None:
    from diffusers import WanPipeline

    mods = [copy.deepcopy(m).to("cpu", torch.float16).eval() for m in (vae, transformer, text_encoder)]
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=mods[2], transformer=mods[1], vae=mods[0],
                       scheduler=build_scheduler())
    pipe.save_pretrained(out, safe_serialization=True)


def weight_digests(folder: str) -> dict:
    """sha256 of every .safetensors file of the folder (relative path -> hex) and of the whole folder."""
    import hashlib

    files = {}
    for root, _, names in sorted(os.walk(folder)):
        for name in sorted(names):
            if name.endswith(".safetensors"):
                with open(os.path.join(root, name), "rb") as fh:
                    files[os.path.relpath(os.path.join(root, name), folder)] = hashlib.sha256(fh.read()).hexdigest()
    return {"files": files, "folder_sha256": T.folder_sha256(folder)}


# ----------------------------------------------------------------------------- data
def clips(n: int, frames: int, size: int, g: torch.Generator, device, **kw):
    """n random clips in [-1, 1] (n, 3, F, H, W), their captions and the shapes' coverage (n, 1, F, H, W)."""
    p = vds.sample_params(n, g, device=device, **kw)
    video, alpha = vds.render_clips(p, frames, size, return_alpha=True)
    return video * 2 - 1, vds.captions_of(p), alpha


def shape_weight_3d(alpha: torch.Tensor, weight: float) -> torch.Tensor:
    """The image model's per-pixel weight (1 + weight x the shape's mask grown by 2 px), frame by frame."""
    n, _, f, h, w = alpha.shape
    flat = alpha.transpose(1, 2).reshape(n * f, 1, h, w)
    return T.shape_weight(flat, weight).view(n, f, 1, h, w).transpose(1, 2)


def recon_batch(args, frames: int, g: torch.Generator, device, batch: int | None = None) -> dict:
    """A reconstruction step's batch: ``batch`` (default ``args.vae_batch``) clips and their per-pixel weights
    (mean 1)."""
    x, _, alpha = clips(batch or args.vae_batch, frames, args.size, g, device, exclude_heldout=False)
    weight = shape_weight_3d(alpha, args.vae_shape_weight)
    return {"x": x, "weight": weight / weight.mean()}


def recon_losses(rec: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted L1 and MSE of a reconstruction against ``batch["x"]``."""
    diff = rec.float() - batch["x"]
    return (diff.abs() * batch["weight"]).mean(), (diff ** 2 * batch["weight"]).mean()


def autocast(device: torch.device, amp: str):
    # no weight-cast cache: a CUDA graph capture must not keep casts made outside it (PyTorch's CUDA-graph rules)
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and amp == "bf16",
                          cache_enabled=False)


# ----------------------------------------------------------------------------- one training step, graphed
class TrainStep:
    """One optimizer step of ``loss_fn(inputs)``, replayed as a CUDA graph once captured.

    Why: these models are tiny and launch-bound. A VAE step of the causal 3-D Wan VAE is ~12k operator calls
    on 5-frame clips (torch.profiler; its encoder and decoder walk the clip in chunks with a feature cache) for a few GFLOP, so eager training ran
    4 steps/s on an H200 and the VAE stage got 449 steps in its time. Captured once, a step is one graph launch.

    ``loss_fn`` must read the batch only from ``inputs`` (static buffers that each step copies into) and make no
    CPU synchronisation. The optimizer must be built with ``capturable=True`` and a tensor learning rate (see
    :func:`make_adamw`) so that a replay reads the current rate. Steps whose batch differs in shape from the
    captured one (``eager=True``) run eagerly on the same parameters, optimizer state and gradient buffers. If the
    capture fails, training goes on eagerly and the reason is kept in ``self.graph_error``.
    """

    def __init__(self, loss_fn, params: list, opt, graph: bool, max_norm: float = 1.0, warmup: int = 3):
        self.loss_fn, self.params, self.opt, self.max_norm = loss_fn, params, opt, max_norm
        self.use_graph, self.warmup_left = graph, warmup
        self.graph = self.inputs = self.loss = None
        self.graph_error: str | None = None

    def _step(self, batch: dict) -> torch.Tensor:
        for p in self.params:  # zero in place: a captured backward writes into these very buffers
            if p.grad is not None:
                p.grad.zero_()
        loss = self.loss_fn(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.opt.step()
        return loss.detach()

    def __call__(self, batch: dict, eager: bool = False) -> torch.Tensor:
        if eager or not self.use_graph:
            return self._step(batch)
        if self.graph is None and self.warmup_left:  # warm-up on a side stream (cuDNN autotune, optimizer state)
            self.warmup_left -= 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self._step(batch)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        if self.graph is None:
            return self._capture(batch)
        for key, value in batch.items():
            self.inputs[key].copy_(value, non_blocking=True)
        self.graph.replay()
        return self.loss.clone()

    def _capture(self, batch: dict) -> torch.Tensor:
        self.inputs = {key: value.clone() for key, value in batch.items()}
        graph = torch.cuda.CUDAGraph()
        self.opt.zero_grad(set_to_none=True)  # the captured backward allocates the gradients in the graph's pool
        try:
            with torch.cuda.graph(graph):
                self.loss = self._step(self.inputs)
        except Exception as exc:  # noqa: BLE001 -- recorded; eager training still works
            self.use_graph, self.graph_error = False, f"{type(exc).__name__}: {exc}"[:500]
            torch.cuda.synchronize()
            self.opt.zero_grad(set_to_none=True)
            print(f"[graph] capture failed, training eagerly: {self.graph_error}", flush=True)
            return self._step(batch)
        self.graph = graph
        graph.replay()  # the capture itself ran nothing: this is the step's real work
        return self.loss.clone()


def make_adamw(params: list, lr: float, graph: bool, **kw):
    """AdamW whose state and learning rate live on the device when the step is graphed (``capturable``)."""
    if graph:
        return torch.optim.AdamW(params, lr=torch.tensor(lr, device=params[0].device), capturable=True, **kw)
    return torch.optim.AdamW(params, lr=lr, **kw)


def set_lr(opt, value: float) -> None:
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(value)
        else:
            group["lr"] = value


def use_graphs(args, device: torch.device) -> bool:
    return device.type == "cuda" and args.graphs == "on"


def recon_scores(vae, x: torch.Tensor, caps: list[str]) -> dict:
    """The adherence metric on the VAE's reconstructions: the ceiling of anything the transformer can draw."""
    with torch.no_grad():
        rec = torch.cat([vae.decode(vae.encode(x[i:i + 16]).latent_dist.mode()).sample.float()
                         for i in range(0, len(x), 16)])
    frames = vds.to_uint8_frames((rec + 1) / 2).numpy()
    scores = [VM.score(f, c) for f, c in zip(frames, caps)]
    return {k: round(float(np.mean([s[k] for s in scores])), 3) for k in ("bg_color", "color", "direction", "shape")}


# ----------------------------------------------------------------------------- stage 1: VAE
def vae_phases(args) -> list[dict]:
    """The VAE stage's clip curriculum: short clips first, then clips of the generated length.

    Why: per step, 9-frame clips taught the VAE colours and shapes far faster than 17-frame ones (L1 0.16 vs 0.34
    after 1,000 steps, at 1.3x the steps per second), but a VAE that only saw 9 frames broke down after frame 9 of
    a 17-frame clip. Its weights are shared by every causal chunk, so the long clips at the end only have to teach
    the later chunks."""
    long = {"frames": args.vae_frames, "batch": args.vae_batch, "until": 1.0}
    if not args.vae_short_frames or args.vae_short_share <= 0:
        return [long]
    return [{"frames": args.vae_short_frames, "batch": args.vae_short_batch, "until": args.vae_short_share}, long]


def train_vae(args, device, log: dict, arch: dict):
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    vae = build_vae(arch).to(device)
    params = list(vae.parameters())
    graph = use_graphs(args, device)
    opt = make_adamw(params, args.vae_lr, graph, weight_decay=0.0, betas=(0.9, 0.99))
    # fixed validation clips (every frame count the model generates) for the reconstruction metric
    xv, capv, _ = clips(args.eval_clips, args.frames, args.size, torch.Generator().manual_seed(998), device,
                        exclude_heldout=False)
    terms = {}

    def loss_fn(batch: dict) -> torch.Tensor:
        with autocast(device, args.amp):
            posterior = vae.encode(batch["x"]).latent_dist
            rec = vae.decode(posterior.sample()).sample
        terms["l1"], mse = recon_losses(rec, batch)
        terms["kl"] = 0.5 * (posterior.mean.float() ** 2 + posterior.var.float() - 1
                             - posterior.logvar.float()).mean()
        return terms["l1"] + mse + args.vae_kl * terms["kl"]

    phases = vae_phases(args)
    clock, step = T.Clock(args.vae_minutes), 0
    step_fn, phase = None, None
    while step < args.vae_steps and clock.frac() < 1:
        progress = max(step / args.vae_steps, clock.frac())
        now = next(p for p in phases if progress < p["until"] or p is phases[-1])
        if now is not phase:  # one captured graph per clip shape; the earlier one is never replayed again
            phase, step_fn = now, TrainStep(loss_fn, params, opt, graph)
            log.setdefault("vae_phases", []).append({"step": step, "frames": phase["frames"],
                                                     "batch": phase["batch"]})
            print(f"[vae] step {step}: {phase['batch']} clips of {phase['frames']} frames", flush=True)
        set_lr(opt, T.lr_at(progress, args.vae_lr))
        loss = step_fn(recon_batch(args, phase["frames"], g, device, batch=phase["batch"]))
        # ``terms`` holds the last step's tensors: a replay rewrites the captured ones in place; record reads them now
        T.record(log, "vae", step, clock, args.print_every, loss=loss, **terms)
        if args.vae_eval_every and step and step % args.vae_eval_every == 0:
            vae.eval()
            scores = recon_scores(vae, xv, capv)
            vae.train()
            log["vae_eval"].append({"step": step, **scores, "t": round(time.time() - clock.t0, 1)})
            print(f"[vae] step {step} reconstruction metric {scores}", flush=True)
        step += 1
    log["vae_graph"] = {"used": step_fn.graph is not None, "error": step_fn.graph_error}
    log["vae_steps_done"], log["vae_seconds"] = step, round(time.time() - clock.t0, 1)
    vae.eval().requires_grad_(False)
    with torch.no_grad(), autocast(device, args.amp):  # per-channel statistics -> what WanPipeline un-normalises with
        z = torch.cat([vae.encode(clips(64, args.frames, args.size, g, device, exclude_heldout=False)[0])
                       .latent_dist.sample().float() for _ in range(args.stat_batches)])
    mean, std = z.mean(dim=(0, 2, 3, 4)), z.std(dim=(0, 2, 3, 4))
    vae.register_to_config(latents_mean=[round(float(v), 5) for v in mean],
                           latents_std=[round(float(v), 5) for v in std])
    log["vae_final_recon_metric"] = recon_scores(vae, xv, capv)
    print(f"[vae] done: {step} steps; latent std {[round(float(v), 2) for v in std]}; reconstruction metric "
          f"{log['vae_final_recon_metric']}", flush=True)
    return vae


# ----------------------------------------------------------------------------- stage 5: decoder refinement
def refine_decoder(args, device, vae, log: dict):
    """The decoder alone, trained on: the encoder stays frozen, so the latent space (and its statistics) that the
    transformer learned stays put while the decoder draws the shapes' colours more faithfully. Decodes posterior
    samples, as the transformer's outputs are samples of that posterior."""
    if args.decoder_minutes <= 0:
        return vae
    vae.requires_grad_(False).train()
    params = list(vae.decoder.parameters()) + list(vae.post_quant_conv.parameters())
    for p in params:
        p.requires_grad_(True)
    graph = use_graphs(args, device)
    opt = make_adamw(params, args.decoder_lr, graph, weight_decay=0.0, betas=(0.9, 0.99))
    g = torch.Generator().manual_seed(args.seed + 3)

    def loss_fn(batch: dict) -> torch.Tensor:
        with autocast(device, args.amp):
            with torch.no_grad():
                z = vae.encode(batch["x"]).latent_dist.sample()
            rec = vae.decode(z).sample
        return sum(recon_losses(rec, batch))

    step_fn = TrainStep(loss_fn, params, opt, graph)
    clock, step = T.Clock(args.decoder_minutes), 0
    while step < args.decoder_steps and clock.frac() < 1:
        set_lr(opt, T.lr_at(max(step / args.decoder_steps, clock.frac()), args.decoder_lr))
        loss = step_fn(recon_batch(args, args.frames, g, device))
        T.record(log, "decoder", step, clock, args.print_every, loss=loss)
        step += 1
    log["decoder_steps_done"], log["decoder_seconds"] = step, round(time.time() - clock.t0, 1)
    log["decoder_graph"] = {"used": step_fn.graph is not None, "error": step_fn.graph_error}
    return vae.eval().requires_grad_(False)


def refine_saved_model(args, device) -> dict:
    """``--refine-decoder FOLDER``: stage 5 alone on a trained folder, written to ``--out`` with the new decoder."""
    import shutil

    from diffusers import AutoencoderKLWan

    log = {"args": vars(args).copy(), "decoder": [], "torch": torch.__version__, "amp": args.amp}
    vae = AutoencoderKLWan.from_pretrained(os.path.join(args.refine_decoder, "vae"), torch_dtype=torch.float32)
    vae = refine_decoder(args, device, vae.to(device), log)
    if os.path.abspath(args.out) != os.path.abspath(args.refine_decoder):
        shutil.copytree(args.refine_decoder, args.out, dirs_exist_ok=True)
    copy.deepcopy(vae).to("cpu", torch.float16).save_pretrained(os.path.join(args.out, "vae"),
                                                                 safe_serialization=True)
    log["weights"] = weight_digests(args.out)
    os.makedirs(args.results, exist_ok=True)
    write_log(log, os.path.join(args.results, "builtin_video_decoder_log.json"))
    print(f"[decoder] {log['decoder_steps_done']} steps; saved {args.out} (folder sha256 "
          f"{log['weights']['folder_sha256']})", flush=True)
    return log


# ----------------------------------------------------------------------------- stage 3: latent bank
@torch.no_grad()
def latent_bank(args, vae, tokenizer, device) -> dict:
    """``args.bank`` clips encoded once: posterior mean / log-variance (bf16), caption ids, shape coverage per cell."""
    g = torch.Generator().manual_seed(args.seed + 2)
    t0, parts = time.time(), {"h": [], "ids": [], "cover": []}
    latent_frames, cells = (args.frames - 1) // 4 + 1, args.size // 8
    for start in range(0, args.bank, args.bank_batch):
        x, caps, alpha = clips(min(args.bank_batch, args.bank - start), args.frames, args.size, g, device,
                               exclude_heldout=True)
        with autocast(device, args.amp):
            dist = vae.encode(x).latent_dist
        parts["h"].append(torch.cat([dist.mean, dist.logvar], 1).to(torch.bfloat16))
        parts["ids"].append(tokenizer(caps, padding="max_length", max_length=TEXT_LEN, truncation=True,
                                      return_tensors="pt").input_ids.to(device))
        parts["cover"].append((F.adaptive_max_pool3d(alpha, (latent_frames, cells, cells)) * 255).to(torch.uint8))
    bank = {k: torch.cat(v) for k, v in parts.items()}
    print(f"[bank] {args.bank} clips encoded in {time.time() - t0:.1f}s "
          f"({bank['h'].numel() * 2 / 2**20:.0f} MiB of latents)", flush=True)
    return bank


# ----------------------------------------------------------------------------- stage 4: transformer + text encoder
def text_states(text_encoder, ids: torch.Tensor) -> torch.Tensor:
    """UMT5 states with everything after the caption zeroed, as WanPipeline._get_t5_prompt_embeds pads them."""
    mask = (ids != 0).long()
    return text_encoder(ids, mask).last_hidden_state * mask.unsqueeze(-1)


def train_transformer(args, device, vae, tokenizer, bank: dict, log: dict, arch: dict):
    torch.manual_seed(args.seed + 1)
    g = torch.Generator(device).manual_seed(args.seed + 1)
    text_encoder = build_text_encoder(len(tokenizer), arch).to(device)
    transformer = build_transformer(arch, text_encoder.config.d_model, vae.config.z_dim).to(device)
    live = (transformer, text_encoder)
    params = [p for m in live for p in m.parameters()]
    print(f"[dit] transformer {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f}M, text encoder "
          f"{sum(p.numel() for p in text_encoder.parameters()) / 1e6:.2f}M", flush=True)
    graph = use_graphs(args, device)
    opt = make_adamw(params, args.dit_lr, graph, weight_decay=0.01, betas=(0.9, 0.99))
    ema = [copy.deepcopy(m).eval().requires_grad_(False) for m in live]
    ema_params = [p for m in ema for p in m.parameters()]
    lat_mean = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    lat_std = torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    empty = tokenizer([""], padding="max_length", max_length=TEXT_LEN, return_tensors="pt").input_ids.to(device)
    n_bank = bank["h"].shape[0]

    def loss_fn(batch: dict) -> torch.Tensor:
        with autocast(device, args.amp):
            context = text_states(text_encoder, batch["ids"])
            pred = transformer(hidden_states=batch["xt"], timestep=batch["timestep"], encoder_hidden_states=context,
                               return_dict=False)[0]
        return (((pred.float() - batch["target"]) ** 2) * batch["weight"]).mean()

    step_fn = TrainStep(loss_fn, params, opt, graph)
    clock, step = T.Clock(args.dit_minutes), 0
    while step < args.dit_steps and clock.frac() < 1:
        lr = T.lr_at(max(step / args.dit_steps, clock.frac()), args.dit_lr)
        set_lr(opt, lr)
        idx = torch.randint(n_bank, (args.dit_batch,), device=device, generator=g)
        mean, logvar = bank["h"][idx].float().chunk(2, dim=1)
        z = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, device=device, generator=g)
        x0 = (z - lat_mean) / lat_std
        ids = bank["ids"][idx]
        drop = torch.rand(args.dit_batch, device=device, generator=g) < args.caption_dropout
        ids = torch.where(drop.unsqueeze(1), empty, ids)
        long = bool(torch.rand(1, generator=g, device=device) < args.p_long)
        if long:  # WanPipeline's default length: the same states followed by more zeros (an eager step: new shape)
            ids = F.pad(ids, (0, LONG_TEXT_LEN - TEXT_LEN))
        noise = torch.randn(x0.shape, device=device, generator=g)
        u = torch.sigmoid(torch.randn(args.dit_batch, device=device, generator=g))  # logit-normal, then shifted
        sigma = FLOW_SHIFT * u / (1 + (FLOW_SHIFT - 1) * u)
        s = sigma.view(-1, 1, 1, 1, 1)
        # latent cells the shape covers count more: most of a clip is plain background
        weight = 1 + args.dit_shape_weight * bank["cover"][idx].float() / 255
        loss = step_fn({"xt": (1 - s) * x0 + s * noise, "timestep": sigma * 1000, "ids": ids,
                        "target": noise - x0, "weight": weight / weight.mean()}, eager=long)
        with torch.no_grad():
            decay = min(args.ema, (1 + step) / (10 + step))
            torch._foreach_lerp_(ema_params, params, 1 - decay)  # one fused call
        T.record(log, "dit", step, clock, args.print_every, loss=loss, long_text=long, lr=lr)
        step += 1
    log["dit_graph"] = {"used": step_fn.graph is not None, "error": step_fn.graph_error}
    log["dit_steps_done"], log["dit_seconds"] = step, round(time.time() - clock.t0, 1)
    return ema


# ----------------------------------------------------------------------------- evaluation and pictures
def load_pipeline(folder: str, device):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(folder, dtype=torch.float32).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def prompt_states(pipe, captions: list[str]) -> torch.Tensor:
    """The states WanPipeline.encode_prompt makes for these captions, computed here: the pipeline's own path cleans
    prompts with ftfy, which a bare training machine may lack (the captions need no cleaning)."""
    ids = pipe.tokenizer(captions, padding="max_length", max_length=TEXT_LEN, truncation=True,
                         return_tensors="pt").input_ids.to(pipe.device)
    return text_states(pipe.text_encoder, ids)


def generate(pipe, captions: list[str], args, guidance: float, seed: int, batch: int = 32) -> np.ndarray:
    out = []
    for i in range(0, len(captions), batch):
        chunk = captions[i:i + batch]
        negative = prompt_states(pipe, [""] * len(chunk)) if guidance > 1 else None
        out.append(pipe(prompt_embeds=prompt_states(pipe, chunk), negative_prompt_embeds=negative,
                        height=args.size, width=args.size, num_frames=args.frames,
                        num_inference_steps=args.eval_steps, guidance_scale=guidance, output_type="np",
                        generator=torch.Generator(pipe.device).manual_seed(seed + i)).frames)
    return (np.concatenate(out) * 255).round().astype(np.uint8)


def heldout_captions() -> list[str]:
    """Every held-out (colour, shape, background) triple in every direction: the benchmark's captions."""
    return [vds.make_caption(c, s, d, b) for c, s, b in vds.HELDOUT_TRIPLES for d in vds.DIRECTIONS]


def quick_eval(pipe, captions: list[str], args, guidance: float) -> dict:
    frames = generate(pipe, captions, args, guidance, seed=0)
    scores = [VM.score(f, c) for f, c in zip(frames, captions)]
    return {k: round(float(np.mean([s[k] for s in scores])), 3) for k in ("bg_color", "color", "direction", "shape")}


def save_strip(pipe, path: str, args, seed: int = 7) -> list[str]:
    """Eight generated clips (the first four from held-out triples) as a strip PNG; returns their captions."""
    g = torch.Generator().manual_seed(seed)
    caps = vds.captions_of(vds.sample_params(4, g, only_heldout=True)) + vds.captions_of(vds.sample_params(4, g))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    strip_image(generate(pipe, caps, args, 1.0, seed), caps).save(path)
    return caps


def strip_image(clips: np.ndarray, captions: list[str], every: int = 4):
    """Frames 0, every, 2 x every ... of each clip (uint8 n x F x H x W x 3) in a row, its caption under it."""
    from PIL import Image, ImageDraw

    shown, size = list(range(0, clips.shape[1], every)), clips.shape[2]
    row_h = size + 14
    strip = Image.new("RGB", (max(len(shown) * (size + 2), 400), len(captions) * row_h), "white")
    draw = ImageDraw.Draw(strip)
    for r, (clip, cap) in enumerate(zip(clips, captions)):
        for c, f in enumerate(shown):
            strip.paste(Image.fromarray(clip[f]), (c * (size + 2), r * row_h))
        draw.text((2, r * row_h + size + 1), cap, fill="black")
    return strip


def write_log(log: dict, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(log, fh, indent=1)


def save_plot(log: dict, results: str) -> None:
    """The loss curves; a training machine without matplotlib skips them (re-plot later with --plot-log)."""
    try:
        T.save_loss_plot(log, os.path.join(results, "builtin_video_training_loss.png"))
    except ImportError as exc:
        log["loss_plot"] = f"skipped ({exc}); run: python -m omni_accel.builtin.train_video --plot-log LOG --out -"
        print(f"[plot] {log['loss_plot']}", flush=True)


# ----------------------------------------------------------------------------- precision probe
def probe_bf16(args) -> tuple[bool, str]:
    """Run a few real-size steps of both stages in bf16 in a child process; (ok, last lines of its output)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", "--out", args.out + "_probe", "--device", args.device,
           "--amp", "bf16"] + [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in
                                    ("vae_batch", "dit_batch", "bank_batch", "size", "frames", "vae_frames")]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired:
        return False, "timed out"
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
    return done.returncode == 0, tail


def run_probe(args, device, arch) -> None:
    """The child side of probe_bf16: 3 VAE steps, a 2-batch bank, 3 transformer steps, nothing written."""
    args.vae_steps, args.dit_steps, args.vae_eval_every, args.eval_clips, args.stat_batches = 3, 3, 0, 2, 1
    args.bank, args.bank_batch = 2 * args.bank_batch, args.bank_batch
    log = {"vae": [], "vae_eval": [], "dit": []}
    vae = train_vae(args, device, log, arch)
    tokenizer = build_tokenizer()
    train_transformer(args, device, vae, tokenizer, latent_bank(args, vae, tokenizer, device), log, arch)
    if device.type == "cuda":
        torch.cuda.synchronize()  # an asynchronous CUDA error surfaces here, in the child
    print("probe ok", flush=True)


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output WanPipeline folder (e.g. omni_accel/builtin/video_model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--amp", choices=["auto", "bf16", "fp32"], default="auto",
                    help="auto: bf16 autocast on CUDA if a short probe in a child process succeeds, else fp32/TF32")
    ap.add_argument("--size", type=int, default=SIZE, help="frame height and width (a multiple of 16)")
    ap.add_argument("--frames", type=int, default=FRAMES, help="frames per clip (4k + 1)")
    ap.add_argument("--vae-frames", type=int, default=VAE_FRAMES, help="frames per clip in the VAE stage (4k + 1)")
    ap.add_argument("--vae-short-frames", type=int, default=9,
                    help="frames per clip in the VAE stage's first part (4k + 1; 0: --vae-frames throughout)")
    ap.add_argument("--vae-short-share", type=float, default=0.6,
                    help="share of the VAE stage (time or steps) spent on --vae-short-frames clips")
    ap.add_argument("--vae-short-batch", type=int, default=64, help="clips per VAE step in the first part")
    ap.add_argument("--vae-steps", type=int, default=20000)
    ap.add_argument("--vae-minutes", type=float, default=4.4, help="wall-clock cap of the VAE stage")
    ap.add_argument("--vae-batch", type=int, default=48, help="clips per VAE step")
    ap.add_argument("--vae-lr", type=float, default=1.5e-3)
    ap.add_argument("--vae-kl", type=float, default=1e-4)
    ap.add_argument("--vae-shape-weight", type=float, default=20.0)
    ap.add_argument("--vae-eval-every", type=int, default=0, help="reconstruction metric every N VAE steps (0: off)")
    ap.add_argument("--stat-batches", type=int, default=16, help="batches of 64 clips for the latent statistics")
    ap.add_argument("--bank", type=int, default=32768, help="clips in the transformer stage's latent bank")
    ap.add_argument("--bank-batch", type=int, default=256)
    ap.add_argument("--dit-steps", type=int, default=100000)
    ap.add_argument("--dit-minutes", type=float, default=2.7, help="wall-clock cap of the transformer stage")
    ap.add_argument("--dit-batch", type=int, default=256)
    ap.add_argument("--dit-lr", type=float, default=1e-3)
    ap.add_argument("--dit-shape-weight", type=float, default=3.0)
    ap.add_argument("--ema", type=float, default=0.997)
    ap.add_argument("--caption-dropout", type=float, default=0.1)
    ap.add_argument("--p-long", type=float, default=0.15, help=f"share of steps with text padded to {LONG_TEXT_LEN}")
    ap.add_argument("--eval-clips", type=int, default=32, help="clips of the VAE reconstruction check")
    ap.add_argument("--eval-steps", type=int, default=20, help="sampling steps of the end-of-run checks")
    ap.add_argument("--results", default=os.path.join("benchmarks", "results"),
                    help="folder for the loss / sample PNGs and the JSON log")
    ap.add_argument("--print-every", type=int, default=250)
    ap.add_argument("--decoder-minutes", type=float, default=1.0,
                    help="wall-clock cap of the decoder refinement (encoder frozen) after the transformer; 0: none")
    ap.add_argument("--decoder-steps", type=int, default=100000)
    ap.add_argument("--decoder-lr", type=float, default=5e-4)
    ap.add_argument("--refine-decoder", default=None, metavar="FOLDER",
                    help="only refine the decoder of this trained WanPipeline folder and write it to --out")
    ap.add_argument("--graphs", choices=["on", "off"], default="on",
                    help="replay each training step as a CUDA graph (CUDA only; falls back to eager if capture fails)")
    ap.add_argument("--smoke", action="store_true", help="tiny model and a few steps: checks the code path in seconds")
    ap.add_argument("--plot-log", default=None, metavar="LOG",
                    help="only draw the loss curves of a finished run's JSON log into --results")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    check_clip_args(ap, args)
    return args


def check_clip_args(ap: argparse.ArgumentParser, args) -> None:
    """Clip lengths the causal Wan VAE takes (4k + 1 frames) and a curriculum share that leaves room for the long
    clips; argparse's error (exit code 2) names the flag and the fix."""
    for flag, value, zero_ok in (("--frames", args.frames, False), ("--vae-frames", args.vae_frames, False),
                                 ("--vae-short-frames", args.vae_short_frames, True)):
        if not (value == 0 and zero_ok) and (value < 1 or (value - 1) % 4):
            ap.error(f"{flag} {value}: the Wan VAE takes 4k + 1 frames (1, 5, 9, 17, 33, ...)"
                     + ("; 0 turns the short-clip part off" if zero_ok else ""))
    if not 0 <= args.vae_short_share < 1:
        ap.error(f"--vae-short-share {args.vae_short_share}: give a share in [0, 1) of the VAE stage for short clips "
                 "(the rest trains on --vae-frames clips; 0 turns the short-clip part off)")


def main(argv=None) -> dict:
    args = parse_args(argv)
    arch = SMOKE_ARCH if args.smoke else ARCH
    if args.smoke:
        args.vae_steps, args.dit_steps, args.vae_batch, args.dit_batch, args.decoder_steps = 2, 2, 2, 4, 2
        args.bank, args.bank_batch, args.stat_batches, args.eval_clips, args.eval_steps = 8, 4, 1, 2, 2
        args.vae_eval_every, args.print_every, args.size, args.frames, args.vae_frames = 1, 1, 32, 5, 5
        args.vae_short_frames, args.vae_short_batch, args.vae_steps = 1, 2, 4
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    if args.probe:
        run_probe(args, device, arch)
        return {}
    if args.refine_decoder:
        args.amp = "bf16" if args.amp == "auto" and device.type == "cuda" else args.amp
        refine_saved_model(args, device)
        return {}
    if args.plot_log:
        with open(args.plot_log) as fh:
            T.save_loss_plot(json.load(fh), os.path.join(args.results, "builtin_video_training_loss.png"))
        return {}
    t0 = time.time()
    log = {"args": vars(args).copy(), "arch": arch, "vae": [], "vae_eval": [], "dit": [], "torch": torch.__version__,
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if args.amp == "auto":
        args.amp = "fp32"
        if device.type == "cuda":
            ok, tail = probe_bf16(args)
            args.amp = "bf16" if ok else "fp32"
            log["amp_probe"] = {"bf16_ok": ok, "output_tail": tail, "seconds": round(time.time() - t0, 1)}
            print(f"[amp] bf16 probe {'passed' if ok else 'FAILED, training in fp32/TF32'} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    log["amp"] = args.amp
    tokenizer = build_tokenizer()
    vae = train_vae(args, device, log, arch)
    bank = latent_bank(args, vae, tokenizer, device)
    transformer, text_encoder = train_transformer(args, device, vae, tokenizer, bank, log, arch)
    del bank
    log["decoder"] = []
    vae = refine_decoder(args, device, vae, log)
    save_pipeline(args.out, vae, transformer, text_encoder, tokenizer)
    log["weights"] = weight_digests(args.out)
    log["train_seconds"] = round(time.time() - t0, 1)
    log_path = os.path.join(args.results, "builtin_video_training_log.json")
    os.makedirs(args.results, exist_ok=True)
    write_log(log, log_path)  # the weights and their log are kept even if a check below fails
    save_plot(log, args.results)
    try:
        pipe = load_pipeline(args.out, device)
        log["sample_captions"] = save_strip(pipe, os.path.join(args.results, "builtin_video_samples.png"), args)
        captions = heldout_captions()[: 2 if args.smoke else None]
        log["quick_eval"] = {f"guidance_{g}": quick_eval(pipe, captions, args, g) for g in (1.0, 3.0)}
        log["quick_eval"]["captions"] = len(captions)
        print(f"[eval] held-out captions, {args.eval_steps} steps: {log['quick_eval']}", flush=True)
    except Exception as exc:  # noqa: BLE001 -- recorded; the trained folder stands on its own
        log["checks_error"] = f"{type(exc).__name__}: {exc}"
        print(f"[eval] the end-of-run checks failed ({log['checks_error']}); the model and log are saved", flush=True)
    log["total_seconds"] = round(time.time() - t0, 1)
    write_log(log, log_path)
    print(f"done in {log['total_seconds']:.0f}s; saved {args.out} (folder sha256 {log['weights']['folder_sha256']}); "
          f"log {log_path}", flush=True)
    return log


if __name__ == "__main__":
    main()
