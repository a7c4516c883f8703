"""Train the built-in FluxPipeline-compatible text-to-image model from scratch.

    python -m omni_accel.builtin.train --out DIR --device cuda            # the shipped run (~7 min on one H200)
    python omni_accel/builtin/train.py --out DIR --device cpu --smoke     # seconds-long smoke test

Stages (all seeded): 1. a small AutoencoderKL (16 latent channels, 8x down-sampling) on the procedural
shapes (L1 + MSE with the shape's pixels weighted 21x, + small KL); 2. latent statistics ->
scaling_factor / shift_factor; 3. a small FluxTransformer2DModel trained with rectified flow
(x_t = (1-t) x0 + t noise, target noise - x0, exactly the inputs FluxPipeline feeds it; the latent
tokens the shape covers weighted 4x) jointly with tiny CLIPTextModel / T5EncoderModel text encoders
over a word-level tokenizer of the closed caption vocabulary; 10 % caption dropout so true CFG
(negative_prompt="" + true_cfg_scale) is available. Writes a diffusers folder (fp16 safetensors),
loss JSON + PNG, a sample grid and an end-of-run adherence check (quick_eval).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a plain script: do not import the (large) omni_accel package
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import dataset as ds  # type: ignore
else:
    from . import dataset as ds

IMAGE_SIZE = 128
CLIP_MAX_LEN = 32  # tokenizer.model_max_length -> FluxPipeline.tokenizer_max_length
TRAIN_T5_LENGTHS = (32, 512)  # FluxPipeline pads T5 to max_sequence_length (default 512); train on both
SPECIALS = ["<pad>", "</s>", "<unk>"]  # ids 0, 1, 2 (T5 convention); CLIP eos id 1 != 2 -> first-eos pooling


# ----------------------------------------------------------------------------- components
def build_tokenizer(model_max_length: int, words: list[str] | None = None):
    """A word-level tokenizer over a closed caption vocabulary (default: the image captions' words + "an"),
    lower-cased, </s> appended, <pad> / </s> / <unk> as ids 0 / 1 / 2."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for w in (ds.VOCAB_WORDS + ["an"] if words is None else words):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length, pad_token="<pad>",
                                   eos_token="</s>", unk_token="<unk>", padding_side="right")


def build_text_encoders(vocab_size: int):
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LEN, pad_token_id=0, bos_token_id=1, eos_token_id=1, projection_dim=128))
    t5 = T5EncoderModel(T5Config(
        vocab_size=vocab_size, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, dropout_rate=0.0, is_encoder_decoder=False, tie_word_embeddings=False))
    make_t5_causal(t5)
    return clip, t5


@torch.no_grad()
def make_t5_causal(t5) -> None:
    """Block attention to later positions through T5's relative-position bias (the buckets for
    key-after-query), so a token's embedding is independent of how many <pad> tokens follow it:
    FluxPipeline pads T5 input to max_sequence_length and passes no attention mask."""
    att = t5.encoder.block[0].layer[0].SelfAttention
    nb = att.relative_attention_bias.weight.shape[0]
    att.relative_attention_bias.weight[nb // 2:] = -1e4


def build_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 64, 64, 128), layers_per_block=1, norm_num_groups=16, sample_size=IMAGE_SIZE,
        mid_block_add_attention=False, use_quant_conv=False, use_post_quant_conv=False,
        scaling_factor=1.0, shift_factor=0.0, force_upcast=False)


def build_transformer():
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1, in_channels=64, out_channels=None, num_layers=2, num_single_layers=4,
        attention_head_dim=32, num_attention_heads=8, joint_attention_dim=128, pooled_projection_dim=128,
        guidance_embeds=False, axes_dims_rope=(8, 12, 12))


def build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX-style dynamic shifting; base_image_seq_len = our 64 tokens (128 px) -> mu = base_shift
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=64, max_image_seq_len=4096, time_shift_type="exponential")


def pack(latents: torch.Tensor) -> torch.Tensor:
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def image_ids(h2: int, w2: int, device) -> torch.Tensor:
    ids = torch.zeros(h2, w2, 3)
    ids[..., 1] = torch.arange(h2)[:, None]
    ids[..., 2] = torch.arange(w2)[None, :]
    return ids.reshape(h2 * w2, 3).to(device)


# ----------------------------------------------------------------------------- helpers
class Clock:
    def __init__(self, minutes: float):
        self.t0, self.budget = time.time(), minutes * 60

    def frac(self) -> float:
        return (time.time() - self.t0) / self.budget


def lr_at(progress: float, base: float, warmup: float = 0.03) -> float:
    if progress < warmup:
        return base * progress / warmup
    p = min(1.0, (progress - warmup) / (1 - warmup))
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p)))


def optimizer_step(opt, loss: torch.Tensor, params, max_norm: float = 1.0) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()


def record(log: dict, stage: str, step: int, clock: Clock, print_every: int, **values) -> None:
    """Every 25 steps the values (tensors are read once) go to log[stage]; every print_every steps they are printed."""
    if step % 25:
        return
    row = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}
    log[stage].append({"step": step, **row, "t": round(time.time() - clock.t0, 1)})
    if step % print_every == 0:
        shown = " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
        print(f"[{stage}] step {step} {shown} t {time.time() - clock.t0:.0f}s", flush=True)


def batch_images(n: int, g: torch.Generator, device, with_alpha: bool = False, **kw):
    """n random images in [-1, 1] and their captions (and the shapes' coverage masks if with_alpha)."""
    p = ds.sample_params(n, g, device=device, **kw)
    img, alpha = ds.render(p, IMAGE_SIZE, return_alpha=True)
    return (img * 2 - 1, ds.captions_of(p)) + ((alpha,) if with_alpha else ())


def shape_weight(alpha: torch.Tensor, weight: float, grow: int = 2) -> torch.Tensor:
    """Per-pixel loss weight 1 + weight * (shape mask grown by `grow` pixels). A small shape is 1-2 %
    of the pixels: with an unweighted loss the VAE learned the background first and, in a short run,
    decoded shapes as blurry blobs of the wrong color (the color accuracy of the first model)."""
    if weight <= 0:
        return torch.ones_like(alpha)
    return 1 + weight * F.max_pool2d(alpha, 2 * grow + 1, 1, grow)


def recon_scores(vae, x: torch.Tensor, caps: list[str]) -> dict:
    """Adherence metric on VAE reconstructions (the ceiling of anything the transformer can draw)."""
    if __package__ in (None, ""):
        import metric as M  # type: ignore
    else:
        from . import metric as M
    with torch.no_grad():
        rec = vae.decode(vae.encode(x).latent_dist.mode()).sample.float()
    imgs = ds.to_uint8((rec + 1) / 2)
    sc = [M.score(im, c) for im, c in zip(imgs, caps)]
    return {k: round(float(np.mean([s_[k] for s_ in sc if k in s_])), 3) for k in ("bg_color", "color", "shape", "position")}


LOSS_PANELS = (("vae", "VAE (L1+MSE+KL)"), ("dit", "Transformer (flow matching MSE)"))


def save_loss_plot(log: dict, path: str, panels: tuple = LOSS_PANELS) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        rec = log.get(key, [])
        if rec:
            s = [r["step"] for r in rec]
            ax.plot(s, [r["loss"] for r in rec], lw=0.6, alpha=0.5, label="loss")
            k = max(1, len(rec) // 50)
            sm = np.convolve([r["loss"] for r in rec], np.ones(k) / k, mode="valid")
            ax.plot(s[k - 1:], sm, lw=1.5, label=f"moving avg ({k})")
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_pipeline(out: str, vae, transformer, clip, t5, tok_clip, tok_t5, scheduler) -> None:
    from diffusers import FluxPipeline

    mods = [copy.deepcopy(m).to("cpu", torch.float16).eval() for m in (vae, transformer, clip, t5)]
    pipe = FluxPipeline(scheduler=scheduler, vae=mods[0], transformer=mods[1], text_encoder=mods[2],
                        text_encoder_2=mods[3], tokenizer=tok_clip, tokenizer_2=tok_t5)
    pipe.save_pretrained(out, safe_serialization=True)
    # transformers records the saved dtype (fp16) in the text encoders' configs and loads them in it by default,
    # while diffusers loads the transformer and VAE in fp32: declare fp32 so that a plain
    # DiffusionPipeline.from_pretrained(out) gets one dtype (fp16 -> fp32 is exact; the files stay fp16)
    for name in ("text_encoder", "text_encoder_2"):
        path = os.path.join(out, name, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["dtype"] = "float32"
        with open(path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")


def folder_sha256(path: str) -> str:
    """One digest over every file of a model folder (relative names and bytes): ties a result to the weights."""
    import hashlib

    digest = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            full = os.path.join(root, name)
            digest.update(os.path.relpath(full, path).encode())
            with open(full, "rb") as fh:
                digest.update(fh.read())
    return digest.hexdigest()


def tar_split(folder: str, prefix: str, part_bytes: int = 15 * 2**20) -> None:
    """tar `folder` (as model/) and write it as prefix.part0, .part1 ... (cat them to restore)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(folder, arcname="model")
    data = buf.getvalue()
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    for i in range(0, len(data), part_bytes):
        with open(f"{prefix}.part{i // part_bytes}", "wb") as f:
            f.write(data[i:i + part_bytes])


# ----------------------------------------------------------------------------- training
def train_vae(args, device, log, clock_min, out_dir):
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    vae = build_vae().to(device)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0, betas=(0.9, 0.99))
    clock = Clock(clock_min)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    # fixed validation images (all captions' attributes stated) for the reconstruction metric
    xv, capv = batch_images(64 if not args.smoke else 4, torch.Generator().manual_seed(998), device,
                            exclude_heldout=False, p_omit_size=0.0, p_omit_position=0.0)
    step = 0
    while step < args.vae_steps and clock.frac() < 1:
        prog = max(step / args.vae_steps, clock.frac())
        for gp in opt.param_groups:
            gp["lr"] = lr_at(prog, args.vae_lr)
        x, _, alpha = batch_images(args.vae_batch, g, device, with_alpha=True, exclude_heldout=False)
        with amp:
            post = vae.encode(x).latent_dist
            z = post.sample()
            rec = vae.decode(z).sample
        rec = rec.float()
        w = shape_weight(alpha, args.vae_shape_weight)
        wn = w / w.mean()
        l1 = ((rec - x).abs() * wn).mean()
        mse = ((rec - x) ** 2 * wn).mean()
        kl = post.kl().mean() / z[0].numel()
        loss = l1 + mse + args.vae_kl * kl
        optimizer_step(opt, loss, vae.parameters())
        record(log, "vae", step, clock, args.print_every, loss=loss, l1=l1, mse=mse, kl=kl)
        if args.vae_eval_every and step and step % args.vae_eval_every == 0:
            vae.eval()
            r = recon_scores(vae, xv, capv)
            vae.train()
            log["vae_eval"].append({"step": step, **r, "t": round(time.time() - clock.t0, 1)})
            print(f"[vae] step {step} reconstruction metric {r}", flush=True)
        step += 1
    log["vae_steps_done"] = step
    vae.eval().requires_grad_(False)
    # latent statistics -> scaling / shift (as FLUX's VAE config carries them)
    with torch.no_grad():
        zs = []
        for _ in range(8):
            x, _ = batch_images(64, g, device, exclude_heldout=False)
            zs.append(vae.encode(x).latent_dist.sample().float())
        z = torch.cat(zs)
        shift, std = float(z.mean()), float(z.std())
        vae.register_to_config(shift_factor=round(shift, 5), scaling_factor=round(1.0 / std, 5))
        rec = vae.decode(z[:64]).sample
        x_eval = torch.cat([batch_images(64, torch.Generator().manual_seed(999), device, exclude_heldout=False)[0]])
        rec = vae.decode(vae.encode(x_eval).latent_dist.mode()).sample.float()
        log["vae_eval_l1"] = float((rec - x_eval).abs().mean())
    log["vae_final_recon_metric"] = recon_scores(vae, xv, capv)
    print(f"[vae] done {step} steps; shift {shift:.4f} scale {1 / std:.4f} eval L1 {log['vae_eval_l1']:.4f}; "
          f"reconstruction metric {log['vae_final_recon_metric']}", flush=True)
    return vae


def encode_text(ids_clip, ids_t5, clip, t5):
    pooled = clip(ids_clip).pooler_output
    seq = t5(ids_t5)[0]
    return pooled, seq


def train_dit(args, device, vae, tok_clip, tok_t5, log, clock_min, out_dir, scheduler):
    torch.manual_seed(args.seed + 1)
    g = torch.Generator().manual_seed(args.seed + 1)
    clip, t5 = build_text_encoders(len(tok_clip))
    transformer = build_transformer()
    clip, t5, transformer = clip.to(device), t5.to(device), transformer.to(device)
    params = list(transformer.parameters()) + list(clip.parameters()) + list(t5.parameters())
    print(f"[dit] transformer {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f}M, clip "
          f"{sum(p.numel() for p in clip.parameters()) / 1e6:.2f}M, t5 {sum(p.numel() for p in t5.parameters()) / 1e6:.2f}M",
          flush=True)
    opt = torch.optim.AdamW(params, lr=args.dit_lr, weight_decay=0.01, betas=(0.9, 0.99))
    ema = [copy.deepcopy(m).eval().requires_grad_(False) for m in (transformer, clip, t5)]
    live = (transformer, clip, t5)
    ema_params = [p for m in ema for p in m.parameters()]
    live_params = [p for m in live for p in m.parameters()]
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and args.dit_amp == "bf16"
           else torch.autocast(device.type, enabled=False))
    print(f"[dit] precision: {'bf16 autocast' if device.type == 'cuda' and args.dit_amp == 'bf16' else 'fp32/tf32'}", flush=True)
    sf, sh = vae.config.scaling_factor, vae.config.shift_factor
    lat = IMAGE_SIZE // 8
    img_ids = image_ids(lat // 2, lat // 2, device)
    clock = Clock(clock_min)
    bias = t5.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    step, last_ckpt = 0, time.time()
    while step < args.dit_steps and clock.frac() < 1:
        prog = max(step / args.dit_steps, clock.frac())
        for gp in opt.param_groups:
            gp["lr"] = lr_at(prog, args.dit_lr)
        x, caps, alpha = batch_images(args.dit_batch, g, device, with_alpha=True, exclude_heldout=True)
        drop = torch.rand(len(caps), generator=g) < args.caption_dropout
        caps = ["" if d else c for c, d in zip(caps, drop.tolist())]
        L = TRAIN_T5_LENGTHS[1] if torch.rand(1, generator=g).item() < args.p_long else TRAIN_T5_LENGTHS[0]
        ids_c = tok_clip(caps, padding="max_length", max_length=CLIP_MAX_LEN, truncation=True, return_tensors="pt").input_ids.to(device)
        ids_t = tok_t5(caps, padding="max_length", max_length=L, truncation=True, return_tensors="pt").input_ids.to(device)
        with torch.no_grad(), amp:
            z0 = (vae.encode(x).latent_dist.sample().float() - sh) * sf
        x0 = pack(z0)
        noise = torch.randn(x0.shape, generator=g).to(device)
        # logit-normal timesteps (SD3/FLUX), shifted like the sampler (shift = exp(base_shift))
        u = torch.sigmoid(torch.randn(x0.shape[0], generator=g)).to(device)
        s = math.exp(0.5)
        t = s * u / (1 + (s - 1) * u)
        xt = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * noise
        txt_ids = torch.zeros(L, 3, device=device)
        with amp:
            pooled, seq = encode_text(ids_c, ids_t, clip, t5)
            pred = transformer(hidden_states=xt, timestep=t, guidance=None, pooled_projections=pooled,
                               encoder_hidden_states=seq, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        # per-token weight: tokens covering the shape count more (most of the 64 tokens are plain
        # background); a per-element weighting leaves the regression's minimiser unchanged
        wt = F.adaptive_max_pool2d(alpha, (lat // 2, lat // 2)).flatten(1)  # (b, tokens)
        wt = 1 + args.dit_shape_weight * wt
        wt = (wt / wt.mean()).unsqueeze(-1)
        loss = (((pred.float() - (noise - x0)) ** 2) * wt).mean()
        optimizer_step(opt, loss, params)
        with torch.no_grad():
            make_t5_causal(t5)
            d = min(args.ema, (1 + step) / (10 + step))
            torch._foreach_lerp_(ema_params, live_params, 1 - d)  # one fused call, not ~300 launches
        record(log, "dit", step, clock, args.print_every, loss=loss, L=L, lr=opt.param_groups[0]["lr"])
        step += 1
        if out_dir and time.time() - last_ckpt > args.ckpt_every_s:
            last_ckpt = time.time()
            ck = out_dir.rstrip("/") + "_ckpt"
            save_pipeline(ck, vae, ema[0], ema[1], ema[2], tok_clip, tok_t5, scheduler)
            if args.ckpt_tar:
                tar_split(ck, args.ckpt_tar)
            print(f"[dit] checkpoint at step {step}", flush=True)
            if args.eval_n:  # a small early read of the adherence (batched, a few seconds on a GPU)
                r = quick_eval(ck, device, min(args.eval_n, 40 if not args.smoke else 2), steps=20 if not args.smoke else 2)
                log["dit_eval"].append({"step": step, **r, "t": round(time.time() - clock.t0, 1)})
                print(f"[dit] step {step} quick eval {r}", flush=True)
    log["dit_steps_done"] = step
    make_t5_causal(ema[2])
    return ema


def sample_grid(pipe_dir: str, path: str, device, n: int = 16, seed: int = 7, steps: int = 20) -> list[str]:
    from diffusers import FluxPipeline
    from PIL import Image

    pipe = FluxPipeline.from_pretrained(pipe_dir, torch_dtype=torch.float32).to(device)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(seed)
    caps = ds.captions_of(ds.sample_params(n, g, exclude_heldout=False))
    caps[: n // 4] = ds.captions_of(ds.sample_params(n // 4, g, only_heldout=True))
    imgs = pipe(caps, height=IMAGE_SIZE, width=IMAGE_SIZE, num_inference_steps=steps,
                generator=torch.Generator(device).manual_seed(seed)).images
    cols = 4
    rows = math.ceil(n / cols)
    cw, chh = IMAGE_SIZE + 8, IMAGE_SIZE + 44
    grid = Image.new("RGB", (cols * cw, rows * chh), "white")
    from PIL import ImageDraw

    d = ImageDraw.Draw(grid)
    for i, (im, c) in enumerate(zip(imgs, caps)):
        x, y = (i % cols) * cw + 4, (i // cols) * chh + 4
        grid.paste(im, (x, y))
        words, lines, cur = c.split(), [], ""
        for w in words:
            if len(cur) + len(w) + 1 > 24:
                lines.append(cur)
                cur = w
            else:
                cur = (cur + " " + w).strip()
        lines.append(cur)
        d.text((x, y + IMAGE_SIZE + 2), "\n".join(lines[:3]), fill="black")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    grid.save(path)
    return caps


def quick_eval(pipe_dir: str, device, n: int = 100, steps: int = 20) -> dict:
    """The adherence benchmark's captions (seed 2026, 30 % held-out triples), batched on `device`: an
    early read of benchmarks/bench_builtin_adherence.py (which runs on CPU, one image at a time)."""
    from diffusers import FluxPipeline

    if __package__ in (None, ""):
        import metric as M  # type: ignore
    else:
        from . import metric as M
    g = torch.Generator().manual_seed(2026)
    nh = int(round(0.3 * n))
    caps = ds.captions_of(ds.sample_params(nh, g, only_heldout=True)) + ds.captions_of(
        ds.sample_params(n - nh, g, exclude_heldout=True))
    pipe = FluxPipeline.from_pretrained(pipe_dir, torch_dtype=torch.float32).to(device)
    pipe.set_progress_bar_config(disable=True)
    imgs = pipe(caps, height=IMAGE_SIZE, width=IMAGE_SIZE, num_inference_steps=steps, max_sequence_length=32,
                generator=torch.Generator(device).manual_seed(0)).images
    sc = [M.score(im, c) for im, c in zip(imgs, caps)]
    return {k: round(float(np.mean([s_[k] for s_ in sc if k in s_])), 3)
            for k in ("bg_color", "color", "shape", "position", "size")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output diffusers folder (e.g. omni_accel/builtin/model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vae-steps", type=int, default=6000)
    ap.add_argument("--vae-minutes", type=float, default=2.3, help="wall-clock cap for the VAE stage")
    ap.add_argument("--vae-batch", type=int, default=64)
    ap.add_argument("--vae-lr", type=float, default=1.5e-3)
    ap.add_argument("--vae-kl", type=float, default=1e-4)
    ap.add_argument("--vae-shape-weight", type=float, default=20.0,
                    help="extra loss weight of the (grown) shape pixels in the VAE loss (0 = unweighted)")
    ap.add_argument("--vae-eval-every", type=int, default=500, help="reconstruction-metric check every N VAE steps (0 = off)")
    ap.add_argument("--dit-steps", type=int, default=20000)
    ap.add_argument("--dit-minutes", type=float, default=4.0, help="wall-clock cap for the transformer stage")
    ap.add_argument("--dit-batch", type=int, default=256)
    ap.add_argument("--dit-lr", type=float, default=1e-3)
    ap.add_argument("--dit-amp", choices=["bf16", "fp32"], default="fp32", help="transformer-stage precision on CUDA")
    ap.add_argument("--dit-shape-weight", type=float, default=3.0,
                    help="extra flow-matching loss weight of the latent tokens the shape covers (0 = unweighted)")
    ap.add_argument("--eval-n", type=int, default=100, help="captions of the end-of-training adherence check (0 = off)")
    ap.add_argument("--vae-from", default=None, help="skip stage 1 and use this trained AutoencoderKL folder")
    ap.add_argument("--vae-only", action="store_true", help="train stage 1 only and save the AutoencoderKL to --out")
    ap.add_argument("--ema", type=float, default=0.995)
    ap.add_argument("--caption-dropout", type=float, default=0.1)
    ap.add_argument("--p-long", type=float, default=0.15, help="fraction of steps with T5 padded to 512")
    ap.add_argument("--ckpt-every-s", type=float, default=120)
    ap.add_argument("--ckpt-tar", default=None, help="also write each checkpoint as a tar split into PREFIX.part0, .part1 (15 MiB each)")
    ap.add_argument("--results", default="benchmarks/results", help="folder for the loss/sample PNGs and the JSON log")
    ap.add_argument("--print-every", type=int, default=250)
    ap.add_argument("--smoke", action="store_true", help="tiny run to check the code path")
    args = ap.parse_args(argv)
    if args.smoke:
        args.vae_steps, args.dit_steps, args.vae_batch, args.dit_batch = 3, 3, 4, 4
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    t0 = time.time()
    log = {"args": vars(args), "vae": [], "vae_eval": [], "dit": [], "dit_eval": [], "torch": torch.__version__}
    tok_clip, tok_t5 = build_tokenizer(CLIP_MAX_LEN), build_tokenizer(512)
    scheduler = build_scheduler()
    if args.vae_from:  # reuse a trained VAE folder (its config carries scaling/shift)
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(args.vae_from, torch_dtype=torch.float32).to(device).eval().requires_grad_(False)
        log["vae_from"] = args.vae_from
    else:
        vae = train_vae(args, device, log, args.vae_minutes, args.out)
    if args.vae_only:
        copy.deepcopy(vae).to("cpu", torch.float16).save_pretrained(args.out)
        os.makedirs(args.results, exist_ok=True)
        with open(os.path.join(args.results, "builtin_training_log_vae.json"), "w") as f:
            json.dump(log, f)
        print(f"saved VAE to {args.out}", flush=True)
        return
    if args.ckpt_tar and not args.vae_from:
        vdir = args.out.rstrip("/") + "_vae"
        copy.deepcopy(vae).to("cpu", torch.float16).save_pretrained(vdir)
        tar_split(vdir, args.ckpt_tar + "_vae")
    ema = train_dit(args, device, vae, tok_clip, tok_t5, log, args.dit_minutes, args.out, scheduler)
    save_pipeline(args.out, vae, *ema, tok_clip, tok_t5, scheduler)
    log["train_seconds"] = round(time.time() - t0, 1)
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "builtin_training_log.json"), "w") as f:
        json.dump(log, f)
    save_loss_plot(log, os.path.join(args.results, "builtin_training_loss.png"))
    if args.ckpt_tar:  # the final model replaces the last checkpoint's parts
        import glob

        for f in glob.glob(args.ckpt_tar + ".part*"):
            os.remove(f)
        tar_split(args.out, args.ckpt_tar)
    caps = sample_grid(args.out, os.path.join(args.results, "builtin_samples.png"), device,
                       steps=20 if not args.smoke else 2)
    if args.eval_n:
        log["quick_eval"] = quick_eval(args.out, device, args.eval_n if not args.smoke else 4, steps=20 if not args.smoke else 2)
        print(f"[eval] {log['quick_eval']}", flush=True)
        with open(os.path.join(args.results, "builtin_training_log.json"), "w") as f:
            json.dump(log, f)
    print(f"done in {time.time() - t0:.0f}s; saved {args.out}; samples: {caps[:4]}", flush=True)


if __name__ == "__main__":
    main()
