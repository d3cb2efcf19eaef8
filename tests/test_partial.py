"""Partial rollouts (rollout.partial, tim_megatron/rl/partial.py) at unit level: the recipe's rules, the seeds and
budgets of the schedule, how a sequence's parts are joined (tokens, versions, the routes of the call that sampled
each token), the version metrics, the routes R2 replays, and the checkpoint form of the batches in flight, checked
on load. The runs (vLLM and exact mode, both schedules, a resume) are in tests/test_offpolicy.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tim_megatron.recipe import RecipeError, load_recipe
from tim_megatron.rl.offpolicy import StalenessError
from tim_megatron.rl.partial import (
    RUNNING,
    InFlight,
    PartialRollouts,
    _versions_disagree,
    extended,
    version_metrics,
)
from tim_megatron.rollout.base import Sample, sample_seed, segment_seed

ROOT = Path(__file__).resolve().parents[1]
COUNTDOWN = ROOT / "recipes/tiny-moe/countdown.yaml"
ON = ["rollout.max_staleness=2", "rollout.partial.tokens_per_step=12", "rl.correction.mode=tis"]


# ------------------------------------------------------------------------------------------ the recipe


@pytest.mark.parametrize(
    "overrides, refused",
    [
        (["rollout.partial.tokens_per_step=12"], r"tokens_per_step = 12 with rollout.max_staleness = 0"),
        (
            [*ON, "rollout.partial.tokens_per_step=120"],
            r"tokens_per_step = 120 with rollout.max_tokens = 120",
        ),
        ([*ON, "rollout.stop=[';']"], r"rollout.stop = \[';'\]: a continued request matches stop strings"),
    ],
)
def test_the_recipe_refuses_partial_rollouts_it_cannot_run(overrides, refused):
    with pytest.raises(RecipeError, match=refused):
        load_recipe(COUNTDOWN, overrides)
    r = load_recipe(COUNTDOWN, ON).recipe
    assert r.rollout.partial.enabled and r.rollout.partial.tokens_per_step == 12


# ------------------------------------------------------------------------------------------ the schedule


def test_each_part_has_its_own_seed_whatever_else_runs():
    seeds = {segment_seed(7, s, u, p, j) for s in (3, 4) for u in (1, 2, 3) for p in (0, 5) for j in (0, 1)}
    assert len(seeds) == 2 * 3 * 2 * 2  # batch, step of the part, prompt and sample each change it
    assert segment_seed(7, 3, 2, 5, 1) == segment_seed(7, 3, 2, 5, 1)  # a pure function (resumes, schedules)
    assert segment_seed(7, 3, 3, 5, 1) != sample_seed(7, 3, 5, 1)


def test_a_batch_is_begun_k_steps_ahead_and_finished_at_its_step():
    p = PartialRollouts(k=2, tokens_per_step=12)
    assert p.to_begin(1) == [1, 2, 3]
    p.batches.update({s: None for s in (1, 2, 3)})
    del p.batches[1]
    assert p.to_begin(2) == [4]
    assert p.budget(4, 2, have=0, max_tokens=48) == 12  # a later batch: up to T
    assert p.budget(4, 3, have=40, max_tokens=48) == 8  # ... never past the response budget
    assert p.budget(2, 2, have=24, max_tokens=48) == 24  # its own step: the rest


def _row(prompt=(5, 6, 7), response=(), versions=(), routed=None, finish=RUNNING, policy=None) -> Sample:
    return Sample(
        list(prompt),
        list(response),
        [-0.5] * len(response),
        finish,
        routed_experts=routed,
        prompt_index=1,
        sample_index=2,
        versions=list(versions),
        policy_logprobs=policy,
    )


def _routes(positions: int, tag: int) -> np.ndarray:
    """``[positions, layers = 2, k = 2]`` expert ids that say which call computed them."""
    return np.full((positions, 2, 2), tag, dtype=np.int16)


def test_a_sequences_parts_keep_each_tokens_version_and_the_routes_of_the_call_that_sampled_it():
    row = _row()
    # the first call: 2 tokens, routes of the prompt's positions and the first token's (3 + 2 - 1)
    first = Sample([5, 6, 7], [8, 9], [-0.1, -0.2], "length", routed_experts=_routes(4, 10), prompt_index=1)
    row = extended(row, first, version=0, max_tokens=6)
    assert (row.finish_reason, row.versions, row.response_ids) == (RUNNING, [0, 0], [8, 9])
    # the next call, under the weights of update 1: the prefix re-submitted, routes from its last position on
    more = Sample(
        [5, 6, 7, 8, 9], [3, 2], [-0.3, -0.4], "stop", routed_experts=_routes(2, 11), prompt_index=1
    )
    row = extended(row, more, version=1, max_tokens=6)
    assert row.finish_reason == "stop" and row.versions == [0, 0, 1, 1] and row.logprobs[-1] == -0.4
    # position p: the routes of the call that sampled token p + 1 (positions 0..3 the first's, 4 and 5 the next's)
    assert row.routed_experts[:, 0, 0].tolist() == [10, 10, 10, 10, 11, 11]
    assert len(row.routed_experts) == len(row.prompt_ids) + len(row.response_ids) - 1
    with pytest.raises(RuntimeError, match="does not continue it"):
        extended(row, Sample([5, 6, 7, 8], [1], [-0.1], "stop"), version=2, max_tokens=6)


def test_a_part_that_uses_the_whole_response_budget_ends_the_sequence():
    row = extended(_row(), Sample([5, 6, 7], [8, 9, 1], [-0.1] * 3, "length"), version=3, max_tokens=3)
    assert row.finish_reason == "length" and row.versions == [3, 3, 3]


def test_version_metrics_count_ages_and_sequences_of_several_versions():
    from tim_megatron.rl.batch import from_samples

    rows = [
        [_row(response=(1, 2, 3), versions=(0, 0, 1), finish="stop"), _row(response=(4,), versions=(1,))],
        [_row(response=(5, 6), versions=(2, 2), finish="stop"), _row(response=(7, 8), versions=(1, 2))],
    ]
    b = from_samples(rows, [[0.0, 1.0], [1.0, 0.0]], total_rows=4)
    m = version_metrics(batch=b, step=3, k=2)  # trained at step 3: version 2 is age 0
    assert m["offpolicy/tokens_age_0_frac"] == 3 / 8 and m["offpolicy/tokens_age_2_frac"] == 2 / 8
    assert m["offpolicy/multi_version_frac"] == 2 / 4
    assert m["offpolicy/token_age_mean"] == (2 * 2 + 3 * 1) / 8


# --------------------------------------------------------------------------------------- R2's routes


def test_r2_replays_the_routes_of_the_pass_ppos_ratio_is_taken_against():
    """Issue 58, Why item 4: with rl.proximal = sampled R2 replays the routes the trainer chose at the sampling
    weights (those PPO's denominator pi_s was computed with), not pi_t's; R3 replays the engine's."""
    from tim_megatron.modes import modes_of
    from tim_megatron.rl.phases import OldPass, update_routes

    tiny = ROOT / "recipes/tiny-moe/grpo.yaml"
    at_s, at_t, engine = (torch.full((2, 1, 3, 2), v, dtype=torch.int16) for v in (1, 2, 3))
    old = OldPass(
        old=torch.zeros(1, 3),
        rollout=torch.zeros(1, 3),
        entropy=None,
        trainer_routing=at_t,
        recomputed=True,
        behaviour=torch.zeros(1, 3),
        age=1,
        sampled_routing=at_s,
    )

    from tim_megatron.rl.batch import from_samples

    batch = from_samples([[_row(response=(1, 2), versions=(0, 0))]], [[0.0]], total_rows=1)
    batch.routed_experts = engine

    def routes(*overrides):
        r = load_recipe(tiny, ["rollout.max_staleness=1", "rl.correction.mode=tis", *overrides]).recipe
        return update_routes(recipe=r, routing=modes_of(r).routing, batch=batch, old=old)

    assert routes("remedies.router_replay=r2", "rl.proximal=sampled", "rl.correction.target=tim") is at_s
    assert routes("remedies.router_replay=r2") is at_t
    assert routes("remedies.router_replay=r3") is engine
    assert routes() is None


# ------------------------------------------------------------------------------------ checkpoint form


def _flight() -> PartialRollouts:
    """After step 2 at k = 2, T = 2, max_tokens 6: B_3 (begun at step 1) and B_4 (begun at step 2), groups of 2."""
    p = PartialRollouts(k=2, tokens_per_step=2)
    b3 = (
        _row(response=(8, 9, 1, 2), versions=(0, 0, 1, 1)),  # running: 2 tokens at steps 1 and 2
        _row(response=(8, 3, 4), versions=(0, 0, 1), finish="stop"),  # ended at step 2
    )
    b4 = (_row(response=(4, 4), versions=(1, 1)), _row(response=(6,), versions=(1,), finish="stop"))
    for s, rows in ((3, b3), (4, b4)):
        rows = tuple(
            Sample(**{**x.__dict__, "sample_index": j, "routed_experts": _routes(2 + len(x.response_ids), s)})
            for j, x in enumerate(rows)
        )
        n = torch.tensor([len(x.response_ids) for x in rows])
        behaviour = -torch.rand(2, 6) * (torch.arange(6)[None] < n[:, None])
        p.batches[s] = InFlight(
            step=s, begun=max(s - 2, 1), rows=rows, behaviour=behaviour, scored=n, first_row=2
        )
    return p


def _load(tensors, plain, **kw):
    args = dict(k=2, tokens_per_step=2, max_tokens=6, max_prompt_tokens=8, group_size=2, step=2, first_row=2)
    return PartialRollouts.from_state(tensors, plain, **{**args, **kw}, where="f")


def test_batches_in_flight_round_trip_through_their_checkpoint_form():
    p = _flight()
    tensors, plain = p.state()
    q = _load(tensors, json.loads(json.dumps(plain)))
    for s in (3, 4):
        a, b = p.batches[s], q.batches[s]
        assert [x.response_ids for x in a.rows] == [x.response_ids for x in b.rows]
        assert [x.versions for x in a.rows] == [x.versions for x in b.rows]
        assert [x.finish_reason for x in a.rows] == [x.finish_reason for x in b.rows]
        assert all(
            np.array_equal(x.routed_experts, y.routed_experts) for x, y in zip(a.rows, b.rows, strict=True)
        )
        assert torch.equal(a.behaviour, b.behaviour) and torch.equal(a.scored, b.scored)


def _tamper(what: str, tensors: dict, plain: dict) -> None:
    if what == "relabelled version":
        tensors["3.versions"][0, 3] = 0
    elif what == "a step's part too long":
        tensors["3.versions"][0] = torch.tensor([0, 0, 0, 1])
    elif what == "running without its last part":
        tensors["4.finish"][1] = 3
    elif what == "nan pi_s":
        tensors["3.behaviour"][1, 0] = float("nan")
    elif what == "an unscored token":
        tensors["3.scored"][0] = 3
    elif what == "positive logprob":
        tensors["4.logprobs"][0, 1] = 0.25
    elif what == "missing tensor":
        del tensors["4.versions"]
    elif what == "begun elsewhere":
        plain["batches"][0]["begun"] = 2
    elif what == "a batch missing":
        plain["batches"] = plain["batches"][1:]
    elif what == "another T":
        plain["tokens_per_step"] = 3
    elif what == "not partial":
        del plain["partial"]
    elif what == "float ids":
        tensors["3.ids"] = tensors["3.ids"].float()
    elif what == "another layout":
        plain["batches"][0]["first_row"] = 0


@pytest.mark.parametrize(
    "what, refused",
    [
        ("relabelled version", r"step 3's partial batch, row 0: its tokens' versions \[0, 1, 0\]"),
        ("a step's part too long", r"row 0: a step before its last gave it other than .*tokens_per_step = 2"),
        (
            "running without its last part",
            r"row 1: it is running, but its last step did not give it its full",
        ),
        ("nan pi_s", r"pi_s log-probs that are not finite or above 0"),
        ("an unscored token", r"row 2: 3 of its 4 tokens have pi_s"),
        ("positive logprob", r"step 4's partial batch has log-probs that are not finite or above 0"),
        ("missing tensor", r"step 4's partial batch has no tensor 'versions'"),
        (
            "begun elsewhere",
            r"says it was begun at step 2; with rollout.max_staleness = 2 it is begun at step 1",
        ),
        (
            "a batch missing",
            r"after step 2 the batches in flight are those of steps \[3, 4\]; the file holds \[4\]",
        ),
        ("another T", r"rollout.partial.tokens_per_step = 3; this run has 2"),
        ("not partial", r"holds no partial rollouts in flight"),
        ("float ids", r"step 3's partial batch's ids is torch.float32"),
        ("another layout", r"scored for the rows from 0; this rank trains those from 2"),
    ],
)
def test_a_damaged_or_relabelled_batch_in_flight_is_refused_by_name(what, refused):
    tensors, plain = _flight().state()
    plain = json.loads(json.dumps(plain))
    _load(tensors, plain)  # intact: loads
    _tamper(what, tensors, plain)
    with pytest.raises(StalenessError, match=refused):
        _load(tensors, plain)


def test_versions_follow_the_schedule_or_say_how_they_do_not():
    ok = dict(begun=1, last=3, t=2, max_tokens=9)
    assert _versions_disagree([0, 0, 1, 1, 2, 2], finish=RUNNING, length=6, **ok) is None
    assert _versions_disagree([0, 0, 1], finish="stop", length=3, **ok) is None
    assert "sampled after the checkpoint's step 3" in _versions_disagree(
        [0, 0, 1, 1, 2, 2, 3], finish="stop", length=7, **ok
    )
    assert "ended at its budget" in _versions_disagree([0, 0, 1], finish="length", length=3, **ok)


def test_the_engine_keeps_a_continued_requests_routes_from_its_last_prefix_position():
    from tim_megatron.rollout.vllm_engine import _positions

    pos = np.array([0, 1, 2, 3, 4, 5])
    experts = np.arange(6 * 4, dtype=np.int16).reshape(6, 2, 2)
    got = _positions((pos, experts), 3, 2)  # prefix of 4 tokens, 2 new: positions 3 and 4
    assert got[:, 0, 0].tolist() == [12, 16]
    with pytest.raises(RuntimeError, match=r"no record of positions \[6\]"):
        _positions((pos, experts), 5, 2)
