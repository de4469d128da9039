"""Benchmark prompt sets: JSONL files with one `{"turns": ["first user turn", ...]}` per line.

A set is named by path or by name ("humaneval" or "humaneval.jsonl"), resolved in the prompts
directory: $JSPEC_PROMPTS_DIR if set, else ../shared/data/prompts next to the repository.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class PromptRecord:
    turns: tuple[str, ...]
    source: str  # file the record came from
    line: int  # 1-based line number in that file

    @property
    def first_turn(self) -> str:
        return self.turns[0]


def first_turn(record: PromptRecord | dict) -> str:
    """The first user turn (the one the benchmark uses; mt-bench's second turn is ignored)."""
    turns = record.turns if isinstance(record, PromptRecord) else record["turns"]
    return turns[0]


def prompts_dir() -> Path:
    env = os.environ.get("JSPEC_PROMPTS_DIR")
    return Path(env) if env else REPO_ROOT.parent / "shared" / "data" / "prompts"


def list_prompt_sets() -> list[str]:
    d = prompts_dir()
    return sorted(p.stem for p in d.glob("*.jsonl")) if d.is_dir() else []


def resolve_prompt_set(name_or_path: str | os.PathLike) -> Path:
    """An existing file path as is; otherwise a set name looked up in prompts_dir()."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    name = p.name if p.suffix == ".jsonl" else p.name + ".jsonl"
    if p.parent == Path("."):  # a bare name, not a missing path
        cand = prompts_dir() / name
        if cand.is_file():
            return cand
        avail = ", ".join(list_prompt_sets()) or "none"
        raise FileNotFoundError(
            f"prompt set {str(name_or_path)!r} not found in {prompts_dir()} "
            f"(available: {avail}; set JSPEC_PROMPTS_DIR to look elsewhere)"
        )
    raise FileNotFoundError(f"prompt set file {p} does not exist")


def load_prompts(name_or_path: str | os.PathLike, limit: int | None = None) -> list[PromptRecord]:
    """Records of a prompt set, in file order; blank lines are skipped, bad lines raise
    ValueError naming file and line."""
    path = resolve_prompt_set(name_or_path)
    records: list[PromptRecord] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or "turns" not in obj:
                raise ValueError(f'{where}: expected an object with a "turns" list')
            turns = obj["turns"]
            if not isinstance(turns, list) or not turns:
                raise ValueError(f'{where}: "turns" must be a non-empty list of strings')
            for k, t in enumerate(turns):
                if not isinstance(t, str):
                    raise ValueError(f'{where}: turn {k} is {type(t).__name__}, not a string')
            records.append(PromptRecord(tuple(turns), str(path), lineno))
    return records
