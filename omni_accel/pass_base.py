"""The contract every pass keeps: ``check`` may only look, ``apply`` patches and records its undo."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .config import AccelConfig
from .errors import NotAvailableYet
from .pipelines.base import ModelAdapter
from .state import AccelState


@dataclass
class PassContext:
    pipe: Any
    adapter: ModelAdapter
    config: AccelConfig
    device: torch.device
    state: AccelState | None = None  # set once validation is over and patching begins

    def __deepcopy__(self, memo: dict) -> "PassContext":
        """Shared, not copied: hooks of a deep-copied module belong to the same accelerate() call (a copy would
        drag a copy of the whole pipeline along)."""
        return self


class AccelPass:
    """A generic transformation of a pipeline, driven by its adapter.

    ``check`` runs for every wanted pass before any ``apply``: it raises AccelError and must not change the
    pipeline. ``apply`` patches and calls ``ctx.state.record(name, undo, **details)`` once per undoable change.
    """

    name: str = "pass"

    def wanted(self, config: AccelConfig) -> bool:
        raise NotImplementedError

    def check(self, ctx: PassContext) -> None:
        """Raise AccelError if this pass cannot apply to ``ctx.pipe``; look, don't touch."""

    def apply(self, ctx: PassContext) -> None:
        raise NotImplementedError


class PlannedPass(AccelPass):
    """A knob the config accepts but whose pass is built in a later issue: refusing it beats ignoring it."""

    def __init__(self, name: str, knob: str, is_set: Callable[[AccelConfig], bool], issue: str):
        self.name = name
        self._knob = knob
        self._is_set = is_set
        self._issue = issue

    def wanted(self, config: AccelConfig) -> bool:
        return self._is_set(config)

    def check(self, ctx: PassContext) -> None:
        raise NotAvailableYet(self._knob, getattr(ctx.config, self._knob), self._issue)

    def apply(self, ctx: PassContext) -> None:  # pragma: no cover -- check always refuses first
        raise AssertionError("PlannedPass.apply is unreachable: check() refuses")
