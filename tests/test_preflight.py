"""``make preflight``: the shrink keeps the recipe's layout; the judge's rules (device sharing, socket fallback,
bandwidth, memory, timeouts); the heartbeat watchdog; and three real preflight jobs: on the local Slurm a
two-rank, two-engine go with every figure in ``preflight.json`` and an engine that cannot fit; on the two-node
simulation a sync corrupted on engine 1 (no-go, each naming the engine)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tim_megatron.modes import captures_routes
from tim_megatron.preflight import bandwidth as bw
from tim_megatron.preflight.extrapolate import memory, step_time
from tim_megatron.preflight.heartbeat import Heartbeat, Watchdog, phase_states, read_heartbeats
from tim_megatron.preflight.judge import judge
from tim_megatron.preflight.shrink import load_preflight, preflight_prompts, slurm_minutes

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny-moe/grpo.yaml"
GIB = 2**30


# --------------------------------------------------------------------------------------------- shrink


def test_the_shrink_keeps_the_layout_and_lists_every_override():
    pf = load_preflight("recipes/qwen3-30b-a3b/gspo.yaml", ["remedies.router_replay=r3"])
    full, shrunk = pf.full.recipe, pf.shrunk.recipe
    for section in (
        "model",
        "parallel",
        "remedies",
        "cluster.env",
        "cluster.gpus_per_node",
        "cluster.gpu_type",
    ):
        a, b = full, shrunk
        for part in section.split("."):
            a, b = getattr(a, part), getattr(b, part)
        assert a == b, section
    assert (full.cluster.nodes, full.rollout.tensor_parallel_size) == (shrunk.cluster.nodes, 4)
    assert (full.trainer_dtype, full.rollout_dtype) == (shrunk.trainer_dtype, shrunk.rollout_dtype)
    assert captures_routes(shrunk) and shrunk.rollout.sleep_between_steps
    assert shrunk.model.path == "Qwen/Qwen3-30B-A3B"
    shrink = {s.key: s.value for s in pf.shrink}
    assert shrink == {
        "run.steps": 2,
        "run.val_every": 0,
        "checkpoint.every": 0,
        "checkpoint.save_optimizer": False,
        "cluster.requeue": False,
        "cluster.time": "01:00:00",
        "run.name": "qwen3-30b-a3b-gspo-preflight",
        # 32 ranks / rollout TP 4 = 8 engines; dp = 16 and 4 minibatches of 2 samples per prompt need 32 prompts
        "data.prompts_per_step": 32,
        "rollout.n": 2,
        "rollout.max_tokens": 32,
        "rollout.sync_check": "every",
        "logging.wandb.mode": "offline",
        "diagnostics.dumps.every": 0,
    }
    assert pf.shrunk.name == "qwen3-30b-a3b-gspo-preflight" and shrunk.data.prompts_per_step == 32
    req = pf.request()
    assert req["layout"]["engines"] == 8 and req["layout"]["backend"] == "nccl"
    assert req["shape"]["full"]["sequences_per_step"] == 128 * 16
    assert req["memory_plan"]["device_bytes"] == 80 * GIB


def test_the_command_line_wins_over_the_shrink():
    pf = load_preflight(TINY, ["rollout.max_tokens=3", "parallel.dp=2"])
    assert pf.kept == ["rollout.max_tokens"]
    assert "rollout.max_tokens" not in {s.key for s in pf.shrink}
    assert pf.shrunk.recipe.rollout.max_tokens == 3
    # never more than the recipe: the tiny recipe's 4 tokens stay 4
    assert load_preflight(TINY).shrunk.recipe.rollout.max_tokens == 4
    assert pf.shrunk.recipe.data.prompts_per_step == 2  # one per engine (2), a multiple of dp = 2


def test_prompt_count_and_slurm_times():
    assert preflight_prompts(engines=1, dp=1, n=2, minibatches=2) == 1
    assert preflight_prompts(engines=2, dp=2, n=2, minibatches=2) == 2
    assert preflight_prompts(engines=8, dp=16, n=2, minibatches=4) == 32
    assert preflight_prompts(engines=3, dp=1, n=1, minibatches=2) == 4
    assert [slurm_minutes(t) for t in ("30", "1:30", "02:00:00", "1-00", "1-2:03:00")] == [
        30,
        1.5,
        120,
        1440,
        1563,
    ]
    assert slurm_minutes("UNLIMITED") == float("inf")
    short = load_preflight(TINY, ["cluster.time=00:20:00"]).shrunk.recipe
    assert short.cluster.time == "00:20:00"  # a shorter limit than the preflight's stays


# ---------------------------------------------------------------------------------------------- judge


def _good_report() -> dict:
    """A go report of a 2-node x 2-GPU NCCL job (figures made up, each rule's inputs present)."""
    ranks = [
        {
            "rank": r,
            "local_rank": r % 2,
            "node": r // 2,
            "host": f"gpu{r // 2}",
            "device": f"cuda:{r % 2}",
            "device_uuid": f"GPU-{r}",
            "visible_devices": 2,
        }
        for r in range(4)
    ]
    done = {"state": "done", "ranks": {"done": [0, 1, 2, 3]}, "seconds": 1.0, "timeout_s": 60.0}
    return {
        "layout": {"nodes": 2, "procs_per_node": 2, "world": 4, "gpus_per_node": 2, "backend": "nccl"},
        "job": {"ended": True, "state": "COMPLETED"},
        "phases": {p: dict(done) for p in ("rendezvous", "doctor", "devices", "bandwidth", "setup", "steps")},
        "doctor": [
            {"node": 0, "host": "gpu0", "results": [{"check": "python", "status": "ok", "detail": ""}]}
        ],
        "ranks": ranks,
        "bandwidth": [
            {
                "kind": "inter-node",
                "ranks": [0, 2],
                "span": "inter-node",
                "backend": "nccl",
                "bytes": GIB,
                "busbw_gb_s": 20.0,
                "nominal_gb_s": 25.0,
                "infiniband": True,
                "network": ["IB"],
            }
        ],
        "engines": [
            {"engine": 0, "ranks": [0, 1], "steps": [{"step": 1}], "response_tokens": 10},
            {"engine": 1, "ranks": [2, 3], "steps": [{"step": 1}], "response_tokens": 12},
        ],
        "syncs": [
            {"sync": 1, "check": "probe", "engine": k, "ranks": [2 * k, 2 * k + 1], "verdict": "verified"}
            for k in (0, 1)
        ],
        "memory": [
            {
                "rank": 0,
                "device": "cuda:0",
                "source": "cuda",
                "peak_bytes": 50 * GIB,
                "plan_bytes": 60 * GIB,
                "plan_ratio": 50 / 60,
                "full_bytes": 70 * GIB,
                "device_bytes": 80 * GIB,
                "formula": "f",
            }
        ],
    }


def test_a_good_report_is_go():
    v = judge(_good_report())
    assert v.go and v.no_go == [] and v.warnings == []


def test_a_device_shared_by_two_ranks_is_no_go():
    rep = _good_report()
    rep["ranks"][3]["device_uuid"] = "GPU-2"  # ranks 2 and 3 on node 1 got the same GPU
    rep["ranks"][3]["device"] = "cuda:0"
    v = judge(rep)
    assert not v.go
    assert v.no_go == [
        "ranks 2, 3 on node 1 (gpu1) share one device (cuda:0, GPU-2): every rank needs its own GPU"
    ]


def test_counts_that_differ_from_the_layout_are_no_go():
    rep = _good_report()
    rep["ranks"] = rep["ranks"][:3]
    rep["ranks"][0]["visible_devices"] = 1
    rep["ranks"][1]["visible_devices"] = 1
    v = judge(rep)
    assert v.no_go == [
        "the job runs 3 rank(s); the layout needs 4",
        "node 0 (gpu0) sees 1 GPU(s) but runs 2 rank(s)",
        "node 1 (gpu1) runs 1 rank(s); the layout needs 2 per node",
    ]


def test_sockets_across_nodes_where_infiniband_exists_are_no_go():
    rep = _good_report()
    rep["bandwidth"][0]["network"] = ["Socket"]
    v = judge(rep)
    assert not v.go and len(v.no_go) == 1
    assert v.no_go[0].startswith(
        "inter-node group (ranks 0, 2): NCCL talks across nodes over sockets although InfiniBand exists"
    )
    rep["bandwidth"][0]["infiniband"] = False  # no RDMA port on the nodes: sockets are all there is
    assert judge(rep).go
    cpu = _good_report()
    cpu["bandwidth"][0].update(backend="gloo", network=["gloo (TCP)"], nominal_gb_s=None)
    assert judge(cpu).go  # gloo always uses TCP; nothing to judge on CPU


@pytest.mark.parametrize(
    ("busbw", "go", "warned"), [(20.0, True, False), (10.0, True, True), (2.0, False, False)]
)
def test_bandwidth_against_nominal(busbw, go, warned):
    rep = _good_report()
    rep["bandwidth"][0]["busbw_gb_s"] = busbw  # nominal 25 GB/s: 80%, 40%, 8%
    v = judge(rep)
    assert v.go == go and bool(v.warnings) == warned
    text = (v.no_go or v.warnings or [""])[0]
    if not go or warned:
        assert f"{100 * busbw / 25:.0f}% of the nominal 25 GB/s (inter-node)" in text


def test_memory_above_95_percent_of_the_device_is_no_go_and_an_underestimating_plan_warns():
    rep = _good_report()
    rep["memory"][0].update(full_bytes=77 * GIB)  # 96% of 80 GiB
    v = judge(rep)
    assert not v.go and "peak memory extrapolated to the full recipe 77.0 GiB is above 95%" in v.no_go[0]
    rep = _good_report()
    rep["memory"][0].update(peak_bytes=66 * GIB, plan_ratio=1.1)
    v = judge(rep)
    assert v.go and "tim plan underestimates the measured peak by 10%" in v.warnings[0]
    rep["memory"][0].update(source="rss", full_bytes=1000 * GIB)  # CPU: reported only
    assert judge(rep).go and not judge(rep).warnings


def test_engines_syncs_and_phases_name_what_failed():
    rep = _good_report()
    rep["engines"][1] = {
        "engine": 1,
        "ranks": [2, 3],
        "error": "ValueError: not enough KV cache memory",
        "kind": "fit",
    }
    rep["phases"]["setup"] = {
        "state": "failed",
        "ranks": {"failed": [2, 3], "done": [0, 1]},
        "errors": {"2": "x"},
    }
    rep["phases"]["steps"] = {
        "state": "failed",
        "ranks": {"failed": [0]},
        "errors": {"0": "WeightSyncError: ..."},
    }
    rep["syncs"][1].update(verdict="failed", error="rollout engine 1 does not hold the trainer's weights")
    v = judge(rep)
    assert v.no_go == [
        "rollout engine 1 (ranks 2, 3) does not fit: ValueError: not enough KV cache memory",
        "weight sync 1 failed verification (probe) on rollout engine 1 (ranks 2, 3): rollout engine 1 does not "
        "hold the trainer's weights",
    ]
    quiet = _good_report()
    quiet["engines"][0]["response_tokens"] = 0
    assert judge(quiet).no_go == ["rollout engine 0 (ranks 0, 1) produced nothing in 1 step(s)"]


def test_a_phase_past_its_timeout_or_cut_by_the_job_end_is_no_go():
    rep = _good_report()
    rep["phases"]["bandwidth"] = {
        "state": "timeout",
        "ranks": {"timeout": [2], "running": [0]},
        "timeout_s": 900.0,
    }
    del rep["phases"]["setup"], rep["phases"]["steps"]
    v = judge(rep)
    assert v.no_go == ["phase bandwidth ran past its timeout (900 s) on rank 2; rank 0 still in it"]
    rep = _good_report()
    rep["job"] = {"ended": True, "state": "TIMEOUT"}
    rep["phases"]["steps"] = {"state": "running", "ranks": {"running": [0, 1, 2, 3]}}
    assert judge(rep).no_go == ["the job ended (TIMEOUT) during phase steps: ranks 0, 1, 2, 3 still in it"]
    assert judge({"layout": _good_report()["layout"], "phases": {}}).no_go == [
        "the preflight did not run its loop steps (no rank started; see the job log)"
    ]


def test_a_doctor_fail_is_no_go():
    rep = _good_report()
    rep["doctor"][0]["results"].append(
        {
            "check": "patch megatron-cpu-shims",
            "status": "fail",
            "detail": "guard refuses",
            "fix": "pin megatron-core",
        }
    )
    assert judge(rep).no_go == [
        "doctor on node 0 (gpu0): patch megatron-cpu-shims: guard refuses -> fix: pin megatron-core"
    ]


# ----------------------------------------------------------------------------- bandwidth, extrapolation


def test_bus_bandwidth_follows_nccl_tests():
    alg, bus = bw.algbw_busbw(GIB, 0.01, 8)
    assert alg == pytest.approx(GIB / 0.01 / 1e9) and bus == pytest.approx(alg * 2 * 7 / 8)
    assert bw.algbw_busbw(GIB, 0.01, 2)[1] == pytest.approx(alg)  # 2(n-1)/n = 1 for two ranks
    ranks = [{"rank": r, "node": r // 2} for r in range(4)]
    per_rank = [
        [{"kind": "dp", "ranks": [0, 2], "sizes": [{"bytes": GIB, "seconds": 0.1 * (r + 1)}]}] for r in (0, 2)
    ]
    ports = {n: [{"state": "4: ACTIVE", "rate_gbit_s": 200.0}] for n in (0, 1)}
    (e,) = bw.combine(
        per_rank,
        ranks_info=ranks,
        layout={"backend": "nccl", "gpu_type": "h100-80gb"},
        ports=ports,
        networks={0: ["IB"], 2: ["IB"]},
    )
    assert e["sizes"][0]["seconds"] == pytest.approx(0.3)  # the slowest member
    assert e["span"] == "inter-node" and e["nominal_gb_s"] == 25.0 and e["network"] == ["IB"]
    assert bw.nominal_gb_s(span="intra-node", backend="nccl", gpu_type="h100-80gb", ib_gb_s=None) == 450.0
    assert bw.nominal_gb_s(span="intra-node", backend="gloo", gpu_type=None, ib_gb_s=None) is None


def test_nccl_log_names_the_network(tmp_path):
    (tmp_path / "gpu0.123.log").write_text(
        "gpu0:123 NCCL INFO NET/Socket : Using [0]eth0\ngpu0:123 NCCL INFO Using network Socket\n"
    )
    assert bw.nccl_networks(tmp_path, host="gpu0", pid=123) == ["Socket"]
    assert bw.nccl_networks(tmp_path, host="gpu0", pid=124) == []


def test_step_time_and_memory_extrapolation_show_their_formulas():
    pf = {"sequences_per_step": 4, "dp": 2, "width": 36, "max_tokens": 32, "waves": 1, "updates": 4}
    full = {
        "sequences_per_step": 2048,
        "dp": 16,
        "width": 10240,
        "max_tokens": 8192,
        "waves": 2,
        "updates": 4,
    }
    rows = {
        r["component"]: r
        for r in step_time(
            {"rollout": 2.0, "logprobs": 1.0, "train": 3.0, "optimizer": 0.5, "sync": 4.0, "other": 0.0},
            preflight=pf,
            full=full,
            width=20,
        )
    }
    assert rows["rollout"]["full_s"] == pytest.approx(2.0 * 2 * 8192 / 32)
    tokens = (2048 / 16 * 10240) / (4 / 2 * 20)
    assert rows["logprobs"]["full_s"] == pytest.approx(tokens) and rows["train"]["full_s"] == pytest.approx(
        3 * tokens
    )
    assert rows["optimizer"]["full_s"] == 0.5 and rows["sync"]["full_s"] == 4.0
    assert rows["step"]["full_s"] == pytest.approx(sum(r["full_s"] for k, r in rows.items() if k != "step"))
    assert rows["logprobs"]["formula"] == "1 s x (2048/16 seq x 10240 tok) / (4/2 seq x 20 tok) per dp rank"
    plan = {
        "full_activations_bytes": 10 * GIB,
        "preflight_activations_bytes": 1 * GIB,
        "preflight_total_bytes": 40 * GIB,
        "full_total_bytes": 49 * GIB,
        "device_bytes": 80 * GIB,
    }
    m = memory(45 * GIB, plan)
    assert m["full_bytes"] == 54 * GIB and m["plan_ratio"] == pytest.approx(45 / 40)
    assert (
        m["formula"]
        == "45.000 GiB measured + (10.000 - 1.000) GiB activations (tim plan, full - preflight shape) = 54.000 GiB"
    )


# ---------------------------------------------------------------------------------------- heartbeats


def test_the_watchdog_names_a_phase_past_its_timeout(tmp_path):
    hb = Heartbeat(tmp_path, rank=3, host="h", timeouts={"bandwidth": 0.3, "setup": 60})
    fired = []
    dog = Watchdog(hb, fired.append, poll_s=0.05)
    dog.start()
    with hb.phase("setup"):
        time.sleep(0.4)  # within its 60 s
    hb.begin("bandwidth")
    dog.join(timeout=10)
    assert fired == ["bandwidth"]
    (rec,) = read_heartbeats(tmp_path)
    assert rec["phases"]["setup"]["state"] == "done" and rec["phases"]["bandwidth"]["state"] == "timeout"
    states = phase_states([rec])
    assert states["bandwidth"]["state"] == "timeout" and states["bandwidth"]["ranks"] == {"timeout": [3]}
    hb.end("bandwidth")  # the phase's own end after the watchdog spoke does not hide the timeout
    assert read_heartbeats(tmp_path)[0]["phases"]["bandwidth"]["state"] == "timeout"


def test_an_error_in_a_phase_is_recorded_and_raised(tmp_path):
    hb = Heartbeat(tmp_path, rank=0, host="h")
    with pytest.raises(RuntimeError), hb.phase("doctor"):
        raise RuntimeError("boom")
    p = read_heartbeats(tmp_path)[0]["phases"]["doctor"]
    assert p["state"] == "failed" and p["error"] == "RuntimeError: boom"


def test_the_recorder_watches_the_loop_through_its_hook():
    """Preflight's records come from the loop's observer: each generation, each update's seconds summed per step,
    a sync with its load and agreements, and a failed check with the engines its error names (as data)."""
    from tim_megatron.observer import StepObserver
    from tim_megatron.preflight.steps import Records
    from tim_megatron.rollout.base import GenerationStats
    from tim_megatron.rollout.sync import Agreement, SyncReport, WeightSyncError

    rec = Records()
    assert isinstance(rec, StepObserver)
    rec.generated(step=1, engine=1, prompts=4, sequences=32, stats=GenerationStats(2.5, 40, 96))
    for _ in range(2):
        rec.trained(step=1, times={"fwd_bwd": 0.5, "optimizer": 0.25})
    rec.synced(sync=1, check="samples", metrics={})  # nothing was checked: nothing to record
    ag = Agreement(p80_abs_prob_diff=1e-5, mean_abs_prob_diff=5e-6, max_abs_prob_diff=3e-5,
                   max_abs_logprob_diff=2e-5, frac_above=0.0, tokens=10)  # fmt: skip
    rec.synced(
        sync=1, check="probe", metrics={"sync/seconds": 0.1}, load=SyncReport(7, 1024, 0.1), agreements=[ag]
    )
    err = WeightSyncError("rollout engine 1 does not hold the trainer's weights", engines=[1])
    rec.synced(sync=2, check="samples", error=err)
    out = rec.as_dict()
    assert out["generations"] == [
        {"step": 1, "engine": 1, "prompts": 4, "sequences": 32, "response_tokens": 96, "prompt_tokens": 40,
         "seconds": 2.5}
    ]  # fmt: skip
    assert out["train"] == {"1": {"fwd_bwd": 1.0, "optimizer": 0.5, "updates": 2}}
    probe, failed = out["syncs"]
    assert (
        probe["load"] == {"tensors": 7, "bytes": 1024, "seconds": 0.1}
        and probe["agreements"][0]["tokens"] == 10
    )
    assert failed == {"sync": 2, "check": "samples", "error": str(err), "engines_failed": [1]}
    import pickle  # a rank's error sent to another keeps its engines

    again = pickle.loads(pickle.dumps(err))
    assert (type(again), str(again), again.engines) == (WeightSyncError, str(err), [1])


def test_where_start_up_failed_is_classified():
    import pickle

    from tim_megatron.preflight.steps import classify_setup_error
    from tim_megatron.rollout.base import EngineStartError

    fit = EngineStartError("ValueError: less than requested memory for kv", kind="fit")
    assert classify_setup_error(fit) == {
        "where": "engine",
        "kind": "fit",
        "error": "ValueError: less than requested memory for kv",
    }
    load = pickle.loads(pickle.dumps(EngineStartError("RuntimeError: bad weights", kind="load")))
    assert classify_setup_error(load) == {
        "where": "engine",
        "kind": "load",
        "error": "RuntimeError: bad weights",
    }
    # the wording no longer decides: a trainer error that talks of memory is still start-up, not the engine
    assert classify_setup_error(RuntimeError("out of memory")) == {
        "where": "setup",
        "error": "RuntimeError: out of memory",
    }


# ----------------------------------------------------------------------------------- on a real Slurm


def make_preflight(slurm, out: Path, overrides: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``make preflight`` of the tiny recipe into ``out``; returns the result and its preflight.json."""
    res = subprocess.run(
        [
            *getattr(slurm, "prefix", []),  # the two-node cluster's clients run in its namespace
            "make",
            "--no-print-directory",
            "-o",
            ".venv/.tim-setup-stamp",
            "preflight",
            f"PY={sys.executable}",
            f"TIM={Path(sys.executable).parent / 'tim'}",
            f"RECIPE={TINY}",
            f"OVERRIDES=run.output_dir={out} {overrides}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**slurm.env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        timeout=900,
    )
    found = list(out.glob("*/*/preflight.json"))
    assert len(found) == 1, res.stdout[-4000:] + res.stderr[-4000:]
    return res, json.loads(found[0].read_text())


def no_go_exit(res: subprocess.CompletedProcess) -> bool:
    """``tim preflight`` exited 1 (no-go), which make reports as its own error 2."""
    return res.returncode == 2 and "preflight] Error 1" in res.stderr


def _log(res, report) -> str:
    logs = "\n".join(p.read_text()[-3000:] for p in Path(report["run_dir"]).glob("logs/slurm-*.out"))
    return res.stdout[-3000:] + res.stderr[-2000:] + logs


@pytest.mark.slurm
def test_make_preflight_two_ranks_two_engines_is_go_with_every_figure(slurm, tmp_path):
    res, rep = make_preflight(slurm, tmp_path, "parallel.dp=2")
    assert res.returncode == 0 and "preflight tiny-moe-grpo: GO" in res.stdout, _log(res, rep)
    assert rep["schema"] == "tim-preflight/1" and rep["verdict"] == {"go": True, "no_go": [], "warnings": []}
    assert rep["job"]["state"] == "COMPLETED" and rep["written_by"] == "tim preflight"
    assert rep["layout"]["engines"] == 2 and rep["layout"]["world"] == 2
    assert list(rep["phases"]) == ["model", "rendezvous", "doctor", "devices", "bandwidth", "setup", "steps"]
    assert all(p["state"] == "done" and p["ranks"] == {"done": [0, 1]} for p in rep["phases"].values())
    (node,) = rep["doctor"]  # the first rank of the one node ran every check
    assert len(node["results"]) >= 17 and not [r for r in node["results"] if r["status"] == "fail"]
    assert [(d["rank"], d["local_rank"], d["device"]) for d in rep["ranks"]] == [(0, 0, "cpu"), (1, 1, "cpu")]
    assert len({d["pid"] for d in rep["ranks"]}) == 2
    kinds = {e["kind"]: e for e in rep["bandwidth"]}
    assert set(kinds) == {"node", "dp"}  # tp and ep groups have one rank each: nothing to measure
    for e in kinds.values():
        assert e["ranks"] == [0, 1] and e["backend"] == "gloo" and e["nominal_gb_s"] is None
        assert [s["bytes"] for s in e["sizes"]] == [2**20, 4 * 2**20, 16 * 2**20]
        assert all(s["busbw_gb_s"] > 0 and s["seconds"] > 0 for s in e["sizes"])
    for k, e in enumerate(rep["engines"]):
        assert e["engine"] == k and e["ranks"] == [k] and e["load_seconds"] > 0
        assert (
            [s["step"] for s in e["steps"]] == [1, 2] and e["response_tokens"] > 0 and e["tokens_per_s"] > 0
        )
    syncs = {(s["sync"], s["check"], s["engine"]): s for s in rep["syncs"]}
    tolerance = load_preflight(TINY).shrunk.recipe.sync_tolerance
    assert set(syncs) == {(i, c, k) for i, c in ((1, "probe"), (1, "samples"), (2, "probe")) for k in (0, 1)}
    for (_, check, _), s in syncs.items():
        assert s["verdict"] == "verified" and s["p80_abs_prob_diff"] <= tolerance
        assert 0 <= s["mean_abs_prob_diff"] <= s["max_abs_prob_diff"]
        if check == "probe":
            assert s["mbytes"] > 0 and s["seconds"] > 0
    assert [m["rank"] for m in rep["memory"]] == [0, 1]
    for m in rep["memory"]:
        assert m["source"] == "rss" and m["peak_bytes"] > 100 * 2**20 and m["device_bytes"] is None
        assert m["full_bytes"] >= m["peak_bytes"] and "GiB measured" in m["formula"]
    comps = {c["component"]: c for c in rep["step_time"]}
    assert set(comps) == {"rollout", "logprobs", "train", "optimizer", "sync", "other", "step"}
    assert all(c["preflight_s"] >= 0 and c["full_s"] >= 0 and c["formula"] for c in comps.values())
    assert comps["step"]["preflight_s"] == pytest.approx(rep["loop_times"]["2"]["time/step"], rel=1e-6)
    assert rep["checkpoint"]["bytes"] > 0 and not (Path(rep["run_dir"]) / "checkpoints").exists()
    assert json.loads((Path(rep["run_dir"]) / "run.json").read_text())["status"] == "completed"
    for line in (
        "all-reduce dp [0, 1]",
        "engine 1 [1]: loaded in",
        "sync 2 (probe) engine 1:",
        "step time (step 2)",
    ):
        assert line in res.stdout, res.stdout[-3000:]


@pytest.mark.slurm
def test_a_sync_that_fails_verification_on_engine_1_of_two_nodes_is_no_go(two_nodes, tmp_path):
    """On the two-node simulation (one rank and one engine per node): the rendezvous, doctor and bandwidth across
    nodes run for real, and a sync corrupted on engine 1 is a no-go naming it."""
    res, rep = make_preflight(
        two_nodes,
        tmp_path,
        "cluster.nodes=2 parallel.dp=2 cluster.cpus_per_task=1 "
        f"cluster.env.GLOO_SOCKET_IFNAME={two_nodes.IFACE} "
        "diagnostics.sync_fault.kind=corrupt diagnostics.sync_fault.engine=1",
    )
    assert no_go_exit(res) and "preflight tiny-moe-grpo: NO-GO" in res.stdout, _log(res, rep)
    assert (rep["layout"]["nodes"], rep["layout"]["procs_per_node"], rep["layout"]["engines"]) == (2, 1, 2)
    assert [(d["rank"], d["node"]) for d in rep["ranks"]] == [(0, 0), (1, 1)]
    assert len({d["host"] for d in rep["ranks"]}) == 2
    assert sorted(n["node"] for n in rep["doctor"]) == [0, 1]  # the first rank of each node ran the doctor
    kinds = {e["kind"]: e for e in rep["bandwidth"]}
    assert set(kinds) == {"inter-node", "dp"}  # one rank per node: no group within a node
    assert kinds["inter-node"]["span"] == "inter-node" and kinds["inter-node"]["network"] == ["gloo (TCP)"]
    assert all(s["busbw_gb_s"] > 0 for e in kinds.values() for s in e["sizes"])
    (reason,) = rep["verdict"]["no_go"]
    assert reason.startswith(
        "weight sync 1 failed verification (probe) on rollout engine 1 (rank 1): rollout engine 1 does not hold "
        "the trainer's weights"
    ), reason
    by_engine = {s["engine"]: s for s in rep["syncs"]}
    assert set(by_engine) == {0, 1} and len(rep["syncs"]) == 2  # sync 1's probe stopped the loop
    assert by_engine[0]["verdict"] == "passed" and by_engine[1]["verdict"] == "failed"
    tolerance = load_preflight(TINY).shrunk.recipe.sync_tolerance
    assert by_engine[0]["p80_abs_prob_diff"] <= tolerance < by_engine[1]["p80_abs_prob_diff"]
    for s in by_engine.values():  # a failed sync still reports what it moved
        assert s["mbytes"] > 0 and s["seconds"] > 0 and s["max_abs_prob_diff"] >= s["p80_abs_prob_diff"]
    assert rep["phases"]["steps"]["state"] == "failed"
    assert f"NO-GO: {reason}" in res.stdout
    # After the failed check the job ran tim align in its own processes: every o_proj of engine 1 is corrupted,
    # so engine 1 parts from the trainer at layer 0's attention, by far more than the bf16 tolerance; engine 0,
    # healthy, stays within it everywhere. The failing engine's first rank wrote RUN/align/ (tim report shows it).
    assert rep["phases"]["align"]["state"] == "done"
    aligned = rep["align"]
    assert (aligned["engine"], aligned["where"], aligned["tolerance"]) == (1, "layer 0, attention", 5e-2)
    assert (
        f"tim align on this engine (tolerance 0.05): first divergence layer 0, attention ({aligned['folder']})"
        in reason
    )
    per_rank = json.loads((Path(rep["run_dir"]) / "preflight" / "results" / "align.json").read_text())
    by_engine = {d["engine"]: d["alignment"] for d in per_rank}
    assert by_engine[0]["first_divergence"] is None, by_engine[0]
    assert by_engine[1]["layers"][0]["attention"]["scaled"] > 10 * 5e-2
    written = json.loads((Path(aligned["folder"]) / "align.json").read_text())
    assert written["engine"] == 1 and written["where"] == "layer 0, attention"


@pytest.mark.slurm
def test_an_engine_that_cannot_fit_is_no_go(slurm, tmp_path):
    res, rep = make_preflight(slurm, tmp_path, "rollout.cpu_kvcache_gib=100000")
    assert no_go_exit(res) and "preflight tiny-moe-grpo: NO-GO" in res.stdout, _log(res, rep)
    (reason,) = rep["verdict"]["no_go"]
    assert reason.startswith("rollout engine 0 (rank 0) does not fit: ValueError: "), reason
    assert "requested memory for kv" in reason
    assert rep["engines"][0]["kind"] == "fit" and "steps" not in rep["phases"]
    assert json.loads((Path(rep["run_dir"]) / "run.json").read_text())["status"] == "failed"


def test_dry_run_prints_the_shrink_and_the_job_script(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "tim_megatron.cli",
            "preflight",
            TINY,
            f"run.output_dir={tmp_path}",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "#   data.prompts_per_step=1  (one prompt per engine (1)" in res.stdout
    assert '-m tim_megatron.cli preflight-job --run-dir "$RUN_DIR"' in res.stdout
    assert "#SBATCH --time=01:00:00" in res.stdout and "--requeue" not in res.stdout
    assert not list(tmp_path.iterdir())  # nothing created


def test_report_copy_is_not_mutated_by_judge():
    rep = _good_report()
    before = copy.deepcopy(rep)
    judge(rep)
    assert rep == before


def test_the_job_command_is_one_of_the_known_ones(tmp_path):
    from tim_megatron.slurm.render import RenderError, render

    recipe = load_preflight(TINY).shrunk.recipe
    script = render(recipe, run_dir=tmp_path, job_name="x", command="preflight-job")
    assert '-m tim_megatron.cli preflight-job --run-dir "$RUN_DIR"' in script
    assert '-m tim_megatron.cli train --run-dir "$RUN_DIR"' in render(recipe, run_dir=tmp_path, job_name="x")
    with pytest.raises(RenderError, match="job command 'train; rm -rf /': allowed train, preflight-job"):
        render(recipe, run_dir=tmp_path, job_name="x", command="train; rm -rf /")
