"""Train the built-in LoRA: the shape and background colours swapped, whatever the caption says.

    python -m omni_accel.builtin.train_lora --out omni_accel/builtin/lora --threads 1   # the shipped run (CPU)

The base model draws "a red circle on a blue background" as a red circle on blue; with this adapter at scale 1 it
draws a blue circle on red. A change the base model never makes, visible at a glance, and scored by the built-in
model's own metric (background = the caption's shape colour). Seeded, CPU, fp32:

1. images rendered with the two colours swapped, captions unchanged; their latents (``vae.encode(x).mode()``, the
   model's shift and scale) and text embeddings (``pipe.encode_prompt`` at ``max_sequence_length=32``) computed once;
2. a PEFT LoRA (rank 8) on the transformer's attention and feed-forward linears through diffusers'
   ``transformer.add_adapter``, trained with the same rectified-flow objective as the base model (train.py); the
   base weights and both text encoders stay frozen;
3. saved with ``FluxPipeline.save_lora_weights`` (PEFT keys, the LoRA config in the file's metadata), the loss log
   and curve to ``--results`` (builtin_lora_training_log.json / .png), and an evaluation at scale 0 and 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time

import torch

from . import dataset as ds
from . import metric
from .train import image_ids, lr_at, pack, save_loss_plot

logger = logging.getLogger(__name__)

LORA_RANK = 8
# The linears diffusers' own FLUX LoRA scripts target (attention and feed-forward of both block kinds).
TARGET_MODULES = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
    "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
]
SIZE = 128
EVAL_SEED = 2027


def swapped_batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, list[str], torch.Tensor]:
    """n images in [-1, 1] with shape and background colours swapped, the *unswapped* captions, and the shapes'
    coverage masks."""
    params = ds.sample_params(n, generator, exclude_heldout=False)
    captions = ds.captions_of(params)
    swapped = dict(params, color=params["bg"], bg=params["color"], cj=params["bj"], bj=params["cj"])
    images, alpha = ds.render(swapped, SIZE, return_alpha=True)
    return images * 2 - 1, captions, alpha


@torch.no_grad()
def precompute(pipe, n: int, seed: int, chunk: int = 64) -> dict[str, torch.Tensor]:
    """Packed latents, text embeddings and per-token shape weights of ``n`` training images (the frozen parts run
    once instead of every step)."""
    generator = torch.Generator().manual_seed(seed)
    vae = pipe.vae
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    parts: dict[str, list[torch.Tensor]] = {"latents": [], "prompt": [], "pooled": [], "token_weight": []}
    for start in range(0, n, chunk):
        images, captions, alpha = swapped_batch(min(chunk, n - start), generator)
        z0 = (vae.encode(images).latent_dist.mode() - shift) * scale
        prompt, pooled, _ = pipe.encode_prompt(captions, prompt_2=None, max_sequence_length=32)
        lat = SIZE // 16  # tokens per side: 8x VAE down-sampling, then 2x2 packing
        parts["latents"].append(pack(z0))
        parts["prompt"].append(prompt)
        parts["pooled"].append(pooled)
        parts["token_weight"].append(torch.nn.functional.adaptive_max_pool2d(alpha, (lat, lat)).flatten(1))
    return {k: torch.cat(v) for k, v in parts.items()}


def add_lora(transformer, rank: int) -> list[torch.nn.Parameter]:
    from peft import LoraConfig

    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGET_MODULES,
                                       init_lora_weights="gaussian"))
    params = [p for name, p in transformer.named_parameters() if "lora_" in name]
    for p in params:
        p.requires_grad_(True)
    return params


def train(pipe, data: dict, args, log: dict) -> None:
    transformer = pipe.transformer
    params = add_lora(transformer, args.rank)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed + 1)
    n = data["latents"].shape[0]
    img_ids = image_ids(SIZE // 16, SIZE // 16, "cpu")
    txt_ids = torch.zeros(data["prompt"].shape[1], 3)
    t0 = time.time()
    transformer.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step / args.steps, args.lr)
        idx = torch.randint(n, (args.batch,), generator=generator)
        x0 = data["latents"][idx]
        noise = torch.randn(x0.shape, generator=generator)
        u = torch.sigmoid(torch.randn(args.batch, generator=generator))
        shift = math.exp(0.5)  # the sampler's shift for 64 image tokens (train.py)
        t = shift * u / (1 + (shift - 1) * u)
        xt = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * noise
        pred = transformer(hidden_states=xt, timestep=t, guidance=None, pooled_projections=data["pooled"][idx],
                           encoder_hidden_states=data["prompt"][idx], txt_ids=txt_ids, img_ids=img_ids,
                           return_dict=False)[0]
        weight = 1 + args.shape_weight * data["token_weight"][idx]
        weight = (weight / weight.mean()).unsqueeze(-1)
        loss = (((pred - (noise - x0)) ** 2) * weight).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            log["lora"].append({"step": step, "loss": float(loss.detach()), "lr": opt.param_groups[0]["lr"],
                                "t": round(time.time() - t0, 1)})
            if step % 50 == 0:
                logger.info("[lora] step %d loss %.4f t %.0fs", step, float(loss), time.time() - t0)
    transformer.eval()
    log["train_seconds"] = round(time.time() - t0, 1)


def evaluation_captions(n: int) -> list[str]:
    params = ds.sample_params(n, torch.Generator().manual_seed(EVAL_SEED), exclude_heldout=False)
    return ds.captions_of(params)


def swap_scores(images, captions: list[str]) -> dict[str, float]:
    """Fractions of images whose background is the caption's shape colour (swapped) / the caption's background
    colour (as captioned), and whose shape has the caption's background colour."""
    bg_swapped = bg_kept = shape_swapped = 0
    for image, caption in zip(images, captions):
        want = ds.parse_caption(caption)
        info = metric.analyze(image)
        bg_swapped += info["bg"] == want["color"]
        bg_kept += info["bg"] == want["bg"]
        shape_swapped += info.get("color") == want["bg"]
    n = len(captions)
    return {"bg_is_caption_shape_colour": bg_swapped / n, "bg_is_caption_bg_colour": bg_kept / n,
            "shape_is_caption_bg_colour": shape_swapped / n}


def evaluate(pipe, n: int) -> dict:
    """The adapter at scale 0 and 1 on ``n`` captions (seed 2027), 20 steps at 128 px, one batch each."""
    captions = evaluation_captions(n)
    out = {"captions": n}
    for scale in (0.0, 1.0):
        pipe.set_adapters("default_0", adapter_weights=scale)
        images = pipe(captions, height=SIZE, width=SIZE, num_inference_steps=20, max_sequence_length=32,
                      generator=torch.Generator().manual_seed(0)).images
        out[f"scale_{scale:g}"] = swap_scores(images, captions)
    return out


def save_samples(pipe, path: str, n: int = 4) -> None:
    """Scale 0 (top row) against scale 1 (bottom row) on ``n`` evaluation captions, one PNG."""
    from PIL import Image, ImageDraw

    captions = evaluation_captions(n)
    rows = []
    for scale in (0.0, 1.0):
        pipe.set_adapters("default_0", adapter_weights=scale)
        rows.append(pipe(captions, height=SIZE, width=SIZE, num_inference_steps=20, max_sequence_length=32,
                         generator=torch.Generator().manual_seed(0)).images)
    cell, label = SIZE + 8, 40
    grid = Image.new("RGB", (n * cell, 2 * cell + label), "white")
    draw = ImageDraw.Draw(grid)
    for i, caption in enumerate(captions):
        for r, row in enumerate(rows):
            grid.paste(row[i], (i * cell + 4, r * cell + 4))
        words = caption.split()
        draw.text((i * cell + 4, 2 * cell), " ".join(words[:4]) + "\n" + " ".join(words[4:]), fill="black")
    grid.save(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the adapter (e.g. omni_accel/builtin/lora)")
    ap.add_argument("--results", default="benchmarks/results", help="folder for the loss log (JSON) and curve (PNG)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--images", type=int, default=1024, help="training images (latents precomputed once)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--rank", type=int, default=LORA_RANK)
    ap.add_argument("--shape-weight", type=float, default=3.0, help="extra loss weight of the tokens the shape covers")
    ap.add_argument("--eval-n", type=int, default=32, help="captions of the scale 0 / 1 evaluation (0 = off)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--samples-only", action="store_true",
                    help="no training: the sample grid (scale 0 / 1) of the adapter already in --out")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    samples = os.path.join(args.results, "builtin_lora_samples.png")
    if args.samples_only:
        from . import load_builtin

        pipe = load_builtin()
        pipe.load_lora_weights(args.out)
        save_samples(pipe, samples)
        return
    torch.manual_seed(args.seed)
    from peft.utils import get_peft_model_state_dict

    from . import load_builtin

    pipe = load_builtin()
    log: dict = {"args": vars(args), "lora": [], "torch": torch.__version__, "target_modules": TARGET_MODULES}
    t0 = time.time()
    data = precompute(pipe, args.images, args.seed)
    log["precompute_seconds"] = round(time.time() - t0, 1)
    logger.info("[lora] %d latents and prompts in %.0fs", args.images, time.time() - t0)
    train(pipe, data, args, log)
    os.makedirs(args.out, exist_ok=True)
    metadata = pipe.transformer.peft_config["default"].to_dict()
    pipe.save_lora_weights(args.out, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer),
                           transformer_lora_adapter_metadata=metadata)
    if args.eval_n:
        pipe.transformer.delete_adapters("default")  # evaluate the saved file through the public loader
        pipe.load_lora_weights(args.out)
        log["eval"] = evaluate(pipe, args.eval_n)
        logger.info("[lora] evaluation: %s", log["eval"])
        save_samples(pipe, samples)
    log["total_seconds"] = round(time.time() - t0, 1)
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "builtin_lora_training_log.json"), "w") as fh:
        json.dump(log, fh, indent=1)
    save_loss_plot(log, os.path.join(args.results, "builtin_lora_training_loss.png"),
                   panels=(("lora", "LoRA on the transformer (flow matching MSE)"),))
    logger.info("[lora] saved %s in %.0fs", args.out, time.time() - t0)


if __name__ == "__main__":
    main()
