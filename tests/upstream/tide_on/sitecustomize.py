"""Loaded by Python at start-up (run_fsdp2_tests.py puts this folder on PYTHONPATH), in the pytest
process and in every rank process that FSDP2's multi-process tests spawn.

TIDE_UPSTREAM_CPU_MULTIPROC=1 (both modes): torch 2.13's FSDPTest._run exits every rank with
"Need at least N CUDA devices" when torch.accelerator.device_count() < world_size, even on CPU, so
on a machine without GPUs every multi-process FSDP2 test skips. Its base (FSDPTestMixin._run) is the
same code with that check guarded by DEVICE_TYPE != "cpu"; this puts the base's back, so the tests
run on CPU with gloo as the CPU branch of common_fsdp intends.

TIDE_UPSTREAM=on: turns TIDE on for every root FSDP2 module (tide_upstream_hook.py). It is installed
first, before common_fsdp is imported here, and also rebinds fully_shard in modules already
imported (tide_upstream_hook.install)."""
import os

if os.environ.get("TIDE_UPSTREAM") == "on":
    import tide_upstream_hook

    tide_upstream_hook.install()

if os.environ.get("TIDE_UPSTREAM_CPU_MULTIPROC") == "1":
    from torch.testing._internal import common_fsdp as _common_fsdp

    if _common_fsdp.DEVICE_TYPE == "cpu" and "_run" in _common_fsdp.FSDPTest.__dict__:
        _common_fsdp.FSDPTest._run = _common_fsdp.FSDPTestMixin.__dict__["_run"]
