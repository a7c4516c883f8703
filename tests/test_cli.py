"""The omni-accel command line, run in-process through main(argv) on a tiny FLUX pipeline folder."""

import json
import sys

import pytest
from PIL import Image

from omni_accel.cli import main, save_output
from omni_accel.testing import tiny_pipeline


@pytest.fixture(scope="module")
def tiny_flux_dir(tmp_path_factory):
    pipe, _ = tiny_pipeline("flux")
    path = tmp_path_factory.mktemp("tiny_flux")
    pipe.save_pretrained(path)
    return str(path)


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


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--sp", "0"], "sp=0"),
        (["--attention", "nope"], "attention='nope'"),
        (["--cache-config", "{not json"], "--cache-config"),
        (["--cache-config", '{"a": 1}'], "cache_config"),
        (["--steps", "0"], "--steps"),
        (["--quant", "int3"], "quant='int3'"),
    ],
)
def test_bad_values_exit_2_with_clear_message(tiny_flux_dir, tmp_path, capsys, flags, needle):
    assert _generate(tiny_flux_dir, tmp_path / "o.png", *flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err
    assert "Traceback" not in err
    assert not (tmp_path / "o.png").exists()


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
    """--model left out: load_builtin(dtype=, device=) and BUILTIN_DEFAULTS fill the call (a stand-in module)."""
    import types

    import torch

    calls = {}

    def load_builtin(path=None, dtype=torch.float32, device="cpu"):
        calls.update(dtype=dtype, device=device)
        return tiny_pipeline("flux")[0]

    fake = types.ModuleType("omni_accel.builtin")
    fake.load_builtin = load_builtin
    fake.BUILTIN_DEFAULTS = {"height": 32, "width": 64, "num_inference_steps": 2, "guidance_scale": 1.0}
    monkeypatch.setitem(sys.modules, "omni_accel.builtin", fake)
    monkeypatch.delenv("OMNI_ACCEL_MODEL", raising=False)
    out = tmp_path / "b.png"
    assert main(["generate", "a red circle", "--device", "cpu", "--report", "json", "-o", str(out)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert calls == {"dtype": torch.float32, "device": "cpu"}
    assert report["saved"]["size"] == [64, 32] and report["last_call"]["transformer_forwards"] == 2


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
