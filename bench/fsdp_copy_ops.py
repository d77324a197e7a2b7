"""What TIDE removes from an FSDP2 step: stock FSDP2's layout-conversion ops, timed on one GPU.

For one Llama-3.1-70B decoder layer (q, k, v, o, gate, up, down, two norms; 855.7 M params) at
W ranks, runs the exact ops stock FSDP2 uses around its collectives, on this rank's buffers:
  - all-gather copy-out: torch.ops.fsdp.split_with_sizes_copy (flat rank-major bf16 buffer ->
    per-param unsharded storage);
  - reduce-scatter copy-in: torch.ops.fsdp.chunk_cat (per-param bf16 gradients -> full-group fp32
    buffer of W x shard elements);
and reports medians of CUDA-event timings, the bytes each moves, and the full-group buffers stock
allocates that TIDE does not (computed from the shapes). TIDE-AG writes shards straight into the
parameters' storage and TIDE-RS reads gradients in place, so neither op exists in a TIDE step.

    python bench/fsdp_copy_ops.py [--world 8] [--layers 1] [--runs 20]
"""

import argparse
import statistics

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_collectives  # noqa: F401  (registers fsdp ops)


def llama70b_layer():
    h, inter, kv = 8192, 28672, 8 * 128
    return [("q_proj", (h, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, h)),
            ("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter)),
            ("input_layernorm", (h,)), ("post_attention_layernorm", (h,))]


def timed(fn, runs):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--runs", type=int, default=20)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fsdp_copy_ops: needs a CUDA device")
    if a.world < 2 or a.layers < 1 or a.runs < 1:
        raise SystemExit(f"fsdp_copy_ops: --world {a.world} --layers {a.layers} --runs {a.runs}: expected >= 2, >= 1, >= 1")
    dev, W = torch.device("cuda"), a.world
    shapes = [s for _ in range(a.layers) for _, s in llama70b_layer()]
    shard_numels = []
    for s in shapes:
        rows = -(-s[0] // W)
        shard_numels.append(rows * (s[1] if len(s) > 1 else 1))
    total_shard = sum(shard_numels)
    params = sum(torch.Size(s).numel() for s in shapes)

    # All-gather copy-out, exactly as foreach_all_gather_copy_out calls it.
    ag_output = torch.randn(W * total_shard, device=dev).to(torch.bfloat16)
    outs = [torch.empty(W * n, dtype=torch.bfloat16, device=dev) for n in shard_numels]
    views = [t.view(W, -1) for t in outs]

    def copy_out():
        torch.ops.fsdp.split_with_sizes_copy(ag_output.view(W, -1), shard_numels, dim=1, out=views)

    ag_ms = timed(copy_out, a.runs)
    for k, (t, n) in enumerate(zip(outs, shard_numels)):  # check: rank r's block of param k
        off = sum(shard_numels[:k])
        expect = ag_output.view(W, -1)[:, off:off + n]
        assert torch.equal(t.view(W, -1), expect), f"copy-out check failed for param {k}"

    # Reduce-scatter copy-in, exactly as foreach_reduce_scatter_copy_in calls it.
    grads = [torch.randn(s, device=dev).to(torch.bfloat16) for s in shapes]
    rs_input = torch.empty(W * total_shard, dtype=torch.float32, device=dev)

    def copy_in():
        torch.ops.fsdp.chunk_cat(grads, dim=0, num_chunks=W, out=rs_input.view(W, -1))

    rs_ms = timed(copy_in, a.runs)
    g0 = grads[0].float().reshape(-1)
    assert torch.equal(rs_input.view(W, -1)[0, :shard_numels[0]], g0[:shard_numels[0]]), "copy-in check failed"

    ag_bytes = 2 * 2 * W * total_shard             # read + write, bf16
    rs_bytes = 2 * params + 4 * W * total_shard    # read bf16 grads, write fp32 buffer
    gib = 2 ** 30
    print(f"# stock FSDP2 layout-conversion ops, {a.layers} Llama-3.1-70B layer(s) "
          f"({params / 1e6:.1f} M params), W = {W}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'op (stock FSDP2)':<44} {'median ms':>10} {'GB moved':>9} {'GB/s':>7}")
    print(f"{'AG copy-out  split_with_sizes_copy':<44} {ag_ms:>10.3f} {ag_bytes / 1e9:>9.2f} {ag_bytes / ag_ms / 1e6:>7.0f}")
    print(f"{'RS copy-in   chunk_cat bf16 -> fp32':<44} {rs_ms:>10.3f} {rs_bytes / 1e9:>9.2f} {rs_bytes / rs_ms / 1e6:>7.0f}")
    print(f"{'both, per step (TIDE runs neither)':<44} {ag_ms + rs_ms:>10.3f}")
    print(f"full-group buffers stock allocates per step and TIDE does not (from the shapes): "
          f"AG flat output {2 * W * total_shard / gib:.2f} GiB bf16 (TIDE's window is the params' own storage), "
          f"RS input {4 * W * total_shard / gib:.2f} GiB fp32")


if __name__ == "__main__":
    main()
