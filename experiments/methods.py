"""What the benchmarks time and how: a method (a decoder of one prompt: Hugging Face
`generate`, or this framework's loop with a drafter, named by a compare entry), the prompts
they all decode, and the timing of every method on every prompt, each prompt's record a row
of the figures (bench_report.summarise reads them).

A compare entry, "<drafter>:<tree>[:key=value,...]", names conf/drafter/<drafter>.yaml and
conf/tree/<tree>.yaml with keys overridden (`parse_compare`); the prompts are Spec-Bench
questions through the target's chat template, as token ids (`spec_bench_prompts`); methods
run one after another on each prompt, so machine noise hits all alike, `repeats` times over
all prompts (`time_methods`). experiments.bench is the command; peers, served, demo,
context_sweep and batch_bench time with the same pieces.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from drafters import build_drafter, check_rule_fits
from drafters.checkpoint import KEPT_DIR
from drafters.draft_model import load_draft_model, truncated_copy
from experiments.bench_report import summarise
from experiments.common import CONF_DIR, pick_questions, report_name
from experiments.data import Question
from verify.loop import generate
from verify.protocol import Drafter, DraftStats, ProposalCounts, Resettable
from verify.rules import RuleConfig, check_rule, rule_for_decoding, rule_parts
from verify.runtime.model import Target, hf_generate, load_target_from_config
from verify.runtime.timing import device_clock
from verify.sampling import SamplingParams

COMPARE_FORMAT = "<drafter>:<tree>[:key=value,...]"

Method = Callable[[torch.Tensor, int, int], dict]  # (prompt (T,), max_new_tokens, seed) -> record


class Contender(NamedTuple):
    """A drafter to time through the tree verifier, under its method name; `rule` names the
    acceptance rule (None: greedy at temperature 0, exact sampling above), with its settings
    when it is a mapping (verify.rules.RuleConfig)."""

    name: str
    drafter: DictConfig
    tree: DictConfig
    rule: RuleConfig = None


class Prompt(NamedTuple):
    """One prompt every method decodes."""

    category: str      # what the figures are grouped by
    question_id: str
    ids: torch.Tensor  # (T,) token ids


def encoded(questions: list[Question], target: Target) -> list[Prompt]:
    """Spec-Bench questions as every method (and every engine) is handed them: through the
    target's chat template, as token ids."""
    return [Prompt(q.category, q.question_id, target.encode_prompt(q.prompt)) for q in questions]


def spec_bench_prompts(cfg: DictConfig, target: Target, warmup: int = 0) -> list[Prompt]:
    """cfg.num_prompts Spec-Bench questions spread over cfg.categories (common.pick_questions,
    from cfg.data_root; `warmup` of them to run untimed first), `encoded`."""
    return encoded(pick_questions(cfg.data_root, cfg.num_prompts, cfg.categories, warmup),
                   target)


def sampling_params(cfg: DictConfig) -> SamplingParams:
    return SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)


def baseline_name(params: SamplingParams) -> str:
    """Hugging Face `generate` of the target alone, greedy or sampling as the run decodes."""
    return "hf_greedy" if params.greedy else "hf_sample"


def hf_method(target: Target, params: SamplingParams, **generate_kwargs) -> Method:
    """A method running Hugging Face `generate` with extra keyword arguments, sampling with
    `params` (seeded per call) unless they are greedy."""
    if not params.greedy:
        generate_kwargs.update(do_sample=True, temperature=params.temperature,
                               top_k=params.top_k, top_p=params.top_p)

    def run(ids: torch.Tensor, max_new_tokens: int, seed: int) -> dict:
        torch.manual_seed(seed)
        tokens = hf_generate(target, ids, max_new_tokens, **generate_kwargs)
        return {"new_tokens": len(tokens), "tokens": tokens.tolist()}
    return run


def treedraft_method(target: Target, drafter: Drafter | None, params: SamplingParams,
                     rule: RuleConfig = None, pad_rows: int = 1,
                     attn_implementation: str | None = None) -> Method:
    """A method running this framework's loop (drafter None: plain decoding) with `params`
    and acceptance `rule` (None: the default for params), every step padded to `pad_rows`
    rows (verify.loop.generate_batch), the target's attention switched to
    `attn_implementation` for its runs if given (the baselines keep the target's own). Its
    record counts the draft forwards when the drafter runs a DraftEngine."""
    stats = drafter if isinstance(drafter, DraftStats) else None
    weights = own_weights_bytes(drafter, target.model) if drafter is not None else 0
    # a hybrid's running count per member
    proposed = drafter.proposed if isinstance(drafter, ProposalCounts) else None

    def run(ids: torch.Tensor, max_new_tokens: int, seed: int) -> dict:
        before = stats.draft_forwards if stats is not None else 0  # a running count: diff it
        proposed_before = dict(proposed) if proposed is not None else {}
        generator = torch.Generator(target.model.device).manual_seed(seed)
        with attention(target.model, attn_implementation):
            result = generate(target.step, ids, max_new_tokens, drafter=drafter,
                              sampling=params, eos_token_id=target.eos_token_ids,
                              generator=generator, rule=rule, pad_rows=pad_rows)
        record = {"new_tokens": len(result.tokens), "tokens": result.tokens.tolist(),
                  "steps": [vars(s) for s in result.steps], "prefill_s": result.prefill_s}
        if drafter is not None:
            record["draft_weights_mb"] = weights / 2**20
        if stats is not None:
            record["draft_forwards"] = stats.draft_forwards - before
            # the memory the draft cache holds at the end (its layers' room): its peak
            record["draft_cache_mb"] = stats.draft_cache_bytes() / 2**20
        if proposed is not None:
            record["proposed_by"] = {name: count - proposed_before.get(name, 0)
                                     for name, count in proposed.items()}
        return record
    if isinstance(drafter, Resettable):
        run.forget = drafter.forget  # a drafter with memory: time_methods resets it
    return run


@contextmanager
def attention(model: torch.nn.Module, implementation: str | None) -> Iterator[None]:
    """Run `model` with another attention implementation (None: its own), then restore it."""
    own = model.config._attn_implementation
    if implementation is not None:
        model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        if implementation is not None:
            model.set_attn_implementation(own)


def own_weights_bytes(drafter: Drafter, target_model: torch.nn.Module) -> int:
    """Bytes of the drafter's parameters and buffers that are not the target's (a shared
    embedding or LM head is counted once, with the target): what the drafter adds."""
    def tensors(module: torch.nn.Module):
        return [*module.parameters(), *module.buffers()]

    shared = {t.data_ptr() for t in tensors(target_model)}
    own = {t.data_ptr(): t.numel() * t.element_size()
           for module in vars(drafter).values() if isinstance(module, torch.nn.Module)
           for t in tensors(module) if t.data_ptr() not in shared}
    return sum(own.values())


def parse_compare(entry: str, greedy: bool | None = None) -> Contender:
    """One `compare` entry, "<drafter>:<tree>[:key=value,...]": conf/drafter/<drafter>.yaml with
    the keys overridden (each must be one of its keys), conf/tree/<tree>.yaml, and the method
    name "<drafter>/<tree>", or "<drafter>/<tree> (<label>)" given `label=<label>`.
    Raises ValueError for a malformed entry, an unknown drafter, tree or key, or a rule
    that does not fit the drafter or, where `greedy` says how the run decodes, the decoding."""
    parts = entry.split(":", 2)  # the overrides may hold colons (paths)
    if len(parts) < 2 or not all(parts[:2]):
        raise ValueError(f"compare entry {entry!r} is not {COMPARE_FORMAT}")
    drafter_cfg, tree_cfg = _conf_file("drafter", parts[0]), _conf_file("tree", parts[1])
    overrides = _overrides(parts[2] if len(parts) == 3 else "", entry)
    label = overrides.pop("label", None)
    rule = overrides.pop("rule", None)
    tree_overrides = overrides.pop("tree", OmegaConf.create({}))
    _check_keys(entry, parts[0], overrides, set(drafter_cfg) - {"name"}, "")
    _check_keys(entry, parts[1], tree_overrides, set(tree_cfg) - {"name", "choices"}, "tree.")
    name = f"{drafter_cfg.name}/{tree_cfg.name}" + (f" ({label})" if label else "")
    drafter_cfg, tree_cfg = _merged(drafter_cfg, overrides), _merged(tree_cfg, tree_overrides)
    _check_rule(entry, rule, drafter_cfg, tree_cfg, greedy)
    return Contender(name, drafter_cfg, tree_cfg, rule)


def _check_rule(entry: str, rule: RuleConfig, drafter_cfg: DictConfig,
                tree_cfg: DictConfig, greedy: bool | None) -> None:
    """`rule=<name>`, or `rule.name=<name>,rule.<setting>=<value>` (verify.rules.RuleConfig):
    refused here, before anything loads, when the rule, a setting or its value is unknown or
    wrong, when the rule verifies chains only and the drafter's trees may branch, or when it
    does not fit greedy decoding (`greedy`; None: not known here)."""
    try:
        check_rule(*rule_parts(rule))
        check_rule_fits(rule, drafter_cfg, tree_cfg)
        if greedy is not None:
            rule_for_decoding(rule_parts(rule)[0], greedy)
    except ValueError as error:
        raise ValueError(f"compare entry {entry!r}: {error}") from None


def _merged(cfg: DictConfig, overrides: DictConfig) -> DictConfig:
    """`cfg` with `overrides` over it, where a dotted key may index a list:
    members.1.checkpoint=<path> sets the second member's checkpoint (a hybrid's)."""
    merged = OmegaConf.create(OmegaConf.to_container(cfg))
    for key, value in _leaves(OmegaConf.to_container(overrides)):
        OmegaConf.update(merged, key, value, merge=True)
    return merged


def _leaves(tree: dict, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, value) of every leaf of a nested dict."""
    leaves = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            leaves += _leaves(value, f"{prefix}{key}.")
        else:
            leaves.append((f"{prefix}{key}", value))
    return leaves


def _check_keys(entry: str, owner: str, overrides: DictConfig, settable: set[str],
                prefix: str) -> None:
    """Refuse an override of a key `owner`'s config does not have (the name picks the file,
    and a static tree's choices are a list the entry's syntax cannot spell)."""
    unknown = sorted(f"{prefix}{key}" for key in set(overrides) - settable)
    if unknown:
        keys = sorted(f"{prefix}{key}" for key in settable)
        raise ValueError(f"compare entry {entry!r}: {owner} cannot set {unknown}; its keys: "
                         f"{keys}" + ("" if prefix else " (and label, rule, tree.<key>)"))


def _conf_file(group: str, name: str) -> DictConfig:
    """conf/<group>/<name>.yaml, or a ValueError listing the known names."""
    path = Path(CONF_DIR) / group / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ValueError(f"compare: unknown {group} {name!r}; known: {known}")
    return OmegaConf.load(path)


def _overrides(text: str, entry: str) -> DictConfig:
    """"key=value,..." as a config, values typed as YAML reads them (1, null, /a/path)."""
    items = [item for item in text.split(",") if item]
    bad = [item for item in items if not re.fullmatch(r"(tree\.)?\w+(\.\w+)*=.*", item)]
    if bad:
        raise ValueError(f"compare entry {entry!r}: {bad} not key=value ({COMPARE_FORMAT})")
    return OmegaConf.from_dotlist(items)


def contenders(cfg: DictConfig) -> list[Contender]:
    """The drafters to time: `drafter=`/`tree=` first, then the `compare` entries; a name
    already taken (the same drafter and tree twice, no label) gets " #2", " #3", ..."""
    found = [Contender(f"{cfg.drafter.name}/{cfg.tree.name}", cfg.drafter, cfg.tree)]
    found += kept_contenders(cfg)
    for entry in cfg.compare:
        contender = parse_compare(entry, sampling_params(cfg).greedy)
        taken, name, suffix = {c.name for c in found}, contender.name, 2
        while name in taken:
            name, suffix = f"{contender.name} #{suffix}", suffix + 1
        found.append(contender._replace(name=name))
    return found


def kept_contenders(cfg: DictConfig) -> list[Contender]:
    """drafter=/tree= with each draft that the run cfg.kept kept (train.py keep_every=), in
    step order; ValueError when the folder keeps none."""
    if not cfg.get("kept"):
        return []
    folders = sorted(Path(cfg.kept, KEPT_DIR).glob("step-*"),
                     key=lambda folder: int(folder.name.removeprefix("step-")))
    if not folders:
        raise ValueError(f"kept={cfg.kept} holds no kept drafts ({KEPT_DIR}/step-<N>/): train "
                         "with keep_every=<steps> to keep them")
    return [Contender(f"{cfg.drafter.name}/{cfg.tree.name} ({folder.name.replace('-', ' ')})",
                      OmegaConf.merge(cfg.drafter, {"checkpoint": str(folder)}), cfg.tree)
            for folder in folders]


def build_methods(cfg: DictConfig, target: Target, drafters: list[Contender]) -> dict:
    """Method name -> method, in the order they run on each prompt (baseline first)."""
    params = sampling_params(cfg)
    methods = {baseline_name(params): hf_method(target, params)}
    if "plain_loop" in cfg.peers:
        methods["plain_loop"] = treedraft_method(target, None, params, pad_rows=cfg.pad_rows,
                                                 attn_implementation=cfg.loop_attention)
    for contender in drafters:
        drafter = build_drafter(contender.drafter, contender.tree, target)
        methods[contender.name] = treedraft_method(target, drafter, params, contender.rule,
                                                   cfg.pad_rows, cfg.loop_attention)
    if "hf_prompt_lookup" in cfg.peers:
        methods["hf_prompt_lookup"] = hf_method(
            target, params, prompt_lookup_num_tokens=cfg.hf_prompt_lookup_num_tokens)
    if "hf_assisted" in cfg.peers:
        methods["hf_assisted"] = hf_method(target, params,
                                           assistant_model=hf_assistant(cfg, target))
    return methods


def hf_assistant(cfg: DictConfig, target: Target):
    """The draft Hugging Face's assisted generation runs: a saved model (hf_assistant_path,
    e.g. a distilled draft over the whole vocabulary), else the target's first
    hf_assistant_num_layers layers (`assistant_layers`)."""
    if cfg.hf_assistant_path is None:
        return truncated_copy(target.model, assistant_layers(cfg.hf_assistant_num_layers,
                                                             target.model.config))
    model, vocab_ids = load_draft_model(cfg.hf_assistant_path, target)
    if vocab_ids is not None:
        raise ValueError(f"{cfg.hf_assistant_path} drafts over a reduced vocabulary, which "
                         "Hugging Face's assisted generation cannot use: distil one with "
                         "drafter.draft_vocab_size=null, or drop hf_assisted from peers")
    return model


def assistant_layers(asked: int | None, config) -> int:
    """Layers of the target the hf_assisted peer keeps: `asked`, or null's a fifth of them
    (6 of SmolLM2's 30, 1 of a two-layer tiny target); ValueError naming the keys when the
    target has too few layers for what was asked."""
    total = config.num_hidden_layers
    if asked is None:
        return max(1, total // 5)
    if not 1 <= asked < total:
        raise ValueError(f"hf_assistant_num_layers={asked} does not fit a target of {total} "
                         f"layers (1 to {total - 1}): set it, or null for a fifth of them, "
                         "or drop hf_assisted from peers")
    return asked


def check_bench(cfg: DictConfig) -> list[Contender]:
    """Refuse what the config of a bench (or batch_bench, context_sweep: the same schema)
    cannot mean, before the command makes its out_dir or loads anything: repeats or
    max_new_tokens below 1 (transformers refused 0 only inside the timed baseline), a
    reference other than the baseline or plain_loop in peers, a bad compare entry; returns
    the contenders."""
    for key in ("repeats", "max_new_tokens"):
        if cfg[key] < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[key]}")
    if cfg.reference not in (None, "plain_loop") or (cfg.reference and
                                                    cfg.reference not in cfg.peers):
        raise ValueError(f"reference must be null (the baseline) or plain_loop with plain_loop "
                         f"in peers, got reference={cfg.reference!r}, peers={list(cfg.peers)}")
    return contenders(cfg)


def run_benchmark(cfg: DictConfig) -> dict:
    """Time every method on every prompt; returns the summary (see bench_report.summarise)."""
    drafters = check_bench(cfg)  # before the target loads
    # picked before the target loads: a bad count or category fails at once
    questions = pick_questions(cfg.data_root, cfg.num_prompts, cfg.categories, cfg.warmup)
    target = load_target_from_config(cfg.target)
    methods = build_methods(cfg, target, drafters)
    prompts = encoded(questions, target)
    records = time_methods(methods, prompts, cfg, device=target.model.device)
    params = sampling_params(cfg)
    baseline = baseline_name(params)
    # greedy: every method's output must be the reference's, token for token; sampled outputs
    # differ by design (their distribution is the correctness command's test)
    reference = (cfg.reference or baseline) if params.greedy else None
    summary = summarise(records, baseline, reference)
    note = memory_note(methods, drafters)
    if note:
        summary["memory"] = note
    return summary


MEMORY_PROTOCOL = ("drafters with memory start every repeat (and the first after the warm-up) "
                   "with their warm start only, empty without one; "
                   "within a repeat, prompt i drafts from the outputs of prompts 0..i-1 only: "
                   "an output joins the memory when the next prompt begins")


def time_methods(methods: dict[str, Method], prompts: list[Prompt], cfg: DictConfig,
                 desc: str = "bench", device: torch.device | str = "cpu"
                 ) -> dict[str, list[dict]]:
    """Run every method on every prompt, `cfg.repeats` times over all prompts, after
    `cfg.warmup` untimed prompts; returns each method's records, timed (on the target's
    `device`: an accelerator is synchronised before each clock reading). A method with a
    `forget` (a drafter with memory) is emptied before every repeat (MEMORY_PROTOCOL), so no
    prompt is ever drafted from its own earlier answer."""
    clock = device_clock(device)
    for prompt in prompts[: cfg.warmup]:  # first calls pay one-off costs; keep them out
        for run in methods.values():
            run(prompt.ids, min(cfg.max_new_tokens, 16), cfg.seed)
    records = defaultdict(list)
    with tqdm(total=cfg.repeats * len(prompts), desc=desc, unit="prompt") as bar:
        for repeat in range(cfg.repeats):
            forget_memories(methods)
            for index, prompt in enumerate(prompts):
                # every method samples prompt i of run r from the same seed
                seed = cfg.seed + repeat * len(prompts) + index
                for name, run in methods.items():
                    start = clock()
                    record = run(prompt.ids, cfg.max_new_tokens, seed)
                    record.update(seconds=clock() - start, repeat=repeat,
                                  category=prompt.category, question_id=prompt.question_id)
                    records[name].append(record)
                bar.update()
    return records


def forget_memories(methods: dict[str, Method]) -> None:
    """Empty the memory of every method whose drafter keeps one."""
    for run in methods.values():
        if isinstance(run, Resettable):
            run.forget()


def memory_note(methods: dict[str, Method], drafters: list[Contender]) -> str | None:
    """How the drafters with memory were warmed, for the report (None: no such drafter)."""
    if not any(isinstance(run, Resettable) for run in methods.values()):
        return None
    warmed = sorted({str(path) for c in drafters for path in _warm_files(c.drafter)})
    return MEMORY_PROTOCOL + (f"; warmed first from {', '.join(warmed)}" if warmed else "")


def _warm_files(drafter_cfg: DictConfig) -> list:
    """The warm-up files a drafter config (or a hybrid's members) names."""
    members = [m for m in drafter_cfg.get("members", []) if not isinstance(m, str)]
    return [cfg[key] for cfg in [drafter_cfg, *members] for key in ("warm_from", "memory_file")
            if cfg.get(key)]


def treedraft_records(cfg: DictConfig, target: Target, prompts: list[Prompt],
                      entries: list[str], desc: str, plain: bool = True
                      ) -> dict[str, list[dict]]:
    """Records of treedraft's plain loop (unless `plain` is false) and each compare entry on
    `prompts`, greedy, named treedraft/<method>: timed as `time_methods` times (cfg.warmup
    prompts untimed first, one repeat, cfg.max_new_tokens), what an engine's method is put
    beside (experiments.peers, experiments.served)."""
    params = SamplingParams()  # greedy
    methods = {"treedraft/plain_loop": treedraft_method(target, None, params)} if plain else {}
    for entry in entries:
        contender = parse_compare(entry, params.greedy)
        drafter = build_drafter(contender.drafter, contender.tree, target)
        methods[f"treedraft/{contender.name}"] = treedraft_method(target, drafter, params,
                                                                 contender.rule)
    timing = OmegaConf.create({"warmup": cfg.warmup, "repeats": 1, "seed": 0,
                               "max_new_tokens": cfg.max_new_tokens})
    return time_methods(methods, prompts, timing, desc=desc, device=target.model.device)


def report_stem(cfg: DictConfig, *kind: str) -> str:
    """The result files' name (common.report_name): the target and every drafter's method
    name with its acceptance rule, then `kind` (batch_bench's "batch": its report is not the
    bench's), then the settings that change the figures (temperature, the target's step and
    dtype) where they are not the defaults."""
    return report_name(cfg, "+".join(map(_method_part, contenders(cfg))), *kind)


def _method_part(contender: Contender) -> str:
    """A method in the report's name: its name, and its rule where an entry names one (two
    entries of one drafter and tree with other rules measure other things)."""
    name, settings = rule_parts(contender.rule)
    if name is None:
        return contender.name
    return "-".join([contender.name, name, *(f"{k}={v}" for k, v in settings.items())])
