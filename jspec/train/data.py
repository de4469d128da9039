"""Training data: corpus gathering, manifest, packing, held-out split, reply sequences, and a
deterministic batch order that a checkpoint can resume from (a batch is a pure function of the
seed and its position, so the iterator's whole state is one integer).

Pure NumPy: nothing here touches a device.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np


# ---- corpus -------------------------------------------------------------------------------------

def gather_corpus(root: str | Path, suffixes: Sequence[str] = (".py",)) -> list[Path]:
    """Files under root with one of the suffixes, sorted by relative path (stable across runs)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"corpus directory {str(root)!r} does not exist")
    files = [p for p in root.rglob("*") if p.suffix in suffixes and p.is_file() and not p.is_symlink()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def corpus_manifest(root: str | Path, files: Sequence[Path]) -> dict:
    """File count, bytes and sha256 per file, and one sha256 over the (path, sha256) list."""
    root = Path(root)
    entries, total = [], hashlib.sha256()
    for path in files:
        data = path.read_bytes()
        rel = path.relative_to(root).as_posix()
        digest = hashlib.sha256(data).hexdigest()
        entries.append({"path": rel, "bytes": len(data), "sha256": digest})
        total.update(f"{rel}\0{digest}\n".encode())
    return {"root": str(root.resolve()), "file_count": len(entries),
            "total_bytes": sum(e["bytes"] for e in entries), "sha256": total.hexdigest(),
            "files": entries}


def read_texts(files: Iterable[Path]) -> list[str]:
    # Source files are almost always UTF-8; a stray byte becomes U+FFFD rather than a crash.
    return [p.read_bytes().decode("utf-8", errors="replace") for p in files]


def tokenize_documents(texts: Sequence[str], tokenizer, batch: int = 256) -> list[list[int]]:
    """Token ids per document (nothing added); empty documents are dropped."""
    docs = []
    for i in range(0, len(texts), batch):
        docs.extend(ids for ids in tokenizer.encode_batch(list(texts[i:i + batch])) if ids)
    return docs


# ---- pre-training rows --------------------------------------------------------------------------

def split_documents(docs: Sequence[list[int]], heldout_fraction: float, seed: int
                    ) -> tuple[list[list[int]], list[list[int]]]:
    """(train, held-out), split by whole documents so no held-out text leaks into training."""
    order = np.random.default_rng(seed).permutation(len(docs))
    n_held = int(round(heldout_fraction * len(docs)))
    if heldout_fraction > 0 and len(docs) > 1:
        n_held = min(max(n_held, 1), len(docs) - 1)
    held = sorted(order[:n_held].tolist())
    train = sorted(order[n_held:].tolist())
    return [docs[i] for i in train], [docs[i] for i in held]


def pack_documents(docs: Sequence[list[int]], seq_len: int, sep_id: int) -> np.ndarray:
    """[N, seq_len] int32: documents joined, each followed by `sep_id`, cut into full rows (the
    tail that does not fill a row is dropped). Documents longer than a row span rows."""
    stream = np.fromiter((t for doc in docs for t in (*doc, sep_id)), np.int32)
    n = len(stream) // seq_len
    return stream[:n * seq_len].reshape(n, seq_len)


# ---- batch order --------------------------------------------------------------------------------

class BatchOrder:
    """Batch `position` of an endless sequence of epochs; each epoch is a permutation of the
    examples drawn from (seed, epoch), and the last incomplete batch of an epoch is dropped."""

    def __init__(self, num_examples: int, batch_size: int, seed: int):
        if num_examples < batch_size:
            raise ValueError(f"{num_examples} examples cannot fill a batch of {batch_size}")
        self.num_examples, self.batch_size, self.seed = num_examples, batch_size, seed
        self.batches_per_epoch = num_examples // batch_size

    def indices(self, position: int) -> np.ndarray:
        epoch, offset = divmod(position, self.batches_per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
        return perm[offset * self.batch_size:(offset + 1) * self.batch_size]


def batch_source(arrays: dict[str, np.ndarray], batch_size: int, seed: int):
    """position -> {name: array[batch]} over examples along axis 0 of every array."""
    order = BatchOrder(len(next(iter(arrays.values()))), batch_size, seed)

    def batch_at(position: int) -> dict[str, np.ndarray]:
        idx = order.indices(position)
        return {k: v[idx] for k, v in arrays.items()}

    batch_at.order = order
    return batch_at


def interleaved_source(short_at, long_at, long_every: int):
    """position -> batch from two sources: every `long_every`-th position is the next batch of
    `long_at` (long rows), the others the next batches of `short_at`. Most steps take the
    cheaper short rows (attention cost grows with the row length) while the model still trains
    at the full context; a pure function of the position, so a resumed run is unchanged, and a
    time-boxed run that stops early has seen both at the same proportion."""
    if long_every < 1:
        raise ValueError(f"long_every must be >= 1, got {long_every}")

    def batch_at(position: int) -> dict[str, np.ndarray]:
        cycle, k = divmod(position, long_every)
        if k == long_every - 1:
            return long_at(cycle)
        return short_at(cycle * (long_every - 1) + k)

    return batch_at


# ---- drafter data: prompt + the target's own reply ----------------------------------------------

def make_prompts(docs: Sequence[list[int]], num: int, min_len: int, max_len: int, seed: int
                 ) -> list[list[int]]:
    """`num` prompts: a random window of min_len..max_len tokens from a random document."""
    rng = np.random.default_rng(seed)
    pool = [d for d in docs if len(d) > min_len]
    if not pool:
        raise ValueError(f"no document is longer than {min_len} tokens")
    prompts = []
    for _ in range(num):
        doc = pool[rng.integers(len(pool))]
        length = int(rng.integers(min_len, min(max_len, len(doc) - 1) + 1))
        start = int(rng.integers(0, len(doc) - length + 1))
        prompts.append(list(doc[start:start + length]))
    return prompts


def reply_arrays(prompts: Sequence[list[int]], replies: Sequence[list[int]], seq_len: int,
                 pad_id: int, min_loss_tokens: int = 2) -> dict[str, np.ndarray]:
    """tokens [N, seq_len] int32 (prompt ++ reply, right-padded) and loss_mask [N, seq_len] bool
    (1 on reply tokens, as DeepSpec's mask covers the assistant span). Sequences are truncated
    to seq_len; those left with fewer than `min_loss_tokens` reply tokens are dropped."""
    rows, masks = [], []
    for prompt, reply in zip(prompts, replies, strict=True):
        seq = (list(prompt) + list(reply))[:seq_len]
        n_reply = len(seq) - len(prompt)
        if n_reply < min_loss_tokens:
            continue
        row = np.full(seq_len, pad_id, np.int32)
        row[:len(seq)] = seq
        mask = np.zeros(seq_len, bool)
        mask[len(prompt):len(seq)] = True
        rows.append(row)
        masks.append(mask)
    if not rows:
        raise ValueError("no sequence has enough reply tokens")
    return {"tokens": np.stack(rows), "loss_mask": np.stack(masks)}


def pack_reply_arrays(prompts: Sequence[list[int]], replies: Sequence[list[int]], seq_len: int,
                      pad_id: int, min_loss_tokens: int = 2, joined_share: float = 0.0,
                      seed: int = 0) -> dict[str, np.ndarray]:
    """reply_arrays' sequences packed several to a row, so a row holds more reply tokens (the
    anchors a drafter step trains on) than one short reply and its padding. Returns tokens,
    loss_mask, segment_ids [N, seq_len] int32 (1, 2, ... per sequence in its row, 0 on padding)
    and positions (each sequence's own positions 0, 1, ...: the ones inference gives it).
    Training keeps sequences apart by their segment ids, so each computes exactly what it would
    alone. Packing is best-fit decreasing over the lengths: deterministic, and the batch order
    shuffles the rows.

    joined_share: that share of the rows (drawn with `seed`) joins its sequences into ONE long
    sequence (segment 1, positions 0 .. used - 1), the way a long multi-part prompt reads: the
    drafter then also trains at contexts as long as the row, with the target's features computed
    over the whole joined context. The replies stay the loss tokens; a joined reply was sampled
    after its own prompt only, so its labels are the short context's, while the distillation
    terms (computed on the fly) are the long context's own."""
    import bisect
    if not 0.0 <= joined_share <= 1.0:
        raise ValueError(f"joined_share must be in [0, 1], got {joined_share}")
    single = reply_arrays(prompts, replies, seq_len, pad_id, min_loss_tokens)
    # Each sequence ends with its reply: its length is one past its last reply token.
    lengths = seq_len - np.argmax(single["loss_mask"][:, ::-1], axis=1)
    room: list[tuple[int, int]] = []  # (free tokens, row), sorted: the best fit is a bisect away
    rows: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable"):
        j = bisect.bisect_left(room, (int(lengths[i]), -1))
        if j == len(room):
            rows.append([int(i)])
            free, r = seq_len - int(lengths[i]), len(rows) - 1
        else:
            free, r = room.pop(j)
            rows[r].append(int(i))
            free -= int(lengths[i])
        bisect.insort(room, (free, r))
    out = {"tokens": np.full((len(rows), seq_len), pad_id, np.int32),
           "loss_mask": np.zeros((len(rows), seq_len), bool),
           "segment_ids": np.zeros((len(rows), seq_len), np.int32),
           "positions": np.zeros((len(rows), seq_len), np.int32)}
    joined = np.random.default_rng(seed).random(len(rows)) < joined_share
    for r, members in enumerate(rows):
        start = 0
        for seg, i in enumerate(sorted(members), 1):
            n = int(lengths[i])
            out["tokens"][r, start:start + n] = single["tokens"][i, :n]
            out["loss_mask"][r, start:start + n] = single["loss_mask"][i, :n]
            out["segment_ids"][r, start:start + n] = 1 if joined[r] else seg
            out["positions"][r, start:start + n] = np.arange(start, start + n) if joined[r] else np.arange(n)
            start += n
    return out


def write_replies(path: str | Path, prompts: Sequence[list[int]], replies: Sequence[list[int]]) -> None:
    with open(path, "w") as f:
        for p, r in zip(prompts, replies, strict=True):
            f.write(json.dumps({"prompt_ids": list(map(int, p)), "reply_ids": list(map(int, r))}) + "\n")


def read_replies(path: str | Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts, replies = [], []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "prompt_ids" not in rec or "reply_ids" not in rec:
            raise ValueError(f"{path}:{n}: each line needs 'prompt_ids' and 'reply_ids'")
        prompts.append(rec["prompt_ids"])
        replies.append(rec["reply_ids"])
    return prompts, replies


# ---- chat-form code tasks (so the target knows the chat template the benchmarks use) ------------

INSTRUCTIONS = (
    "Complete the following Python function.",
    "Implement the function below so that it does what its docstring says.",
    "Write the body of this Python function:",
    "Finish this code:",
    "Here is a function signature with its documentation. Write the implementation.",
)


def function_tasks(text: str, max_chars: int = 4000) -> list[tuple[str, str]]:
    """(prompt, answer) pairs from one source file: for every `def` whose body opens with a
    docstring, the prompt is the file's imports plus the signature and docstring, the answer the
    whole function. Found by indentation, not parsing, so any text works."""
    lines = text.splitlines()
    imports = "\n".join(l for l in lines[:80] if l.startswith(("import ", "from "))
                        and len(l) < 200)[:1500]
    tasks = []
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if not stripped.startswith(("def ", "async def ")) or not stripped.rstrip().endswith(":"):
            continue
        indent = len(line) - len(stripped)
        j = i + 1
        if j >= len(lines) or not lines[j].lstrip().startswith(('"""', "'''", 'r"""')):
            continue
        quote = '"""' if '"""' in lines[j] else "'''"
        k = j if lines[j].count(quote) >= 2 else next(
            (n for n in range(j + 1, min(len(lines), j + 60)) if quote in lines[n]), None)
        if k is None:
            continue
        end = k + 1
        while end < len(lines) and (not lines[end].strip() or
                                    len(lines[end]) - len(lines[end].lstrip()) > indent):
            end += 1
        while end > k + 1 and not lines[end - 1].strip():
            end -= 1
        if end == k + 1:
            continue  # nothing after the docstring
        dedent = lambda ls: "\n".join(l[indent:] if l[:indent].isspace() or not l[:indent] else l for l in ls)
        head, whole = dedent(lines[i:k + 1]), dedent(lines[i:end])
        if len(whole) > max_chars:
            continue
        tasks.append(((imports + "\n\n\n" if imports else "") + head, whole))
    return tasks


def chat_task_text(tokenizer, prompt_code: str, answer_code: str | None, instruction: str) -> str:
    """The Qwen3 chat (non-thinking) text of one task: the user turn, and when `answer_code` is
    given the assistant turn ending in <|im_end|>."""
    user = f"{instruction}\n```python\n{prompt_code}\n```"
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}])
    if answer_code is None:
        return text
    return text + f"```python\n{answer_code}\n```<|im_end|>\n"


# ---- described tasks: a function asked for in words, with no code in the prompt -----------------
# Users (and the MBPP prompts) often ask for a function in one sentence. The corpus documents its
# functions in exactly such sentences: a docstring's summary line ("Return the sum of ...") turns
# into "Write a function to return the sum of ...". These prompts give the drafter S's replies to
# that kind of request, which the code tasks above never show it.

DESCRIPTION_TEMPLATES = {
    # the summary opens with an imperative verb: "Return the ...", "Convert ..."
    "imperative": ("Write a function to {task}.", "Write a Python function to {task}.",
                   "Implement a function to {task}.", "Write a python function to {task}."),
    # or with a third-person one: "Returns the ...", "Converts ..."
    "third_person": ("Write a function that {task}.", "Write a Python function which {task}.",
                     "Create a function that {task}.", "Write a function which {task}."),
}
# first words that open a noun phrase or a remark, not an action: such summaries are skipped
_NOT_A_VERB = frozenset(
    "a an the this these that those it its if for in on of to with when where while as is are was "
    "used internal helper private deprecated todo note see alias same like called wrapper default "
    "utility convenience hook override overridden subclasses obsolete legacy fixme xxx "
    "example examples".split())


def docstring_summary(head: str, min_chars: int = 16, max_chars: int = 200) -> tuple[str, str] | None:
    """(task, form) from a function's signature + docstring (function_tasks' prompt head): the
    docstring's first sentence with its first word lowered, and "imperative" or "third_person"
    for the verb it opens with; None when the summary is no usable task (too short or long, code
    or doctest text, not opening with a verb by the heuristic above)."""
    quote = '"""' if '"""' in head else "'''"
    if head.count(quote) < 2:
        return None
    doc = head.split(quote, 1)[1].rsplit(quote, 1)[0]
    first = " ".join(doc.strip().split("\n\n")[0].split())  # the first paragraph, one line
    cut = re.search(r"[.!?](\s|$)", first)
    sentence = (first[:cut.start()] if cut else first).strip().rstrip(":;,")
    if not min_chars <= len(sentence) <= max_chars or any(c in sentence for c in "`>{}[]=|\\"):
        return None
    word, _, rest = sentence.partition(" ")
    if not rest or not word.isalpha() or not word[0].isupper() or word.lower() in _NOT_A_VERB:
        return None
    if word[1:] and not word[1:].islower():
        return None  # an acronym or a CamelCase name, not a verb
    word = word.lower()
    form = "third_person" if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else "imperative"
    return f"{word} {rest}", form


def function_descriptions(text: str) -> list[tuple[str, str]]:
    """(task, form) for every documented function of one source file whose docstring summary
    reads as a task (docstring_summary)."""
    found = (docstring_summary(head) for head, _ in function_tasks(text))
    return [d for d in found if d is not None]


def described_task_text(tokenizer, task: str, template: str) -> str:
    """The Qwen3 chat (non-thinking) text of a user turn asking for a function in words."""
    return tokenizer.apply_chat_template([{"role": "user", "content": template.format(task=task)}])
