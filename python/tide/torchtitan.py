"""TIDE inside torchtitan's trainer: name this module on torchtitan's command line with any config
torchtitan registers, and TIDE is enabled on every rank, per model part, before the first step.

    torchrun --nproc_per_node 8 -m torchtitan.train --module tide.torchtitan --config llama3_8b

``--config NAME`` is looked up in torchtitan's own config registries (models, then experiments);
``--config MODULE.NAME`` (``qwen3.qwen3_moe_debug``) names the registry. Or wrap a config of your
own: ``tide.torchtitan.with_tide(config)``.

torchtitan builds the model on the meta device and runs ``parallelize`` (fully_shard per block and
root) there, then materialises it (``to_empty`` + ``init_weights``), then builds the optimizers and
calls the model spec's ``post_optimizer_build_fn``: the first call that sees the real, sharded
tensors, before the first step and before a checkpoint loads into those same tensors. TIDE is
enabled there, after the hook the model spec had (MoE models register their load balancing there).

torchtitan captures forward + backward of each GPU step in a CUDA graph unless
``training.disable_cuda_graphs`` is set, and TIDE's collectives are captured with it (its warm-up
step runs them uncaptured first, as they need); captured training is bitwise run-by-run training
(tests/python/test_fsdp_cuda_graphs.py, stepped by torchtitan's own wrapper). Groups whose
collectives no graph can capture (across nodes, CPU offload) are named in one warning at enable,
and the capture then raises naming the group: pass ``--training.disable_cuda_graphs`` for them.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging

import tide.fsdp

log = logging.getLogger("tide.torchtitan")

# The torchtitan releases whose Trainer.Config and ModelSpec.post_optimizer_build_fn this module
# is written and tested against (CI: torchtitan's own trainer on CPU).
KNOWN_TORCHTITAN = ("0.3.",)


def with_tide(config):
    """`config` (a torchtitan ``Trainer.Config``) with TIDE enabled once its model is materialised
    and sharded; each model part's handle is kept on the part as ``part.tide_handle``."""
    _check_version()
    spec = config.model_spec
    previous = spec.post_optimizer_build_fn

    def enable_tide(optimizers, model_parts, parallel_dims):
        if previous is not None:
            previous(optimizers, model_parts, parallel_dims)
        for part in model_parts:
            part.tide_handle = tide.fsdp.enable(part)
            log.info("tide.torchtitan: %s; fallbacks: %s", part.tide_handle, part.tide_handle.fallbacks)
            refusals = part.tide_handle.capture_refusals()
            if refusals:
                log.warning("tide.torchtitan: no CUDA graph can capture TIDE's collectives of %s: with "
                            "captured steps (torchtitan's default on GPUs) the capture raises; pass "
                            "--training.disable_cuda_graphs", refusals)

    config.model_spec = dataclasses.replace(spec, post_optimizer_build_fn=enable_tide)
    return config


def _check_version() -> None:
    import torchtitan
    version = getattr(torchtitan, "__version__", "unknown")
    if not version.startswith(KNOWN_TORCHTITAN):
        raise RuntimeError(f"tide.torchtitan: torchtitan {version} is not one this module knows "
                           f"({', '.join(v + 'x' for v in KNOWN_TORCHTITAN)}): its config and model spec "
                           "may differ; call tide.fsdp.enable(model_part) yourself after the model is sharded")


def _registries(package: str, prefix: str | None):
    """torchtitan's config registry modules of `package` (its models or its experiments), those
    named `prefix` or all; those that fail to import on this machine are skipped."""
    group = importlib.import_module(package)
    names = sorted(getattr(group, "_supported_models", None) or getattr(group, "_supported_experiments", ()))
    for name in names:
        if prefix is None or name == prefix:
            try:
                yield name, importlib.import_module(f"{package}.{name}.config_registry")
            except ImportError:
                continue


def config_function(name: str):
    """The config registry function torchtitan's ``--config NAME`` would name, wrapped by
    ``with_tide``. NAME is ``function`` (searched in torchtitan's models, then its experiments,
    which re-export some models' configs) or ``module.function``."""
    prefix, _, function = name.rpartition(".")
    for package in ("torchtitan.models", "torchtitan.experiments"):
        found = [(module, getattr(registry, function)) for module, registry in _registries(package, prefix or None)
                 if callable(getattr(registry, function, None))]
        if found:
            break
    if not found:
        raise AttributeError(f"tide.torchtitan: no torchtitan config registry has a config {name!r} "
                             "(--config NAME or --config MODULE.NAME, e.g. llama3.llama3_8b)")
    if len(found) > 1:
        raise AttributeError(f"tide.torchtitan: config {name!r} is in several registries "
                             f"({', '.join(m for m, _ in found)}): name one, e.g. {found[0][0]}.{function}")
    make = found[0][1]

    def config():
        return with_tide(make())

    config.__name__ = function
    return config


def __getattr__(name: str):
    # torchtitan's ConfigManager reads --config as an attribute of the --module it imports.
    if name.startswith("__"):
        raise AttributeError(name)
    return config_function(name)
