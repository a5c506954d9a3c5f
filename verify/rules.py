"""The acceptance rules by name, and the forms configs give a rule in.

- greedy, sampling, typical, block: verify.accept.
- traversal: Traversal Verification of sampled trees (verify.traversal).
- spectr: SpecTr's k-sequential selection among siblings drawn i.i.d. (verify.multidraft).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from verify.accept import (
    AcceptanceRule,
    BlockVerificationRule,
    GreedyRule,
    RuleRefusal,
    SpeculativeSamplingRule,
    TypicalRule,
)
from verify.multidraft import KSequentialRule
from verify.sampling import SamplingParams
from verify.traversal import TraversalVerificationRule

RULES: dict[str, type[AcceptanceRule]] = {
    rule.name: rule for rule in (GreedyRule, SpeculativeSamplingRule, TypicalRule,
                                 BlockVerificationRule, TraversalVerificationRule,
                                 KSequentialRule)
}


def make_rule(name: str | None, params: SamplingParams, **settings) -> AcceptanceRule:
    """The named rule built with `settings` (typical: epsilon, alpha), or by default greedy at
    temperature 0 and exact sampling otherwise. ValueError for an unknown rule or setting, the
    greedy rule at a temperature above 0, or a sampling-only rule at temperature 0."""
    check_rule(name, settings)
    return RULES[rule_for_decoding(name, params.greedy)](**settings)


def rule_for_decoding(name: str | None, greedy: bool) -> str:
    """The rule's name for decoding greedily (temperature 0) or not: `name`, or by default
    greedy at temperature 0 and exact sampling otherwise. ValueError for the greedy rule at
    a temperature above 0, RuleRefusal for a sampling-only rule at temperature 0: what a
    command asks before anything loads, and `make_rule` again."""
    if name is None:
        return "greedy" if greedy else "sampling"
    if name == "greedy" and not greedy:
        raise ValueError("the greedy rule needs temperature 0; use 'sampling' or 'typical'")
    if RULES[name].sampling_only and greedy:
        raise RuleRefusal(f"the {name!r} rule verifies sampled drafts, but decoding is greedy "
                          "(temperature 0): use 'greedy' (or no rule) there")
    return name


def check_rule(name: str | None, settings: Mapping) -> None:
    """Refuse an unknown rule name, a setting the rule does not take (its constructor's
    keyword arguments), naming what it knows, or a value its constructor refuses; settings
    need a name (None: the default rule for the temperature, which is chosen later)."""
    if name is None:
        if settings:
            raise ValueError(f"acceptance rule settings {sorted(settings)} need the rule's name "
                             "as well ({name: typical, ...})")
        return
    if name not in RULES:
        raise ValueError(f"unknown acceptance rule {name!r}; the rule must be one of "
                         f"{sorted(RULES)}")
    settable = sorted(inspect.signature(RULES[name]).parameters)
    unknown = sorted(set(settings) - set(settable))
    if unknown:
        raise ValueError(f"acceptance rule {name!r} has no setting(s) {unknown}; its settings: "
                         f"{settable or 'none'}")
    RULES[name](**settings)  # its constructor refuses a value out of range


# A rule as configs give it: None (the default for the temperature), a name ("typical"), or,
# like a hybrid drafter's member, a mapping of the name and the rule's settings
# ({name: typical, epsilon: 0.05, alpha: 0.2}); code may pass a rule already built.
RuleConfig = str | Mapping | AcceptanceRule | None


def rule_parts(rule: RuleConfig) -> tuple[str | None, dict]:
    """(name, settings) of a rule config that is not a built rule."""
    if rule is None or isinstance(rule, str):
        return rule, {}
    settings = dict(rule)
    return settings.pop("name", None), settings


def rule_from_config(rule: RuleConfig, params: SamplingParams) -> AcceptanceRule:
    """The rule a config names, for sampling with `params` (see RuleConfig)."""
    if isinstance(rule, AcceptanceRule):
        return rule
    name, settings = rule_parts(rule)
    return make_rule(name, params, **settings)
