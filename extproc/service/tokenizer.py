"""The model's own tokenizer and chat template, read from its GGUF file (service.tokenizer).

What llama.cpp does with a chat body, reproduced here so that the router counts the tokens the
replica will count:
  - the chat template (``tokenizer.chat_template``) renders the messages, with the opening of
    the assistant's answer, as llama.cpp's Jinja engine does (trim_blocks, lstrip_blocks);
  - the text is cut at the vocabulary's control and user-defined tokens (parsed as special, as
    the server does), each piece in between is split by the pre-tokenizer's regexes of
    llama.cpp's ``src/llama-vocab.cpp`` for ``tokenizer.ggml.pre`` and encoded with the byte-
    level BPE of ``tokenizer.ggml.tokens`` / ``tokenizer.ggml.merges`` (the ``tokenizers``
    package); a BOS token is added when ``tokenizer.ggml.add_bos_token`` says so.

Only what a turn adds is tokenized: BPE never merges across a special token, so a prompt's
count is the number of its special tokens plus the counts of the pieces between them, and
each piece's count is kept (bounded, by a 128-bit hash of the piece). A later turn resends
the earlier messages, whose pieces are known: it tokenizes its new message and the previous
answer only. The Jinja rendering itself is redone per request (tens of microseconds).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

from extproc.routing.tokens import OPENING_TOKENS, CharCounter, ChatCount, Message, TokenCounter

CHARS = "chars"  # service.tokenizer: characters / service.chars_per_token
PIECE_MEMORY = 65_536  # pieces whose count is kept (then the memory starts again)

# llama.cpp's pre-tokenizer regexes per tokenizer.ggml.pre (src/llama-vocab.cpp, applied in
# order), for the vocabularies checked against a replica's /tokenize: SmolLM2's and Qwen2's
# (the local stack's models). Others (llama3's ignore_merges, BOS defaults) are refused.
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "smollm": (r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"),
    "qwen2": (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values parsed as special tokens


class TokenizerError(ValueError):
    """service.tokenizer names no usable tokenizer; the message says why."""


def make_counter(tokenizer: str, chars_per_token: float) -> TokenCounter:
    """The counter service.tokenizer names: "chars", or the path of the model's GGUF file."""
    if tokenizer == CHARS:
        return CharCounter(chars_per_token)
    return GgufTokenizer.load(Path(tokenizer))


class GgufTokenizer:
    """A GGUF model's tokenizer and chat template (see the module docstring)."""

    def __init__(self, name: str, encoder: Any, specials: Sequence[str], bos: str, add_bos: bool,
                 template_source: str | None, eos: str) -> None:
        self._name = name
        self._encoder = encoder
        longest_first = sorted(specials, key=len, reverse=True)
        self._split = re.compile("(" + ("|".join(re.escape(s) for s in longest_first) or "(?!)") + ")")
        self._special_ids = {token: encoder.token_to_id(token) for token in specials}
        self._bos, self._eos, self._add_bos = bos, eos, add_bos
        self._template_source = template_source
        self._template = None if template_source is None else _compile_template(name, template_source)
        self._template_globals = {} if self._template is None else dict(self._template.globals)
        self._pieces: dict[bytes, int] = {}  # piece hash -> its tokens
        self._heads: dict[bytes, tuple[int, ...]] = {}  # piece hash -> the ids of its head (openings)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Sent to the worker that parses large bodies (offload.py) as the encoder's JSON: reading
        the GGUF file again takes seconds, rebuilding from JSON a fraction of one."""
        return _restore, (self._name, self._encoder.to_str(), sorted(self._special_ids), self._bos, self._add_bos,
                          self._template_source, self._eos)

    @property
    def name(self) -> str:
        return self._name

    @classmethod
    def load(cls, path: Path) -> GgufTokenizer:
        """Read the tokenizer of the GGUF file at ``path``; TokenizerError when it cannot be."""
        from gguf import GGUFReader
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers

        if not path.is_file():
            raise TokenizerError(f"{path}: no such file (service.tokenizer: a GGUF model file or {CHARS!r})")
        try:
            reader = GGUFReader(str(path))
        except Exception as exc:  # gguf raises ValueError, struct.error, ... on a file that is no GGUF
            raise TokenizerError(f"{path}: not a GGUF file ({exc})") from None
        fields = {key: value.contents() for key, value in reader.fields.items() if key.startswith("tokenizer.")}
        kind, pre = fields.get("tokenizer.ggml.model"), fields.get("tokenizer.ggml.pre", "gpt2")
        if kind != "gpt2":
            raise TokenizerError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE, "
                                 f"'gpt2'): set service.tokenizer = {CHARS!r}")
        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported (known: "
                                 f"{', '.join(sorted(PRE_TOKENIZERS))}): set service.tokenizer = {CHARS!r}")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types: list[int] = fields["tokenizer.ggml.token_type"]
        merges = [tuple(merge.split(" ", 1)) for merge in fields["tokenizer.ggml.merges"]]
        encoder = Tokenizer(models.BPE({token: index for index, token in enumerate(tokens)}, merges))
        encoder.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in PRE_TOKENIZERS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        specials = [token for token, kind in zip(tokens, types, strict=True) if kind in (CONTROL, USER_DEFINED)]

        def token(key: str) -> str:
            index = fields.get(key)
            return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else ""

        source = fields.get("tokenizer.chat_template")
        add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False))
        return cls(f"gguf:{path.name}", encoder, specials, token("tokenizer.ggml.bos_token_id"), add_bos,
                   source if isinstance(source, str) else None, token("tokenizer.ggml.eos_token_id"))

    def count_text(self, text: str) -> int:
        """Tokens of ``text`` as llama.cpp's server tokenizes a prompt (special tokens parsed)."""
        return self._tokens(text, 0)[0]

    def count_chat(self, messages: Sequence[Message]) -> ChatCount:
        from jinja2 import TemplateError

        try:
            rendered = self.render(messages)
        except TemplateError:  # the template refuses these messages (the replica will answer so): their text alone
            return ChatCount(self.count_text("".join(text for _, text in messages)), 0, ())
        last_answer = next((text for role, text in reversed(messages) if role == "assistant"), None)
        # the answer's text is in the rendered prompt (templates do not rewrite it): up to its end
        # is what the replica that generated it holds, the later turns' pieces follow
        found = rendered.rfind(last_answer) if last_answer else -1
        end = found + len(last_answer) if last_answer and found >= 0 else 0
        count, opening = self._tokens(rendered, OPENING_TOKENS)
        return ChatCount(count, self._tokens(rendered[:end], 0)[0] if end else 0, opening)

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of ``text`` (tests compare them with the replica's /tokenize)."""
        return self._tokens(text, len(text) + 1)[1]

    def _tokens(self, text: str, opening: int) -> tuple[int, tuple[int, ...]]:
        """(tokens of ``text``, the ids of its first ``opening`` tokens). Each piece between special
        tokens is encoded once: its count is kept, and the ids of its head while it is a prompt's
        opening."""
        bos = self._special_ids.get(self._bos) if self._add_bos else None
        count, ids = (0, []) if bos is None else (1, [bos])
        pieces, heads = self._pieces, self._heads
        for piece in self._split.split(text):
            if not piece:
                continue
            special = self._special_ids.get(piece)
            if special is not None:
                count += 1
                if len(ids) < opening:
                    ids.append(special)
                continue
            key = xxhash.xxh3_128_digest(piece.encode(errors="surrogatepass"))
            known = pieces.get(key)
            wanted = opening - len(ids)
            head = heads.get(key) if wanted > 0 else None
            if known is None or (wanted > 0 and (head is None or len(head) < min(wanted, known))):
                encoded = self._encoder.encode(piece, add_special_tokens=False).ids
                known = len(encoded)
                if len(pieces) >= PIECE_MEMORY:
                    pieces.clear()
                pieces[key] = known
                if wanted > 0:
                    if len(heads) >= PIECE_MEMORY // 16:
                        heads.clear()
                    head = heads[key] = tuple(encoded[: max(wanted, OPENING_TOKENS)])
            if head is not None and wanted > 0:
                ids.extend(head[:wanted])
            count += known
        return max(1, count), tuple(ids[:opening])

    def render(self, messages: Sequence[Message]) -> str:
        """The prompt the replica makes of ``messages`` (ChatML when the model has no template)."""
        if self._template is None:
            return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in messages) + \
                "<|im_start|>assistant\n"
        # Template.render copies the template's globals (a ChainMap, iterated key by key) into
        # every context: half a render's time. The copy made once is passed shared instead.
        context = self._template.new_context({
            **self._template_globals, "messages": [{"role": role, "content": text} for role, text in messages],
            "add_generation_prompt": True, "bos_token": self._bos, "eos_token": self._eos,
        }, shared=True)
        rendered: str = "".join(self._template.root_render_func(context))
        if self._add_bos and self._bos and rendered.startswith(self._bos):  # llama.cpp adds it once
            rendered = rendered[len(self._bos):]
        return rendered


def _restore(name: str, encoder: str, specials: list[str], bos: str, add_bos: bool, template_source: str | None,
             eos: str) -> GgufTokenizer:
    from tokenizers import Tokenizer

    return GgufTokenizer(name, Tokenizer.from_str(encoder), specials, bos, add_bos, template_source, eos)


def _compile_template(name: str, source: str) -> Any:
    """The chat template as llama.cpp's Jinja engine reads it: blocks trimmed, JSON unescaped."""
    from jinja2 import TemplateError
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    class Sandbox(ImmutableSandboxedEnvironment):
        """The sandbox, its checks skipped where they always pass: a public attribute of Jinja's
        own loop object (``loop.first``, ``loop.last``: the sandbox's checks refuse only names
        starting with "_" there). Templates read them once per message: a quarter of a render."""

        def getattr(self, obj: Any, attribute: str) -> Any:
            if type(obj) is LoopContext and not attribute.startswith("_"):
                try:
                    return getattr(obj, attribute)
                except AttributeError:
                    pass
            return super().getattr(obj, attribute)

    environment = Sandbox(trim_blocks=True, lstrip_blocks=True)
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    environment.globals["raise_exception"] = raise_exception
    try:
        return environment.from_string(source)
    except TemplateError as exc:
        raise TokenizerError(f"{name}: tokenizer.chat_template does not compile ({exc})") from None
