"""``CompiledFusion``: everything kiln derives from one version of a fusion definition.

A fusion's Rust core bumps its version on every change to the definition or the schedule;
the first use after a change starts a fresh ``CompiledFusion`` and drops the old one with
all its lowerings, so nothing derived from an earlier version is kept or reused.
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, List, Optional, Tuple


class CompiledFusion:
    """The lowerings and launchers of one fusion version, by input signature and heuristic."""

    __slots__ = ("version", "as_scheduled", "by_inputs", "by_heuristic", "launchers", "shape_scalars",
                 "aliases", "mesh")

    def __init__(self, version: int) -> None:
        self.version = version
        # The fusion lowered as scheduled (a hand schedule, or `as_written` runs).
        self.as_scheduled: Optional[Any] = None
        # Automatic lowerings: input sizes/layout/device -> lowering, and heuristic -> the
        # same lowering, so that sizes the schedulers treat alike share one.
        self.by_inputs: Dict[Hashable, Any] = {}
        self.by_heuristic: Dict[Hashable, Any] = {}
        # GPU input signature -> (specialised launcher, its evaluator): the fast path.
        self.launchers: Dict[Hashable, Tuple[Any, Any]] = {}
        # Positions of the scalar inputs that tensor shapes read.
        self.shape_scalars: Optional[List[int]] = None
        # In-place outputs: (output position, input position).
        self.aliases: Optional[List[Tuple[int, ...]]] = None
        # A sharded fusion's mesh program and stage definitions (``multidevice.MeshRun``).
        self.mesh: Optional[Any] = None

    def lowerings(self) -> List[Any]:
        """Every distinct lowering this version holds."""
        out: Dict[int, Any] = {id(low): low for low in self.by_heuristic.values()}
        if self.as_scheduled is not None:
            out[id(self.as_scheduled)] = self.as_scheduled
        return list(out.values())


def compiled(fd: Any) -> CompiledFusion:
    """The ``CompiledFusion`` of ``fd``'s current version (a fresh one after any change)."""
    c: Optional[CompiledFusion] = fd._compiled
    version = fd._core.version
    if c is None or c.version != version:
        c = fd._compiled = CompiledFusion(version)
    return c
