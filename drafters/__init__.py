"""Drafters: each proposes a TokenTree for the shared verifier (see verify.protocol).

A new drafter is one module here with a `from_config(cfg, topology, target)` builder, one entry
in DRAFTERS, one YAML in conf/drafter/, and one row in tests/drafters/test_drafter_table.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from drafters import draft_model, medusa, prompt_lookup
from verify.protocol import Drafter
from verify.target import Target
from verify.tree import TreeTopology

DrafterBuilder = Callable[[Mapping, TreeTopology, Target], Drafter]

DRAFTERS: dict[str, DrafterBuilder] = {
    "draft_model": draft_model.from_config,
    "medusa": medusa.from_config,
    "prompt_lookup": prompt_lookup.from_config,
}


def build_drafter(drafter_cfg: Mapping, tree_cfg: Mapping, target: Target) -> Drafter:
    """The drafter named by `drafter_cfg["name"]` (a conf/drafter/*.yaml mapping), filling the
    topology of `tree_cfg["choices"]` (conf/tree/*.yaml) for `target`.

    Raises ValueError for an unknown name and TreeError for a tree the drafter cannot fill.
    """
    name = drafter_cfg["name"]
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; known drafters: {sorted(DRAFTERS)}")
    topology = TreeTopology.from_choices(tree_cfg["choices"])
    return DRAFTERS[name](drafter_cfg, topology, target)
