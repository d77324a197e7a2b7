"""TIDE in torchtitan (0.3.0): the one hook, as a config registry torchtitan can load.

    torchrun --nproc_per_node 8 -m torchtitan.train --module tide_hook --config llama3_8b
    # with this folder on PYTHONPATH; any other config: wrap it with with_tide(...) the same way

torchtitan builds the model on the meta device and runs `parallelize` (fully_shard per block and
root) there, then materialises it (`to_empty` + `init_weights`), then builds the optimizers and
calls the model spec's `post_optimizer_build_fn`. That call is the first one that sees the real,
sharded tensors and comes before the first step (and before a checkpoint loads, which copies into
those same tensors), so TIDE is enabled there, on every rank, for every model part.
"""

from __future__ import annotations

import dataclasses
import logging

import tide.fsdp

log = logging.getLogger("tide.fsdp")
HANDLES: list = []  # one tide.fsdp.TideFSDP per model part (also on the part as .tide_handle)


def with_tide(config):
    """`config` (a torchtitan Trainer.Config) with TIDE enabled after its model is materialised."""
    spec = config.model_spec
    previous = spec.post_optimizer_build_fn  # MoE models use it (load balancing): keep it

    def enable_tide(optimizers, model_parts, parallel_dims):
        if previous is not None:
            previous(optimizers, model_parts, parallel_dims)
        for part in model_parts:
            part.tide_handle = tide.fsdp.enable(part)
            HANDLES.append(part.tide_handle)
            log.info("tide.fsdp: %s; fallbacks: %s", part.tide_handle, part.tide_handle.fallbacks)

    config.model_spec = dataclasses.replace(spec, post_optimizer_build_fn=enable_tide)
    return config


def llama3_debugmodel():
    from torchtitan.models.llama3 import config_registry as llama3
    return with_tide(llama3.llama3_debugmodel())


def llama3_8b():
    from torchtitan.models.llama3 import config_registry as llama3
    return with_tide(llama3.llama3_8b())


def llama3_70b():
    from torchtitan.models.llama3 import config_registry as llama3
    return with_tide(llama3.llama3_70b())
