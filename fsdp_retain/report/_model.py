"""The model the report trains: a causal LM with random weights, one FSDP unit per decoder layer."""

from __future__ import annotations

from ._config import DTYPES, ReportConfig


def torch_dtype(cfg: ReportConfig):
    import torch

    return getattr(torch, DTYPES[cfg.dtype])


def build_model(cfg: ReportConfig, device):
    """A ``Qwen2ForCausalLM`` with random weights (seed ``cfg.seed``), in ``cfg.dtype``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dims = cfg.dims()
    config = Qwen2Config(
        vocab_size=dims["vocab"],
        hidden_size=dims["hidden"],
        intermediate_size=dims["intermediate"],
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"],
        max_position_embeddings=max(32768, dims["seq_len"]),
        tie_word_embeddings=dims["tie"],
        use_cache=False,
    )
    torch.manual_seed(cfg.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype(cfg))
    try:
        with torch.device(device):
            return Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def wrap(model, backend: str, device, mesh=None):
    """Shards each decoder layer, then the root, with ``backend``'s defaults."""
    layers = model.model.layers
    if backend == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({type(layers[0])}), device_id=device
    )


def fsdp_units(model, backend: str) -> int:
    if backend == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return len(FullyShardedDataParallel.fsdp_modules(model))
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.modules())


def make_batch(cfg: ReportConfig, rank: int, device):
    import torch

    dims = cfg.dims()
    gen = torch.Generator().manual_seed(cfg.seed + rank + 1)
    ids = torch.randint(0, dims["vocab"], (dims["batch"], dims["seq_len"]), generator=gen)
    advantages = torch.randn(dims["batch"], generator=gen)
    return ids.to(device), advantages.to(device)
