"""The int8 GEMM's gated-residual epilogue (kernels/int8_gemm_triton.py's ``_int8_gemm_rescale_residual*_kernel``,
op ``omni_accel::int8_mm_rescale_residual``): every kernel variant in Triton's interpreter against the op's PyTorch
reference, and lowered for sm_90 (what the interpreter cannot see: MMAs, warp specialization, spills).

This file is also the interpreter's worker: ``TRITON_INTERPRET=1 python tests/test_int8_gated_residual.py OUT.json``
(TRITON_INTERPRET must be set before triton is imported, hence a subprocess, as tests/kernels_worker.py does for the
other kernels). The reference rounds the GEMM's product to the output dtype before the gated add, as the unfused
graph does, so the kernels' outputs must equal it bit for bit: the int32 sums are exact, the rescale and the add the
same float32 operations, and the interpreter's float32 output is rounded to 16 bits by torch (to nearest even).
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import traceback

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (M, K, N, bias, output dtype, gate dtype, config, residual row padding, residual column offset): rows and columns
# that leave partial tiles of the interpreter's 32 x 32 x 32 tile (and partial halves in the TMA / warp-specialized
# kernels, which compute and store 16 columns at a time), a partial K block (40), fp16, Wan's float32 gate, a float32
# output, a residual whose rows are wider than the output (a row stride other than N), one that starts off TMA's
# 16-byte alignment (the persistent kernels read a copy); the persistent kernels with more tiles than the
# interpreter's 4 programs, so that each program walks several.
CASES = {
    "pointer-40x64x72-bias-bf16": (40, 64, 72, True, "bfloat16", "bfloat16", None, 0, 0),
    "pointer-33x40x24-nobias-bf16-strided": (33, 40, 24, False, "bfloat16", "bfloat16", None, 8, 1),
    "pointer-17x96x40-bias-fp16": (17, 96, 40, True, "float16", "float16", None, 0, 0),
    "pointer-40x64x72-bias-bf16-fp32gate": (40, 64, 72, True, "bfloat16", "float32", None, 0, 0),
    "tma-70x128x64-nobias-bf16": (70, 128, 64, False, "bfloat16", "bfloat16", "tma_128x256x128", 0, 0),
    "tma-40x48x72-bias-bf16-strided": (40, 48, 72, True, "bfloat16", "bfloat16", "tma_128x256x128", 8, 0),
    "tma-40x48x72-bias-bf16-misaligned": (40, 48, 72, True, "bfloat16", "bfloat16", "tma_128x256x128", 8, 3),
    "ws-70x128x64-nobias-bf16": (70, 128, 64, False, "bfloat16", "bfloat16", "ws_128x256x128", 0, 0),
    "ws-as-tma-70x128x64-nobias-bf16": (70, 128, 64, False, "bfloat16", "bfloat16", "ws_128x256x128", 0, 0),
    "ws-40x48x72-bias-fp16-strided": (40, 48, 72, True, "float16", "float16", "ws_128x256x128", 8, 0),
    "ws-40x48x72-bias-fp16-misaligned": (40, 48, 72, True, "float16", "float16", "ws_128x256x128", 8, 1),
    "ws-40x48x72-bias-fp32": (40, 48, 72, True, "float32", "float32", "ws_128x256x128", 0, 0),
    # the warp-specialized twin's epilogue with its residual and / or output through pointers (RESIDUAL_WS_IO 1-3),
    # with a residual of wider rows so that the pointer load's row stride is not N
    # (72 columns: the last 16-column half tile partial, so the pointer paths' column masks are exercised)
    "ws-70x128x72-bias-bf16-strided-io1": (70, 128, 72, True, "bfloat16", "bfloat16", "ws_128x256x128", 8, 0),
    "ws-70x128x72-bias-bf16-strided-io2": (70, 128, 72, True, "bfloat16", "bfloat16", "ws_128x256x128", 8, 0),
    "ws-70x128x72-bias-bf16-strided-io3": (70, 128, 72, True, "bfloat16", "bfloat16", "ws_128x256x128", 8, 0),
    # with SPLIT_TAIL on, 14 tiles of which the last 2 would be split along K: the residual call keeps them whole
    "ws-64x96x224-bias-bf16-splittail": (64, 96, 224, True, "bfloat16", "bfloat16", "ws_128x256x128", 0, 0),
    # more than FEW_ROWS rows, no config: where the plain call takes the warp-specialized kernel (the interpreter
    # counts as Hopper), the residual call takes the TMA kernel's twin unless RESIDUAL_WARP_SPECIALIZED is on
    "default-1040x32x40-nobias-bf16": (1040, 32, 40, False, "bfloat16", "bfloat16", None, 0, 0),
    "default-1040x32x40-nobias-bf16-wsresidual": (1040, 32, 40, False, "bfloat16", "bfloat16", None, 0, 0),
}
POINTER, TMA, WS = ("_int8_gemm_rescale_residual_kernel", "_int8_gemm_rescale_residual_tma_kernel",
                    "_int8_gemm_rescale_residual_ws_kernel")
LAUNCHED = {case: {None: POINTER, "tma_128x256x128": TMA, "ws_128x256x128": WS}[config]
            for case, (_, _, _, _, _, _, config, _, _) in CASES.items()}
LAUNCHED.update({"default-1040x32x40-nobias-bf16": TMA, "default-1040x32x40-nobias-bf16-wsresidual": WS,
                 "ws-as-tma-70x128x64-nobias-bf16": TMA})


def _operands(m: int, k: int, n: int, has_bias: bool, dtype, gate_dtype, padding: int, offset: int):
    from omni_accel.kernels import int8

    gen = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, m)[:, None]
    x_int8, x_scale = int8.quantize_rows_int8(x)
    w_int8, w_scale = int8.quantize_rows_int8(torch.randn(n, k, generator=gen))
    bias = torch.randn(n, generator=gen).to(dtype) if has_bias else None
    # the gate as the graph hands it over: one row of a modulation output's chunk, (1, 1, N), not contiguous
    modulation = torch.randn(1, 3 * n, generator=gen).to(gate_dtype)
    gate = modulation.chunk(3, dim=1)[2].unsqueeze(1)
    residual = (torch.randn(m, n + padding, generator=gen) * 4).to(dtype)[:, offset:offset + n]
    return (x_int8, w_int8, x_scale, w_scale.reshape(1, -1), bias), gate, residual


def interpreted_cases() -> dict:
    """Each case's kernel output against ``int8_mm_rescale_residual_reference``, the kernels launched, and whether the
    residual was left as it was."""
    from omni_accel.kernels import int8
    from omni_accel.kernels import int8_gemm_triton as g

    from kernels_worker import record_launches

    launched = []
    stop_recording = record_launches(g, launched, keywords=("IO",))
    results = {}
    for key, (m, k, n, has_bias, dtype_name, gate_dtype_name, config, padding, offset) in CASES.items():
        g.SPLIT_TAIL = key.endswith("splittail")
        # the ws- cases ask for the warp-specialized twin; "ws-as-tma" asks for it with the switch off
        g.RESIDUAL_WARP_SPECIALIZED = key.endswith("wsresidual") or (key.startswith("ws-") and "as-tma" not in key)
        g.RESIDUAL_WS_IO = int(key[-1]) if "-io" in key else 0
        launched.clear()
        try:
            dtype = getattr(torch, dtype_name)
            operands, gate, residual = _operands(m, k, n, has_bias, dtype, getattr(torch, gate_dtype_name), padding,
                                                 offset)
            before = residual.clone()
            got = g.int8_mm_rescale(*operands, dtype, config=config, gate=gate, residual=residual)
            want = int8.int8_mm_rescale_residual_reference(*operands, gate, residual, dtype)
            # the gated add on the unrounded product: what a kernel that skipped the product's rounding would give
            product = int8.int8_mm_rescale_reference(*operands, torch.float32)
            once = (residual.float() + gate.float().reshape(1, -1) * product).to(dtype)
            results[key] = {"equal": bool(torch.equal(got, want)), "dtype": str(got.dtype), "shape": list(got.shape),
                            "max_abs_err": (got.float() - want.float()).abs().max().item(),
                            "differs_from_one_rounding": not torch.equal(want, once),
                            "residual_unchanged": bool(torch.equal(residual, before)), "launched": list(launched)}
        except Exception:  # noqa: BLE001 -- recorded per case
            results[key] = {"error": traceback.format_exc()[-3000:]}
        finally:
            g.SPLIT_TAIL = False
            g.RESIDUAL_WARP_SPECIALIZED = False
            g.RESIDUAL_WS_IO = 0
    stop_recording()
    return results


def unknown_io_refusal() -> str:
    """The message of the warp-specialized twin's call with RESIDUAL_WS_IO set to a value it does not take."""
    from omni_accel.kernels import int8_gemm_triton as g

    operands, gate, residual = _operands(70, 128, 64, False, torch.bfloat16, torch.bfloat16, 0, 0)
    g.RESIDUAL_WARP_SPECIALIZED, g.RESIDUAL_WS_IO = True, 7
    try:
        g.int8_mm_rescale(*operands, torch.bfloat16, config="ws_128x256x128", gate=gate, residual=residual)
        return "no error"
    except ValueError as exc:
        return str(exc)
    finally:
        g.RESIDUAL_WARP_SPECIALIZED, g.RESIDUAL_WS_IO = False, 0


def main(out_path: str) -> int:
    from omni_accel.kernels import fused

    result = {"interpreted": fused.interpreted(), "cases": interpreted_cases(), "unknown_io": unknown_io_refusal()}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    return 0


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """One subprocess with TRITON_INTERPRET=1 runs every case (~20 s)."""
    pytest.importorskip("triton", reason="triton is Linux-only in the test extra")
    out = tmp_path_factory.mktemp("gated_residual") / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_worker_ran_the_kernels_in_the_interpreter(interpreted):
    assert interpreted["interpreted"] is True and set(interpreted["cases"]) == set(CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_residual_kernels_equal_the_reference_bit_for_bit(interpreted, case):
    """Each kernel variant with the gated residual: the reference's output exactly (masked edges, bias or none,
    bf16 / fp16 / float32, a float32 gate, strided or misaligned residual rows), the residual untouched, the residual
    twin launched once (with SPLIT_TAIL on too: its last wave is not split; without a config, the TMA kernel's twin
    where the warp-specialized one would run, unless RESIDUAL_WARP_SPECIALIZED). In 16 bits the reference is not the
    gated add of the unrounded product, so a kernel that skipped that rounding would fail here. (The
    warp-specialized twin is right here and in the interpreter, and wrong in a few values on an H100 with Triton 3.6:
    int8_gemm_triton.RESIDUAL_WARP_SPECIALIZED.)"""
    r = interpreted["cases"][case]
    assert "error" not in r, r.get("error")
    m, _, n, _, dtype, _, _, _, _ = CASES[case]
    assert r["equal"] and r["max_abs_err"] == 0, r
    assert r["dtype"] == f"torch.{dtype}" and r["shape"] == [m, n] and r["residual_unchanged"], r
    assert [launch[0] for launch in r["launched"]] == [LAUNCHED[case]], r
    # the warp-specialized twin's epilogue IO as the case asked (RESIDUAL_WS_IO); the other twins take none
    want_io = {"IO": int(case[-1]) if "-io" in case else 0} if LAUNCHED[case] == WS else {}
    assert r["launched"][0][2] == want_io, r
    if dtype != "float32":
        assert r["differs_from_one_rounding"], r


def test_an_unknown_epilogue_io_is_refused_naming_the_values_it_takes(interpreted):
    assert interpreted["unknown_io"] == (
        "int8_gemm_triton.RESIDUAL_WS_IO=7: use 0 (residual and output through TMA), 1 (output through pointers), "
        "2 (residual through pointers) or 3 (both)")


def test_the_residual_stays_out_of_the_warp_specialized_kernel_unless_switched_on(monkeypatch):
    """``residual_in_gemm``, which the graph pass asks: off a GPU, up to FEW_ROWS rows (the pointer kernel), and on
    GPUs where the warp-specialized kernel does not run, the GEMM takes the residual; on Hopper above FEW_ROWS rows only
    with RESIDUAL_WARP_SPECIALIZED (off by default), since the TMA kernel's twin would run a slower main loop."""
    from omni_accel.kernels import int8_gemm_triton as g

    capability = [(9, 0)]
    monkeypatch.setattr(g, "_capability", lambda index: capability[0])
    cuda = torch.device("cuda", 0)
    assert g.RESIDUAL_WARP_SPECIALIZED is False
    assert g.residual_in_gemm(4096, torch.device("cpu")) and g.residual_in_gemm(g.FEW_ROWS, cuda)
    assert g.residual_in_gemm(g.FEW_ROWS + 1, cuda) is not g._WS_BUILDABLE  # Triton without it: the TMA kernel
    capability[0] = (10, 0)
    assert g.residual_in_gemm(4096, cuda)
    capability[0] = (9, 0)
    monkeypatch.setattr(g, "RESIDUAL_WARP_SPECIALIZED", True)
    assert g.residual_in_gemm(4096, cuda)
    monkeypatch.setattr(g, "RESIDUAL_WARP_SPECIALIZED", False)
    monkeypatch.setattr(g, "WARP_SPECIALIZE", False)
    assert g.residual_in_gemm(4096, cuda)


# --------------------------------------------------------------------------------- lowered for sm_90, no GPU needed
def _hopper_tools():
    """tests/test_kernels.py's ``_compile_for_hopper`` and ``_ptxas_report`` (loaded by path, as it loads its
    worker)."""
    spec = importlib.util.spec_from_file_location("test_kernels_for_gated_residual",
                                                  os.path.join(ROOT, "tests", "test_kernels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._compile_for_hopper, module._ptxas_report


_POINTERS = dict(x_ptr="*i8", w_ptr="*i8", out_ptr="*bf16", x_scale_ptr="*fp32", w_scale_ptr="*fp32",
                 bias_ptr="*bf16", gate_ptr="*bf16", residual_ptr="*bf16")


def _spilled_bytes(report: str) -> int:
    return max(int(found) for found in re.findall(r"(\d+) bytes spill stores", report))


def _residual_consts(tile, **more):
    import triton.language as tl

    block_m, block_n, block_k, group_m, _, _ = tile
    return dict(HAS_BIAS=True, ROUND_TO=tl.bfloat16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                GROUP_M=group_m, **more)


@pytest.mark.parametrize("name", ["pointer", "tma", "ws"])
def test_residual_kernels_lower_for_hopper(name):
    """Every tile of every residual twin lowers to an sm_90 cubin with s8 warp-group MMAs (and TMA copies for the
    persistent ones), within the 227 KiB of shared memory a block gets. The tiles the library picks on Hopper --
    the pointer kernel's for up to FEW_ROWS rows, the warp-specialized kernel's above -- spill nothing, and the
    warp-specialized twin keeps its producer / consumer partitions (Triton falls back silently where it cannot)."""
    from omni_accel.kernels import fused
    from omni_accel.kernels import int8_gemm_triton as g

    if fused.interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1; the worker covers that path")
    pytest.importorskip("triton", reason="triton is Linux-only in the test extra")
    compile_for_hopper, ptxas_report = _hopper_tools()
    if name == "pointer":
        kernel, tiles, no_spill = g._int8_gemm_rescale_residual_kernel, g.CONFIGS, {g.FEW_ROWS_TILE}
    elif name == "tma":
        kernel, tiles, no_spill = g._int8_gemm_rescale_residual_tma_kernel, g.TMA_CONFIGS, set()
    else:
        kernel, tiles, no_spill = g._int8_gemm_rescale_residual_ws_kernel, g.WS_CONFIGS, set(g.WS_CONFIGS)
    spills = {}
    for tile_name, tile in tiles.items():
        block_m, block_n, block_k, _, warps, stages = tile
        pointers = dict(_POINTERS)
        if name == "tma":  # blocks of half the tile's columns: the tile is computed and stored in two halves
            pointers.update(x_desc=f"tensordesc<i8[{block_m}, {block_k}]>",
                            w_desc=f"tensordesc<i8[{block_n // 2}, {block_k}]>",
                            out_desc=f"tensordesc<bf16[{block_m}, {block_n // 2}]>",
                            res_desc=f"tensordesc<bf16[{block_m}, {block_n // 2}]>")
        consts = (_residual_consts(tile, EVEN_K=True) if name == "pointer" else
                  _residual_consts(tile, PROGRAMS=132, **({"IO": g.RESIDUAL_WS_IO} if name == "ws" else {})))
        compiled = compile_for_hopper(kernel, pointers, consts, {"num_warps": warps, "num_stages": stages},
                                      floats=(), aligned=True)
        ptx = compiled.asm["ptx"]
        assert "wgmma" in ptx and ".s8" in ptx, tile_name
        assert compiled.metadata.shared <= 227 * 1024, (tile_name, compiled.metadata.shared)
        if name != "pointer":
            assert "cp.async.bulk.tensor" in ptx, tile_name
        if name == "ws":
            assert "ttg.warp_specialize" in compiled.asm["ttgir"] and "setmaxnreg" in ptx, tile_name
        spills[tile_name] = _spilled_bytes(ptxas_report(ptx))
    assert all(spills[tile_name] == 0 for tile_name in no_spill), spills



@pytest.mark.parametrize("io", [1, 2, 3])
def test_warp_specialized_epilogue_io_variants_lower_for_hopper(io):
    """RESIDUAL_WS_IO 1-3 (the residual and / or the output through pointers) lower for sm_90 into Triton's
    producer / consumer partitions with s8 warp-group MMAs and TMA operand loads; they may spill (they are A/B
    variants, not defaults), and with both through pointers the epilogue needs no shared-memory staging, so the
    kernel takes less shared memory than with TMA in and out."""
    from omni_accel.kernels import fused
    from omni_accel.kernels import int8_gemm_triton as g

    if fused.interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1; the worker covers that path")
    pytest.importorskip("triton", reason="triton is Linux-only in the test extra")
    compile_for_hopper, _ = _hopper_tools()
    tile = g.WS_CONFIGS[g.WS_TILE]
    launch = {"num_warps": tile[4], "num_stages": tile[5]}
    shared = {}
    for variant in (0, io):
        compiled = compile_for_hopper(g._int8_gemm_rescale_residual_ws_kernel, dict(_POINTERS),
                                      _residual_consts(tile, PROGRAMS=132, IO=variant), launch, floats=(),
                                      aligned=True)
        ptx = compiled.asm["ptx"]
        assert "wgmma" in ptx and ".s8" in ptx and "cp.async.bulk.tensor" in ptx, variant
        assert "ttg.warp_specialize" in compiled.asm["ttgir"] and "setmaxnreg" in ptx, variant
        shared[variant] = compiled.metadata.shared
    if io == 3:
        assert shared[3] < shared[0], shared

if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main(sys.argv[1]))
