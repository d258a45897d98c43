"""Reading a Hugging Face ``config.json`` (``--model-config``): its model's dimensions.

A module of its own, importing nothing of the report: ``_config``
(``ReportConfig.dims``) and ``_model`` (building the model) both need it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

# ReportConfig.dims() key -> Hugging Face config attribute
HF_ATTRS = dict(layers="num_hidden_layers", hidden="hidden_size",
                intermediate="intermediate_size", heads="num_attention_heads",
                kv_heads="num_key_value_heads", vocab="vocab_size")
SUPPORTED = "a decoder-only causal LM config (Llama, Qwen2, Mistral, ...)"


@functools.lru_cache(maxsize=None)
def load_config(path: str):
    import transformers
    from transformers import AutoConfig

    where = Path(path)
    if not (where.is_file() or (where / "config.json").is_file()):
        raise ValueError(
            f"--model-config {path}: no such file; pass the path of a Hugging Face "
            "config.json (or of the folder that holds it)"
        )
    try:
        return AutoConfig.from_pretrained(str(where), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:  # bad JSON: OSError or ValueError
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ValueError(
            f"--model-config {path}: transformers {transformers.__version__} cannot read it "
            f"({type(exc).__name__}: {first}); pass {SUPPORTED} with a model_type it knows"
        ) from exc


def config_dims(path: str) -> dict[str, Any]:
    """``ReportConfig.dims()`` of a ``config.json``; seq_len 2048 (at most), batch 1."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = load_config(path)
    kind = f"{type(config).__name__} (model_type {config.model_type!r})"
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"--model-config {path}: {kind} has no causal LM class in transformers "
            f"(AutoModelForCausalLM); pass {SUPPORTED}"
        )
    dims = {key: getattr(config, attr, None) for key, attr in HF_ATTRS.items()}
    dims["kv_heads"] = dims["kv_heads"] or dims["heads"]
    missing = [HF_ATTRS[key] for key, value in dims.items() if value is None]
    if missing:
        raise ValueError(f"--model-config {path}: {kind} has no {', '.join(missing)}; "
                         f"pass {SUPPORTED}")
    max_len = getattr(config, "max_position_embeddings", None) or 2048
    return {**dims, "tie": bool(getattr(config, "tie_word_embeddings", False)),
            "seq_len": min(2048, max_len), "batch": 1}
