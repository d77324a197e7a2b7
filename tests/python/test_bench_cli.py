"""tide-bench: clear argument errors; a short CPU run whose JSON has every field and whose plots exist."""

import json

import pytest

from tide.bench import cli


@pytest.mark.parametrize("argv, fragment", [
    (["fsdp", "--world", "0"], "--world 0: expected a positive integer"),
    (["fsdp", "--steps", "abc"], "--steps 'abc': expected a positive integer"),
    (["fsdp", "--world", "1"], "--world 1: FSDP needs at least 2 ranks"),
    (["fsdp", "--warmup", "-1"], "--warmup -1: expected >= 0"),
    (["fsdp", "--layers", "0"], "--layers 0: expected a positive integer"),
    (["fsdp", "--ranks-per-node", "0"], "--ranks-per-node 0: expected a positive integer"),
    (["fsdp", "--model", "huge"], "invalid choice: 'huge'"),
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
