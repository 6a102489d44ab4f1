"""Chat conversations to prompt token ids: the tokenizer's chat template, else a plain one (what
`LLM.chat` and the server's /v1/chat/completions both use)."""

from __future__ import annotations

# the template used when the tokenizer has no chat template of its own (documented in docs/serve.md)
PLAIN_TEMPLATE = "{role}: {content}\n"
PLAIN_GENERATION_PROMPT = "assistant:"
ROLES = ("system", "developer", "user", "assistant", "tool")


def check_messages(messages, name: str = "messages") -> list[dict]:
    """A non-empty list of {"role", "content"} (content a string or text parts) -> plain dicts."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError(f"{name} must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}")
    out = []
    for i, m in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"{where} must be a dict with a 'role' in {ROLES}, got {m!r}")
        content = m.get("content")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise ValueError(
                    f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are served"
                )
            content = "".join(parts)
        if not isinstance(content, str):
            raise ValueError(f"{where}.content must be a string, got {content!r}")
        out.append({"role": m["role"], "content": content})
    return out


def template_options(
    chat_template=None, add_generation_prompt=True, continue_final_message=False, chat_template_kwargs=None
) -> dict:
    """The rendering keywords of `LLM.chat` checked (vLLM's names and rules) -> `render`'s keywords."""
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template):
        raise ValueError(f"chat_template must be a non-empty Jinja template string, got {chat_template!r}")
    for name, value in (("add_generation_prompt", add_generation_prompt), ("continue_final_message",
                        continue_final_message)):  # fmt: skip
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a boolean, got {value!r}")
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "continue_final_message=True needs add_generation_prompt=False (the model goes on with the "
            "last message instead of starting a new one)"
        )
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict, got {chat_template_kwargs!r}")
    return {
        "chat_template": chat_template,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "chat_template_kwargs": chat_template_kwargs or {},
    }


def render(
    tokenizer,
    messages: list[dict],
    encode=None,
    add_generation_prompt: bool = True,
    *,
    chat_template: str | None = None,
    continue_final_message: bool = False,
    chat_template_kwargs: dict | None = None,
):
    """(the prompt text, its token ids) of a checked conversation. With a chat template (the tokenizer's,
    or `chat_template`): the template's text (its special tokens written by the template, none added);
    else the plain template encoded as any prompt (`encode`, default `tokenizer.encode`)."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(chat_template_kwargs or {}),
        )
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "".join(PLAIN_TEMPLATE.format(**m) for m in messages)
    if continue_final_message:
        text = text.removesuffix("\n")
    text += PLAIN_GENERATION_PROMPT if add_generation_prompt else ""
    ids = (encode or tokenizer.encode)(text)
    return text, list(getattr(ids, "ids", ids))
