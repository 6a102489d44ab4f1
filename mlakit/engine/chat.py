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


def render(tokenizer, messages: list[dict], encode=None, add_generation_prompt: bool = True):
    """(the prompt text, its token ids) of a checked conversation. With a chat template: the template's
    text (its special tokens written by the template, none added); else the plain template encoded as
    any prompt (`encode`, default `tokenizer.encode`)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "".join(PLAIN_TEMPLATE.format(**m) for m in messages)
    text += PLAIN_GENERATION_PROMPT if add_generation_prompt else ""
    ids = (encode or tokenizer.encode)(text)
    return text, list(getattr(ids, "ids", ids))
