"""``tim align``: the comparison's rules in process, then the real vLLM engine against the real Megatron trainer on
the tiny models: fp32 within 1e-5, a planted fault found where it was planted, R3 removing the router's part, a
TP=2 engine, and every family's tiny recipe."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import importable, require, run_ok
from tim_megatron.align.capture import Capture, sorted_topk
from tim_megatron.align.compare import compare, last_rows, router_agreement
from tim_megatron.align.report import write
from tim_megatron.align.run import AlignOptions, check_tokens, parse_sides, read_tokens, refuse
from tim_megatron.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny-moe/grpo.yaml"
FP32 = ["trainer.dtype=float32", "rollout.dtype=float32"]

# ---------------------------------------------------------------------------------------- in process


def _capture(side: str, *, layers: int = 3, lengths=(4, 3), hidden: int = 5, experts: int = 6, k: int = 2):
    g = torch.Generator().manual_seed(0)
    t = sum(lengths)
    cap = Capture(side, list(lengths), layers)
    part = {}
    for i in range(layers):
        part[("attention", i)] = torch.randn(t, hidden, generator=g)
        part[("mlp", i)] = torch.randn(t, hidden, generator=g)
        part[("router_logits", i)] = torch.randn(t, experts, generator=g)
        part[("topk", i)] = torch.tensor([[0, 3]] * t)
        part[("gates", i)] = torch.full((t, k), 0.5)
    part[("final_norm", 0)] = torch.randn(t, hidden, generator=g)
    part[("logprobs", 0)] = -torch.rand(t, generator=g)
    cap.add(part)
    return cap


def _changed(cap: Capture, key: tuple, value: torch.Tensor) -> Capture:
    out = Capture("b", cap.lengths, cap.num_layers, dict(cap.tensors))
    out.tensors[key] = value
    return out


def test_the_first_divergence_follows_the_order_a_layer_computes():
    a = _capture("a")
    assert compare(a, _changed(a, ("topk", 0), a.get("topk", 0)), tolerance=1e-5).first_divergence is None
    bump = a.get("mlp", 1) + 1e-3
    al = compare(a, _changed(a, ("mlp", 1), bump), tolerance=1e-5)
    assert al.first_divergence == {"layer": 1, "component": "experts"}
    assert al.layers[0].block.max_abs == 0 and al.layers[1].block.max_abs == pytest.approx(1e-3, rel=1e-3)
    assert compare(a, _changed(a, ("mlp", 1), bump), tolerance=1e-2).first_divergence is None
    # the router of layer 1 comes before its experts, attention before both
    routed = _changed(_changed(a, ("mlp", 1), bump), ("topk", 1), torch.tensor([[0, 4]] * 7))
    assert compare(a, routed, tolerance=1e-5).first_divergence == {"layer": 1, "component": "router"}
    attn = _changed(routed, ("attention", 1), a.get("attention", 1) - 1)
    assert compare(a, attn, tolerance=1e-5).first_divergence == {"layer": 1, "component": "attention"}
    head = _changed(a, ("logprobs", 0), a.get("logprobs") - 1e-3)
    assert compare(a, head, tolerance=1e-5).first_divergence == {"layer": None, "component": "head"}
    first_token = a.get("logprobs").clone()
    first_token[0] -= 1  # position 0 of a sequence has no logprob: never compared
    assert compare(a, _changed(a, ("logprobs", 0), first_token), tolerance=1e-5).head.max_abs == 0


def test_nan_is_a_divergence_and_a_router_on_one_side_only_is_refused(tmp_path):
    a = _capture("a")
    broken = a.get("attention", 1).clone()
    broken[3, 0] = float("nan")
    al = compare(a, _changed(a, ("attention", 1), broken), tolerance=1e-5)
    assert al.first_divergence == {"layer": 1, "component": "attention"}
    body = json.loads(write(al, tmp_path, sequences=2, meta={})["json"].read_text())  # strict JSON: no NaN
    assert body["layers"][1]["attention"]["max_abs"] == "nan"
    dense = Capture("b", a.lengths, a.num_layers, {k: v for k, v in a.tensors.items() if k != ("topk", 2)})
    with pytest.raises(ValueError, match="layer 2 is a MoE layer for a only"):
        compare(a, dense, tolerance=1e-5)


def test_router_agreement_counts_choices_sets_and_gates_where_sets_agree():
    ids_a = torch.tensor([[0, 1], [2, 3], [4, 5], [0, 5]])
    ids_b = torch.tensor([[0, 1], [2, 4], [1, 6], [0, 5]])
    gates_a = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.5, 0.5], [0.7, 0.3]])
    gates_b = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.7, 0.3]])
    choice, sets, gate, differs = router_agreement(ids_a, ids_b, gates_a, gates_b)
    assert choice == pytest.approx((0 + 0.5 + 1 + 0) / 4) and sets == 0.5
    assert gate == pytest.approx(0.1) and differs.tolist() == [False, True, True, False]
    ids, gates = sorted_topk(torch.tensor([[5, 0]]), torch.tensor([[0.3, 0.7]]))
    assert ids.tolist() == [[0, 5]] and gates[0].tolist() == pytest.approx([0.7, 0.3])


def test_the_head_is_judged_like_the_layers_in_units_of_its_largest_entry():
    """Logprobs of size up to 8 that differ by 2e-2 nats differ by 2.5e-3 of their size: within a tolerance of 1e-2,
    as a layer's residual stream of that size and difference would be. Judged in raw nats (as before), the head was
    blamed for a fault every layer kept within the tolerance."""
    a = _capture("a")
    lp = -8 * torch.rand(len(a.get("logprobs")), generator=torch.Generator().manual_seed(1))
    lp[1] = -8.0  # the largest entry is exactly 8
    base = _changed(a, ("logprobs", 0), lp)
    shifted = _changed(a, ("logprobs", 0), lp - 2e-2)
    al = compare(base, shifted, tolerance=1e-2)
    assert al.head.max_abs == pytest.approx(2e-2, rel=1e-3) and al.head.scaled == pytest.approx(
        2.5e-3, rel=1e-2
    )
    assert al.first_divergence is None, al.first_divergence
    assert compare(base, shifted, tolerance=1e-3).first_divergence == {"layer": None, "component": "head"}


def test_with_replay_each_sequences_last_row_is_left_out():
    assert last_rows([3, 2]).tolist() == [False, False, True, False, True]
    a = _capture("a", lengths=(3, 2))
    last = a.get("mlp", 0).clone()
    last[[2, 4]] += 5.0  # only the last rows differ
    b = _changed(a, ("mlp", 0), last)
    assert compare(a, b, tolerance=1e-5).first_divergence == {"layer": 0, "component": "experts"}
    skipped = compare(a, b, tolerance=1e-5, skip_last=True)
    assert skipped.first_divergence is None and skipped.tokens == 3


def test_the_report_holds_every_figure_a_table_and_a_plot(tmp_path):
    a = _capture("engine")
    b = _changed(a, ("mlp", 2), a.get("mlp", 2) * 1.5)
    al = compare(a, b, tolerance=1e-5)
    files = write(al, tmp_path, sequences=2, meta={"recipe": "x"})
    body = json.loads(files["json"].read_text())
    assert body["schema"] == "tim-align/1" and body["first_divergence"] == {
        "layer": 2,
        "component": "experts",
    }
    assert [ld["layer"] for ld in body["layers"]] == [0, 1, 2] and body["where"] == "layer 2, experts"
    text = files["text"].read_text()
    assert "first divergence: layer 2, experts" in text and len(text.splitlines()) == 2 + 3 + 4
    assert files["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_html_report_shows_an_alignment_kept_in_a_run_folder(tmp_path):
    """tim report finds RUN/align/align.json (where the command a failed sync prints writes it) and shows the
    sides, the first divergence, the table and the plot; a run without one has no such section."""
    from tests.test_report import synthetic_run
    from tim_megatron.report.build import build_report

    run = synthetic_run(tmp_path / "runs", "aligned", growing=False, steps=12, dumps=False)
    a = _capture("engine")
    al = compare(a, _changed(a, ("mlp", 2), a.get("mlp", 2) * 1.5), tolerance=1e-5)
    write(al, run / "align", sequences=2, meta={})
    plain = synthetic_run(tmp_path / "runs", "plain", growing=False, steps=12, dumps=False)
    page = (build_report([run, plain], tmp_path / "rep")["out"] / "index.html").read_text()
    assert "Where the engine and the trainer part ways (tim align)" in page
    assert "<h3>aligned: engine vs b</h3>" in page and "First divergence: <b>layer 2, experts</b>" in page
    assert "<h3>plain" not in page and (tmp_path / "rep" / "align-0.png").read_bytes()[:4] == b"\x89PNG"
    page = (build_report([plain], tmp_path / "rep2")["out"] / "index.html").read_text()
    assert "tim align" not in page


def test_bad_inputs_are_named(tmp_path):
    bad = tmp_path / "t.json"
    for content in ("{", "[]", "[[1]]", '[["a", 2]]'):
        bad.write_text(content)
        with pytest.raises(ValueError, match=r"--tokens .*t\.json"):
            read_tokens(bad)
    bad.write_text("[[1, 2, 3]]")
    assert read_tokens(bad) == [[1, 2, 3]]
    with pytest.raises(ValueError, match="rollout.backend = trainer"):
        refuse(load_recipe(TINY, ["diagnostics.vexact=exact"]).recipe)
    with pytest.raises(ValueError, match="rollout.enforce_eager = false"):
        refuse(load_recipe(TINY, ["rollout.enforce_eager=false"]).recipe)
    r = load_recipe(TINY).recipe
    vocab, longest = r.model.dims.vocab_size, r.rollout.max_model_len
    with pytest.raises(
        ValueError, match=rf"sequence 1 has ids \[{vocab}\] outside the vocabulary \[0, {vocab}\)"
    ):
        check_tokens([[1, 2], [3, vocab]], r)
    with pytest.raises(
        ValueError, match=f"sequence 0 has {longest + 1} tokens; rollout.max_model_len = {longest}"
    ):
        check_tokens([[1] * (longest + 1)], r)
    check_tokens([[0, vocab - 1]], r)
    for text in ("engine", "engine,engine", "engine,trainer,hf", "engine,megatron"):
        with pytest.raises(
            ValueError, match=rf"--sides {text}: give two different sides.*engine, trainer, hf"
        ):
            parse_sides(text)
    assert parse_sides("trainer, hf") == ("trainer", "hf")
    with pytest.raises(ValueError, match="--fault-layer 1: the fault is planted in the engine.*trainer,hf"):
        AlignOptions(fault_layer=1, sides=("trainer", "hf"))


# --------------------------------------------------------------------------------- engine vs trainer


def _tokens(tmp: Path, recipe: str = TINY, *, count: int = 6, length: int = 12) -> Path:
    """Fixed token sequences within the model's vocabulary (nothing sampled: the figures depend on them only)."""
    vocab = load_recipe(recipe).recipe.model.dims.vocab_size
    g = torch.Generator().manual_seed(7)
    seqs = torch.randint(1, vocab, (count, length), generator=g).tolist()
    path = tmp / "tokens.json"
    path.write_text(json.dumps(seqs))
    return path


def _align(tmp: Path, *args: str, recipe: str = TINY, timeout: int = 600) -> dict:
    require(importable("megatron.core", "vllm"), "megatron-core and vLLM")
    out = tmp / "align"
    res = run_ok(
        [sys.executable, "-m", "tim_megatron.cli", "align", recipe, *args, "--out", str(out)],
        threads=2,
        timeout=timeout,
    )
    assert f"wrote {out}/align.json" in res.stdout
    assert (out / "align.png").stat().st_size > 0 and (out / "align.txt").read_text() in res.stdout
    return json.loads((out / "align.json").read_text())


def _components(ld: dict) -> list[float]:
    """Max |diff| of the layer's residual streams and router logits (the tiny MoE's entries are about 1 to 10, so
    this is within a factor 10 of what the tolerance judges)."""
    return [ld["attention"]["max_abs"], ld["block"]["max_abs"], ld["router_logits"]["max_abs"]]


def _first_above(rep: dict, tolerance: float) -> dict | None:
    """The first divergence the report's own figures give at ``tolerance``, in the order a layer computes."""
    for ld in rep["layers"]:
        order = [("attention", ld["attention"]["scaled"] > tolerance)]
        if ld["moe"]:
            order.append(
                ("router", ld["router_logits"]["scaled"] > tolerance or ld["expert_set_differs"] > 0)
            )
        order.append(("experts" if ld["moe"] else "mlp", ld["block"]["scaled"] > tolerance))
        hit = next((c for c, off in order if off), None)
        if hit:
            return {"layer": ld["layer"], "component": hit}
    for c, x in (("final_norm", rep["final_norm"]["scaled"]), ("head", rep["head"]["scaled"])):
        if x > tolerance:
            return {"layer": None, "component": c}
    return None


@pytest.mark.slow
def test_bf16_sides_differ_in_every_layer_and_the_report_says_where_it_starts(tmp_path):
    """The tiny recipe as it is (bf16 on both sides), as the README's example runs it: the sides differ in every
    layer, from layer 0's attention on (above float32's 1e-5); the tolerance is 4 x the floor measured here (HF
    transformers in bf16 against float32 on the same tokens), printed with the floor, and the first divergence is
    what the figures give at that tolerance."""
    rep = _align(tmp_path, "--tokens", str(_tokens(tmp_path)))
    assert (rep["trainer_dtype"], rep["rollout_dtype"]) == ("bfloat16", "bfloat16") and rep[
        "tokens"
    ] == 6 * 12
    assert all(ld["attention"]["max_abs"] > 0 and ld["block"]["max_abs"] > 0 for ld in rep["layers"])
    assert rep["head"]["max_abs"] > 0 and _first_above(rep, 1e-5) == {"layer": 0, "component": "attention"}
    rule = rep["tolerance_from"]
    assert (rule["source"], rule["dtype"], rule["factor"]) == ("measured", "bfloat16", 4.0), rule
    assert rule["floor"] > 1e-4 and rep["tolerance"] == pytest.approx(4.0 * rule["floor"])
    assert rule["floor_at"] in judged_places(rep)
    assert rep["first_divergence"] == _first_above(rep, rep["tolerance"]), rep["where"]
    table = (tmp_path / "align" / "align.txt").read_text()
    assert f"= 4 x the floor {rule['floor']:.3g} measured on this machine" in table.splitlines()[1]
    assert table.count("\n") == 3 + 2 + 4 and f"first divergence: {rep['where']}" in table


def judged_places(rep: dict) -> set[str]:
    """The places :func:`~tim_megatron.align.compare.judged` names, for a report's layers."""
    places = {"final norm", "head"}
    for ld in rep["layers"]:
        places |= {
            f"layer {ld['layer']}, attention",
            f"layer {ld['layer']}, {'experts' if ld['moe'] else 'mlp'}",
        }
        if ld["moe"]:
            places.add(f"layer {ld['layer']}, router logits")
    return places


@pytest.fixture(scope="module")
def small_fault(tmp_path_factory):
    """One fp32 run with a fault of 1% in layer 1's experts, judged at 2e-2 (the fault moves layer 1's residual
    stream by about 4e-3 of its size, the final norm's output by about 1e-2, the head's logprobs by about 3e-2 nats,
    2e-3 of their size), into an output folder where links to files outside it were planted first. Those figures
    are the tiny MoE's after a 300-step warm-up; after the demo's 50 the final norm moves as much as the head does
    (1.9e-2 against 1.8e-2 nats), so no tolerance would separate them."""
    tmp = tmp_path_factory.mktemp("small-fault")
    out, outside = tmp / "align", tmp / "outside"
    out.mkdir()
    outside.mkdir()
    planted = {}
    for name in (".align.json.tmp", "align.png", "align.txt", "align.json"):
        target = outside / f"secret-{name.strip('.')}"
        target.write_text(f"not {name}: the user's own file\n")
        (out / name).symlink_to(target)
        planted[name] = target
    rep = _align(
        tmp,
        *FP32,
        "model.tiny_warmup_steps=300",
        "--tokens",
        str(_tokens(tmp)),
        "--fault-layer",
        "1",
        "--fault-scale",
        "0.01",
        "--tolerance",
        "2e-2",
    )
    return {"rep": rep, "out": out, "planted": planted}


@pytest.mark.slow
def test_a_fault_below_the_layer_tolerance_is_not_blamed_on_the_head(small_fault):
    """Before, the head was judged in raw nats: the fault that every layer keeps within 2e-2 reached the head as
    3e-2 nats and the report named the head. Now the head is judged in units of its largest logprob, as the layers
    are, and nothing is above the tolerance."""
    rep = small_fault["rep"]
    fault = rep["layers"][1]
    assert rep["layers"][1]["attention"]["scaled"] <= 1e-5 and 1e-3 < fault["block"]["scaled"] < 2e-2
    assert rep["final_norm"]["scaled"] < 2e-2 < rep["head"]["max_abs"]  # the case that was blamed on the head
    assert rep["head"]["scaled"] < 2e-2
    assert rep["first_divergence"] is None, rep["where"]
    assert rep["others"]["before_fault"]["first_divergence"] is None
    assert rep["tolerance"] == 2e-2 and rep["tolerance_from"]["source"] == "given"


@pytest.mark.slow
def test_links_planted_in_the_output_folder_are_replaced_not_written_through(small_fault):
    """Before, ``align.json`` went through ``.align.json.tmp`` (a fixed name, written through a link there) and the
    plot through ``align.png`` (savefig follows a link): the files the links pointed to were overwritten. Now each
    file is a fresh temporary file renamed into place: the files outside are unchanged, the report's are real."""
    out = small_fault["out"]
    for name, target in small_fault["planted"].items():
        assert target.read_text() == f"not {name}: the user's own file\n", name
    for name in ("align.json", "align.txt", "align.png"):
        assert not (out / name).is_symlink() and (out / name).is_file(), name
    assert (out / "align.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "align.json").read_text())["where"] == small_fault["rep"]["where"]


@pytest.mark.slow
def test_a_tp2_engine_against_a_one_rank_trainer_and_a_planted_fault(tmp_path):
    """A TP=2 engine (two torchrun ranks, the trainer data-parallel) against the fp32 trainer: every layer within
    1e-5 before the fault; the fault planted through the command line is found in layer 1's experts."""
    rep = _align(
        tmp_path,
        *FP32,
        "rollout.tensor_parallel_size=2",
        "--nproc",
        "2",
        "--tokens",
        str(_tokens(tmp_path)),
        "--fault-layer",
        "1",
    )
    assert rep["rollout_tp"] == 2 and rep["trainer_layout"] == {"tp": 1, "ep": 1, "world": 2}
    clean = rep["others"]["before_fault"]
    assert clean["first_divergence"] is None, clean["first_divergence"]
    assert all(max(_components(ld)) <= 1e-5 for ld in clean["layers"])
    assert rep["first_divergence"] == {"layer": 1, "component": "experts"}, rep["where"]
    assert max(_components(rep["layers"][0])) <= 1e-5 and "layer 1 scaled by 1.01" in rep["notes"][0]
