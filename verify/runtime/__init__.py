"""The target's runtime: loading it (model.py, loading.py), what it is (fingerprint.py), the
features drafters read (features.py), its step and the step's kinds (step.py: eager and packed
through hf_state.py, compiled.py, openvino_step.py over openvino_graph.py), the KV-cache moves
(cache.py), its attention implementations, timing and files. Verification (trees, acceptance,
the loop) lives one level up, in verify/, and runs the target only through `TargetStep`.
"""
