"""Tokenizer: a `tokenizers` BPE model plus the chat template and special tokens."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from nanojax.errors import CheckpointError, NanojaxError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves the template


class ChatTemplateError(NanojaxError):
    pass


class Tokenizer:
    def __init__(self, backend: HFTokenizer, config: dict):
        self.backend = backend
        self.config = dict(config)
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token: str | None = config.get("bos_token")
        self.eos_token: str | None = config.get("eos_token")
        self.add_bos_token: bool = bool(config.get("add_bos_token", False))
        self.bos_token_id = self._id(self.bos_token)
        eos = list(config.get("eos_token_ids") or [])
        if not eos and self._id(self.eos_token) is not None:
            eos = [self._id(self.eos_token)]
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self._template = None

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # ---- files -------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        directory = Path(directory)
        self.backend.save(str(directory / TOKENIZER_FILE))
        (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(self.config, indent=2))

    @classmethod
    def load(cls, directory: Path) -> "Tokenizer":
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise CheckpointError(f"missing tokenizer file: {path}")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise CheckpointError(f"corrupt tokenizer file {path}: {e}") from None
        cfg_path = directory / TOKENIZER_CONFIG_FILE
        config = {}
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"corrupt tokenizer config {cfg_path}: {e}") from None
        # HF stores special tokens either as strings or as {"content": ...} dicts.
        for key in ("bos_token", "eos_token"):
            if isinstance(config.get(key), dict):
                config[key] = config[key].get("content")
        template_path = directory / CHAT_TEMPLATE_FILE
        if template_path.is_file():
            # as in transformers, the file wins over the config's entry; kept in the
            # config, so that save() writes it into a converted checkpoint
            config["chat_template"] = template_path.read_text(encoding="utf-8")
        return cls(backend, config)

    # ---- text <-> ids ------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: list[dict] | None = None,
                            template_kwargs: dict | None = None):
        """tools: OpenAI function tools, handed to the template as transformers does;
        template_kwargs: more template variables (a request's chat_template_kwargs, e.g.
        Qwen3's enable_thinking), never the ones set here."""
        if not self.chat_template:
            raise ChatTemplateError("this model's tokenizer has no chat template")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
                                                               lstrip_blocks=True)

            def raise_exception(message):
                raise ChatTemplateError(message)

            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson  # transformers': tool templates rely on it
            self._template = env.from_string(self.chat_template)
        try:
            text = self._template.render({
                **(template_kwargs or {}), "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                "tools": tools})
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError,
                ArithmeticError, RecursionError) as e:  # what request data can make it do
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """JSON as transformers' chat templates get it: not HTML-escaped like jinja's own."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back an unfinished
    multi-byte character. With tokenizers' DecodeStream (0.21 and later) each token is
    one call into Rust; else a short window of ids is decoded twice per push."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self._stream = _decode_stream(skip_special_tokens)
        self._backend = tokenizer.backend

    def push(self, new_ids) -> str:
        if self._stream is not None:
            delta = ""
            for i in new_ids:
                piece = self._stream.step(self._backend, int(i))
                if piece is not None:
                    delta += piece
            self.text += delta
            return delta
        self.ids.extend(int(i) for i in new_ids)
        def decode(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


def _decode_stream(skip_special_tokens: bool):
    """tokenizers' incremental decoder, None where the installed tokenizers predates it."""
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    return DecodeStream(skip_special_tokens=skip_special_tokens)
