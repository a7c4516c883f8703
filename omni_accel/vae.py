"""VAE tiling and slicing switches (diffusers' own VAE features, made undoable).

Slicing decodes a batch one image at a time: lossless. Tiling decodes overlapping tiles and blends the seams:
lossy at the seams, and a no-op for images smaller than one tile.
"""

from __future__ import annotations

from .errors import AccelError
from .pass_base import AccelPass, PassContext

_SWITCHES = {"vae_tiling": ("enable_tiling", "disable_tiling", "use_tiling"),
             "vae_slicing": ("enable_slicing", "disable_slicing", "use_slicing")}


class VaePass(AccelPass):
    name = "vae"

    def wanted(self, config) -> bool:
        return config.vae_tiling or config.vae_slicing

    def _vae(self, ctx: PassContext):
        return getattr(ctx.pipe, ctx.adapter.vae_name, None)

    def check(self, ctx: PassContext) -> None:
        vae = self._vae(ctx)
        for knob, (enable, _, _) in _SWITCHES.items():
            if getattr(ctx.config, knob) and not hasattr(vae, enable):
                raise AccelError(
                    f"{knob}=True but this pipeline's VAE ({type(vae).__name__}) has no {enable}(); "
                    f"leave {knob} off for this model."
                )

    def apply(self, ctx: PassContext) -> None:
        vae = self._vae(ctx)
        for knob, (enable, disable, flag) in _SWITCHES.items():
            if not getattr(ctx.config, knob):
                continue
            was_on = bool(getattr(vae, flag, False))
            getattr(vae, enable)()

            def undo(vae=vae, disable=disable, was_on=was_on) -> None:
                if not was_on:
                    getattr(vae, disable)()

            ctx.state.record(knob, undo)
