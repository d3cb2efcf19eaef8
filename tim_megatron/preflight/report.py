"""``preflight.json``: everything a preflight measured, assembled from what its phases left in the run folder.

The job's phases write their gathered results to ``preflight/results/<phase>.json`` and every rank keeps a
heartbeat (:mod:`tim_megatron.preflight.heartbeat`). :func:`assemble` turns those files, the request written at
submission and the loop's ``metrics.jsonl`` into the report, whoever calls it: the job's rank 0 at its end, or the
submitting side when the job died without a verdict (a hang, a crash). :func:`finalize` adds the verdict and
writes the file; :func:`summary` is what ``tim preflight`` prints.
"""

from __future__ import annotations

import json
from pathlib import Path

from tim_megatron.preflight import bandwidth as bw
from tim_megatron.preflight.extrapolate import memory, step_time
from tim_megatron.preflight.heartbeat import phase_states, read_heartbeats, write_json
from tim_megatron.preflight.judge import judge

SCHEMA = "tim-preflight/1"
REPORT_FILE = "preflight.json"
GIB = 2**30


def folder(run_dir: Path) -> Path:
    return Path(run_dir) / "preflight"


def read_request(run_dir: Path) -> dict:
    return json.loads((folder(run_dir) / "request.json").read_text())


def write_results(run_dir: Path, phase: str, gathered: list[dict]) -> None:
    write_json(folder(run_dir) / "results" / f"{phase}.json", gathered, root=Path(run_dir))


def read_results(run_dir: Path, phase: str) -> list[dict] | None:
    p = folder(run_dir) / "results" / f"{phase}.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _metrics(run_dir: Path) -> dict[int, dict]:
    from tim_megatron.logging.tracker import read_metrics

    p = Path(run_dir) / "metrics.jsonl"
    return {int(r["step"]): r for r in read_metrics(p)} if p.exists() else {}


def _engines(
    layout: dict, setup: list[dict] | None, steps: list[dict] | None
) -> tuple[list[dict], list[dict]]:
    R = layout["ranks_per_engine"]
    by_rank = {d["rank"]: d for d in setup or []}
    out, setup_errors = [], []
    for d in setup or []:
        if d.get("where") == "setup":
            setup_errors.append({"rank": d["rank"], "error": d["error"]})
    gens = {d["rank"]: d.get("records", {}).get("generations", []) for d in steps or []}
    for k in range(layout["engines"]):
        ranks = list(range(k * R, (k + 1) * R))
        e: dict = {"engine": k, "ranks": ranks}
        infos = [by_rank[r] for r in ranks if r in by_rank]
        errs = [d for d in infos if d.get("where") == "engine"]
        if errs:
            e.update(error=errs[0]["error"], kind=errs[0]["kind"])
        loads = [
            d["engine"]["load_seconds"] for d in infos if d.get("engine", {}).get("load_seconds") is not None
        ]
        e["load_seconds"] = max(loads) if loads else None
        mine = gens.get(ranks[0], [])  # the ranks of one engine generate the same samples; its first speaks
        if mine:
            e["steps"] = [
                {
                    "step": g["step"],
                    "sequences": g["sequences"],
                    "response_tokens": g["response_tokens"],
                    "seconds": g["seconds"],
                    "tokens_per_s": g["response_tokens"] / g["seconds"] if g["seconds"] else None,
                }
                for g in mine
            ]
            e["response_tokens"] = sum(g["response_tokens"] for g in mine)
            e["seconds"] = sum(g["seconds"] for g in mine)
            e["tokens_per_s"] = e["response_tokens"] / e["seconds"] if e["seconds"] else None
        out.append(e)
    return out, setup_errors


def _syncs(layout: dict, steps: list[dict] | None) -> list[dict]:
    """One row per sync, check and engine. The verdicts and agreements are collective (rank 0's records hold them
    all); an engine's bytes and seconds come from its first rank's own load when the sync failed before its
    metrics were reduced."""
    if not steps:
        return []
    R = layout["ranks_per_engine"]
    by_rank = {d["rank"]: d.get("records", {}).get("syncs", []) for d in steps}
    records = by_rank.get(0, [])
    rows = []
    for i, rec in enumerate(records):
        m = rec.get("metrics", {})
        ags = rec.get("agreements") or []
        for k in range(layout["engines"]):
            row: dict = {
                "sync": rec["sync"],
                "check": rec["check"],
                "engine": k,
                "ranks": list(range(k * R, k * R + R)),
            }
            if rec["check"] == "probe":
                row["mbytes"] = m.get(f"sync/engine{k}/mbytes")
                row["seconds"] = m.get(f"sync/engine{k}/seconds")
                leader = by_rank.get(k * R, [])
                load = leader[i].get("load") if i < len(leader) else None
                if row["mbytes"] is None and load:
                    row["mbytes"], row["seconds"] = load["bytes"] / 2**20, load["seconds"]
            for q in ("p80", "mean", "max"):
                v = m.get(f"sync/engine{k}/{q}_abs_prob_diff")
                if v is None and k < len(ags):
                    v = ags[k][f"{q}_abs_prob_diff"]
                if v is not None:
                    row[f"{q}_abs_prob_diff"] = v
            if "error" in rec:
                failed = k in rec["engines_failed"] or not rec["engines_failed"]
                row["verdict"] = "failed" if failed else "passed"
                if failed:
                    row["error"] = rec["error"]
            elif "p80_abs_prob_diff" in row:
                row["verdict"] = "verified"
            else:
                row["verdict"] = "structure verified; numbers checked on the next step's samples"
            rows.append(row)
    return rows


def _step_time(request: dict, metrics: dict[int, dict], steps: list[dict] | None) -> list[dict]:
    row = metrics.get(2)
    if not row or "time/step" not in row:
        return []
    train = next((d.get("records", {}).get("train", {}) for d in steps or [] if d["rank"] == 0), {}).get(
        "2", {}
    )
    opt = train.get("optimizer", 0.0)
    update = row.get("time/update", 0.0)
    parts = {
        "rollout": row.get("time/rollout", 0.0),
        "logprobs": row.get("time/old_logprobs", 0.0) + row.get("time/advantages", 0.0),
        "train": update - opt,
        "optimizer": opt,
        "sync": row.get("time/sync", 0.0),
    }
    parts["other"] = max(
        0.0, row["time/step"] - parts["rollout"] - parts["logprobs"] - update - parts["sync"]
    )
    return step_time(
        parts,
        preflight=request["shape"]["preflight"],
        full=request["shape"]["full"],
        width=row.get("batch/width"),
    )


def _nccl_settings(run_dir: Path) -> dict | None:
    try:
        return json.loads((folder(run_dir) / "nccl" / "settings.json").read_text())
    except (OSError, ValueError):
        return None


def assemble(run_dir: Path, *, job: dict | None = None) -> dict:
    """The report (without its verdict) from the run folder's files; ``job``: the Slurm job's id and state."""
    run_dir = Path(run_dir)
    request = read_request(run_dir)
    layout = request["layout"]
    heartbeats = read_heartbeats(run_dir)
    doctor = read_results(run_dir, "doctor") or []
    devices = read_results(run_dir, "devices") or []
    band = read_results(run_dir, "bandwidth")
    setup = read_results(run_dir, "setup")
    steps = read_results(run_dir, "steps")
    metrics = _metrics(run_dir)
    ranks = [{k: v for k, v in d.items() if k not in ("ok", "infiniband")} for d in devices]
    nodes = {}
    for d in devices:
        if "infiniband" in d:
            nodes[str(d["node"])] = {"host": d["host"], "infiniband": d["infiniband"]}
    bandwidth = []
    if band:
        bandwidth = bw.combine(
            [d.get("records", []) for d in band],
            ranks_info=ranks,
            layout=layout,
            ports={int(n): v["infiniband"] for n, v in nodes.items()},
            networks={d["rank"]: d.get("networks", []) for d in band},
        )
    engines, setup_errors = _engines(layout, setup, steps)
    mem = []
    for d in steps or []:
        if d.get("memory"):
            m = memory(d["memory"]["peak_bytes"], request["memory_plan"])
            mem.append({"rank": d["rank"], **d["memory"], **m})
    rank0 = next((d for d in steps or [] if d["rank"] == 0), {})
    return {
        "schema": SCHEMA,
        "run_dir": str(run_dir),
        "job": job or {},
        "recipe": request["recipe"],
        "name": request["name"],
        "overrides": request["overrides"],
        "shrink": request["shrink"],
        "kept": request["kept"],
        "layout": layout,
        "phases": phase_states(heartbeats),
        "doctor": [d for d in doctor if d.get("results")],
        "ranks": ranks,
        "nodes": nodes,
        "bandwidth": bandwidth,
        "engines": engines,
        "setup_errors": setup_errors,
        "syncs": _syncs(layout, steps),
        "memory": mem,
        "memory_plan": request["memory_plan"],
        "step_time": _step_time(request, metrics, steps),
        "loop_times": {
            str(s): {k: v for k, v in r.items() if k.startswith("time/")} for s, r in metrics.items()
        },
        "checkpoint": rank0.get("checkpoint"),
        "nccl_debug": _nccl_settings(run_dir),
        "align": _align(run_dir, read_results(run_dir, "align")),
    }


def _align(run_dir: Path, results: list[dict] | None) -> dict | None:
    """After a failed sync check: the failing engine's first divergence as ``tim align`` found it (its files in
    ``RUN/align/``), or why it did not run; None when it was not asked for."""
    if not results:
        return None
    skipped = next((d["skipped"] for d in results if "skipped" in d), None)
    if skipped:
        return {"skipped": skipped}
    written = next((d for d in results if d.get("writer")), None)
    if written is None:
        return {"skipped": next((d["error"] for d in results if "error" in d), "no rank wrote an alignment")}
    return {
        "engine": written["engine"],
        "where": written["where"],
        "tolerance": written["tolerance"],
        "tokens_differing_any_layer": written["tokens_differing_any_layer"],
        "folder": str(Path(run_dir) / "align"),
    }


def finalize(run_dir: Path, *, job: dict | None = None, written_by: str) -> dict:
    """Assemble, judge and write ``preflight.json``; returns the report."""
    report = assemble(run_dir, job=job)
    report["verdict"] = judge(report).as_dict()
    report["written_by"] = written_by
    write_json(Path(run_dir) / REPORT_FILE, report, root=Path(run_dir))
    return report


# ------------------------------------------------------------------------------------------------ text


def _gib(x) -> str:
    if x is None:
        return "?"
    return f"{x / GIB:.2f} GiB" if x >= GIB / 10 else f"{x / 2**20:.1f} MiB"


def summary(report: dict) -> str:
    """The go / no-go summary, then every measured figure in short."""
    v = report["verdict"]
    lay = report["layout"]
    lines = [
        f"preflight {report['name']}: {'GO' if v['go'] else 'NO-GO'}",
        f"  layout: {lay['nodes']} node(s) x {lay['procs_per_node']} rank(s) "
        f"({lay['gpu_type'] + ' GPUs' if lay['gpus_per_node'] else 'CPU'}), tp={lay['tp']} ep={lay['ep']} "
        f"dp={lay['dp']}, {lay['engines']} rollout engine(s) x {lay['ranks_per_engine']} rank(s), {lay['backend']}",
        "  shrunk: " + ", ".join(f"{s['key']}={s['value']}" for s in report["shrink"]),
    ]
    if report.get("kept"):
        lines.append("  kept as given: " + ", ".join(report["kept"]))
    lines.append(
        "  phases: "
        + ", ".join(f"{n} {p['state']} {p['seconds']:.1f} s" for n, p in report["phases"].items())
    )
    for node in report["doctor"]:
        n = {s: sum(r["status"] == s for r in node["results"]) for s in ("ok", "warn", "fail")}
        lines.append(
            f"  doctor, node {node['node']} ({node['host']}): {n['ok']} ok, {n['warn']} warn, {n['fail']} fail"
        )
        for r in node["results"]:
            if r["status"] != "ok":
                lines.append(f"    {r['status']} {r['check']}: {r['detail']}")
    for d in report["ranks"]:
        dev = d["device"] + (
            f" {d.get('device_name')} {d.get('device_uuid')}" if d["device"] != "cpu" else ""
        )
        lines.append(
            f"  rank {d['rank']}: node {d['node']} ({d['host']}), local rank {d['local_rank']}, {dev}"
        )
    for e in report["bandwidth"]:
        nominal = f"{e['nominal_gb_s']:g} GB/s nominal" if e.get("nominal_gb_s") else "no nominal"
        net = f", network {'/'.join(e['network'])}" if e.get("network") else ""
        lines.append(
            f"  all-reduce {e['kind']} {e['ranks']} ({e['span']}, {e['backend']}{net}): busbw "
            f"{e['busbw_gb_s']:.3g} GB/s at {e['bytes'] / 2**20:g} MiB ({nominal})"
        )
    for e in report["engines"]:
        if e.get("error"):
            lines.append(f"  engine {e['engine']} {e['ranks']}: {e['error'][:300]}")
            continue
        gen = ""
        if e.get("steps"):
            last = e["steps"][-1]
            gen = (
                f", {e['response_tokens']} tokens in {len(e['steps'])} step(s); step {last['step']}: "
                f"{last['response_tokens']} tokens in {last['seconds']:.3f} s"
                + (f" ({last['tokens_per_s']:.0f} tok/s)" if last["tokens_per_s"] else "")
            )
        load = f"loaded in {e['load_seconds']:.1f} s" if e.get("load_seconds") is not None else "not loaded"
        lines.append(f"  engine {e['engine']} {e['ranks']}: {load}{gen}")
    for s in report["syncs"]:
        size = f"{s['mbytes']:.1f} MiB in {s['seconds']:.3f} s, " if s.get("mbytes") is not None else ""
        agree = (
            f"|dp| p80 {s['p80_abs_prob_diff']:.2g} mean {s['mean_abs_prob_diff']:.2g} max {s['max_abs_prob_diff']:.2g}, "
            if "p80_abs_prob_diff" in s
            else ""
        )
        lines.append(f"  sync {s['sync']} ({s['check']}) engine {s['engine']}: {size}{agree}{s['verdict']}")
    for m in report["memory"]:
        judged = "" if m["source"] == "cuda" else " (CPU: resident set, reported only)"
        lines.append(
            f"  memory rank {m['rank']} ({m['device']}): peak {_gib(m['peak_bytes'])} vs plan {_gib(m['plan_bytes'])}; "
            f"full recipe {_gib(m['full_bytes'])} (plan {_gib(m['full_plan_bytes'])}){judged}"
        )
        lines.append(f"    {m['formula']}")
    if report["step_time"]:
        lines.append(
            "  step time (step 2) -> full recipe"
            + ("" if report["layout"]["gpus_per_node"] else " (CPU timings, not judged)")
        )
        for c in report["step_time"]:
            lines.append(
                f"    {c['component']:<10} {c['preflight_s']:8.3f} s -> {c['full_s']:10.2f} s   {c['formula']}"
            )
    if report.get("checkpoint"):
        c = report["checkpoint"]
        lines.append(f"  final checkpoint: {_gib(c['bytes'])} in {c['seconds']:.1f} s (deleted)")
    for w in v["warnings"]:
        lines.append(f"  warning: {w}")
    for r in v["no_go"]:
        lines.append(f"  NO-GO: {r}")
    lines.append(f"  report: {Path(report['run_dir']) / REPORT_FILE}")
    return "\n".join(lines)
