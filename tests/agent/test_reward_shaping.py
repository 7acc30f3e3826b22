"""The shaping terms of agent rewards ([agent].tool_use_reward, unfinished_penalty,
tool_error_penalty) on hand-built conversations: each term moves the reward it should and no
other, and a group whose rollouts all fail the verify gains signal when only some of them loop."""

from __future__ import annotations

from collections import Counter

import pytest

from retrograd.agent.rollout import Trajectory, failed_calls, score_group
from retrograd.agent.scenarios import Scenario

SCEN = Scenario(task="What time is the flight?", verify={"answer_contains": "9:40"}, id="s0")


def traj(answer: str | None, finish: str = "answer", calls: int = 1, ok: int = 1, malformed: int = 0) -> Trajectory:
    t = Trajectory(scenario=SCEN, messages=[], prompt=[1], finish=finish, answer=answer, tool_calls=calls, tool_ok=ok)
    t.causes = Counter({"malformed_call": malformed} if malformed else {})
    return t


def test_failed_calls_counts_errors_unknown_tools_and_unreadable_calls():
    assert failed_calls(traj("x", calls=3, ok=1)) == 2
    assert failed_calls(traj("x", calls=1, ok=1, malformed=2)) == 2
    assert failed_calls(traj("x", calls=0, ok=0)) == 0


def test_without_shaping_the_reward_is_the_verify():
    group = [traj("It leaves at 9:40."), traj("no idea"), traj(None, finish="max_turns", calls=4, ok=0)]
    score_group(group)
    assert [t.reward for t in group] == [1.0, 0.0, 0.0]
    assert [t.verified for t in group] == [True, False, False]


def test_each_term_moves_only_what_it_names():
    passing = traj("It leaves at 9:40.")
    wrong = traj("no idea", calls=0, ok=0)
    looping = traj(None, finish="max_turns", calls=4, ok=1)
    unreadable = traj("no idea", calls=0, ok=0, malformed=1)
    group = [passing, wrong, looping, unreadable]
    score_group(group, tool_use_reward=0.1, unfinished_penalty=0.5, tool_error_penalty=0.25)
    assert passing.reward == pytest.approx(1.1)          # verify + a successful call
    assert wrong.reward == pytest.approx(0.0)            # no call, no error: nothing added
    assert looping.reward == pytest.approx(0.1 - 0.5 - 3 * 0.25)
    assert unreadable.reward == pytest.approx(-0.25)


def test_a_group_of_failures_gains_signal_only_from_the_penalties():
    def group():
        return [traj("no", calls=1, ok=1) for _ in range(4)] + [traj(None, "max_turns", 4, 2) for _ in range(4)]
    plain = group()
    score_group(plain)
    assert len({t.reward for t in plain}) == 1           # all fail: no signal for GRPO
    shaped = group()
    score_group(shaped, unfinished_penalty=0.2)
    assert len({t.reward for t in shaped}) == 2
    assert max(t.reward for t in shaped[4:]) < min(t.reward for t in shaped[:4])
