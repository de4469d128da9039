import json

import pytest

from jspec.prompts import (
    PromptRecord,
    first_turn,
    list_prompt_sets,
    load_prompts,
    prompts_dir,
    resolve_prompt_set,
)

# Row counts from shared/data/prompts/README.md.
EXPECTED_ROWS = {
    "humaneval": 164,
    "mbpp": 257,
    "gsm8k": 1319,
    "math500": 500,
    "aime24": 30,
    "aime25": 30,
    "mt-bench": 80,
}


@pytest.fixture
def shared_sets(monkeypatch):
    monkeypatch.delenv("JSPEC_PROMPTS_DIR", raising=False)
    if not (prompts_dir() / "humaneval.jsonl").is_file():
        pytest.skip(f"shared prompt sets not present at {prompts_dir()}")


@pytest.mark.parametrize("name", sorted(EXPECTED_ROWS))
def test_shared_sets_load(shared_sets, name):
    recs = load_prompts(name)
    assert len(recs) == EXPECTED_ROWS[name]
    assert all(isinstance(r, PromptRecord) and r.turns and r.first_turn for r in recs)
    assert recs[0].line == 1
    if name == "mt-bench":
        assert all(len(r.turns) == 2 for r in recs)


def test_shared_set_names(shared_sets):
    assert set(EXPECTED_ROWS) <= set(list_prompt_sets())
    a = load_prompts("humaneval", limit=3)
    b = load_prompts("humaneval.jsonl", limit=3)
    c = load_prompts(str(prompts_dir() / "humaneval.jsonl"), limit=3)
    assert a == b == c and len(a) == 3
    assert first_turn(a[0]).startswith("Write a solution")


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_env_override_and_first_turn(tmp_path, monkeypatch):
    _write(tmp_path / "tiny.jsonl", [
        json.dumps({"turns": ["hello", "again"]}),
        "",  # blank lines are skipped
        json.dumps({"turns": ["日本語 ✓"], "extra": 1}),
    ])
    monkeypatch.setenv("JSPEC_PROMPTS_DIR", str(tmp_path))
    assert list_prompt_sets() == ["tiny"]
    recs = load_prompts("tiny")
    assert [r.turns for r in recs] == [("hello", "again"), ("日本語 ✓",)]
    assert [r.line for r in recs] == [1, 3]
    assert first_turn(recs[0]) == "hello" == recs[0].first_turn
    assert first_turn({"turns": ["x", "y"]}) == "x"
    assert load_prompts("tiny", limit=1) == recs[:1]


@pytest.mark.parametrize("bad, msg", [
    ("{not json", "not valid JSON"),
    ('["a"]', 'object with a "turns" list'),
    ('{"prompt": "a"}', 'object with a "turns" list'),
    ('{"turns": []}', "non-empty list"),
    ('{"turns": "abc"}', "non-empty list"),
    ('{"turns": ["ok", 3]}', "turn 1 is int"),
])
def test_bad_lines_name_the_line(tmp_path, bad, msg):
    p = _write(tmp_path / "bad.jsonl", [json.dumps({"turns": ["fine"]}), "", bad])
    with pytest.raises(ValueError) as e:
        load_prompts(p)
    assert f"{p}:3:" in str(e.value) and msg in str(e.value)


def test_unknown_set(tmp_path, monkeypatch):
    _write(tmp_path / "one.jsonl", [json.dumps({"turns": ["a"]})])
    monkeypatch.setenv("JSPEC_PROMPTS_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"'nope' not found.*available: one"):
        load_prompts("nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_prompt_set(tmp_path / "missing" / "x.jsonl")
