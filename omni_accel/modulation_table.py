"""The AdaLN modulation linears of a whole denoising run, computed once per pipeline call.

Why: a DiT block's shift / scale / gate come from ``linear(silu(temb))``, a GEMV that reads a whole weight matrix for
one token per sample (FLUX.1: 76 of them per forward, 6.4 GB of weights). Their input depends only on the timestep
and the call's conditioning (FLUX: the pooled text and the guidance), and the pipeline's scheduler holds every
timestep of the run before the first step. So at the call's first forward the embedding module runs once over all
steps and each modulation linear runs one GEMM over them: its weight is read once per call instead of once per step.
Measured upper bound (the outputs recorded once, ``bench_peers.py``'s ``*_frozenmod`` probe rows): 2.1 ms of a
127 ms bf16 FLUX forward and 1.8 ms of an 89.6 ms int8 one on an H100 (docs/benchmarks.md).

How:
- A hook on the transformer (before its forward, outside any CUDA graph) fills the table when the pipeline call or
  the conditioning changed. The family maps the scheduler's timesteps to the transformer's timestep argument and
  that to the embedding module's arguments (pipelines/<family>.py, ``ModulationTable``); rows are (step, sample)
  pairs. Before that, once per fill, it checks that this forward's timestep is one of the schedule's (one host
  sync per call). Outside a pipeline call, or when the check fails, the forward computes the plain model's GEMVs:
  where a whole-forward CUDA graph may replay the table's lookups, by filling the table with its own rows (the same
  answer); elsewhere in the blocks, as without the table.
- A hook on the embedding module (inside the forward, so a CUDA graph records it) gives each sample the row whose
  ``temb`` is nearest to the forward's own (within ``MATCH_TOLERANCE`` of its largest value) and hands every
  modulation linear its rows through modulation_prefetch.py's slots, which its ``PrefetchedLinear`` takes. A sample
  with no such row is counted on the GPU, without a sync.
- At the end of a pipeline call (its work done), the count is read. A miss means a forward's modulation came from
  another step: the call raises AccelError, and from then on the table holds each forward's own rows.
- The table tensors are buffers of the modules (not saved with the weights): a larger table moves them, and a
  whole-forward CUDA graph, which watches its module's buffer addresses (cuda_graphs.py), is captured again.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable

import torch
from diffusers.hooks import ModelHook

from .errors import AccelError
from .hooks import add_hook
from .modulation_prefetch import _lock, _Slot, _slots, modulation_input, serve_linears

logger = logging.getLogger(__name__)

# Whether the compile pass computes the family's modulation linears once per call from this table (where the family
# declares one) instead of per forward (the prefetch, inside CUDA graphs). Measured on an H100, FLUX 1024², 28-step
# schedules inside a pipeline call: 124.7 against 126.9 ms per step in bf16, 86.6 against 88.1 with int8 linears
# (bench_peers_h100_flux_modtable_20261207.json); False: the A side.
MODULATION_TABLE = True
# A sample's temb matches a table row when no value differs by more than this fraction of its largest |value|: the
# table's embedding ran on all rows in one batch, which may round differently from the forward's (a few 16-bit
# steps); another step's temb differs by far more.
MATCH_TOLERANCE = 2.0 ** -5
# Conditionings whose rows one call may hold (true CFG has two): past that, the call's forwards compute their own
# rows, so that a pipeline that changes its conditioning every step cannot grow the table without bound.
MAX_CONDITIONINGS = 4
_TEMB_BUFFER = "_omni_accel_table_temb"
_MISS_BUFFER = "_omni_accel_table_misses"
_ROWS_BUFFER = "_omni_accel_table_rows"


class ModulationTable:
    """The table of one transformer: rows of ``temb`` (a buffer of the embedding module) and of each modulation
    linear's output (a buffer of that linear), and which rows this pipeline call has filled."""

    def __init__(self, pipe, transformer: torch.nn.Module, embedding: torch.nn.Module,
                 linears: list[torch.nn.Linear], spec, state, fill_own_rows: bool = True):
        self.pipe, self.transformer, self.embedding, self.linears = pipe, transformer, embedding, linears
        self.spec, self.state, self.fill_own_rows = spec, state, fill_own_rows
        self.signature = inspect.signature(type(transformer).forward)
        self.call = -1  # state.calls when the schedule's rows were filled
        self.filled: dict[tuple, bool] = {}  # conditioning key -> True (schedule rows) this call
        self.filled_values: list[tuple] = []  # copies of the conditioning tensors whose schedule rows are filled
        self.own_rows_this_call = False  # a forward of this call was off the schedule: the rest fill their own rows
        self.rows = 0  # rows in use, from the top
        self.own_rows_only = False  # after a miss: every forward fills its own rows
        self.filling = False  # the embedding hook stays out of the table's own embedding call

    # -- before the forward (host) ------------------------------------------------------------------------
    def before_forward(self, args: tuple, kwargs: dict) -> None:
        bound = self.signature.bind(self.transformer, *args, **kwargs).arguments
        in_call = self.state is not None and self.state.in_call and not self.own_rows_only
        if in_call and self.call != self.state.calls:
            self.call, self.filled, self.filled_values, self.rows = self.state.calls, {}, [], 0
            self.own_rows_this_call = False
        if in_call and not self.own_rows_this_call:
            key = self._conditioning_key(bound)
            if self.filled.get(key):
                return
            values = self._values(bound)
            if values in self:  # the same conditioning at a new address
                self.filled[key] = True
                return
            schedule = self._schedule_rows(bound) if len(self.filled) < MAX_CONDITIONINGS else None
            if schedule is not None:
                self._fill(bound, schedule, start=self.rows)
                self.filled[key] = True
                self.filled_values.append(values)
                return
            self.own_rows_this_call = True  # the rest of this call: each forward its own rows (they overwrite)
        self.rows = 0
        if self.fill_own_rows:
            self._fill(bound, bound[self.spec.timestep_arg].reshape(-1), start=0)

    def _values(self, bound: dict) -> tuple:
        """The conditioning tensors themselves (copies: a pipeline may reuse their memory), and the batch's shape."""
        return tuple(value.detach().clone() if isinstance(value, torch.Tensor) else value
                     for value in (bound.get(name) for name in self.spec.conditioning)) \
            + (tuple(bound[self.spec.batch_arg].shape),)

    def __contains__(self, values: tuple) -> bool:
        """Whether the schedule's rows of a conditioning with these values are filled this call (one host sync per
        comparison: only when a conditioning tensor shows up at a new address, as a pipeline that builds its
        guidance tensor every step does)."""
        def same(a, b) -> bool:
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                        and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b))
            return a == b

        return any(all(same(a, b) for a, b in zip(values, filled)) for filled in self.filled_values)

    def _conditioning_key(self, bound: dict) -> tuple:
        """What, besides the timestep, decides temb: the conditioning tensors by identity and shape, and the batch."""
        parts = []
        for name in self.spec.conditioning:
            value = bound.get(name)
            parts.append((name, value.data_ptr(), tuple(value.shape)) if isinstance(value, torch.Tensor)
                         else (name, value))
        return tuple(parts) + (tuple(bound[self.spec.batch_arg].shape),)

    def _schedule_rows(self, bound: dict) -> torch.Tensor | None:
        """The transformer's timestep argument at every step of the scheduler's schedule ((steps x samples,)), or
        None (logged) when this forward's timestep is not one of them or there is no schedule."""
        scheduler = getattr(self.pipe, "scheduler", None)
        timesteps = getattr(scheduler, "timesteps", None)
        own = bound[self.spec.timestep_arg]
        if not isinstance(timesteps, torch.Tensor) or not isinstance(own, torch.Tensor) or own.ndim != 1:
            return None
        batch = bound[self.spec.batch_arg].shape[0]
        if own.shape[0] != batch:
            return None
        rows = self.spec.schedule_timestep(timesteps.to(own.device), batch, bound[self.spec.batch_arg].dtype)
        in_schedule = bool((rows.view(-1, batch) == own.to(rows.dtype)[None]).all(dim=1).any())  # one sync
        if not in_schedule:
            logger.info("omni_accel: this forward's timestep is not one of the scheduler's; the modulation table "
                        "serves each forward's own rows for the rest of this call")
            return None
        return rows

    @torch.no_grad()
    def _fill(self, bound: dict, timestep: torch.Tensor, start: int) -> None:
        """Rows [start, start + R) for the timestep argument's R values: the embedding, then each linear's GEMM."""
        self.filling = True
        try:
            temb = self.embedding(*self.spec.embedding_args(bound, timestep))
        finally:
            self.filling = False
        end = start + temb.shape[0]
        self._reserve(end, temb)
        table_temb = self.embedding._buffers[_TEMB_BUFFER]
        table_temb[start:end] = temb
        table_temb[end:] = float("inf")  # rows past the filled ones never match
        activations: dict[torch.dtype, torch.Tensor] = {}
        for linear in self.linears:
            linear._buffers[_ROWS_BUFFER][start:end] = torch.nn.functional.linear(
                modulation_input(temb, linear, activations), linear.weight, linear.bias)
        self.rows = end

    def _reserve(self, rows: int, temb: torch.Tensor) -> None:
        """Buffers for at least ``rows`` rows (grown by doubling: a move recaptures a whole-forward CUDA graph)."""
        current = self.embedding._buffers.get(_TEMB_BUFFER)
        if current is not None and current.shape[0] >= rows and current.dtype == temb.dtype \
                and current.device == temb.device:
            return
        capacity = max(rows, 2 * current.shape[0] if current is not None else 0)
        old_rows = self.rows if current is not None else 0
        # ordinary tensors even under torch.inference_mode: a later call outside it writes them in place
        with torch.inference_mode(False):
            grown = torch.full((capacity, temb.shape[-1]), float("inf"), dtype=temb.dtype, device=temb.device)
            if old_rows:
                grown[:old_rows] = current[:old_rows]
            self.embedding.register_buffer(_TEMB_BUFFER, grown, persistent=False)
            misses = self.embedding._buffers.get(_MISS_BUFFER)
            if misses is None or misses.device != temb.device:
                self.embedding.register_buffer(_MISS_BUFFER, torch.zeros(1, dtype=torch.int32, device=temb.device),
                                               persistent=False)
            for linear in self.linears:
                table = torch.empty(capacity, linear.weight.shape[0], dtype=linear.weight.dtype, device=temb.device)
                if old_rows:
                    table[:old_rows] = linear._buffers[_ROWS_BUFFER][:old_rows]
                linear.register_buffer(_ROWS_BUFFER, table, persistent=False)

    # -- inside the forward (recorded by a CUDA graph) -------------------------------------------------------
    def hand_out(self, temb: torch.Tensor) -> None:
        """Each sample's nearest row of the table, to every modulation linear's slot; misses counted."""
        table_temb = self.embedding._buffers[_TEMB_BUFFER]
        distance = (temb.float()[:, None, :] - table_temb.float()[None]).abs().amax(dim=-1)  # (samples, rows)
        nearest, index = distance.min(dim=1)
        matched = nearest <= MATCH_TOLERANCE * temb.float().abs().amax(dim=-1)
        self.embedding._buffers[_MISS_BUFFER].add_((~matched).sum().to(torch.int32))
        slots, activations = {}, {}
        for linear in self.linears:  # with what the block feeds the linear, which PrefetchedLinear checks once
            out = linear._buffers[_ROWS_BUFFER].index_select(0, index)
            slots[linear.weight.data_ptr()] = _Slot(out, None, modulation_input(temb, linear, activations))
        with _lock:
            _slots.update(slots)

    # -- after the pipeline call (host) -----------------------------------------------------------------------
    def after_call(self) -> None:
        """Read the call's miss count; on a miss serve own rows from now on and raise AccelError."""
        misses = self.embedding._buffers.get(_MISS_BUFFER)
        if misses is None:
            return
        missed = int(misses.item())
        if not missed:
            return
        misses.zero_()
        self.own_rows_only = True
        message = (f"omni_accel: {missed} forward(s) of this pipeline call ran with a timestep or conditioning "
                   "that the modulation table did not hold (a scheduler that calls the transformer between its "
                   "steps?), so their AdaLN modulation came from another step and this call's output is wrong. The "
                   "table now computes each forward's own rows; to turn it off, set "
                   "omni_accel.modulation_table.MODULATION_TABLE = False before accelerate().")
        raise AccelError(message)  # AccelState.end_call raises it once the call is left (logs it if the call raised)

    def release(self) -> None:
        """Drop the table's buffers (the undo)."""
        for module, name in ([(self.embedding, _TEMB_BUFFER), (self.embedding, _MISS_BUFFER)]
                             + [(linear, _ROWS_BUFFER) for linear in self.linears]):
            if name in module._buffers:
                delattr(module, name)  # also forgets it as a non-persistent buffer
        self.filled_values = []


class _BeforeForward(ModelHook):
    def __init__(self, table: ModulationTable):
        super().__init__()
        self.table = table

    def pre_forward(self, module, *args, **kwargs):
        self.table.before_forward(args, kwargs)
        return args, kwargs


class _HandOut(ModelHook):
    def __init__(self, table: ModulationTable):
        super().__init__()
        self.table = table

    def post_forward(self, module, output):
        if isinstance(output, torch.Tensor) and not self.table.filling and self.table.rows:
            self.table.hand_out(output)  # no rows: the linears compute themselves
        return output


def tabulates(spec, transformer: torch.nn.Module) -> bool:
    """Whether ``spec`` (a family's ``ModulationPrefetch``) declares a table that describes ``transformer``'s temb."""
    table = spec.table if spec is not None else None
    return table is not None and (table.applies is None or table.applies(transformer))


def use_modulation_table(pipe, transformer: torch.nn.Module, spec, state,
                         fill_own_rows: bool = True) -> tuple[int, Callable[[], None]]:
    """Serve the modulation linears that ``spec`` (pipelines/base.py's ``ModulationPrefetch`` with a ``table``)
    names in ``transformer`` from a table filled once per pipeline call of ``state`` (an AccelState, or None: no
    call). A forward outside a call (or off its schedule) fills the table with its own rows if ``fill_own_rows``
    (needed under a whole-forward CUDA graph, which replays the lookups it captured), else its linears compute
    themselves. Returns how many linears and the undo; (0, no-op) when the family declares no table for this
    transformer (``tabulates``) or the embedding module or the linears are absent."""
    served = serve_linears(transformer, spec) if tabulates(spec, transformer) else None
    if served is None:
        return 0, lambda: None
    embedding, linears, unserve = served
    table = ModulationTable(pipe, transformer, embedding, linears, spec.table, state, fill_own_rows)
    remove_before = add_hook(transformer, "modulation_table", _BeforeForward(table))
    remove_hand_out = add_hook(embedding, "modulation_table", _HandOut(table))
    if state is not None:
        state.on_call_end(table.after_call)

    def undo() -> None:
        remove_before()
        remove_hand_out()
        if state is not None:
            state.remove_call_hooks(table.after_call)
        unserve()
        table.release()

    return len(linears), undo
