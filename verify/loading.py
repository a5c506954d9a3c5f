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
  the model's attention must be causal.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)


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
    model, loading = AutoModelForCausalLM.from_pretrained(
        pretrained_source(path, what), output_loading_info=True,
        trust_remote_code=trust_remote_code, **kwargs)
    check_loaded_whole(loading, path, what)
    check_causal(model, path, what)
    return model


def load_tokenizer(path: str | Path, what: str, *, trust_remote_code: bool = False,
                   **kwargs) -> PreTrainedTokenizerBase:
    """The tokenizer in folder or hub id `path`, under the same rules as `load_causal_lm`."""
    return AutoTokenizer.from_pretrained(pretrained_source(path, what),
                                         trust_remote_code=trust_remote_code, **kwargs)


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
    """Refuse a model whose self-attention is not causal (BERT and other encoders load as a
    "causal" LM whose every token sees the whole sequence): transformers marks each attention
    module's `is_causal`; cross-attention (`cross` in its name) is left aside."""
    bidirectional = [name for name, module in model.named_modules()
                     if getattr(module, "is_causal", True) is False and "cross" not in name]
    if bidirectional:
        raise ValueError(f"the {what} in {path} is a {type(model).__name__}, whose attention "
                         f"is not causal ({bidirectional[0]}): decoding needs a causal LM")
