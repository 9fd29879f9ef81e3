"""Model folder (or ``dummy:<shape>`` spec) to a ready :class:`LlamaForCausalLM`.

A Hugging Face folder needs ``config.json`` and its ``*.safetensors`` (sharded ones are
found through ``model.safetensors.index.json``); tensors are read with ``safetensors``
straight onto the target device, no ``transformers`` import. ``dummy:<shape>`` builds
random weights of a real model's shape on the target device, scaled so activations stay
finite, for benchmarks without a checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from common.model_specs import (  # noqa: F401 (DUMMY_SHAPES re-exported: the engine's)
    DUMMY_SHAPES,
    ModelLoadError,
    hf_config,
    is_dummy,
)
from workers.engine.models.llama import LlamaForCausalLM, ModelConfig, rope_inv_freq


def load_model_config(model: str) -> ModelConfig:
    """Read and check a folder's ``config.json``, or a dummy spec's shape."""
    cfg = hf_config(model)
    try:
        return ModelConfig.from_hf(cfg)
    except (KeyError, ValueError, TypeError) as exc:
        where = model if is_dummy(model) else Path(model) / "config.json"
        raise ModelLoadError(f"{where}: {exc}") from exc


def generation_config_eos(model: str) -> set[int]:
    """EOS ids of ``generation_config.json`` (what ``transformers.generate`` stops on)."""
    if is_dummy(model):
        return set()
    path = Path(model) / "generation_config.json"
    if not path.is_file():
        return set()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (ValueError, AttributeError) as exc:  # not JSON, or not an object
        raise ModelLoadError(f"{path}: not a JSON object ({exc})") from None
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


# Weights a Hugging Face folder may hold beside the model's own, not part of it: Mistral's
# native format (the same tensors under other names) and a PEFT adapter.
_NOT_THE_MODEL = ("consolidated", "adapter_model")


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's shards: those the index names, else ``model.safetensors``, else
    every ``*.safetensors`` but Mistral's ``consolidated*`` and a PEFT ``adapter_model``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [folder / name for name in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(
                f"{index}: unreadable ({type(exc).__name__}: {exc}); "
                "it must be JSON with a weight_map of tensor names to shard files"
            ) from exc
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: missing (named by {index.name})")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(f for f in folder.glob("*.safetensors") if not f.name.startswith(_NOT_THE_MODEL))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights found")
    return files


def iter_safetensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    # Opened and read under a check that names the file: safetensors' own errors ("header
    # too large") say neither which shard nor why. One tensor at a time, as before.
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device=str(device))
        except Exception as exc:
            raise _unreadable(f, exc) from exc
        with handle as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                try:
                    tensor = st.get_tensor(name)
                except torch.cuda.OutOfMemoryError:
                    raise
                except Exception as exc:
                    raise _unreadable(f, exc) from exc
                yield name, tensor


def _unreadable(f: Path, exc: Exception) -> ModelLoadError:
    hint = ""
    if f.stat().st_size < 1024:
        hint = " (a git-lfs pointer, not the weights? `git lfs pull` in that folder)"
    return ModelLoadError(
        f"{f}: unreadable safetensors ({type(exc).__name__}: {exc}){hint}; "
        "a partial download or a damaged file?"
    )


def load_model(
    model: str,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    backend: str,
    seed: int = 0,
) -> LlamaForCausalLM:
    """Build the decoder on ``device`` in ``dtype`` and fill its weights."""
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg, backend)
    # Allocate once, in the final dtype, on the final device: no fp32 or CPU staging copy.
    net = net.to(dtype).to_empty(device=device)
    net.inv_freq = rope_inv_freq(cfg).to(device)
    if is_dummy(model):
        init_dummy_weights(net, seed)
    else:
        files = safetensors_files(Path(model))
        try:
            with torch.no_grad():
                net.load_weights(iter_safetensors(files, device))
        except ValueError as exc:
            raise ModelLoadError(f"{model}: {exc}") from exc
    return net.eval()


# Bump when init_dummy_weights draws differently: dummy models' KV fingerprints change.
DUMMY_INIT_VERSION = 1


@torch.no_grad()
def init_dummy_weights(net: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights in place: N(0, 0.02) matrices (activations stay O(1) through RMSNorm
    and the residual stream), unit norms, zero biases. Drawn on the device itself."""
    gen = torch.Generator(device=net.inv_freq.device).manual_seed(seed)
    for name, p in net.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
