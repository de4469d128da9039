"""Qwen3 tokenizer: encode/decode, streaming detokenizer, chat template, EOS ids.

The vocabulary is Qwen's byte-level BPE (ranks 0..151642 of ``qwen.tiktoken``) plus Qwen3's 26
added tokens (151643..151668). A built ``tokenizer.json`` ships xz-compressed in ``jspec/assets``
(made by ``python -m jspec.convert.build_tokenizer``); :func:`write_qwen3_tokenizer` lays it out
in a model directory so the directory looks like a real Qwen3 checkpoint.
"""

from __future__ import annotations

import codecs
import json
import lzma
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping, Sequence

ASSET_PATH = Path(__file__).resolve().parent / "assets" / "qwen3_tokenizer.json.xz"

N_BPE_RANKS = 151643  # ids 0..151642 come from qwen.tiktoken

# Qwen3's added tokens, in id order from 151643. The flag is tokenizer_config.json's "special":
# only special tokens are dropped by decode(skip_special_tokens=True); tool/FIM/think markers are
# ordinary added tokens, so they survive decoding (as in transformers with the real checkpoint).
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
QWEN3_SPECIAL_IDS = {tok: N_BPE_RANKS + i for i, (tok, _) in enumerate(QWEN3_ADDED_TOKENS)}
ENDOFTEXT_ID = QWEN3_SPECIAL_IDS["<|endoftext|>"]  # 151643
IM_START_ID = QWEN3_SPECIAL_IDS["<|im_start|>"]  # 151644
IM_END_ID = QWEN3_SPECIAL_IDS["<|im_end|>"]  # 151645
QWEN3_EOS_IDS = (IM_END_ID, ENDOFTEXT_ID)  # Qwen3's generation_config.json eos_token_id

# Qwen2/Qwen3 pre-tokenizer regex (same as qwen.tiktoken's pat_str).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's chat template, verbatim from the Qwen3 checkpoints' tokenizer_config.json. Written into
# tokenizer_config.json so transformers renders it; jspec renders the same text in Python
# (Tokenizer.apply_chat_template) and the tests check the two agree.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def qwen3_tokenizer_config() -> dict:
    """tokenizer_config.json as Qwen3 checkpoints ship it (non-thinking default left to callers)."""
    added = {
        str(N_BPE_RANKS + i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (tok, special) in enumerate(QWEN3_ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t, s in QWEN3_ADDED_TOKENS[1:] if s],
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def read_qwen3_tokenizer_json() -> str:
    """The shipped tokenizer.json text."""
    if not ASSET_PATH.is_file():
        raise FileNotFoundError(
            f"{ASSET_PATH} is missing; rebuild it with "
            "`python -m jspec.convert.build_tokenizer --write-asset`"
        )
    return lzma.decompress(ASSET_PATH.read_bytes()).decode("utf-8")


def write_qwen3_tokenizer(out_dir: str | Path) -> Path:
    """Write tokenizer.json + tokenizer_config.json (Qwen3's) into out_dir; returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(read_qwen3_tokenizer_json(), encoding="utf-8")
    cfg = json.dumps(qwen3_tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(cfg, encoding="utf-8")
    return out


def _read_eos(path: Path) -> tuple[int, ...] | None:
    if not path.is_file():
        return None
    eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    if eos is None:
        return None
    ids = (eos,) if isinstance(eos, int) else tuple(eos)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return ids


def read_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids as generation would use them: generation_config.json first, then config.json."""
    d = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        ids = _read_eos(d / name)
        if ids is not None:
            return ids
    raise FileNotFoundError(
        f"{d}: no eos_token_id in generation_config.json or config.json (or neither file exists)"
    )


class Tokenizer:
    """Thin wrapper over a `tokenizers.Tokenizer` with the Qwen3 conventions jspec needs."""

    def __init__(self, tk, eos_ids: Sequence[int]):
        self._tk = tk
        self.eos_ids: tuple[int, ...] = tuple(int(i) for i in eos_ids)
        self._id_bytes: list[bytes | None] | None = None
        self._special_ids: frozenset[int] | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load model_dir/tokenizer.json; EOS from generation_config.json, else config.json."""
        from tokenizers import Tokenizer as _HFTokenizer

        from jspec.standin import resolve
        d = resolve(model_dir)  # a stand-in name builds its directory (jspec.standin)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: {d} has no tokenizer.json (a Qwen3 checkpoint directory needs "
                "one; jspec.tokenizer.write_qwen3_tokenizer(dir) writes the shipped Qwen3 one)"
            )
        return cls(_HFTokenizer.from_file(str(path)), read_eos_ids(d))

    @classmethod
    def qwen3(cls) -> "Tokenizer":
        """The shipped Qwen3 tokenizer with Qwen3's EOS ids (<|im_end|>, <|endoftext|>)."""
        from tokenizers import Tokenizer as _HFTokenizer

        return cls(_HFTokenizer.from_str(read_qwen3_tokenizer_json()), QWEN3_EOS_IDS)

    # -- basic mapping -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows (151669 for Qwen3); the model's embedding table may be larger."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, i: int) -> str | None:
        """Token string (byte-level form, e.g. 'Ġthe'), or None for ids the tokenizer lacks."""
        return self._tk.id_to_token(int(i))

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of added tokens marked special (the ones skip_special_tokens drops)."""
        if self._special_ids is None:
            dec = self._tk.get_added_tokens_decoder()
            self._special_ids = frozenset(i for i, t in dec.items() if t.special)
        return self._special_ids

    # -- encode / decode -----------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of text, nothing added. Added-token strings in text (e.g. '<|im_start|>',
        '<think>') map to their ids, as with transformers, so chat-template output encodes right."""
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ids; ids the tokenizer lacks (e.g. padded embedding rows) are dropped."""
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_bytes(self, i: int) -> bytes | None:
        """Raw bytes a token stands for (added tokens: their UTF-8 text); None if unknown."""
        if self._id_bytes is None:
            self._id_bytes = self._build_id_bytes()
        return self._id_bytes[i] if 0 <= i < len(self._id_bytes) else None

    def _build_id_bytes(self) -> list[bytes | None]:
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        added = self._tk.get_added_tokens_decoder()
        table: list[bytes | None] = [None] * self.vocab_size
        for tok, i in self._tk.get_vocab(with_added_tokens=True).items():
            if i in added:
                table[i] = tok.encode("utf-8")
            else:
                table[i] = bytes(byte_of[c] for c in tok)
        return table

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens)

    # -- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
    ) -> str:
        return render_qwen3_chat(messages, add_generation_prompt, enable_thinking)


class IncrementalDetokenizer:
    """Streaming detokenizer: push ids, get the text they complete.

    Tokens map to raw bytes; an incremental UTF-8 decoder holds back a character split across
    tokens until its last byte arrives, so no broken halves are emitted. Joining every push()
    and the final flush() gives decode(all ids) (invalid bytes become U+FFFD in both).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: int | Iterable[int]) -> str:
        if isinstance(ids, int):
            ids = (ids,)
        parts = []
        for i in ids:
            i = int(i)
            if i in self._skip:
                continue
            b = self._tok.id_bytes(i)
            if b is not None:
                parts.append(b)
        return self._utf8.decode(b"".join(parts))

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished character becomes U+FFFD) and reset."""
        return self._utf8.decode(b"", final=True)


def render_qwen3_chat(
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
) -> str:
    """Qwen3's chat template in Python for system/user/assistant turns (no tools).

    Mirrors the jinja template above: a leading system message goes first; an assistant turn
    after the last user turn keeps its <think> block (an empty one if it is the last message),
    earlier assistant turns drop their reasoning. The generation prompt in non-thinking mode is
    '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n'. Tool calls and tool turns are not
    supported and raise ValueError.
    """
    if not messages:
        raise ValueError("chat needs at least one message")
    for k, m in enumerate(messages):
        role = m.get("role")
        if role not in ("system", "user", "assistant"):
            raise ValueError(
                f"message {k}: role {role!r} unsupported (system/user/assistant only; no tools)"
            )
        if m.get("tool_calls"):
            raise ValueError(f"message {k}: tool_calls are not supported")

    def content_of(m: Mapping[str, str]) -> str:
        c = m.get("content")
        return c if isinstance(c, str) else ""

    # Index of the last real user query: only later assistant turns keep their reasoning.
    last_query = len(messages) - 1
    for k in range(len(messages) - 1, -1, -1):
        m = messages[k]
        c = m.get("content")
        if m["role"] == "user" and isinstance(c, str) and not (
            c.startswith("<tool_response>") and c.endswith("</tool_response>")
        ):
            last_query = k
            break

    out: list[str] = []
    if messages[0]["role"] == "system":
        out.append("<|im_start|>system\n" + content_of(messages[0]) + "<|im_end|>\n")
    for k, m in enumerate(messages):
        role, content = m["role"], content_of(m)
        if role == "user" or (role == "system" and k > 0):
            out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        elif role == "assistant":
            reasoning = m.get("reasoning_content")
            if not isinstance(reasoning, str):
                reasoning = ""
                if "</think>" in content:
                    head, _, _ = content.partition("</think>")
                    reasoning = head.rstrip("\n").split("<think>")[-1].lstrip("\n")
                    content = content.split("</think>")[-1].lstrip("\n")
            last = k == len(messages) - 1
            if k > last_query and (last or reasoning):
                out.append(
                    "<|im_start|>assistant\n<think>\n" + reasoning.strip("\n")
                    + "\n</think>\n\n" + content.lstrip("\n")
                )
            else:
                out.append("<|im_start|>assistant\n" + content)
            out.append("<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
        if not enable_thinking:
            out.append("<think>\n\n</think>\n\n")
    return "".join(out)
