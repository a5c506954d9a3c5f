"""Target fingerprints: what changes the model changes them, how it runs does not."""

import torch

from verify.runtime.fingerprint import identity, weights_digest
from verify.runtime.model import Target, load_target


def test_weights_config_dtype_and_adapter_each_change_the_fingerprint():
    base = load_target(tiny="llama").fingerprint()
    assert base == load_target(tiny="llama").fingerprint()  # deterministic
    reseeded = load_target(tiny="llama", seed=1).fingerprint()
    assert reseeded["name"] == base["name"] and reseeded["weights"] != base["weights"]
    assert load_target(tiny="qwen2").fingerprint()["config"] != base["config"]
    halved = load_target(tiny="llama", dtype="bfloat16").fingerprint()
    # bfloat16 copy of the same weights: the dtype differs, the identity drafters check does not
    assert halved["dtype"] == "bfloat16" and identity(halved) == identity(base)
    model = load_target(tiny="llama").model
    adapted = Target(model, None, "tiny-llama", adapter="lora", base_weights=base["weights"])
    assert adapted.fingerprint()["adapter"] == "lora"


def test_the_attention_kernel_is_not_part_of_the_identity():
    sdpa = load_target(tiny="llama").fingerprint()
    eager = load_target(tiny="llama", attn_implementation="eager").fingerprint()
    assert sdpa == eager


def test_one_changed_weight_row_changes_the_digest():
    model = load_target(tiny="llama").model
    before = weights_digest(model)
    with torch.no_grad():
        model.get_output_embeddings().weight[0].add_(0.01)  # row 0 holds the first sample
    assert weights_digest(model) != before
