"""The omni-accel command line, run in-process through main(argv) on a tiny FLUX pipeline folder."""

import json
import logging
import os
import re
import subprocess
import sys

import pytest
from conftest import saved_tiny_pipeline
from PIL import Image

from omni_accel.cli import main, save_output
from omni_accel.testing import tiny_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_flux_dir(tmp_path_factory):
    return saved_tiny_pipeline(tmp_path_factory, "flux")


def _generate(tiny_flux_dir, out, *extra):
    return main(["generate", "a red fox", "--model", tiny_flux_dir, "--steps", "2", "--height", "32", "--width", "48",
                 "--device", "cpu", "-o", str(out), *extra])


def test_generate_writes_png_of_requested_size_and_prints_report(tiny_flux_dir, tmp_path, capsys):
    out = tmp_path / "out.png"
    assert _generate(tiny_flux_dir, out, "--attention", "sdpa", "--vae-slicing") == 0
    with Image.open(out) as im:
        assert im.size == (48, 32)
    text = capsys.readouterr().out
    assert "family" in text and "flux" in text
    assert "attention(sdpa)" in text and "vae_slicing" in text
    assert "transformer forwards  2" in text
    assert "denoising s" in text and "vae decode s" in text


def test_generate_json_report(tiny_flux_dir, tmp_path, capsys):
    out = tmp_path / "sub" / "x.png"
    assert _generate(tiny_flux_dir, out, "--report", "json", "--seed", "3") == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["family"] == "flux" and report["saved"]["size"] == [48, 32]
    assert [p["pass"] for p in report["applied"]] == ["attention"]
    assert report["last_call"]["transformer_forwards"] == 2
    assert set(report["last_call"]["time_s"]) >= {"text_encoding", "denoising", "vae_decode", "total"}
    assert out.exists()


def test_quant_config_flag_reaches_accelerate(tiny_flux_dir, tmp_path, capsys):
    out = tmp_path / "q.png"
    assert _generate(tiny_flux_dir, out, "--quant", "int8", "--quant-config", '{"modulation": "int8"}',
                     "--report", "json") == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (quant,) = [p for p in report["applied"] if p["pass"] == "quant"]
    assert quant["mode"] == "int8" and quant["modulation_layers"] > 0
    assert report["config"]["quant_config"] == {"modulation": "int8"} and out.exists()


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--sp", "0"], "sp=0"),
        (["--attention", "nope"], "attention='nope'"),
        (["--cache-config", "{not json"], "--cache-config"),
        (["--cache-config", '{"a": 1}'], "cache_config"),
        (["--steps", "0"], "--steps"),
        (["--quant", "int3"], "quant='int3'"),
        (["--quant", "int8", "--quant-config", "{oops"], "--quant-config is not valid JSON"),
        (["--quant", "int8", "--quant-config", '{"activations": "static"}'],
         "quant_config['activations']='static' is not offered with quant='int8'"),
        (["--quant-config", '{"skip": []}'], "quant_config was given without quant=..."),
    ],
)
def test_bad_values_exit_2_with_clear_message(tiny_flux_dir, tmp_path, capsys, flags, needle):
    assert _generate(tiny_flux_dir, tmp_path / "o.png", *flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err
    assert "Traceback" not in err
    assert not (tmp_path / "o.png").exists()


def test_compile_cache_flag_is_written_by_the_first_run_and_loaded_by_the_next(tiny_flux_dir, tmp_path, caplog):
    cache = tmp_path / "flux.compile-cache"
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    with caplog.at_level(logging.INFO, logger="omni_accel"):
        assert _generate(tiny_flux_dir, first, "--compile", "on", "--compile-cache", str(cache), "--seed", "1",
                         "-v") == 0
        assert cache.stat().st_size > 0 and f"compile cache {cache} written" in caplog.text
        assert _generate(tiny_flux_dir, second, "--compile", "on", "--compile-cache", str(cache), "--seed", "1",
                         "-v") == 0
    # the file holds everything this process compiled (other tests' graphs too): at least this model's two
    pattern = rf"compile cache {re.escape(str(cache))} loaded \(\{{'aot_autograd': (\d+), 'inductor': (\d+)\}}\)"
    loaded = re.search(pattern, caplog.text)
    assert loaded and int(loaded[2]) >= 2
    with Image.open(first) as a, Image.open(second) as b:
        assert a.tobytes() == b.tobytes()


def test_compile_cache_flag_refuses_without_compile_or_folder(tiny_flux_dir, tmp_path, capsys):
    cache = str(tmp_path / "c")
    assert _generate(tiny_flux_dir, tmp_path / "o.png", "--compile-cache", cache) == 2
    assert f"--compile-cache {cache!r} needs --compile on or max: without compiling there is nothing to cache." in \
        capsys.readouterr().err
    missing = str(tmp_path / "no" / "c")
    assert _generate(tiny_flux_dir, tmp_path / "o.png", "--compile", "on", "--compile-cache", missing) == 2
    assert (f"--compile-cache {missing!r}: its folder {str(tmp_path / 'no')!r} does not exist; create it, or give a "
            "path in an existing folder.") in capsys.readouterr().err
    assert not (tmp_path / "o.png").exists()


def test_serve_reads_the_compile_cache_and_says_when_there_is_none(tmp_path, caplog):
    from omni_accel.cli import build_parser
    from omni_accel.serve.server import device_dtype_config

    missing = str(tmp_path / "none.compile-cache")
    args = build_parser().parse_args(["serve", "--device", "cpu", "--compile", "on", "--compile-cache", missing])
    with caplog.at_level(logging.WARNING, logger="omni_accel"):
        device_dtype_config(args)
    assert (f"--compile-cache {missing} does not exist yet; compiling from scratch. `omni-accel generate` with the "
            f"same flags and --compile-cache {missing} writes it.") in caplog.text
    assert not os.path.exists(missing)


def test_missing_model_path_exits_2_naming_it(tmp_path, capsys):
    out = str(tmp_path / "o.png")
    assert main(["generate", "x", "--model", "/nonexistent/model", "--device", "cpu", "-o", out]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "/nonexistent/model" in err


def test_env_var_is_the_default_and_the_flag_wins(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMNI_ACCEL_MODEL", "/nonexistent/from-env")
    assert main(["generate", "x", "--device", "cpu", "-o", str(tmp_path / "o.png")]) == 2
    assert "/nonexistent/from-env" in capsys.readouterr().err
    monkeypatch.setenv("OMNI_ACCEL_DEVICE", "cpu")
    assert _generate(tiny_flux_dir, tmp_path / "o.png", "--report", "none") == 0


def test_argparse_errors_and_help_return_codes(capsys):
    assert main(["generate", "x", "--compile", "sometimes"]) == 2
    assert main(["generate", "x", "--sp", "two"]) == 2
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    assert "OMNI_ACCEL_MODEL" in out and "OMNI_ACCEL_DEVICE" in out and "precedence" in out


def test_info_prints_versions_backends_and_families(capsys):
    from omni_accel.pipelines import supported_families

    assert main(["info"]) == 0
    text = capsys.readouterr().out
    for word in ("omni_accel", "torch", "diffusers", "transformers", "python", "attention", "sdpa"):
        assert word in text
    assert "cpu only" in text or "cuda:0" in text
    for family in supported_families():
        assert family in text
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["families"] == supported_families()
    assert "sdpa" in info["attention_backends"]["cpu"]


def test_video_frames_save_as_gif_or_first_frame(tmp_path):
    import numpy as np

    class Out:
        frames = [np.random.default_rng(0).random((3, 16, 24, 3), dtype=np.float32)]

    gif = save_output(Out(), str(tmp_path / "v.gif"))
    assert gif["frames"] == 3 and gif["size"] == [24, 16]
    with Image.open(tmp_path / "v.gif") as im:
        assert im.n_frames == 3
    png = save_output(Out(), str(tmp_path / "v.png"))
    assert png["kind"] == "video (first frame)"
    with Image.open(tmp_path / "v.png") as im:
        assert im.size == (24, 16)


def test_python_dash_m_runs_the_same_cli(monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(sys, "argv", ["omni_accel", "generate", "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("omni_accel", run_name="__main__", alter_sys=False)
    assert exc.value.code == 0 and "--cache-config" in capsys.readouterr().out


def test_without_model_uses_builtin_with_its_defaults(monkeypatch, tmp_path, capsys):
    """--model left out: load_builtin(dtype=, device=), and every key of the model's call defaults reaches the call
    (max_sequence_length too: generate once dropped it, 5x slower on the built-in model) -- a stand-in module."""
    import types

    import torch

    calls = {}

    def load_builtin(path=None, dtype=torch.float32, device="cpu"):
        calls.update(dtype=dtype, device=device, pipe=tiny_pipeline("flux")[0])
        return calls["pipe"]

    fake = types.ModuleType("omni_accel.builtin")
    fake.load_builtin = load_builtin
    fake.call_defaults = lambda pipe: {"height": 32, "width": 64, "num_inference_steps": 2, "guidance_scale": 1.0,
                                       "max_sequence_length": 7}
    fake.off_trained_size = lambda pipe, height, width: None
    monkeypatch.setitem(sys.modules, "omni_accel.builtin", fake)
    monkeypatch.delenv("OMNI_ACCEL_MODEL", raising=False)
    out = tmp_path / "b.png"
    assert main(["generate", "a red circle", "--device", "cpu", "--report", "json", "-o", str(out)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {k: calls[k] for k in ("dtype", "device")} == {"dtype": torch.float32, "device": "cpu"}
    assert report["saved"]["size"] == [64, 32] and report["last_call"]["transformer_forwards"] == 2
    assert calls["pipe"].omni_accel.call_kwargs["max_sequence_length"] == 7


def test_real_builtin_model_when_shipped(tmp_path, capsys):
    builtin = pytest.importorskip("omni_accel.builtin")
    if not hasattr(builtin, "load_builtin"):
        pytest.skip("the built-in model is not in this tree yet")
    out = tmp_path / "builtin.png"
    assert main(["generate", "a red circle on a blue background", "--device", "cpu", "--steps", "2", "-o",
                 str(out)]) == 0
    with Image.open(out) as im:
        assert im.size == (builtin.BUILTIN_DEFAULTS["width"], builtin.BUILTIN_DEFAULTS["height"])


@pytest.mark.parametrize("command, flags, message", [
    ("serve", ["--default-size", "12by"], "error: --default-size: size='12by' is not 'WIDTHxHEIGHT'"),
    ("demo", ["--default-size", "12by"], "error: --default-size: size='12by' is not 'WIDTHxHEIGHT'"),
    ("demo", ["--default-steps", "0"], "error: --default-steps 0 is invalid: it must be >= 1."),
])
def test_serve_and_demo_refuse_bad_defaults_before_loading_the_model(capsys, command, flags, message):
    # the model path does not exist: an error naming it would mean the model was looked for before the flags
    assert main([command, "--model", "/nonexistent/model", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "/nonexistent/model" not in err


@pytest.mark.parametrize("flags, message", [
    (["-o", "noext"], "error: -o 'noext' has no extension: the image format comes from it; use e.g. noext.png (or "
                      ".jpg, .webp; .mp4 or .gif for a video)."),
    (["-o", "x.imgx"], "error: -o 'x.imgx' has extension '.imgx': the image format comes from it; use e.g. x.png (or "
                       ".jpg, .webp; .mp4 or .gif for a video)."),
    (["--true-cfg-scale", "4"], "error: --true-cfg-scale 4.0 runs true CFG only with a negative prompt: add "
                                "--negative-prompt TEXT (--negative-prompt '' for an empty one), or drop "
                                "--true-cfg-scale."),
])
def test_output_name_and_true_cfg_are_checked_before_the_model_loads(capsys, flags, message):
    # a model path that does not exist: an error naming it would mean the model was looked for first
    assert main(["generate", "x", "--model", "/nonexistent/model", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.strip() == message and "Traceback" not in err


def test_a_size_the_vae_cannot_encode_is_a_clear_error(tiny_flux_dir, tmp_path, capsys):
    assert main(["generate", "x", "--model", tiny_flux_dir, "--device", "cpu", "--width", "8",
                 "-o", str(tmp_path / "o.png")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: width=8 is too small: FluxPipeline needs at least 16 pixels per side (sides are multiples of 16: the "
        "VAE's down-sampling x 2x2 patches).")
    assert not (tmp_path / "o.png").exists()


def test_diffusers_names_of_the_sampling_flags_and_version(capsys):
    from omni_accel import __version__
    from omni_accel.cli import build_parser

    args = build_parser().parse_args(["generate", "x", "--num-inference-steps", "3", "--guidance-scale", "2.5",
                                      "--num-frames", "9"])
    assert (args.steps, args.guidance, args.frames) == (3, 2.5, 9)
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"omni-accel {__version__}"


def test_every_flag_of_every_command_is_documented():
    from omni_accel.cli import SUBCOMMANDS, build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == set(SUBCOMMANDS)
    for name, sub in commands.items():
        undocumented = [a.option_strings or a.dest for a in sub._actions if not a.help]
        assert not undocumented, f"omni-accel {name}: flags without help: {undocumented}"


def test_import_and_help_stay_light():
    """`import omni_accel` and `omni-accel --help` load neither torch nor diffusers (they took 4-5 s; the times are
    measured by benchmarks/bench_startup.py)."""
    code = ("import sys, omni_accel; from omni_accel.cli import main; code = main(['--help']); "
            "print(code, sorted(m for m in ('torch', 'diffusers', 'transformers', 'fastapi', 'gradio') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT)).stdout
    assert out.strip().splitlines()[-1] == "0 []"


def test_torchvision_notes_are_silenced_on_the_command_line(caplog):
    """transformers' note when torchvision is absent, and a mismatched torchvision's image-extension warning, were
    printed by every command; the CLI drops both (and nothing else)."""
    import logging
    import warnings

    from omni_accel.cli import _quiet_torchvision

    noisy = logging.getLogger("transformers.utils.import_utils")
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        _quiet_torchvision()
        warnings.warn_explicit("Failed to load image Python extension", UserWarning, "image.py", 1,
                               module="torchvision.io.image")
        warnings.warn_explicit("something else", UserWarning, "x.py", 1, module="somewhere")
        noisy.warning("`CLIPImageProcessor` requires torchvision (not installed); falling back to ...")
        noisy.warning("an unrelated import note")
    assert [str(w.message) for w in caught] == ["something else"]
    assert [r.getMessage() for r in caplog.records] == ["an unrelated import note"]


def test_calibrate_runs_like_the_other_commands(tiny_flux_dir, tmp_path, capsys):
    """calibrate takes --model / --device / --dtype like generate (the built-in model without --model), shows its
    progress, and writes the profile."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\n")
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--model", tiny_flux_dir, "--device", "cpu", "--prompts", str(prompts), "--steps", "8",
                 "--height", "32", "--width", "48", "--target-psnr", "20", "--batch-size", "1", "-o", str(out)]) == 0
    captured = capsys.readouterr()
    profile = json.loads(out.read_text())
    assert profile["steps"] == 8 and profile["criterion"] == "min" and profile["prompts"] == 1
    assert profile["call_kwargs"]["height"] == 32 and profile["call_kwargs"]["width"] == 48
    assert json.loads(captured.out.strip().splitlines()[-1])["family"] == "flux"
    assert "calibrating (reference, then threshold trials)" in captured.err
    assert main(["calibrate", "--model", tiny_flux_dir, "--steps", "0", "-o", str(out)]) == 2
    assert capsys.readouterr().err.strip().endswith("error: --steps 0 is invalid: it must be >= 1.")
