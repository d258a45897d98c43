"""The ``env`` stage of ``scripts/gpu_validate.py``: what this machine has, against what
the project supports. Features are found by trying them, not by reading version strings;
only the torch range of ``pyproject.toml`` is a version check (it is what the suite ran on)."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def supported_torch() -> str:
    """The torch requirement in pyproject.toml, e.g. ``>=2.9,<2.16``."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'"torch\s*([^"]+)"', text)
    return match.group(1).strip() if match else ""


def in_range(version: str, spec: str) -> bool | None:
    """Whether ``version`` meets ``spec`` (local tags such as ``+cu128`` ignored); None if
    ``packaging`` is missing."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:
        return None
    return Version(Version(version).base_version) in SpecifierSet(spec)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _imports(module: str, name: str | None = None) -> Callable[[], object]:
    def check():
        mod = importlib.import_module(module)
        return getattr(mod, name) if name else mod

    return check


def _features(device: str) -> dict[str, tuple[Callable[[], object], bool]]:
    """name -> (check, required): a check raises or returns a falsy value when absent."""
    import torch
    import torch.distributed as dist

    features = {
        "fully_shard (FSDP2)": (_imports("torch.distributed.fsdp", "fully_shard"), True),
        "FullyShardedDataParallel (FSDP1)":
            (_imports("torch.distributed.fsdp", "FullyShardedDataParallel"), True),
        "MixedPrecisionPolicy (FSDP2 bf16)":
            (_imports("torch.distributed.fsdp", "MixedPrecisionPolicy"), True),
        "CommDebugMode (collective counts)":
            (_imports("torch.distributed.tensor.debug", "CommDebugMode"), True),
        "FSDPMemTracker (report memory breakdown)":
            (_imports("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker"), False),
        "fsdp_retain imports": (_imports("fsdp_retain", "no_reshard_between_backwards"), True),
        "transformers Qwen2 (report, benchmarks)": (_imports("transformers", "Qwen2Config"), True),
        "matplotlib (report.png)": (_imports("matplotlib"), False),
    }
    if device == "cuda":
        features["NCCL"] = (dist.is_nccl_available, True)
        features["bf16 on this GPU"] = (torch.cuda.is_bf16_supported, True)
    else:
        features["gloo"] = (dist.is_gloo_available, True)
    return features


def _nvidia_smi() -> list[dict[str, str]]:
    if shutil.which("nvidia-smi") is None:
        return []
    query = "name,driver_version,memory.total,compute_cap"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    keys = query.split(",")
    return [dict(zip(keys, (v.strip() for v in line.split(",")))) for line in out.splitlines()
            if line.strip()]


def collect_env(device: str) -> dict:
    """Versions, devices and features; ``problems`` lists what stops a valid run."""
    import torch

    spec = supported_torch()
    torch_ok = in_range(torch.__version__, spec)
    env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_supported": spec,
        "torch_in_supported_range": torch_ok,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": [],
        "nccl": None,
        "driver": None,
        "packages": {d: _version(d) for d in ("transformers", "accelerate", "deepspeed",
                                               "packaging", "matplotlib", "pytest")},
        "features": {},
        "problems": [],
        "device": device,
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            env["gpus"].append(dict(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                                    capability=f"{props.major}.{props.minor}"))
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - a build without NCCL says so below
            env["nccl"] = f"unavailable ({type(exc).__name__})"
        smi = _nvidia_smi()
        env["driver"] = smi[0]["driver_version"] if smi else None
        env["nvidia_smi"] = smi
    if torch_ok is False:
        env["problems"].append(f"torch {torch.__version__} is outside the supported range "
                               f"torch{spec} (pyproject.toml): results may not hold")
    for name, (check, required) in _features(device).items():
        try:
            ok = bool(check())
            why = None
        except Exception as exc:  # noqa: BLE001 - absence is the answer
            ok, why = False, f"{type(exc).__name__}: {exc}"[:200]
        env["features"][name] = dict(ok=ok, required=required, error=why)
        if required and not ok:
            env["problems"].append(f"missing: {name}" + (f" ({why})" if why else ""))
    if device == "cuda" and not env["gpus"]:
        env["problems"].append("no CUDA device")
    return env


def env_lines(env: dict) -> list[str]:
    """What the env stage prints."""
    range_note = {True: "supported", False: "NOT in the supported range", None: "range unchecked"}
    lines = [
        f"python {env['python']} on {env['platform']} ({env['cpu_count']} CPUs)",
        f"torch {env['torch']} ({range_note[env['torch_in_supported_range']]}: "
        f"torch{env['torch_supported']}), CUDA runtime {env['cuda_runtime']}, "
        f"NCCL {env['nccl']}, driver {env['driver']}",
    ]
    lines += [f"GPU {i}: {g['name']}, {g['memory_gib']} GiB, sm {g['capability']}"
              for i, g in enumerate(env["gpus"])]
    lines.append("packages: " + ", ".join(f"{k} {v or '-'}" for k, v in env["packages"].items()))
    for name, f in env["features"].items():
        state = "ok" if f["ok"] else ("MISSING" if f["required"] else "absent (optional)")
        lines.append(f"  {state:<17} {name}")
    lines += [f"PROBLEM: {p}" for p in env["problems"]]
    return lines
