"""A vLLM request's hints for tierkv (``request_hints.py``), read from ``kv_transfer_params``
and from vLLM's typed hint envelope, and planned by the scheduler side: a retention rides on
the save, a drop replaces the save, a prefetch is planned once. Bad hints are ignored, never
fatal to the request."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from tierkv.chunks.identity import PLAIN
from tierkv.integrations.vllm_v1.request_hints import NO_HINTS, RequestHints, request_hints
from tierkv.integrations.vllm_v1.scheduler import LookupResult, SchedulerPlanner


def request(params: Any = None, actions: Any = None) -> SimpleNamespace:
    envelope = None if actions is None else SimpleNamespace(actions=[
        SimpleNamespace(action_type=kind, payload=payload) for kind, payload in actions])
    return SimpleNamespace(request_id="r1", kv_transfer_params=params, kv_hints=envelope)


def test_hints_from_kv_transfer_params() -> None:
    assert request_hints(request()) == NO_HINTS and not NO_HINTS
    assert request_hints(request({"tierkv": {"retain_s": 600}})) == RequestHints(retain_s=600.0)
    assert request_hints(request({"tierkv": {"drop": True}})) == RequestHints(drop=True)
    assert request_hints(request({"tierkv": {"prefetch_token_ids": [1, 2, 3]}})) == RequestHints(prefetch=(1, 2, 3))
    assert request_hints(request({"other_connector": {"x": 1}})) == NO_HINTS


def test_hints_from_vllms_typed_envelope() -> None:
    hints = request_hints(request(actions=[("retain", {"ttl_s": 120}), ("fetch", {"token_ids": [5, 6]}),
                                           ("something_else", {})]))
    assert hints == RequestHints(retain_s=120.0, prefetch=(5, 6))
    assert request_hints(request(actions=[("pin", {"seconds": 30})])).retain_s == 30.0
    assert request_hints(request(actions=[("prefetch", {})])).prefetch == (), "no token ids: this request's prompt"
    assert request_hints(request(actions=[("evict", {})])).drop


def test_bad_hints_are_ignored_not_fatal(caplog: Any) -> None:
    for params in ({"tierkv": {"retain_s": -1}}, {"tierkv": {"retain_s": "long"}}, {"tierkv": {"drop": "yes"}},
                   {"tierkv": {"prefetch_token_ids": "1 2 3"}}, {"tierkv": {"prefetch_token_ids": [1, -2]}},
                   {"tierkv": ["retain"]}, {"tierkv": {"retain_s": float("nan")}}):
        assert request_hints(request(params)) == NO_HINTS, params
    assert request_hints(request(actions=[("retain", {})])) == NO_HINTS
    assert "ignored" in caplog.text


def planner() -> SchedulerPlanner:
    return SchedulerPlanner(lambda tokens, identity: LookupResult(0, 0), block_size=16)


def step(planner: SchedulerPlanner, req_id: str, prompt: list[int]) -> Any:
    output = SimpleNamespace(
        num_scheduled_tokens={req_id: len(prompt)},
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, prompt_token_ids=prompt, block_ids=([0, 1],),
                                            num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                              num_computed_tokens=[]),
        preempted_req_ids=None)
    return planner.build(output)


def test_the_scheduler_plans_each_hint() -> None:
    prompt = list(range(32))
    plans = planner()
    plans.matched_tokens("keep", prompt, 0, PLAIN, hints=RequestHints(retain_s=60.0))
    plan = step(plans, "keep", prompt)
    assert [s.retain_s for s in plan.saves] == [60.0] and not plan.drops

    plans.matched_tokens("end", prompt, 0, PLAIN, hints=RequestHints(drop=True))
    plan = step(plans, "end", prompt)
    assert not plan.saves and [d.req_id for d in plan.drops] == ["end"]
    assert plans.finished("end") is False, "nothing saved: its blocks need not outlive it"

    plans.matched_tokens("ahead", prompt, 0, PLAIN, hints=RequestHints(prefetch=(7, 8, 9)))
    plans.matched_tokens("ahead", prompt, 0, PLAIN, hints=RequestHints(prefetch=(7, 8, 9)))  # asked again
    plan = step(plans, "ahead", prompt)
    assert [list(p.token_ids) for p in plan.prefetches] == [[7, 8, 9]], "planned once"
    assert np.array_equal(plan.saves[0].token_ids, prompt)
