"""The model the report trains: a causal LM with random weights, one FSDP unit per decoder layer."""

from __future__ import annotations

import dataclasses

from ._config import DTYPES, ReportConfig
from ._hf_config import HF_ATTRS, SUPPORTED, load_config


def torch_dtype(cfg: ReportConfig):
    import torch

    return getattr(torch, DTYPES[cfg.dtype])


def hf_config(cfg: ReportConfig):
    """The ``transformers`` config of ``cfg``'s model: its ``config.json`` with the
    dimension flags applied, or a ``Qwen2Config`` of the preset ``cfg.size``."""
    dims = cfg.dims()
    if cfg.model_config is None:
        from transformers import Qwen2Config

        return Qwen2Config(
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
    base = load_config(cfg.model_config)
    values = {**base.to_dict(), **{attr: dims[key] for key, attr in HF_ATTRS.items()},
              "use_cache": False}
    if dims["layers"] != base.num_hidden_layers:
        values.pop("layer_types", None)  # one entry per layer; rebuilt from the new count
    return type(base).from_dict(values)


def build_model(cfg: ReportConfig, device):
    """``cfg``'s causal LM with random weights (seed ``cfg.seed``), in ``cfg.dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(cfg)
    dtype = torch_dtype(cfg)
    # transformers >= 4.56 calls it dtype, older ones torch_dtype; from_config builds in it.
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", dtype)
    torch.manual_seed(cfg.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    if cfg.activation_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


def check_model_config(cfg: ReportConfig) -> None:
    """Raises ``ValueError`` unless ``cfg.model_config`` builds a causal LM whose decoder
    layers the report can find (tried on a one-layer copy, on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(dataclasses.replace(cfg, layers=1))
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - any failure means the same fix
        raise ValueError(
            f"--model-config {cfg.model_config}: transformers cannot build "
            f"{type(config).__name__} ({type(exc).__name__}: {exc}); pass {SUPPORTED}"
        ) from exc
    decoder_layers(model)


def decoder_layers(model):
    """The decoder layers, one FSDP unit each (``model.model.layers`` in Llama, Qwen2, ...)."""
    import torch

    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{type(model).__name__} has no decoder layers at "
            f"model.{getattr(model, 'base_model_prefix', 'model')}.layers, which the report "
            f"shards one by one; pass {SUPPORTED}"
        )
    return layers


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def device_mesh(cfg: ReportConfig, backend: str, device_type: str, world: int):
    """The mesh ``backend`` shards over (``None``: FSDP1's default process group): every
    rank, or for FSDP1 ``HYBRID_SHARD`` shard groups of ``cfg.node_size`` consecutive ranks
    (one node: launchers number ranks node by node), replicated across nodes."""
    from torch.distributed.device_mesh import init_device_mesh

    if backend == "fsdp1" and cfg.fsdp1_sharding == "HYBRID_SHARD":
        assert cfg.node_size, "HYBRID_SHARD needs node_size (ReportConfig checks it)"
        return init_device_mesh(device_type, (world // cfg.node_size, cfg.node_size),
                                mesh_dim_names=("replicate", "shard"))
    if backend == "fsdp2":
        return init_device_mesh(device_type, (world,))
    return None


def wrap(model, backend: str, device, mesh=None, *, bucket_cap_mb: float | None = None,
         compile_layers: str | None = None):
    """Shards each decoder layer, then the root, with ``backend``'s defaults (``ddp``:
    the whole model in one ``DistributedDataParallel``, nothing sharded, its buckets of
    ``bucket_cap_mb``; ``None``: DDP's default); FSDP1 with a 2-D ``mesh`` (``device_mesh``)
    uses ``HYBRID_SHARD`` over it. ``compile_layers`` (FSDP2): each decoder layer is
    compiled in place with that backend before ``fully_shard``, as torchtitan does; two
    passes over a compiled forward need ``donated_buffer`` off (docs/guide.md, torch.compile)."""
    if backend == "ddp":
        from ._ddp import wrap as ddp_wrap

        return ddp_wrap(model, device, bucket_cap_mb)
    layers = decoder_layers(model)
    if backend == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        if compile_layers:
            import torch._functorch.config

            torch._functorch.config.donated_buffer = False
        for layer in layers:
            if compile_layers:
                layer.compile(backend=compile_layers)
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    hybrid = {} if mesh is None else {"sharding_strategy": ShardingStrategy.HYBRID_SHARD,
                                      "device_mesh": mesh}
    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({type(layers[0])}), device_id=device, **hybrid
    )


def fsdp_units(model, backend: str) -> int:
    """The units the backend communicates by: FSDP units; on ``ddp`` its gradient buckets
    (one bucket until DDP's first synced backward rebuilds them: read it after a step)."""
    if backend == "ddp":
        from ._ddp import buckets

        return buckets(model)
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
