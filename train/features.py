"""The target's features over training sequences, extracted by prefill and cached in shards.

EAGLE-1 and Medusa-1 train on the frozen target's hidden states over fixed text: one
teacher-forced forward per sequence, no generation (5-8x cheaper per token than distilling
answers). Sequences are (input_ids (T,), loss_mask (T,)) pairs from either source: ShareGPT
conversations (`train.conversations`) or distilled answers (`answer_sequences`). Features go
through `verify.runtime.features.select_features`, so a drafter trains on the rows the verifier
hands it when decoding. Shards are written atomically: an interrupted extraction keeps the ones it
finished and the next run computes only the rest.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable, Iterator, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm import tqdm

from train.conversations import sharegpt_sequences
from train.distill import Answer
from train.distributed import DistEnv, all_reduce_sum
from train.feature_set import FeatureSet, SequenceFeatures, shard_entries
from train.lock import run_lock
from train.loop import batch_indices, chunks
from train.regen_features import corpus_features
from train.regen_folder import conversation_file
from verify.runtime.features import num_layers, resolve_layers, select_features
from verify.runtime.files import (
    read_or_rebuild,
    remove_orphans,
    save_tensors_atomically,
    shard_path,
    write_json,
)
from verify.runtime.model import Target, cache_root
from verify.runtime.timing import device_clock

TokenSequence = tuple[torch.Tensor, torch.Tensor]  # input_ids (T,) long, loss_mask (T,) bool
MANIFEST_FILE = "manifest.json"  # written when every shard of a cache is there
FEATURE_BYTES = 2  # float16


class LiveFeatures:
    """Sequences whose features the frozen target computes when a batch asks for them, in one
    padded forward: nothing on disk, but every epoch pays the prefill again (FeatureSet reads
    it once). `take` and `learned_tokens` as FeatureSet's."""

    def __init__(self, target: Target, sequences: Sequence[TokenSequence], layers: Sequence[int]):
        self.target, self.sequences = target, list(sequences)
        self.layers = resolve_layers(layers, num_layers(target.model.config))

    def __len__(self) -> int:
        return len(self.sequences)

    def take(self, indices: Sequence[int]) -> list[SequenceFeatures]:
        chosen = [self.sequences[i] for i in indices]
        states = target_features(self.target, [ids for ids, _ in chosen], self.layers)
        return [SequenceFeatures(ids, mask, f) for (ids, mask), f in zip(chosen, states)]

    def learned_tokens(self) -> Iterator[torch.Tensor]:
        return (ids[mask] for ids, mask in self.sequences)


def live_target(train_set: FeatureSet | LiveFeatures, target: Target) -> torch.nn.Module | None:
    """The target's model when it computes `train_set`'s features batch by batch (what
    dist.strategy=fsdp shards with the draft), else None."""
    return target.model if isinstance(train_set, LiveFeatures) else None


def answer_sequences(answers: list[Answer]) -> list[TokenSequence]:
    """Distilled answers as sequences: input_ids = prompt + response (P + R,), loss on the
    response."""
    return [(torch.cat([a.prompt, a.response]),
             torch.cat([torch.zeros(len(a.prompt), dtype=torch.bool),
                        torch.ones(len(a.response), dtype=torch.bool)]))
            for a in answers]


def training_features(data, target: Target, answers: list[Answer], heldout: list[Answer],
                      layers: Sequence[int], env: DistEnv | None = None
                      ) -> tuple[FeatureSet | LiveFeatures, FeatureSet]:
    """Features at `layers` of the training sequences (`training_sequences`: a regeneration's
    captured features, data.corpus; self-distilled `answers`; then `data.sharegpt_tokens`
    tokens of ShareGPT conversations prefilled) and of the held-out
    answers. `data`: the run's data config (sharegpt_tokens, max_sequence_tokens, seed,
    cache_dir, cache_hidden: false computes the training features live, batch by batch; the
    held-out ones, a few thousand tokens, are cached either way). Under torchrun (`env`), the
    ranks extract shares of each cache. Raises ValueError when there is nothing to train on."""
    sources, corpus = training_sequences(data, target, answers, heldout, layers)
    if not data.cache_hidden and not corpus:
        train = LiveFeatures(target, [s for source in sources for s in source], layers)
    else:  # one cache per source, so that a mix reuses what each source alone extracted
        if not data.cache_hidden:
            raise ValueError("data.corpus holds its features on disk: train on it with "
                             "data.cache_hidden=true")
        cache = _feature_cache(data)
        parts = [extract_features(target, source, layers, cache, env=env) for source in sources]
        train = FeatureSet.join(corpus + parts)
    return train, heldout_features(data, target, heldout, layers, env)


def training_sequences(data, target: Target, answers: list[Answer], heldout: list[Answer],
                       layers: Sequence[int]
                       ) -> tuple[list[list[TokenSequence]], list[FeatureSet]]:
    """The training data before any extraction: the token sequences of each source to prefill
    (the distilled `answers`, then data.sharegpt_tokens of conversations; empty sources left
    out) and data.corpus's captured features (a list of one, or none), without the sequences
    that begin with a `heldout` prompt. ValueError when there is nothing to train on."""
    sources = [answer_sequences(answers)]
    if data.sharegpt_tokens:
        given = data.get("conversations")
        path = conversation_file(given, target) if given else None
        sources.append(list(sharegpt_sequences(target.tokenizer, data.max_sequence_tokens,
                                               data.sharegpt_tokens, seed=data.seed, path=path)))
    sources = [source for source in sources if source]
    corpus = [without_prompts(corpus_features(data.corpus, target, layers),
                              [answer.prompt for answer in heldout])] if data.get("corpus") else []
    if not sources and not corpus:
        raise ValueError("no training data: set data.corpus, data.sharegpt_tokens or "
                         "data.num_prompts")
    return sources, corpus


def heldout_features(data, target: Target, heldout: list[Answer], layers: Sequence[int],
                     env: DistEnv | None = None) -> FeatureSet:
    """The held-out answers' features at `layers`, cached under data.cache_dir."""
    return extract_features(target, answer_sequences(heldout), layers, _feature_cache(data),
                            env=env)


def _feature_cache(data) -> Path | None:
    """Where feature shards go: <data.cache_dir>/features, or None for the default root."""
    return None if data.cache_dir is None else Path(data.cache_dir) / "features"


def without_prompts(features: FeatureSet, prompts: Sequence[torch.Tensor]) -> FeatureSet:
    """`features` without the sequences that begin with one of `prompts` (P_i,): the held-out
    prompts, which a corpus of the same prompt sets may hold too (a draft evaluated on what it
    trained on reads better than it is)."""
    kept = [entry for entry, (ids, _) in zip(features.entries, features.token_sequences())
            if not any(len(ids) >= len(p) and torch.equal(ids[:len(p)], p) for p in prompts)]
    if len(kept) < len(features.entries):
        print(f"corpus: {len(features.entries) - len(kept)} sequences left out: they begin with "
              "a held-out prompt")
    return FeatureSet(kept, features.layers, features.folder)


def extract_features(target: Target, sequences: Sequence[TokenSequence], layers: Sequence[int],
                     cache_dir: str | Path | None = None, tokens_per_batch: int = 8192,
                     env: DistEnv | None = None) -> FeatureSet:
    """The target's features at `layers` (indices into HF's hidden_states, -1 the last normed
    state) over `sequences`, from shards in the cache where present.

    Sequences are batched by length, each batch at most `tokens_per_batch` tokens with padding
    (one sequence at least), and one batch makes one shard. The cache folder under `cache_dir`
    (default: cache_root() / "features") is named by the target, the layers, the batching and
    every token id and mask, so another setting never reads these shards. Under torchrun
    (`env`), rank r extracts the missing shards b with b % world_size == r; the batching does
    not depend on the ranks, so the shards are those one process writes. When all are there,
    the main rank writes manifest.json. Before extracting, the bytes to write are printed, and
    refused (DiskSpaceError) when the disk has less free. A run that writes (the cache is not
    complete) holds the folder (train.lock): OutDirLocked when another live run does; a
    complete cache is read without it, by any number of runs.
    """
    env = env or DistEnv(0, 1, torch.device("cpu"))
    layers = resolve_layers(layers, num_layers(target.model.config))
    folder = feature_folder(cache_dir, target, layers, sequences, tokens_per_batch)
    folder.mkdir(parents=True, exist_ok=True)
    remove_orphans(folder)  # dead writers' temporary files (a live writer's stay)
    seen = all_reduce_sum(torch.tensor([int((folder / MANIFEST_FILE).exists())]), env)
    complete = seen.item() == env.world_size  # the same answer on every rank: run_lock is a
    # collective, every rank must take it or none
    with nullcontext() if complete else run_lock(folder, env, "data.cache_dir"):
        return _read_features(target, sequences, layers, folder, tokens_per_batch, env)


def _read_features(target: Target, sequences: Sequence[TokenSequence], layers: tuple[int, ...],
                   folder: Path, tokens_per_batch: int, env: DistEnv) -> FeatureSet:
    """extract_features' work: the missing shards extracted, every shard indexed (a shard that
    cannot be read is rebuilt); the features stay on disk until asked for."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))
    batches = _batches([len(sequences[i][0]) for i in order], tokens_per_batch)
    shards = {b: [sequences[order[i]] for i in batch] for b, batch in enumerate(batches)}
    missing = {b: batch for b, batch in shards.items() if not shard_path(folder, b).exists()}
    clock = device_clock(target.model.device)  # an accelerator's queued work included
    started = clock()
    if missing:
        check_disk_space(target, layers, missing, folder, env.is_main)
        _extract(target, layers, {b: batch for b, batch in missing.items()
                                  if b % env.world_size == env.rank}, folder, env)
    env.barrier()  # every rank reads every shard
    seconds = clock() - started
    found = [entry for b in shards for entry in read_or_rebuild(
        shard_path(folder, b), shard_entries,
        lambda b=b: _extract(target, layers, {b: shards[b]}, folder, env))]
    if env.is_main and not (folder / MANIFEST_FILE).exists():
        write_manifest(folder, target, layers, shards, missing, seconds, env.world_size)
    # found[k] is sequence order[k]: back to the caller's order
    given = [found[k] for k in sorted(range(len(order)), key=order.__getitem__)]
    return FeatureSet(given, layers, folder)


def write_manifest(folder: Path, target: Target, layers: tuple[int, ...],
                   shards: dict[int, list[TokenSequence]], extracted: dict[int, list],
                   seconds: float, ranks: int) -> None:
    """manifest.json: what the cache holds and, for the shards this run extracted, how fast
    (tokens over the wall time until every rank was done)."""
    tokens, new_tokens = token_count(shards.values()), token_count(extracted.values())
    write_json(folder / MANIFEST_FILE, {
        "target": target.fingerprint(), "layers": list(layers), "shards": len(shards),
        "sequences": sum(len(batch) for batch in shards.values()), "tokens": tokens,
        "bytes": feature_bytes(target, layers, shards.values()),
        "bytes_per_token": bytes_per_token(target, layers),
        "extracted": {"tokens": new_tokens, "seconds": round(seconds, 2), "ranks": ranks,
                      "tokens_per_s": round(new_tokens / max(seconds, 1e-9), 1)}})


class DiskSpaceError(OSError):
    """An offline feature extraction would write more than the disk has free."""


def feature_bytes(target: Target, layers: tuple[int, ...],
                  batches: Iterable[list[TokenSequence]]) -> int:
    """Bytes of float16 features over the sequences of `batches`: tokens x layers x hidden x 2."""
    return token_count(batches) * bytes_per_token(target, layers)


def bytes_per_token(target: Target, layers: tuple[int, ...]) -> int:
    return len(layers) * target.model.config.hidden_size * FEATURE_BYTES


def token_count(batches: Iterable[list[TokenSequence]]) -> int:
    """Tokens over the sequences of `batches`."""
    return sum(len(ids) for batch in batches for ids, _ in batch)


def check_disk_space(target: Target, layers: tuple[int, ...],
                     missing: dict[int, list[TokenSequence]], folder: Path, report: bool) -> None:
    """Print what the missing shards will take (`report`: one rank says it) and refuse before
    writing any when the disk holding `folder` has less free."""
    needed = feature_bytes(target, layers, missing.values())
    free = shutil.disk_usage(folder).free
    tokens = token_count(missing.values())
    if report:
        print(f"features: {tokens:,} tokens x {len(layers)} layers x "
              f"{target.model.config.hidden_size} x {FEATURE_BYTES} bytes -> "
              f"{needed / 2**30:.2f} GiB float16 in {folder} ({free / 2**30:.1f} GiB free)")
    if needed > free:
        raise DiskSpaceError(
            f"the features would take {needed / 2**30:.2f} GiB and {folder} has "
            f"{free / 2**30:.2f} GiB free: set data.cache_hidden=false to compute them live "
            "(nothing on disk), data.cache_dir= to another disk, or fewer tokens")


def _extract(target: Target, layers: tuple[int, ...], todo: dict[int, list[TokenSequence]],
             folder: Path, env: DistEnv) -> None:
    """Shard b of `folder` for every batch b in `todo`, with a progress bar in tokens (this
    rank's share)."""
    tokens = token_count(todo.values())
    if env.world_size > 1:
        print(f"features: rank {env.rank} extracts {len(todo)} shard(s), {tokens:,} tokens")
    with tqdm(total=tokens, unit="tok", desc="extracting features",
              disable=not env.is_main) as bar:
        for b, batch in todo.items():
            states = target_features(target, [ids for ids, _ in batch], layers)
            _write_shard(shard_path(folder, b), [SequenceFeatures(ids, mask, f)
                                                  for (ids, mask), f in zip(batch, states)])
            bar.update(token_count([batch]))


def target_features(target: Target, input_ids: list[torch.Tensor], layers: Sequence[int]
                    ) -> list[torch.Tensor]:
    """(T_i, F * H) float16 CPU features of each (T_i,) sequence, on the target's step: one
    paged prefill where the step serves one (target.step=openvino: OpenVINO's kernels, 1.2-4x
    Hugging Face's forward here), else Hugging Face's forward (`prefill_features`)."""
    if not getattr(target.step, "continuous_batching", False):
        return prefill_features(target.model, input_ids, layers)
    _, states = target.step.new_state(tuple(layers)).prefill_rows(input_ids)
    return [_stored(state, layers) for state in states]


@torch.no_grad()
def prefill_features(model: torch.nn.Module, input_ids: list[torch.Tensor], layers: Sequence[int]
                     ) -> list[torch.Tensor]:
    """(T_i, F * H) float16 CPU features of each (T_i,) sequence, in one right-padded forward.

    The base model runs without its LM head (no vocabulary-wide logits). Padding follows every
    real token and is masked, so it never reaches a real token's state.
    """
    width = max(len(ids) for ids in input_ids)
    padded = torch.zeros((len(input_ids), width), dtype=torch.long)  # (B, W)
    attention_mask = torch.zeros_like(padded)
    for row, ids in enumerate(input_ids):
        padded[row, :len(ids)] = ids
        attention_mask[row, :len(ids)] = 1
    out = model.base_model(input_ids=padded.to(model.device),
                           attention_mask=attention_mask.to(model.device),
                           output_hidden_states=True)
    features = _stored(select_features(out.hidden_states, layers), layers)  # (B, W, F*H)
    return [features[row, :len(ids)] for row, ids in enumerate(input_ids)]


def _stored(features: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
    """Features as the cache stores them: float16 on the CPU (half the bytes; drafters train
    under bf16 autocast anyway). Some layers carry "massive activations" (SmolLM2-135M: ~25k,
    float16 ends at 65,504): OverflowError where one does not fit."""
    stored = features.to(torch.float16).cpu()
    if not torch.isfinite(stored).all():
        raise OverflowError(f"features of layers {tuple(layers)} overflow float16")
    return stored


def feature_folder(cache_dir: str | Path | None, target: Target, layers: tuple[int, ...],
                   sequences: Sequence[TokenSequence], tokens_per_batch: int) -> Path:
    """A folder named by everything the shards depend on: the target's fingerprint (weights,
    dtype, adapter, config), the layers, the batching, every token. Token ids and masks are
    hashed as bytes: a JSON list of a million ids would cost seconds."""
    made = {"target": target.fingerprint(), "layers": layers, "tokens_per_batch": tokens_per_batch}
    if target.step_name != "eager":  # another step's kernels round otherwise
        made["step"] = target.step_name
    digest = hashlib.sha256(json.dumps(made).encode())
    for ids, mask in sequences:
        digest.update(len(ids).to_bytes(8, "little"))
        digest.update(ids.to(torch.int64).numpy().tobytes())
        digest.update(mask.to(torch.bool).numpy().tobytes())
    root = Path(cache_dir).expanduser() if cache_dir else cache_root() / "features"
    return root / target.name.replace("/", "--") / digest.hexdigest()[:16]


def _batches(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Consecutive runs of ascending `lengths` (as indices into them) whose padded size,
    count x longest, stays within `tokens_per_batch`."""
    batches: list[list[int]] = []
    for i, length in enumerate(lengths):
        if batches and (len(batches[-1]) + 1) * length <= tokens_per_batch:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _write_shard(path: Path, sequences: list[SequenceFeatures]) -> None:
    """Sequences concatenated, with lengths to split them again; written to a temporary name
    and renamed, so a shard on disk is always whole."""
    tensors = {
        "lengths": torch.tensor([len(s.input_ids) for s in sequences]),
        "input_ids": torch.cat([s.input_ids for s in sequences]).to(torch.long),
        "loss_mask": torch.cat([s.loss_mask for s in sequences]).to(torch.bool),
        "features": torch.cat([s.features for s in sequences]),
    }
    save_tensors_atomically(tensors, path)


def sequence_batcher(features: FeatureSet | LiveFeatures, cfg, env: DistEnv):
    """make_batch(step) -> the padded batch (pad_batch) of this rank's share of the step's
    cfg.optim.batch_sequences sequences, on env.device (batch_to_device)."""
    def make_batch(step: int) -> dict:
        picked = batch_indices(step, len(features), cfg.optim.batch_sequences, cfg.seed, env)
        batch = pad_batch(features.take(picked.tolist()))
        return batch_to_device(batch, env.device)
    return make_batch


def batch_to_device(batch: dict[str, torch.Tensor], device: torch.device
                    ) -> dict[str, torch.Tensor]:
    """A host batch's tensors on `device`. For a CUDA device they go through pinned
    (page-locked) memory with non-blocking copies: a copy from pageable memory is staged
    through a driver buffer while the host waits, a pinned one is a direct DMA the host need
    not wait for (the copy is queued on the current stream, so the step's kernels still see
    it landed; the caching host allocator keeps the pinned buffer until the copy is done).
    Elsewhere a plain `.to(device)`, as before."""
    if device.type != "cuda":
        return {key: value.to(device) for key, value in batch.items()}
    return {key: value.pin_memory().to(device, non_blocking=True)
            for key, value in batch.items()}


def pad_batch(chosen: list[SequenceFeatures]) -> dict:
    """Right-padded input_ids (B, T), float features (B, T, C) and learn (B, T), the tokens
    whose prediction is trained (False on padding)."""
    width = max(len(s.input_ids) for s in chosen)
    columns = chosen[0].features.shape[-1]
    input_ids = torch.zeros(len(chosen), width, dtype=torch.long)
    states = torch.zeros(len(chosen), width, columns)
    learn = torch.zeros(len(chosen), width, dtype=torch.bool)
    for row, s in enumerate(chosen):
        input_ids[row, :len(s.input_ids)] = s.input_ids
        states[row, :len(s.input_ids)] = s.features.float()
        learn[row, :len(s.input_ids)] = s.loss_mask
    return {"input_ids": input_ids, "features": states, "learn": learn}


@torch.no_grad()
def heldout_accuracy(objective: torch.nn.Module, heldout: FeatureSet, batch: int = 8,
                     **kwargs) -> dict:
    """Top-1 / top-5 agreement with the target's next token by draft depth (one entry per row
    of the objective's counts (K, 3)) and, where counted, the mean acceptance alpha, over the
    held-out sequences in eval mode; `kwargs` go to the objective (EAGLE: steps=, how deep to
    unroll)."""
    objective.eval()
    device = next(objective.parameters()).device
    batches = (pad_batch(heldout.take(indices)) for indices in chunks(range(len(heldout)), batch))
    counts = sum(objective(**{k: v.to(device) for k, v in b.items()}, **kwargs)[1]
                 for b in batches)
    rows = counts[:, 0].clamp_min(1)
    accuracy = {"label": "depth", "top1": (counts[:, 1] / rows).tolist(),
                "top5": (counts[:, 2] / rows).tolist(), "rows": int(counts[0, 0])}
    if counts.shape[1] > 3:  # the mean acceptance alpha per depth (train.losses.row_counts)
        accuracy["alpha"] = (counts[:, 3] / rows).tolist()
    return accuracy


def prompts_of(heldout: FeatureSet, count: int) -> list[torch.Tensor]:
    """The prompts of the first `count` held-out sequences: what the end-of-training
    evaluation decodes from."""
    return [s.input_ids[:prompt_length(s)] for s in heldout.take(range(min(count, len(heldout))))]


def prompt_length(sequence: SequenceFeatures) -> int:
    """A held-out answer's prompt: the tokens before its first learned one."""
    return first_learned(sequence.loss_mask)


def first_learned(loss_mask: torch.Tensor) -> int:
    """The index of a (T,) loss mask's first learned token (T when none): a sequence's prompt
    is the tokens before it."""
    learned = loss_mask.nonzero()
    return int(learned[0]) if len(learned) else len(loss_mask)
