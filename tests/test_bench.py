"""The benchmark suite's smallest scenario produces a complete, valid record."""
import json
import mmap
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO

pytestmark = pytest.mark.multirank
FIELDS = ("scenario", "family", "mode", "mesh", "world_size", "device", "threads_per_rank", "tokens",
          "step_ms_median", "step_ms_min", "step_ms_max", "speedup_vs_world1", "param_bytes_per_rank_max",
          "rss_bytes_per_rank_max", "comm_bytes_per_step", "max_abs_err", "dispatch_overhead_ms",
          "activation_peak_bytes_per_rank")


def test_smoke_scenario_writes_a_valid_record(tmp_path):
    out = tmp_path / "records.jsonl"
    result = subprocess.run([sys.executable, str(REPO / "bench" / "run.py"), "--suite", "smoke", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    missing = [f for f in FIELDS if f not in record]
    assert not missing, missing
    assert record["world_size"] == 2 and record["mesh"]["ulysses"] == 2 and record["device"] == "cpu"
    assert record["step_ms_min"] <= record["step_ms_median"] <= record["step_ms_max"]
    assert record["max_abs_err"] <= 1e-5 and record["comm_bytes_per_step"] > 0
    assert 0 < record["param_bytes_per_rank_max"] and record["rss_bytes_per_rank_max"] > record["param_bytes_per_rank_max"]
    assert "consecutive" not in record  # only with --peers
    # Each step's page faults, per process: the one-rank step's and each rank's in the world step.
    assert isinstance(record["world1_minor_faults_median"], int) and record["world1_minor_faults_median"] >= 0
    assert len(record["minor_faults_per_rank_median"]) == 2
    assert all(isinstance(f, int) and f >= 0 for f in record["minor_faults_per_rank_median"])


def test_page_faults_are_counted_for_the_process_that_takes_them():
    """bench/measure.faults_during: a step's page faults, per process (the one-rank step's faults
    move its time by a few per cent: bench/results/ulysses2_breakdown_*, seventh session)."""
    sys.path.insert(0, str(REPO / "bench"))
    import measure

    size = 64 << 20

    def touch_fresh_pages():
        buf = mmap.mmap(-1, size)
        for offset in range(0, size, 4096):
            buf[offset] = 1
        buf.close()
        return "done"

    idle = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        time.sleep(1.0)  # past its start-up
        out, (mine, its) = measure.faults_during([os.getpid(), idle.pid], touch_fresh_pages)
    finally:
        idle.stdin.close()
        idle.wait(10)
    assert out == "done"
    assert mine >= size // (2 << 20)  # one a page touched, or one a huge page where the kernel gives those
    assert its < 100  # the idle process took none of them
    assert measure.minor_faults(idle.pid) is None  # gone: unreadable, not a number
    assert measure.median_count([3, 1, 2]) == 2 and measure.median_count([3, None]) is None


def test_with_the_peers_each_world_size_is_also_timed_back_to_back():
    """run.py --peers: beside the alternated figures, each world size's steps in a row, as the peers'
    harness times theirs (their ranks never idle between steps)."""
    sys.path.insert(0, str(REPO / "bench"))
    import run
    import scenarios

    (scenario,) = scenarios.select("none", ["smoke_flux_ulysses2"])
    record = run.run_scenario(scenario, "cpu", 1, 2, consecutive=True)
    together = record["consecutive"]
    assert together["world1_ms_median"] > 0 and together["step_ms_median"] > 0
    assert abs(together["speedup_vs_world1"] - together["world1_ms_median"] / together["step_ms_median"]) < 2e-3
    assert record["max_abs_err"] <= 1e-5


def _record(speedup, world1_ms, round_, peer=None, failure=None):
    step = world1_ms / speedup if speedup else None
    r = {"scenario": "flux_ulysses2" if peer is None else "peer_ulysses2", "family": "flux", "mode": "ulysses",
         "mesh": {"ulysses": 2}, "world_size": 2, "tokens": 4352, "round": round_, "failure": failure,
         "step_ms_median": step, "step_ms_min": step, "step_ms_max": step,
         "world1_ms_median": world1_ms, "speedup_vs_world1": speedup, "parallel_efficiency": speedup and speedup / 2,
         "max_abs_err": 1e-7}
    if peer:
        r["peer"] = peer
    return r


def test_comparison_takes_medians_over_rounds_and_skips_failed_ones():
    sys.path.insert(0, str(REPO / "bench"))
    import plots

    records = [_record(1.6, 6000, 1), _record(1.9, 6000, 2), _record(1.8, 6000, 3),
               _record(1.5, 7000, 1, "peer A"), _record(None, None, 2, "peer A", failure="SIGABRT"),
               _record(1.7, 7000, 3, "peer A")]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in plots.comparison(records).splitlines()[2:]}
    assert rows["this pack"][:4] == ["1.60x", "1.90x", "1.80x", "1.80x"]
    assert rows["peer A"][:4] == ["1.50x", "failed", "1.70x", "1.60x"]
    assert rows["peer A"][4] == f"{1.8 / 1.6:.3f}"
    assert rows["this pack"][-1] == "? / ? / ?"  # records without the page-fault counts
    with_faults = [{**r, "world1_minor_faults_median": 1000 * r["round"]} for r in records]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in plots.comparison(with_faults).splitlines()[2:]}
    assert rows["this pack"][-1] == "1000 / 2000 / 3000" and rows["peer A"][-1] == "1000 / ? / 3000"
    table = plots.table(records)
    assert "failed: SIGABRT" in table and table.count("flux_ulysses2 (round") == 3


def test_profile_script_measures_the_overlap_of_head_groups():
    """bench/profile_step.py --overlap: the step and rank 0's wait for communication, one Ulysses
    exchange against head groups, in one world."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "profile_step.py"), "--scenario", "flux_small_ulysses2",
                             "--overlap", "2", "--rounds", "2"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {n: line for n in (1, 2) for line in result.stdout.splitlines()
             if line.strip().startswith(f"Ulysses exchange in {n} head group")}
    waited = {n: float(line.split("|")[1]) for n, line in lines.items()}
    steps = {n: float(line.split(":")[1].split("|")[0]) for n, line in lines.items()}
    print("\n" + result.stdout.strip())
    assert set(waited) == {1, 2} and all(v > 0 for v in waited.values()) and all(v > 0 for v in steps.values())
    assert "communication waited for" in result.stdout


def test_comm_timeline_splits_blocked_time_into_transfer_and_wait():
    """bench/comm_timeline.py: per forward, rank 0's compute and each rank's blocked time, the part
    both ranks spent inside the same call (the transfer) apart from the wait for the other."""
    sys.path.insert(0, str(REPO / "bench"))
    import comm_timeline

    # Rank 0's forward from 0 to 1 s: it enters the exchange at 0.2, rank 1 at 0.25, both leave at
    # 0.3; then the output gather, both from 0.5 to 0.6.
    rank0 = [("all_to_all_single", 0.2, 0.3), ("all_gather_into", 0.5, 0.6)]
    rank1 = [("all_to_all_single", 0.25, 0.3), ("all_gather_into", 0.5, 0.6)]
    (row,) = comm_timeline.breakdown([(0.0, 1.0)], rank0, rank1)
    expected = {"wall": 1000, "blocked0": 200, "compute0": 800, "blocked1": 150, "transfer": 150, "tail": 400}
    assert {k: round(row[k], 6) for k in expected} == expected and row["calls"] == 2
    assert comm_timeline.breakdown([(2.0, 3.0)], rank0, rank1)[0]["calls"] == 0  # calls of another forward


def test_comm_timeline_reads_every_ranks_trace():
    """The script end to end: the workers inherit PARALLEL_TRACE_COMM and write their timelines."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "comm_timeline.py"), "--scenario",
                             "flux_small_ulysses2", "--forwards", "2"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    print("\n" + result.stdout.strip())
    calls = int(result.stdout.split("blocked in ")[1].split(" calls")[0])
    assert calls >= 4  # the input broadcast, an exchange there and back, the output gather
    assert "waiting for the other rank: rank 0" in result.stdout


def test_cache_table_and_psnr():
    """bench/cache_bench.py: one row per layout and threshold, the PSNR of an image against itself
    infinite and of a 0.01 offset 40 dB."""
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    import cache_bench

    row = dict(where="world1", world_size=1, threshold=None, cached=False, e2e_ms_median=1000.0, step_ms_median=80.0,
               cached_steps=0, latent_max_abs_err=0.0, image_max_abs_err=0.0, image_psnr_db=None,
               speedup_vs_uncached=1.0, speedup_vs_world1_uncached=1.0, max_abs_err_vs_world1=0.0)
    cached = {**row, "where": "mesh", "threshold": 0.1, "cached": True, "e2e_ms_median": 400.0, "cached_steps": 7,
              "image_psnr_db": 41.5, "speedup_vs_uncached": 2.5, "speedup_vs_world1_uncached": 2.5}
    record = {"scenario": "flux_cache_ulysses2", "mesh": {"cfg": 1, "ring": 1, "ulysses": 2, "tp": 1}, "steps": 12,
              "cache_variants": [row, cached]}
    lines = cache_bench.cache_table([record]).splitlines()
    assert len(lines) == 4
    assert "| flux_cache_ulysses2 | ulysses 2 | 0.1 | 7/12 | 80 | 400 | 2.50x | 2.50x | 41.5 dB |" in lines[3]
    image = torch.rand(1, 3, 8, 8)
    assert cache_bench.psnr(image, image) == float("inf")
    assert abs(cache_bench.psnr(image + 0.01, image) - 40.0) < 1e-4
    rgb = cache_bench.preview_decode(torch.zeros(1, 16, 2, 4, 4), [[0.0] * 3] * 16, [0.0] * 3)
    assert rgb.shape == (1, 3, 2, 4, 4) and torch.all(rgb == 0.5)


def test_dbcache_table_sets_cache_dit_beside_block_cache():
    """bench/cache_bench.py's comparison table: one row per layout and threshold that cache-dit ran, each
    system against its own uncached run, DBCache's end to end over Block Cache's; records without the
    comparison give no table."""
    sys.path.insert(0, str(REPO / "bench"))
    import cache_bench

    def row(where, threshold, e2e, cached, psnr, **more):
        return dict(where=where, threshold=threshold, cached=threshold is not None, e2e_ms_median=e2e,
                    cached_steps=cached, image_psnr_db=psnr, speedup_vs_uncached=more.pop("speedup"), **more)

    ours = [row("world1", None, 1000.0, 0, None, speedup=1.0), row("world1", 0.4, 500.0, 6, 60.0, speedup=2.0),
            row("mesh", None, 600.0, 0, None, speedup=1.0), row("mesh", 0.4, 300.0, 6, 60.0, speedup=2.0)]
    theirs = [row("world1", None, 1100.0, 0, None, speedup=1.0, latent_max_abs_vs_pack=1e-6),
              row("world1", 0.4, 660.0, 5, 55.25, speedup=1.667, latent_max_abs_vs_pack=2e-2),
              row("mesh", None, 700.0, 0, None, speedup=1.0, latent_max_abs_vs_pack=1e-6),
              row("mesh", 0.4, 420.0, 5, 55.25, speedup=1.667, latent_max_abs_vs_pack=2e-2)]
    record = {"scenario": "flux_cache_ulysses2", "mesh": {"cfg": 1, "ring": 1, "ulysses": 2, "tp": 1}, "steps": 12,
              "cache_variants": ours, "dbcache": {"system": "cache-dit 1.5.3", "variants": theirs}}
    lines = cache_bench.dbcache_table([record]).splitlines()
    assert len(lines) == 2 + 4
    assert lines[5] == ("| flux_cache_ulysses2 | ulysses 2 | 0.4 | 6/12, 300, 2.00x, 60.0 dB | "
                        "5/12, 420, 1.67x, 55.2 dB | 1.40x | 2.0e-02 |")
    assert "| unsharded | no cache | 0/12, 1000, 1.00x, - | 0/12, 1100, 1.00x, - | 1.10x | 1.0e-06 |" in lines[2]
    assert cache_bench.dbcache_table([{**record, "dbcache": None}]) == ""
    assert cache_bench.dbcache_table([{**record, "dbcache": {"failure": "cache-dit is not installed"}}]) == ""


def test_cache_dits_uncached_sampling_is_the_benchmarks_sampling():
    """bench/peers.run_dbcache (cache-dit in processes of its own, the benchmark's DBCache comparison):
    uncached at world size 1 and under cache-dit's Ulysses 2 it samples what the Block Cache benchmark
    samples unsharded, the same Euler loop on the same network, here on the smallest Flux; with a
    threshold it caches steps and moves the result, the same steps in every round. Needs the peers' packages,
    which the test host has (tools/host.py); missing, it fails (PARALLEL_NO_PEERS=1 skips it)."""
    import torch
    from test_block_cache_dbcache import need_peers

    need_peers()
    sys.path.insert(0, str(REPO / "bench"))
    import peers
    import scenarios

    steps, shape = 6, scenarios.FLUX_SMOKE
    result = peers.run_dbcache(shape, (0.3,), steps, threads=1, rounds=2, fn=1, bn=0, warmup=2, max_continuous=3)
    assert not result.get("failure"), result.get("failure")
    model, (x, _, context), kwargs = scenarios.build_flux(shape, seed=0, batch=1, device="cpu")
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    with torch.inference_mode():
        for i in range(steps):
            t = torch.full((x.shape[0],), float(sigmas[i]))
            x = x + (sigmas[i + 1] - sigmas[i]) * model._forward(x, t, context, **kwargs, transformer_options={})
    for where in ("world1", "mesh"):
        uncached, cached = result[where]["variants"]
        err = (uncached["latent"] - x).abs().max().item()
        print(f"\ncache-dit {where}: uncached max abs {err:.1e} against ComfyUI's Flux; cached "
              f"{cached['cached_steps']}/{steps}, moved by {(cached['latent'] - x).abs().max().item():.1e}")
        assert err <= 1e-4 * max(1.0, x.abs().max().item())
        assert cached["cached_steps"] > 0 and (cached["latent"] - uncached["latent"]).abs().max().item() > 1e-5
        # every round starts a fresh cache context, as a pipeline call does: the same steps cached each time
        assert len(cached["cached_steps_per_round"]) == 2 and len(set(cached["cached_steps_per_round"])) == 1


def test_controlnet_table():
    """bench/controlnet_bench.py: one row per record, each way's step as ControlNet + transformer, the speedup
    of 3 over 2."""
    sys.path.insert(0, str(REPO / "bench"))
    import controlnet_bench

    ways = [dict(way=w, title=controlnet_bench.WAY_TITLES[w], world_size=n, step_ms_median=s, controlnet_ms_median=c,
                 transformer_ms_median=s - c, step_ms_all=[s, s + 10.0, s - 10.0], max_abs_err_vs_unsharded=e,
                 residual_max_abs_err_vs_unsharded=e)
            for w, n, s, c, e in (("unsharded", 1, 9000.0, 2500.0, 0.0), ("rank0_controlnet", 2, 7000.0, 2500.0, 1e-6),
                                  ("sharded_controlnet", 2, 6000.0, 1500.0, 1e-6))]
    record = {"scenario": "flux_controlnet_ulysses2", "time": "2026-11-27T02:00:00", "machine": {"cpu_count": 2, "cpu": "x"},
              "load_average_start": [4.0], "load_average_end": [4.5], "threads_per_rank": 1, "comfyui": "0.33.0",
              "rounds": 3, "run_s": 200.0, "tokens": 4352, "controlnet_ways": ways,
              "transformer_shape": {"double": 2, "single": 4, "hidden": 512},
              "controlnet_shape": {"layout": "XLabs layout, image hint", "double": 1, "single": 1, "hint": [1, 3, 1024, 1024]},
              "speedup_sharded_over_rank0": 7000 / 6000, "controlnet_speedup_sharded_over_rank0": 2500 / 1500,
              "controlnet_share_unsharded": 2500 / 9000, "control_effect_max_abs": 0.3, "output_max_abs": 2.0}
    record.update(control_entries={"input": 19, "middle": 0, "output": 38}, control_bytes_entries=57 * 2**20,
                  control_bytes_distinct=2 * 2**20)
    lines = controlnet_bench.controlnet_table([record]).splitlines()
    assert len(lines) == 7
    row = lines[4]
    assert row.startswith("| 2026-11-27 02:00 | 2 shared cores, loaded, load 4.0 to 4.5")
    assert "| 9000 (2500 + 6500) | 7000 (2500 + 4500) | 6000 (1500 + 4500) | **1.167x** | 1.67x | 28 % |" in row
    assert "57 entries (57 MiB; 2 MiB of distinct tensors)" in lines[6]


def test_uneven_heads_prediction_charges_the_padded_share():
    """bench/uneven_heads.py (issue 50): Ulysses 3 over 40 heads attends 14 heads per rank where the even
    share is 13.33, so against Ring 3 (every head over a third of the queries, the same flops unpadded)
    its predicted attention is 14 * 3 / 40 = 1.05 times as long; 24 heads on 3 divide: no padding."""
    sys.path.insert(0, str(REPO / "bench"))
    import uneven_heads

    rows = {(r["model"][:3], r["layout"]): r for r in uneven_heads.predictions(3)}
    wan_u, wan_r = rows[("Wan", "ulysses3")], rows[("Wan", "ring3")]
    assert wan_u["heads_per_rank"] == 14 and wan_u["attention_ms"] / wan_r["attention_ms"] == pytest.approx(1.05, 0.01)
    flux_u, flux_r = rows[("Flu", "ulysses3")], rows[("Flu", "ring3")]
    assert flux_u["heads_per_rank"] == 8 and flux_u["attention_ms"] == pytest.approx(flux_r["attention_ms"], 0.01)


def test_load_cases_and_ratios():
    """bench/load.py: a case is layout[/transport][/cold]; each row's times and memory are set against
    the unsharded row of its page-cache state, and its first step against reading the file once."""
    sys.path.insert(0, str(REPO / "bench"))
    import load

    assert load.Case.parse("ulysses2/process_group/cold") == load.Case("ulysses2", "process_group", True)
    assert load.Case.parse("tp2").name == "tp2" and load.Case.parse("unsharded/cold").name == "unsharded/cold"
    assert [load.Case.parse(c).name for c in load.DEFAULT_CASES] == list(load.DEFAULT_CASES)
    with pytest.raises(ValueError):
        load.Case.parse("tp3/shared")
    rows = [{"layout": layout, "cache": cache, "growth": g, "peak_growth": 2 * g, "seconds": s, "first_step_s": s / 2}
            for layout, cache, g, s in (("unsharded", "warm", 100, 2.0), ("tp2", "warm", 110, 3.0),
                                        ("unsharded", "cold", 100, 4.0), ("tp2", "cold", 120, 5.0))]
    load.ratios(rows, {"warm_s": 0.5, "cold_s": 1.0})
    assert [r["growth_ratio"] for r in rows] == [1.0, 1.1, 1.0, 1.2]
    assert rows[1]["time_ratio"] == rows[1]["first_step_ratio"] == 1.5 and rows[3]["time_ratio"] == 1.25
    assert rows[1]["first_step_over_read"] == 3.0 and rows[3]["first_step_over_read"] == 2.5


@pytest.mark.comfy_server
def test_load_bench_on_the_stream_cold_with_a_lora_and_two_models(tmp_path, comfyui_path):
    """bench/load.py's paths other than the memory test's, on a small model (about 0.3 GB) in one
    server: the file read once warm and cold (evicted without root's rights), TP 2 over the stream
    with the page cache cold, each worker reading its slices from the file and receiving nothing, then
    two models in turn (the second run sends nothing) and a LoRA applied and changed (each worker
    receives the patched slices only, keeping the rest it read)."""
    from pathlib import Path

    if "cached_patcher_init" not in (Path(comfyui_path) / "comfy" / "model_patcher.py").read_text():
        pytest.skip("this ComfyUI does not record the file a model came from (0.33 does): no file reads")
    sys.path.insert(0, str(REPO / "bench"))
    import load

    files = load.write_models(tmp_path, 0.2, follow_ups=True)
    reads = load.reference_reads(files["path"])
    assert reads["fadvise_ok"] and reads["evicted"] and reads["resident_after"] in (0, None), reads
    row = load.measure(comfyui_path, tmp_path, load.Case.parse("tp2/process_group/cold"), follow_ups=True, settle_s=0)
    print(f"\n{load.summary(row)}")
    assert row["transport"] == "process_group" and row["weight_sends"] == 1 and row["evicted"]["fadvise_ok"]
    assert 0 < row["comfyui_load_s"] < row["first_step_s"] <= row["seconds"]
    # the sampler's two steps, told apart from the runtime's load bar on the same node (percent)
    assert [v for _, what, v in row["timeline"] if what == "KSampler" and v is not None] == [1, 2]
    planned = row["last_weight_send"]["file_reads"]["bytes_per_worker"][0]
    assert planned > 0.4 * files["model_bytes"]
    assert [(r["file_read_bytes"], r["received_bytes"]) for r in row["ranks"][1:]] == [(planned, 0)]
    assert [f["weight_sends"] for f in row["two_models"]] == [1, 0] and row["two_models"][1]["models_held"] == 2
    applied, changed = row["lora"]
    assert applied["weight_sends"] == changed["weight_sends"] == 1
    (worker,) = changed["ranks"][1:]
    assert worker["file_read_bytes"] == 0 and worker["kept_bytes"] > 0
    assert 0 < worker["received_bytes"] <= files["lora_patched_bytes"] / 2 * 1.01


def test_load_picture(tmp_path):
    """bench/plots.py draws bench/load.py's record (where matplotlib is installed: bench/setup_peers.sh)."""
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(REPO / "bench"))
    import plots

    def rank(n, read, got):
        return {"rank": n, "file_read_bytes": read, "received_bytes": got}

    def later(sends):
        return {"seconds": 1.0, "weight_sends": sends}

    rows = [{"layout": layout, "transport": transport, "cache": "warm", "first_step_s": 1.0, "seconds": 1.5,
             "growth": 1e9, "peak_growth": 2e9, "ranks": [rank(0, 0, None), rank(1, read, got)],
             "two_models": [later(1), later(0)], "lora": [{"strength": 0.8, **later(1)}, {"strength": 0.5, **later(1)}]}
            for layout, transport, read, got in (("unsharded", "shared", 0, 0), ("tp2", "process_group", 5e8, 0),
                                                 ("ulysses2", "shared", 0, 1e9))]
    record = {"suite": "load", "rows": rows, "model_bytes": 1e9, "comfyui": "0.33.0", "load_average_start": [1.0],
              "load_average_end": [2.0], "reference_reads": {"warm_s": 0.3, "cold_s": 0.9}}
    (tmp_path / "load_x.json").write_text(json.dumps(record))
    plots.plot([tmp_path / "load_x.json"], tmp_path / "out")
    assert (tmp_path / "out" / "load_x.png").stat().st_size > 10_000
