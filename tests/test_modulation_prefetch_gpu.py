"""modulation_prefetch.py on a GPU: the side stream's outputs in eager forwards, in one CUDA graph and in a capture
broken into graphs around a host call (as SageAttention's calls break it). Needs CUDA; runs as a script too
(``python tests/test_modulation_prefetch_gpu.py``) on machines without pytest."""

import torch

from omni_accel import cuda_graphs, modulation_prefetch

try:
    import pytest

    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
except ImportError:  # run as a script where pytest is not installed
    def needs_cuda(test):
        return test


def _linears(count: int = 4, width: int = 64) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    linears = [torch.nn.Linear(width, 6 * width, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
    for linear in linears:
        linear.__class__ = modulation_prefetch.PrefetchedLinear
    return linears


def _forward(temb: torch.Tensor, linears: list, host_call: bool) -> list[torch.Tensor]:
    """What a transformer forward does with them: prefetch once temb exists, then each block takes its output (with,
    between the first block and the rest, a call that runs outside the graph)."""
    modulation_prefetch.prefetch(temb, linears)
    big = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)  # main-stream work beside the GEMVs
    outs = [linears[0](torch.nn.functional.silu(temb)) + 0 * (big @ big).sum()]
    if host_call:
        outs[0] = cuda_graphs.run_outside_graph(lambda x: x * 2, (outs[0],), tuple(outs[0].shape), outs[0].dtype)
    outs += [linear(torch.nn.functional.silu(temb)) for linear in linears[1:]]
    return outs


def _expected(temb: torch.Tensor, linears: list, host_call: bool) -> list[torch.Tensor]:
    act = torch.nn.functional.silu(temb)
    outs = [torch.nn.functional.linear(act, linear.weight, linear.bias) for linear in linears]
    if host_call:
        outs[0] = outs[0] * 2
    return outs


def _check(host_call: bool) -> None:
    linears = _linears()
    temb = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    # the side stream held back ~20 ms: a block that took its output without waiting for the event would read memory
    # the GEMV has not written yet
    with torch.cuda.stream(modulation_prefetch._side_stream(torch.cuda.current_stream())):
        torch.cuda._sleep(20_000_000)
    for outs, want in zip(_forward(temb, linears, host_call), _expected(temb, linears, host_call)):
        torch.testing.assert_close(outs, want, rtol=0, atol=0)
    outputs, replay = cuda_graphs.CudaGraphBackend(torch.device("cuda")).capture(
        lambda: _forward(temb, linears, host_call))
    for seed in (1, 2):
        torch.manual_seed(seed)
        temb.copy_(torch.randn_like(temb))
        replay()
        torch.cuda.synchronize()
        for out, want in zip(outputs, _expected(temb, linears, host_call)):
            torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert not modulation_prefetch._slots and not modulation_prefetch._forked_in_capture


@needs_cuda
def test_prefetched_outputs_in_eager_forwards_and_one_cuda_graph():
    _check(host_call=False)


@needs_cuda
def test_prefetched_outputs_across_the_graphs_of_a_capture_broken_by_a_host_call():
    _check(host_call=True)


if __name__ == "__main__":
    test_prefetched_outputs_in_eager_forwards_and_one_cuda_graph()
    test_prefetched_outputs_across_the_graphs_of_a_capture_broken_by_a_host_call()
    print("modulation prefetch GPU checks passed")
