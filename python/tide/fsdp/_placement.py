"""Where a process group's ranks are, and what that allows: one node or several, and what carries
TIDE's steps between nodes (the host transport, CUDA IPC or NCCL). ``topology_for`` and
``transport_for`` are pure, so tide-bench refuses a configuration with the same decisions before
anything runs."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from .. import _tide
from ._agreement import exchange


def placements(group: dist.ProcessGroup, device: torch.device, timeout_ms: int,
               enable_round: int) -> list[tuple[str, str, str]]:
    """(host name, GPU uuid or "", process id) of every rank of `group`, in group-rank order: where
    windows can be mapped (one host, one process per rank on CUDA) and whether NCCL can run (one
    rank per GPU). Asked over the store, keyed by the enable's agreement round."""
    gpu = ""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = str(getattr(props, "uuid", "")) or f"{props.name}#{getattr(props, 'pci_bus_id', device.index)}"
    mine = f"{socket.gethostname()}|{gpu}|{os.getpid()}"
    return [tuple(v.split("|", 2)) for v in exchange(group, f"placement/{enable_round}/{device.type}", mine, timeout_ms)]


def transport_for(placements: list[tuple[str, str, str]], device_type: str, topology: _tide.Topology,
                  requested: str) -> tuple[str | None, str]:
    """(transport between the group's nodes, "") or (None, why the group falls back), from where
    the group's ranks are: `placements` is (host, GPU uuid or "", process id) per group rank. The
    transport is None for one node, "host" (CPU: the host executor's), "ipc" (CUDA IPC, every rank
    on this host) or "nccl" (one communicator per window, node-local work still by CUDA IPC). Pure,
    so tide-bench refuses a configuration with the same decision before anything runs."""
    hosts = [h for h, _, _ in placements]
    one_host = len(set(hosts)) == 1
    if device_type == "cuda" and len({(h, p) for h, _, p in placements}) < len(placements):
        return None, ("ranks that are threads of one process on CUDA (tide.fsdp maps its CUDA windows "
                      "between processes: one process per rank)")
    if topology.nodes == 1:
        if not one_host:
            return None, (f"ranks on several hosts ({', '.join(sorted(set(hosts)))}) as one node: "
                          "declare the nodes with enable(ranks_per_node=...), e.g. LOCAL_WORLD_SIZE")
        return None, ""
    for n in range(topology.nodes):
        node_hosts = set(hosts[n * topology.local:(n + 1) * topology.local])
        if len(node_hosts) > 1:
            return None, f"node {n}'s ranks are on several hosts ({', '.join(sorted(node_hosts))})"
    if device_type == "cpu":
        if requested == "nccl":
            return None, "transport='nccl' on CPU devices (their transport is TIDE's host transport)"
        if not one_host:
            return None, "CPU ranks on several hosts (the host transport needs them on one host)"
        return "host", ""
    transport = ("ipc" if one_host else "nccl") if requested == "auto" else requested
    if transport == "ipc" and not one_host:
        return None, "transport='ipc' needs every rank of the group on this host"
    if transport == "nccl" and len({(h, g) for h, g, _ in placements}) < len(placements):
        return None, "transport='nccl' with ranks sharing a GPU (NCCL refuses two ranks on one GPU)"
    return transport, ""


def launcher_ranks_per_node() -> int | None:
    """LOCAL_WORLD_SIZE, as torchrun sets it (the ranks of one node), or None where it is unset."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not value:
        return None
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"tide.fsdp.enable: LOCAL_WORLD_SIZE = {value!r}, expected a positive int "
                         "(or pass ranks_per_node)")
    return int(value)


def topology_for(ranks: list[int], ranks_per_node: int | None) -> tuple[_tide.Topology | None, str]:
    """(topology, "") of a process group's global `ranks`, or (None, why not). Without
    ranks_per_node the group is one node; with it, global rank g is on node g // ranks_per_node,
    and the group must hold as many ranks of every node it spans, node after node (TIDE's rank =
    node * local + local rank)."""
    if ranks_per_node is None:
        return _tide.Topology.single_node(len(ranks)), ""
    nodes = [g // ranks_per_node for g in ranks]
    distinct = list(dict.fromkeys(nodes))
    local = len(ranks) // len(distinct)
    if nodes != [n for n in distinct for _ in range(local)]:
        return None, (f"ranks {ranks} are not node-major with as many on every node "
                      f"(ranks_per_node={ranks_per_node})")
    return _tide.Topology(len(distinct), local), ""
