"""Loading a pretrained causal LM or tokenizer from a folder or hub id, as it claims to be.

Hugging Face's `from_pretrained` forgives what a result cannot: weights it does not find are
left at random init (a warning in a log), an encoder such as BERT loads as a "causal" LM whose
tokens see the whole sequence, a folder's own code runs after a y/N prompt, and a folder name
that does not exist is sent to the hub as a repository id. Every model and tokenizer the
project loads from a path goes through here instead:

- a path that looks local (starts with `.`, `~` or `/`, holds more than one `/` or a
  backslash, is no valid hub id, or names a folder that exists) and is missing is an error
  naming it, before any hub call; anything else is a hub id, which transformers looks up as
  the environment allows (`HF_HUB_OFFLINE=1`: its local cache only);
- `trust_remote_code` is passed, False unless the caller's setting says otherwise, so a
  folder's code never runs on a keystroke;
- the weights must fill the model exactly (no missing, unexpected or misshapen tensors), and
  the model must be causal: a later token may not change an earlier position's logits
  (checked by one tiny forward at load, whatever the model's modules are called);
- a weights file that does not open (truncated, corrupt) and a folder holding no tokenizer
  files are errors naming the file or the folder and the files it lacks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import SafetensorError
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from verify.runtime.files import check_tensors_file

# The causality probe (`check_causal`): tokens per row, and how far (relative to the logits'
# scale) earlier positions may move when only the last token changes: far below one bfloat16
# rounding step, far above float32 noise, and far below what an encoder's future token moves.
CAUSAL_PROBE_LENGTH = 6
CAUSAL_TOLERANCE = 1e-5


def pretrained_source(path: str | Path, what: str) -> str:
    """`path` as `from_pretrained` should get it: an existing folder (its `~` expanded), or a
    hub id. FileNotFoundError naming `what` and `path` for a path that looks local (see the
    module notes) and is not a folder, so that a typo never reaches the hub."""
    text = str(path)
    folder = Path(text).expanduser()
    if folder.is_dir():
        return str(folder)
    if folder.exists():
        raise FileNotFoundError(f"{what} {text!r} is a file, not a model folder")
    if looks_local(text):
        raise FileNotFoundError(f"{what} {text!r}: no such folder (a local path, not sent to "
                                "the model hub); check the path")
    return text


def looks_local(text: str) -> bool:
    """Whether `text` can only mean a path on this machine: a hub id is `name` or
    `owner/name`, never `./x`, `~/x`, `/x`, `a/b/c`, a Windows path, nor a name whose first
    part is a folder here (`folders/goood`, a typo of `folders/good`)."""
    if text.startswith((".", "~", "/")) or "\\" in text or text.count("/") > 1:
        return True
    try:
        validate_repo_id(text)
    except HFValidationError:
        return True
    return "/" in text and Path(text.split("/")[0]).is_dir()


def load_causal_lm(path: str | Path, what: str, *, trust_remote_code: bool = False,
                   **kwargs) -> PreTrainedModel:
    """The causal LM in folder or hub id `path` (`what` names it in errors: "target",
    "draft model"), `kwargs` passed to `from_pretrained` (dtype=, gguf_file=, ...); refused
    unless its weights fill it exactly and its attention is causal."""
    source = pretrained_source(path, what)
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            source, output_loading_info=True, trust_remote_code=trust_remote_code, **kwargs)
    except SafetensorError:  # it names no file: find the one that does not open
        for weights in sorted(Path(source).glob("*.safetensors")):
            check_tensors_file(weights)
        raise
    check_loaded_whole(loading, path, what)
    check_causal(model, path, what)
    return model


# The files a saved tokenizer's vocabulary is read from, one at least: a fast tokenizer's
# serialization, a sentencepiece model, a BPE or WordPiece vocabulary, T5's sentencepiece.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model")


def load_tokenizer(path: str | Path, what: str, *, trust_remote_code: bool = False,
                   **kwargs) -> PreTrainedTokenizerBase:
    """The tokenizer in folder or hub id `path`, under the same rules as `load_causal_lm`;
    FileNotFoundError naming the folder and the files it lacks when it holds none of
    VOCABULARY_FILES (transformers' own error asks for sentencepiece or tiktoken)."""
    source = pretrained_source(path, what)
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code,
                                             **kwargs)
    except (ValueError, OSError) as error:
        folder = Path(source)
        if folder.is_dir() and not any((folder / name).is_file() for name in VOCABULARY_FILES):
            raise FileNotFoundError(
                f"the {what} in {path} holds no tokenizer: none of "
                f"{', '.join(VOCABULARY_FILES)}; copy the tokenizer files of the model it was "
                "saved from into it") from error
        raise


def check_loaded_whole(loading: dict, path: str | Path, what: str) -> None:
    """Refuse a folder whose weights left parts of the model unloaded (Hugging Face fills them
    with random init) or did not fit it, naming the tensors (`from_pretrained`'s loading
    info)."""
    problems = {"missing": loading.get("missing_keys", []),
                "unexpected": loading.get("unexpected_keys", []),
                "wrong shape": [str(key[0]) if isinstance(key, tuple) else str(key)
                                for key in loading.get("mismatched_keys", [])]}
    named = "; ".join(f"{kind}: {', '.join(sorted(map(str, keys)))}"
                      for kind, keys in problems.items() if keys)
    if named:
        raise ValueError(f"the {what} in {path} does not hold its weights whole ({named})")


def check_causal(model: PreTrainedModel, path: str | Path, what: str) -> None:
    """Refuse a model whose logits at a position depend on a later token (BERT, BigBird,
    RemBERT and other encoders load as a "causal" LM whose every token sees the whole
    sequence). Judged by what the model computes, not by its modules' names or flags: one
    forward of two rows that differ only in their last token, whose earlier positions must
    agree (rows of one batch run the same kernels, so a causal model gives them exactly;
    the tolerance only absorbs a kernel that rounds per row). Decoders with cross-attention
    (BART's or Pegasus's `encoder_attn`, given no encoder states) pass: they are causal."""
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.arange(1, CAUSAL_PROBE_LENGTH + 1).remainder(vocab).repeat(2, 1)
    ids[1, -1] = (ids[1, -1] + 1) % vocab  # the later token, changed in the second row
    with torch.no_grad():
        logits = model(input_ids=ids.to(model.device)).logits.float()
    earlier = logits[:, :-1]
    moved = float((earlier[0] - earlier[1]).abs().max())
    if moved > CAUSAL_TOLERANCE * max(float(earlier.abs().max()), 1.0):
        raise ValueError(f"the {what} in {path} is a {type(model).__name__}, whose attention "
                         f"is not causal: changing token {CAUSAL_PROBE_LENGTH - 1} moved the "
                         f"logits before it (by up to {moved:.3g}), so each position sees "
                         "the future (an encoder); decoding needs a causal LM")
