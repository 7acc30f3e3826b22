"""Data formats, chat-template masks, malformed lines, packing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from retrograd.data import chat as chat_mod
from retrograd.data import tokenizer as tok_mod
from retrograd.data.batching import ExampleStream, pack, split_holdout, to_batch
from retrograd.data.formats import DataError, load_examples


@pytest.fixture(scope="module")
def tok(smollm):
    return tok_mod.load(str(smollm))


@pytest.fixture(scope="module")
def chat(tok):
    return chat_mod.format_for(tok)


def jsonl(tmp_path, records, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return p


def trained_text(tok, ex):
    return tok.decode([int(t) for t, m in zip(ex.tokens, ex.trained) if m], special=True)


def test_chat_masks_only_assistant_turns(tmp_path, tok, chat):
    rec = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
                        {"role": "assistant", "content": "See you."}]}
    (ex,), report = load_examples(jsonl(tmp_path, [rec]), tok, chat)
    assert report.format == "chat"
    assert trained_text(tok, ex) == "Hello!<|im_end|>\nSee you.<|im_end|>\n"
    full = tok.decode(ex.tokens.tolist(), special=True)
    assert full == chat.render(rec["messages"])


def test_text_and_prompt_completion(tmp_path, tok, chat):
    (ex,), r = load_examples(jsonl(tmp_path, [{"text": "plain words"}]), tok, chat)
    assert r.format == "text" and ex.trained[1:].all()
    (ex,), r = load_examples(jsonl(tmp_path, [{"prompt": "Q: 2+2?", "completion": " A: 4"}]), tok, chat)
    assert r.format == "prompt_completion"
    assert trained_text(tok, ex) == " A: 4<|im_end|>"


def test_tool_records_mask_tool_results(tmp_path, tok, chat):
    rec = {"tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
           "messages": [{"role": "user", "content": "2+3?"},
                        {"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                        {"role": "tool", "content": "5"},
                        {"role": "assistant", "content": "It is 5."}]}
    (ex,), r = load_examples(jsonl(tmp_path, [rec]), tok, chat)
    assert r.format == "tools"
    text = trained_text(tok, ex)
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in text
    assert "It is 5." in text and "<tool_response>" not in text
    assert "add" in tok.decode(ex.tokens.tolist(), special=True).split("<|im_start|>user")[0]  # catalog in system


@pytest.mark.parametrize("line, message", [
    ("{not json", "d.jsonl:2: not valid JSON"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "d.jsonl:2: messages[0].role must be one of"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "d.jsonl:2: no assistant message"),
    ('{"foo": 1}', "d.jsonl:2: cannot tell the format"),
    ('[1, 2]', "d.jsonl:2: expected a JSON object"),
])
def test_malformed_lines_name_file_and_line(tmp_path, tok, chat, line, message):
    p = jsonl(tmp_path, [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, line])
    with pytest.raises(DataError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_examples(p, tok, chat)


def test_skip_bad_lines_counts_them(tmp_path, tok, chat):
    good = {"text": "fine"}
    p = jsonl(tmp_path, [good, "{broken", good, '{"text": ""}'])
    examples, report = load_examples(p, tok, chat, skip_bad=True)
    assert len(examples) == 2 and sum(report.skipped.values()) == 2
    assert "skipped" in report.summary()


def test_truncation_and_packing(tmp_path, tok, chat):
    long = {"text": "word " * 400}
    short = {"text": "tiny"}
    examples, report = load_examples(jsonl(tmp_path, [long, short, short, short]), tok, chat, max_length=64)
    assert report.n_truncated == 1 and len(examples[0].tokens) == 64
    groups = pack(examples, 70)
    assert sum(len(g) for g in groups) == 4 and all(sum(len(e.tokens) for e in g) <= 70 for g in groups)
    batch, owner = to_batch(groups[0])
    # every target is the next token of its own sequence
    np.testing.assert_array_equal(batch.target_ids, batch.tokens[batch.target_rows + 1])
    assert (batch.seq_ids[batch.target_rows] == batch.seq_ids[batch.target_rows + 1]).all()


def test_stream_resumes_at_the_same_place(tmp_path, tok, chat):
    examples, _ = load_examples(jsonl(tmp_path, [{"text": f"n {i}"} for i in range(10)]), tok, chat)
    a = ExampleStream(examples, seed=1, shuffle=True)
    first = [e.line for e in a.take(n=7)]
    b = ExampleStream(examples, seed=1, shuffle=True, cursor=a.cursor)
    rest_a = [e.line for e in a.take(n=8)]
    assert [e.line for e in b.take(n=8)] == rest_a
    assert sorted(first + rest_a[:3]) == list(range(1, 11))       # epoch 0 covers everything once
    train, held = split_holdout(examples, 0.2, seed=0)
    assert len(held) == 2 and len(train) == 8


def test_gemma_has_a_fallback_template(gemma):
    t = tok_mod.load(str(gemma))
    c = chat_mod.format_for(t)
    assert c.origin == "fallback:gemma3"
    text = c.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


def test_split_groups_keeps_every_continuation_once_within_the_budget():
    from retrograd.data.batching import Group, split_groups

    rng = np.random.default_rng(0)
    prompt = np.arange(10, dtype=np.int32)
    comps = [rng.integers(0, 50, n).astype(np.int32) for n in (6, 9, 3, 12, 4)]
    trained = [np.arange(len(c)) % 2 == 0 for c in comps]
    small = Group(np.arange(3, dtype=np.int32), [np.ones(2, np.int32)] * 2)
    parts = split_groups([Group(prompt, comps, trained), small], budget=25)
    # 10 + 6 + 9 = 25 fits; 10 + 3 + 12 = 25 fits; 10 + 4; then the small group whole
    assert [p[1].tolist() for p in parts] == [[0, 1], [2, 3], [4], [5, 6]]
    for part, idx in parts[:3]:
        assert part.prompt is prompt and part.n_tokens <= 25
        for c, t, i in zip(part.completions, part.trained, idx):
            assert c is comps[i] and t is trained[i]
    assert parts[3][0].trained is None
    # a continuation longer than the budget still gets a part of its own
    assert [p[1].tolist() for p in split_groups([Group(prompt, comps)], budget=12)] == [[0], [1], [2], [3], [4]]
    # a budget every group fits in leaves the groups whole
    assert [p[1].tolist() for p in split_groups([Group(prompt, comps)], budget=1000)] == [[0, 1, 2, 3, 4]]

