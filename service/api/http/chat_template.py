"""A checkpoint's chat template, rendered as Hugging Face renders it.

The template comes from ``chat_template.jinja`` beside the weights or else ``tokenizer_config.json``'s
``chat_template`` (a string, or a list of named templates of which ``default`` is used), with that
file's ``bos_token`` / ``eos_token``. It runs in Jinja's immutable sandbox with the settings and
helpers ``transformers`` gives templates (``trim_blocks``, ``lstrip_blocks``, loop controls,
``tojson``, ``raise_exception``, ``strftime_now``, the ``generation`` block), so that a checkpoint's
template renders the same text here as in ``apply_chat_template``. A checkpoint without a template
has no chat: the request is refused with that reason rather than answered from a guessed format.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from switchyard.service.errors import InvalidRequestError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"


def _environment() -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it (for
        its training masks); rendering keeps the text."""

        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_keep"), [], [], body).set_lineno(lineno)

        def _keep(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json states it: a string or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    """``source`` None: no chat for this model, ``problem`` says why (every render raises it)."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "", problem: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.problem = problem
        self._template: Any = None
        if source is not None:
            import jinja2

            try:
                self._template = _environment().from_string(source)
            except jinja2.TemplateError as err:
                self.source = None
                self.problem = f"the model's chat template does not compile: {err}"

    @classmethod
    def missing(cls, reason: str) -> ChatTemplate:
        return cls(None, problem=reason)

    @classmethod
    def from_dir(cls, folder: str | Path) -> ChatTemplate:
        folder = Path(folder)
        config: dict[str, Any] = {}
        config_path = folder / CONFIG_FILE
        if config_path.is_file():
            try:
                loaded = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as err:
                return cls.missing(f"the model's {CONFIG_FILE} does not parse ({err}), so it has no chat template")
            config = loaded if isinstance(loaded, dict) else {}
        source: Any = None
        if (folder / TEMPLATE_FILE).is_file():
            source = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
        else:
            source = config.get("chat_template")
            if isinstance(source, list):  # named templates: the default one is for chat
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
        if not isinstance(source, str) or not source:
            return cls.missing(
                f"this model has no chat template ({folder.name} has no {TEMPLATE_FILE} and its {CONFIG_FILE} "
                "sets no chat_template): use /v1/completions with a prompt")
        return cls(source, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")))

    @property
    def available(self) -> bool:
        return self._template is not None

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               extra: dict[str, Any] | None = None) -> str:
        """The prompt text of ``messages``; InvalidRequestError when there is no template or the
        template refuses them (its ``raise_exception`` message, such as roles that must alternate)."""
        if self._template is None:
            raise InvalidRequestError(self.problem or "this model has no chat template")
        import jinja2

        variables = {**(extra or {}), "messages": messages, "add_generation_prompt": add_generation_prompt,
                     "bos_token": self.bos_token, "eos_token": self.eos_token}
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as err:  # the template's own refusal, or a sandbox violation
            raise InvalidRequestError(f"the chat template refused these messages: {err}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as err:
            raise InvalidRequestError(
                f"the chat template could not render these messages: {type(err).__name__}: {err}") from None
