"""tide-bench: clear argument errors; a short CPU run whose JSON has every field and whose plots exist
(and its compute-only reference); the MoE and DiT models, TIDE vs stock, with experts sharded on dim
0 and on dim 1; the compute-only reference's collectives move nothing; spawned ranks end past the
interpreter's finalization, and meet on a port held from before they start; multi_gpu.sh's reader of
the JSON; stock's captured mode refused without NCCL."""

import atexit
import dataclasses
import json
import os
import re
import tempfile

import pytest
import torch

from tide.bench import cli
from tide.bench.model import PRESETS, MoE


@pytest.mark.parametrize("argv, fragment", [
    (["fsdp", "--world", "0"], "--world 0: expected a positive integer"),
    (["fsdp", "--steps", "abc"], "--steps 'abc': expected a positive integer"),
    (["fsdp", "--world", "1"], "--world 1: FSDP needs at least 2 ranks"),
    (["fsdp", "--warmup", "-1"], "--warmup -1: expected >= 0"),
    (["fsdp", "--layers", "0"], "--layers 0: expected a positive integer"),
    (["fsdp", "--ranks-per-node", "0"], "--ranks-per-node 0: expected a positive integer"),
    (["fsdp", "--model", "huge"], "invalid choice: 'huge'"),
    (["fsdp", "--expert-shard-dim", "2"], "invalid choice: 2"),
    (["fsdp", "--model", "tiny", "--expert-shard-dim", "1"], "model tiny has no expert tensors"),
    (["fsdp", "--model", "qwen3-moe-tiny", "--expert-shard-dim", "1", "--world", "3"],
     "dim 64 is not divisible by --world 3"),
    (["fsdp", "--device", "cpu", "--cuda-graphs"], "--cuda-graphs: device cpu: expected cuda"),
    (["fsdp", "--device", "cpu", "--model", "tiny", "--world", "2", "--float8", "--compute-only"],
     "--compute-only with --float8"),
    (["collectives", "--min-bytes", "100", "--max-bytes", "10"], "--min-bytes 100 > --max-bytes 10"),
    (["interference", "--device", "cpu"], "interference needs a CUDA GPU"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_argument_errors_are_clear(argv, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert fragment in capsys.readouterr().err


def test_fsdp_cpu_run_writes_complete_json_and_plots(tmp_path, capsys):
    out = tmp_path / "fsdp.json"
    plots = tmp_path / "plots"
    assert cli.main(["fsdp", "--device", "cpu", "--model", "tiny", "--layers", "1", "--world", "2", "--steps", "2",
                     "--warmup", "0", "--seq", "16", "--json", str(out), "--plot-dir", str(plots),
                     "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "layout-conversion copies (MiB)" in text and "numerical agreement" in text
    data = json.loads(out.read_text())
    for key in ("model", "config", "world", "device", "mp", "steps", "warmup", "stock", "tide",
                "max_abs_diff", "torch"):
        assert key in data, key
    for mode in ("stock", "tide"):
        for key in ("step_ms", "collectives_ms", "layout_copy_mib", "peak_memory_mib",
                    "peak_memory_kind", "tide_buckets", "tide_fallbacks", "tide_window_mib", "sm_cta_us",
                    "ranks_share_gpus"):
            assert key in data[mode], (mode, key)
        assert data[mode]["step_ms"] > 0 and data[mode]["peak_memory_mib"] > 0
    assert data["stock"]["layout_copy_mib"] > 0          # stock converts layouts every step
    assert data["tide"]["layout_copy_mib"] == 0          # TIDE never does
    assert data["config"]["layers"] == 1                  # --layers overrides the preset's 2
    assert data["tide"]["tide_buckets"] == 2 and data["tide"]["tide_window_mib"] > 0
    assert data["max_abs_diff"] == 0.0                   # W = 2, fp32: bitwise
    for name in ("fsdp_step_time.png", "fsdp_memory.png"):
        png = (plots / name).read_bytes()
        assert len(png) > 1000 and png[:8] == b"\x89PNG\r\n\x1a\n", name


def test_fsdp_cpu_run_across_virtual_nodes(tmp_path, capsys):
    """--ranks-per-node 1 at W = 2: TIDE runs its across-node programs (2 nodes); every reduction is
    still a sum of two, so the result is bitwise stock's."""
    out = tmp_path / "fsdp.json"
    assert cli.main(["fsdp", "--device", "cpu", "--model", "tiny", "--world", "2", "--ranks-per-node", "1",
                     "--steps", "1", "--warmup", "0", "--seq", "16", "--json", str(out), "--no-progress"]) == 0
    assert "nodes of 1 ranks" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["ranks_per_node"] == 1
    assert data["tide"]["tide_buckets"] == 3 and data["tide"]["tide_fallbacks"] == []
    assert data["tide"]["layout_copy_mib"] == 0 and data["max_abs_diff"] == 0.0


def test_collectives_cpu_sweep_checks_every_row(tmp_path, capsys):
    out = tmp_path / "coll.json"
    assert cli.main(["collectives", "--device", "cpu", "--world", "2", "--min-bytes", "65536",
                     "--max-bytes", "262144", "--iters", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["collective"], r["bytes"]) for r in rows] == [
        ("AG", 65536), ("RS", 65536), ("AG", 262144), ("RS", 262144)]
    assert all(r["check"] for r in rows)
    assert "busbw" in capsys.readouterr().out


def _fsdp_json(tmp_path, *argv):
    out = tmp_path / "fsdp.json"
    assert cli.main(["fsdp", "--device", "cpu", "--world", "2", "--steps", "2", "--warmup", "0",
                     "--seq", "16", "--json", str(out), "--no-progress", *argv]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("model, groups", [("qwen3-moe-tiny", 5), ("wan-tiny", 3)])
def test_fsdp_cpu_moe_and_dit_models_are_handled_and_bitwise(model, groups, tmp_path, capsys):
    """qwen3-moe-tiny: per layer, its experts and the rest of the layer, then the root (2 x 2 + 1);
    wan-tiny: 2 DiT blocks + the root. TIDE handles every group; W = 2, fp32: bitwise."""
    data = _fsdp_json(tmp_path, "--model", model)
    text = capsys.readouterr().out
    assert f"TIDE handled {groups} of {groups} param groups" in text
    t = data["tide"]
    assert t["param_groups"] == groups and t["tide_buckets"] == groups
    assert t["tide_fallbacks"] == [] and t["tide_fallback_groups"] == []
    assert data["stock"]["layout_copy_mib"] > 0 and t["layout_copy_mib"] == 0
    assert data["max_abs_diff"] == 0.0
    assert data["family"] == PRESETS[model].family and data["expert_shard_dim"] == 0


def test_fsdp_cpu_moe_experts_as_modules_are_handled_and_bitwise(tmp_path, capsys):
    """--experts-as-modules: each expert three nn.Linear, as Hugging Face MoE models keep them, so a
    layer's experts group holds 3 x 8 = 24 params (384 in qwen3-moe-layers). TIDE handles every
    group, bitwise stock's result."""
    data = _fsdp_json(tmp_path, "--model", "qwen3-moe-tiny", "--experts-as-modules")
    text = capsys.readouterr().out
    t = data["tide"]
    assert "TIDE handled 5 of 5 param groups" in text
    assert t["param_groups"] == 5 and t["tide_buckets"] == 5, t
    assert t["tide_fallbacks"] == [] and t["tide_fallback_groups"] == []
    assert data["config"]["experts_as_modules"] is True
    assert data["max_abs_diff"] == 0.0


def test_fsdp_cpu_moe_experts_on_dim_1_are_handled_in_place(tmp_path, capsys):
    """--expert-shard-dim 1: each layer's experts group is sharded on dim 1 (torchtitan's layout
    when the FSDP degree exceeds the expert count). TIDE takes those groups too, gathering each
    rank's block straight into place: every group handled, no layout copy and none of stock's
    Shard(1) re-layout cats, bitwise stock's result."""
    data = _fsdp_json(tmp_path, "--model", "qwen3-moe-tiny", "--expert-shard-dim", "1")
    text = capsys.readouterr().out
    s, t = data["stock"], data["tide"]
    assert t["param_groups"] == 5 and t["tide_buckets"] == 5, t
    assert t["tide_fallbacks"] == [] and t["tide_fallback_groups"] == []
    assert "TIDE handled 5 of 5 param groups" in text
    assert "experts sharded on dim 1" in text
    assert data["max_abs_diff"] == 0.0
    assert s["shard_dim_copy_mib"] > 0 and t["shard_dim_copy_mib"] == 0  # stock's cats, counted
    assert s["layout_copy_mib"] > 0 and t["layout_copy_mib"] == 0


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_params_match_the_built_model(name):
    with torch.device("meta"):
        model = PRESETS[name].build()
    assert sum(p.numel() for p in model.parameters()) == PRESETS[name].params()


@pytest.mark.parametrize("cfg, fragment", [
    (dataclasses.replace(PRESETS["qwen3-moe-tiny"], top_k=9), "top_k 9 > experts 8"),
    (dataclasses.replace(PRESETS["qwen3-moe-tiny"], kv_heads=3), "heads 4, kv_heads 3"),
    (dataclasses.replace(PRESETS["qwen3-moe-tiny"], experts=0), "Qwen3MoeConfig: experts = 0, expected >= 1"),
    (dataclasses.replace(PRESETS["wan-tiny"], heads=5), "WanConfig: dim 64, heads 5"),
    (dataclasses.replace(PRESETS["wan-tiny"], freq_dim=33), "freq_dim 33: expected even"),
    (dataclasses.replace(PRESETS["wan-tiny"], text_len=0), "WanConfig: text_len = 0, expected >= 1"),
])
def test_config_errors_are_clear(cfg, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        cfg.validate()
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        cfg.build()


def test_moe_routes_each_token_to_its_top_k_experts():
    """The permuted grouped computation equals a per-token loop over the chosen experts, forward
    and backward. The model is float64 but its router's softmax runs in float32 (as Qwen3's): the
    loop takes the model's own routing (the same batched float32 ops, so the same bits), and what
    differs is float64 rounding, in other summation orders, of sums of at most dim = 64 products
    of magnitude <= ~3 here: within 64 * 2^-53 * 64 * 3 ~ 1.4e-12 (measured <= 9e-16). Only the
    gradients reaching the router (x's, the router's) pass through float32 (the softmax backward),
    where a float64 difference can flip one float32 rounding of a gate's gradient: 2^-24 of it
    (~1.4e-7 here), within float32's tolerance. A token routed to another expert, or a slot
    permuted wrongly, differs by O(0.1)."""
    torch.manual_seed(0)
    cfg = PRESETS["qwen3-moe-tiny"]
    moe = MoE(cfg).double()
    x = torch.randn(2, 5, cfg.dim, dtype=torch.float64, requires_grad=True)
    y = moe(x)
    tokens = x.reshape(-1, cfg.dim)
    probs = torch.softmax(moe.router(tokens).float(), -1)  # MoE.forward's routing, batched as there
    weights, chosen = probs.topk(cfg.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    e = moe.experts
    ref = torch.stack([sum(wi.double() * ((torch.nn.functional.silu(tok @ e.w1[i]) * (tok @ e.w3[i])) @ e.w2[i])
                           for wi, i in zip(w, idx.tolist()))
                       for tok, w, idx in zip(tokens, weights, chosen)]).view_as(y)
    float64 = {"rtol": 0, "atol": 1e-11}  # ~7x the float64 bound above
    float32 = {"rtol": 1.3e-6, "atol": 1e-5}  # torch.testing's float32 defaults: ~70 such flips
    torch.testing.assert_close(y, ref, **float64)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, moe.experts.w1, moe.router.weight], g)
    refs = torch.autograd.grad(ref, [x, moe.experts.w1, moe.router.weight], g)
    for a, b, tol in zip(grads, refs, (float32, float64, float32)):
        torch.testing.assert_close(a, b, **tol)


def test_host_cost_code_runs_on_cpu_handled_and_without_remaps_after_warmup():
    # tide-bench host-cost itself needs a GPU (cli refuses CPU); its per-rank code and its report
    # run here, so that neither first runs on a GPU. Its times on CPU are not reported.
    from tide.bench import report
    from tide.bench.host_cost_bench import run_host_cost
    from tide.bench.launch import run_ranks

    layers, linears, steps = 6, 3, 2
    results = run_ranks(2, "cpu", run_host_cost, {"layers": layers, "linears": linears, "steps": steps,
                                                  "warmup": 1, "device": "cpu"})
    for r in results:
        assert r["groups"] == layers and r["steps"] == steps, r
        assert r["tide_all_gathers"] == 2 * layers * steps, r  # forward and backward, timed steps only
        assert r["tide_remaps"] == 0, r  # each group finds its window mapped after the first step
        assert r["stock_ms"] > 0 and r["tide_ms"] > 0, r
    table = report.host_cost_table(results, shares_gpu=False)
    assert f"{layers} param groups of {linears} Linear(64) each ({2 * linears} params)" in table and "0.0 times per timed step (12 all-gathers" in table, table


def test_fsdp_cpu_float8_groups_gather_fp8_in_place_and_bitwise(tmp_path, capsys):
    """--float8: the layers' linears trained in float8 by torchao, TIDE with fp8 all-gather on against
    stock with it off (gloo has no fp8). TIDE handles every group, the float8 ones through the
    extension path; it gathers fewer bytes than the params' fp32; no layout copies; bitwise (fp32
    params: the tensorwise scale is a max, exact however it is reduced)."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install torchao)")
    data = _fsdp_json(tmp_path, "--model", "tiny", "--float8")
    text = capsys.readouterr().out
    t = data["tide"]
    assert "float8 (torchao, fp8 all-gather on under TIDE, off under stock)" in text
    assert data["float8"] is True
    assert t["tide_buckets"] == t["param_groups"] and t["tide_fallbacks"] == [], t
    assert t["tide_extension_groups"] >= 1, t
    assert t["tide_float8_casts"] >= 2, t  # the float8 weights' e4m3 bytes cast by TIDE
    assert 0 < t["tide_gather_bytes"] < t["tide_param_bytes"], t
    assert data["stock"]["layout_copy_mib"] > 0 and t["layout_copy_mib"] == 0
    assert data["max_abs_diff"] == 0.0


def test_fsdp_cpu_compute_only_reference_has_its_column(tmp_path, capsys):
    """--compute-only: a third column with the reference's step time and time in collectives, and
    each mode's step less the reference's; of FSDP2's layout copies the reference ran only its
    first all-gathers' (stock: every all-gather's and reduce-scatter's, TIDE: none)."""
    data = _fsdp_json(tmp_path, "--model", "tiny", "--layers", "1", "--compute-only")
    text = capsys.readouterr().out
    step_row = next(line for line in text.splitlines() if line.startswith("step time (ms)"))
    stock, tide, _, reference = step_row.split()[3:]
    assert [stock, tide, reference] == [f"{data[m]['step_ms']:.2f}" for m in ("stock", "tide", "compute_only")]
    assert "communication exposed per step (step time - compute-only step time): stock " in text
    reference = data["compute_only"]
    assert reference["step_ms"] > 0 and reference["tide_buckets"] == 0
    assert 0 < reference["layout_copy_mib"] < data["stock"]["layout_copy_mib"], reference
    assert data["max_abs_diff"] == 0.0  # still TIDE against stock


def test_exposure_rows_read_a_runs_json_and_name_what_it_lacks(tmp_path, capsys):
    """scripts/multi_gpu.sh's reader (python -m tide.bench.report exposure) on a CPU run's JSON: a
    row with each mode's step time; a mode or field the JSON lacks, or a mode tide-bench does not
    know, is an error naming it. And the --cuda-graphs table with stock's captured column, from the
    same run's figures."""
    from tide.bench import report

    data = _fsdp_json(tmp_path, "--model", "tiny", "--layers", "1", "--compute-only")
    path = str(tmp_path / "fsdp.json")
    row = report.exposure_rows([path], ("stock", "tide", "compute_only")).splitlines()[-1]
    assert row.startswith(f"| tiny | 2 | {data['batch'] * 16} | {data['stock']['step_ms']:.2f} | "
                          f"{data['tide']['step_ms']:.2f} | "), row
    assert row.endswith(" | tide_vs_stock 0.0e+00 |"), row
    assert report.main(["exposure", "--expect", "stock,tide", path]) == 0
    with pytest.raises(ValueError, match=r"mode 'stock_captured' absent \(modes there: \['stock', 'tide', "
                                         r"'compute_only'\]\)"):
        report.exposure_rows([path])
    with pytest.raises(ValueError, match=r"modes \['tide_replayed'\]: expected some of"):
        report.exposure_rows([path], ("tide", "tide_replayed"))
    del data["tide"]["host_ms"]
    (tmp_path / "fsdp.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"mode 'tide' has no fields \['host_ms'\]"):
        report.exposure_rows([path], ("stock", "tide"))
    assert report.main(["exposure", "--expect", "stock,tide", path]) == 1
    assert "mode 'tide' has no fields ['host_ms']" in capsys.readouterr().err

    data["tide"]["host_ms"] = data["stock"]["host_ms"] = 1.0  # (CPU: none)
    summary = dict(data, tide_captured=data["tide"], stock_captured=data["stock"],
                   max_abs_diffs={"tide_captured_vs_tide": 0.0, "stock_captured_vs_stock": 0.0,
                                  "tide_vs_stock": 1e-6})
    text = report.fsdp_graphs_table(summary)
    header = text.splitlines()[1]
    assert re.split(r"\s{2,}", header.strip()) == [
        "TIDE run by run", "TIDE captured", "stock run by run", "stock captured", "compute only",
        "TIDE captured/run"], header
    assert "tide captured vs tide 0.000e+00 (bitwise equal), stock captured vs stock 0.000e+00 (bitwise " \
           "equal), tide vs stock 1.000e-06" in text
    assert "communication exposed per step (step time - compute-only step time): TIDE captured " in text
    assert ", stock captured " in text


def test_stock_captured_needs_nccl():
    """Stock FSDP2's captured steps need NCCL: gloo's collectives (ranks sharing a GPU) cannot be
    captured, and the mode says so instead of failing inside the capture."""
    import torch.distributed as dist
    from tide.bench import fsdp_bench

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="mode stock-captured: backend gloo: expected nccl"):
            fsdp_bench.run_mode(0, 1, "stock-captured", PRESETS["tiny"], {"device": "cpu"})
    finally:
        dist.destroy_process_group()


def _compute_only_rank(rank, world):
    """The compute-only reference and stock FSDP2 on one rank, and the rank's param shards as built."""
    from tide.bench import fsdp_bench
    cfg = dataclasses.replace(PRESETS["tiny"], layers=1)
    built = [p.to_local().detach().clone() for p in fsdp_bench._build(cfg, "cpu", "fp32", world).parameters()]
    opts = {"device": "cpu", "mp": "fp32", "steps": 2, "warmup": 0, "batch": 2, "seq": 16, "progress": False}
    return built, {mode: fsdp_bench.run_mode(rank, world, mode, cfg, opts) for mode in ("stock", "compute-only")}


def test_compute_only_collectives_move_nothing():
    """--compute-only's steps: every gradient the optimizer sees is zero (no reduce-scatter reached
    the shards: the params end as built, where stock's trained), and of FSDP2's layout copies only
    the first all-gathers' ran (the forward's, which materialise the unsharded params)."""
    from tide.bench.launch import run_ranks

    for built, runs in run_ranks(2, "cpu", _compute_only_rank):
        stock, reference = runs["stock"], runs["compute-only"]
        assert all(torch.equal(a, b) for a, b in zip(built, reference["params"]))
        assert not all(torch.equal(a, b) for a, b in zip(built, stock["params"]))
        assert 0 < reference["layout_copy_bytes"] < stock["layout_copy_bytes"], (reference, stock)


def _mark_finalization(rank, world, marker_dir):
    """An atexit handler that marks the interpreter's finalization, should this rank reach it."""
    atexit.register(lambda: open(os.path.join(marker_dir, f"finalized.{rank}"), "w").close())
    return rank


def test_spawned_ranks_end_without_the_interpreters_finalization(tmp_path):
    """run_ranks' processes end once their results are saved, past the interpreter's finalization
    (no atexit handler runs): there, gloo's worker thread dropping a finished collective's tensors
    aborts the process (pytorch/pytorch#190489)."""
    from tide.bench.launch import run_ranks

    assert run_ranks(2, "cpu", _mark_finalization, str(tmp_path)) == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _try_to_bind(rank, world, port):
    """0 if this rank can bind the port the ranks met on, else the bind's errno."""
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            return e.errno
    return 0


def test_the_rendezvous_port_is_held_from_before_the_ranks_start_until_they_end():
    """Spawned ranks meet on a port the launcher's store holds from the moment the OS picks it: no
    other process can take it in between (a port found free, closed and handed to the ranks was
    taken under parallel test processes: EADDRINUSE at rank 0's bind)."""
    import errno
    import socket

    from tide.bench import launch

    with launch.rendezvous() as port:
        with socket.socket() as s, pytest.raises(OSError) as e:
            s.bind(("127.0.0.1", port))
        assert e.value.errno == errno.EADDRINUSE
        # The ranks join over it, and the port stays held while they run.
        with tempfile.TemporaryDirectory() as out_dir:
            torch.multiprocessing.start_processes(launch._spawned, args=(2, port, "cpu", _try_to_bind, (port,), out_dir),
                                                  nprocs=2, join=True, start_method="spawn")
            assert [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)] == [errno.EADDRINUSE] * 2


def _fake_mps_control(folder, start_rc=0, server="4242"):
    """A stand-in nvidia-cuda-mps-control on PATH: logs its arguments and standard input, starts
    with exit status `start_rc`, lists `server` as its server."""
    script = folder / "nvidia-cuda-mps-control"
    script.write_text(f"""#!/bin/bash
log={folder}/calls
if [[ "$1" == -d ]]; then echo "start $CUDA_MPS_PIPE_DIRECTORY" >>$log; [[ -d "$CUDA_MPS_PIPE_DIRECTORY" ]] || exit 9; exit {start_rc}; fi
read -r cmd; echo "$cmd" >>$log
[[ "$cmd" == get_server_list ]] && echo "{server}"
exit 0
""")
    script.chmod(0o755)
    return folder / "calls"


@pytest.mark.parametrize("start_rc, server, used, why", [
    (0, "4242", True, ""),
    (0, "", False, "no rank reached the server"),
    (3, "", False, "nvidia-cuda-mps-control -d exited 3"),
])
def test_a_private_mps_server_serves_the_ranks_started_inside_and_quits_after(tmp_path, monkeypatch, start_rc,
                                                                              server, used, why):
    from tide.bench import mps

    calls = _fake_mps_control(tmp_path, start_rc, server)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    for k in mps.ENV:
        monkeypatch.delenv(k, raising=False)
    state = mps.MpsState(requested=True)
    with mps.private_server(state):
        inside = {k: os.environ.get(k) for k in mps.ENV}
    assert all(os.environ.get(k) is None for k in mps.ENV)  # restored
    assert state.used == used and why in state.why, state
    log = calls.read_text().split("\n")
    assert log[0].startswith("start ") and log[0].endswith("/pipe")
    if start_rc == 0:
        assert all(v and v.startswith(os.path.dirname(log[0][6:])) for v in inside.values()), inside
        assert log[1:3] == ["get_server_list", "quit"], log  # the server is told to quit after the ranks
    assert not os.path.exists(os.path.dirname(log[0][6:]))  # its folder is gone
    assert ("private MPS server (pid 4242)" in state.describe()) == used


def test_mps_without_the_control_program_says_so(tmp_path, monkeypatch):
    from tide.bench import mps

    monkeypatch.setenv("PATH", str(tmp_path))
    state = mps.MpsState(requested=True)
    with mps.private_server(state):
        assert not any(os.environ.get(k) for k in mps.ENV)
    assert not state.used and "nvidia-cuda-mps-control is not on PATH" in state.why
    assert "time-slice" in state.describe()


def test_mps_on_cpu_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["fsdp", "--device", "cpu", "--mps"])
    assert "--mps: device cpu: expected cuda" in capsys.readouterr().err
