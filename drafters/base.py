"""Shared pieces of the drafters; the protocol itself lives in verify.protocol."""

from __future__ import annotations

from verify.protocol import DraftContext, Drafter
from verify.tree import TreeError, TreeTopology

__all__ = ["DraftContext", "Drafter", "check_depth"]


def check_depth(topology: TreeTopology, max_depth: int | None, drafter: str) -> None:
    """Refuse, at construction, a tree deeper than the drafter can fill."""
    if max_depth is not None and topology.depth > max_depth:
        raise TreeError(f"tree depth {topology.depth} exceeds what {drafter} can fill "
                        f"(at most {max_depth})")
