"""The parts of the judge, collect and rollouts that are plain functions: reading judge answers
(well-formed, malformed, other scales), agreement statistics, collect's filters and choices,
the tokens a template adds between turns, and endpoint failures. No model is loaded."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from retrograd.agent import endpoint
from retrograd.agent.judge import judge_prompt, parse_scores
from retrograd.agent.rollout import Trajectory, _delta_text, group_stats, messages_of
from retrograd.agent.scenarios import Scenario
from retrograd.commands.collect import _filter, best_traces, pair_of
from retrograd.commands.judge import best_pick, load_fixtures, spearman
from retrograd.config import EndpointSection
from retrograd.data.formats import DataError


# ---- the judge's answers ---------------------------------------------------------------------------
def test_parse_scores_json_object():
    text = 'Sure.\n{"scores": [{"attempt": 2, "score": 0.25, "reason": "wrong"}, {"attempt": 1, "score": 1, ' \
           '"reason": "right"}]}\nDone.'
    assert parse_scores(text, 2) == [(1.0, "right"), (0.25, "wrong")]


def test_parse_scores_list_lines_scales_and_gaps():
    assert parse_scores("[0.5, 0.75]", 2) == [(0.5, ""), (0.75, "")]
    # a 0-10 scale is rescaled, out-of-range values clipped, a missing attempt is None
    got = parse_scores("Attempt 1: 8 - good\nattempt 3: score 12", 3)
    assert got[0] == (0.8, "good") and got[1] is None and got[2] == (1.0, "")
    assert parse_scores("I cannot grade these.", 2) == [None, None]
    assert parse_scores('{"scores": [{"score": "high"}]}', 1) == [None]


def test_judge_prompt_numbers_every_attempt():
    p = judge_prompt("Add a note", ["a", "b", "c"], "be strict")
    assert "Attempt 3" in p and "be strict" in p and '"scores"' in p


def test_agreement_statistics():
    assert spearman([0.1, 0.5, 0.9], [0, 1, 2]) == pytest.approx(1.0)
    assert spearman([0.9, 0.5, 0.1], [0, 1, 2]) == pytest.approx(-1.0)
    assert spearman([0.5, 0.5, 0.5], [0, 1, 2]) is None
    assert best_pick([0.2, 0.9, 0.1], [0, 1, 1]) and not best_pick([0.9, 0.2, 0.1], [0, 1, 1])


def test_fixture_file_errors_name_the_line(tmp_path):
    f = tmp_path / "fx.jsonl"
    f.write_text('{"task": "t", "attempts": [{"transcript": "a", "score": 1}, {"transcript": "b", "label": false}]}\n'
                 '{"task": "t", "attempts": [{"transcript": "a"}]}\n')
    with pytest.raises(DataError, match=r"fx.jsonl:2: \"attempts\" must be a list of at least two"):
        load_fixtures(f)
    f.write_text('{"task": "t", "attempts": [{"transcript": "a", "score": 1}, {"transcript": "b", "label": false}]}\n')
    assert load_fixtures(f)[0]["human"] == [1.0, 0.0]


def test_shipped_fixtures_load():
    from .agent_support import EXAMPLE

    fx = load_fixtures(EXAMPLE / "judge_fixtures.jsonl")
    assert len(fx) >= 6 and all(len(f["transcripts"]) >= 2 for f in fx)


# ---- collect's filters and choices -----------------------------------------------------------------
def traj(reward: float, finish: str = "answer", verified: bool | None = True, text: str = "done", **causes) -> Trajectory:
    t = Trajectory(Scenario("task", verify={"answer_contains": "x"}, id="s1"),
                   [{"role": "user", "content": "task"}, {"role": "assistant", "content": text}], [])
    t.reward, t.finish, t.verified, t.causes = reward, finish, verified, Counter(causes)
    t.raw = [text]
    return t


def test_filters_count_each_cause():
    assert _filter(traj(1.0), True, None) is None
    assert _filter(traj(1.0, finish="context"), True, None) == "truncated"
    assert _filter(traj(1.0, finish="max_turns"), True, None) == "max_turns"
    assert _filter(traj(1.0, malformed_call=1), True, None) == "malformed_call"
    assert _filter(traj(0.0, verified=False), True, None) == "not_verified"
    assert _filter(traj(0.0, verified=False), False, None) is None
    assert _filter(traj(0.2, verified=None), False, 0.5) == "below_min_reward"


def test_keep_prefers_reward_then_shortness_and_drops_duplicates():
    a, b, c, d = traj(1.0, text="long answer here"), traj(1.0, text="short"), traj(1.0, text="short"), traj(0.5)
    counts: Counter = Counter()
    kept = best_traces([a, b, c, d], 2, False, counts)
    assert kept == [b, a] and counts["duplicate"] == 1 and counts["beyond_keep"] == 1


def test_pairs_take_the_best_passing_and_the_worst_complete():
    good, bad, cut = traj(1.0, text="right"), traj(0.0, verified=False, text="wrong"), traj(0.0, finish="context")
    counts: Counter = Counter()
    pair = pair_of([good, bad, cut], [good], 0.5, False, [], counts)
    assert pair["chosen"][-1]["content"] == "right" and pair["rejected"][-1]["content"] == "wrong"
    assert pair_of([good, bad], [good], 1.5, False, [], counts) is None and counts["pair:gap_below_min"] == 1
    assert pair_of([bad], [], 0.5, False, [], counts) is None and counts["pair:no_passing_trace"] == 1


def test_raw_messages_keep_the_generated_text():
    t = traj(1.0)
    t.messages = [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}]
    t.raw = ['<tool_call>{"name": "f", "arguments": {}}</tool_call>', "a"]
    raw = messages_of(t, raw=True)
    assert raw[1] == {"role": "assistant", "content": t.raw[0]} and raw[2]["role"] == "tool"
    assert messages_of(t)[1]["tool_calls"][0]["function"]["name"] == "f"


def test_group_stats_counts_causes_and_finishes():
    ts = [traj(1.0), traj(0.0, finish="context", verified=False, unknown_tool=2)]
    st = group_stats(ts)
    assert st["verify_pass"] == 0.5 and st["finish/context"] == 0.5 and st["count/unknown_tool"] == 2


# ---- what the template adds between turns ----------------------------------------------------------
def test_delta_starts_after_the_models_end_of_turn():
    before = "<s>user: q<end>\nassistant: call<end>\n"
    after = before + "tool: result<end>\nassistant: "
    assert _delta_text(before, after, "<end>") == "\ntool: result<end>\nassistant: "
    # a template that rewrites earlier text: the delta starts where the two renderings part
    assert _delta_text("abcX", "abcYZ", "") == "YZ"


# ---- endpoints ----------------------------------------------------------------------------------------
def test_endpoint_down_is_one_clear_error(tmp_path):
    ep = EndpointSection(base_url="http://127.0.0.1:9/v1", model="m", timeout_seconds=2.0, retries=1)
    with pytest.raises(endpoint.EndpointError, match=r"judge http://127.0.0.1:9/v1/chat/completions failed after 2"):
        endpoint.chat(ep, [{"role": "user", "content": "hi"}], where="judge")


def test_endpoint_settings_are_checked(monkeypatch):
    from retrograd.errors import ConfigError

    with pytest.raises(ConfigError, match="base_url is required"):
        endpoint.check(EndpointSection(), "[agent.judge]")
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    with pytest.raises(ConfigError, match="NO_SUCH_KEY_VAR is not set"):
        endpoint.check(EndpointSection(base_url="http://x/v1", api_key_env="NO_SUCH_KEY_VAR"), "[agent.judge]")


def test_scenarios_generate_dry_run_calls_nothing(tmp_path):
    import argparse

    from retrograd.commands import scenarios

    from .agent_support import EXAMPLE

    cfg = tmp_path / "gen.toml"
    cfg.write_text((EXAMPLE / "config.toml").read_text().replace('scenarios = "scenarios.jsonl"',
                                                                 f'scenarios = "{tmp_path / "new.jsonl"}"')
                   .replace('"seed.db"', f'"{EXAMPLE / "seed.db"}"').replace('"notes_server.py"',
                                                                           f'"{EXAMPLE / "notes_server.py"}"')
                   .replace('"eval_scenarios.jsonl"', f'"{EXAMPLE / "eval_scenarios.jsonl"}"'))
    args = argparse.Namespace(config=str(cfg), dry_run=True, force=False, model=None, device=None)
    assert scenarios.run(args) == 0
    assert not (tmp_path / "new.jsonl").exists()


def test_scenario_candidates_are_validated(tmp_path):
    from retrograd.commands.scenarios import candidates, problem

    text = "\n".join([
        'Here:',
        '{"task": "Add a note titled x", "tools": ["add_note"], "verify": {"answer_contains": "x"}}',
        '{"task": "Add a note titled x", "verify": {"answer_contains": "x"}}',
        '{"task": "Use the fax", "tools": ["fax"]}',
        '{"task": "Check the db", "verify": {"nonsense": 1}}',
        'not json',
    ])
    seen: set[str] = set()
    got = []
    for c in candidates(text):
        why = problem(c, {"add_note"}, seen, tmp_path)
        got.append(why)
        if why is None:
            seen.add(" ".join(c["task"].lower().split()))
    assert got[0] is None and got[1] == "duplicate" and got[2].startswith("unknown tools")
    assert got[3].startswith("bad verify")
    assert json.loads(json.dumps(got))
