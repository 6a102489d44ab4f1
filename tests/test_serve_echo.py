"""/v1/completions with `echo` (the prompt first; with `logprobs` its tokens' log-probabilities, the
first null, in OpenAI's legacy format), `max_tokens: 0` (score a prompt), and token-id prompts, on a
real engine over the tiny fp32 DeepSeek-V3 folder (in-process, 127.0.0.1): the prompt's numbers equal
transformers' log-softmax of its logits (1e-4), the generated part equals the answer without echo."""

from __future__ import annotations

import httpx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("xxhash")

from support.serve import ThreadServer  # noqa: E402
from support.serve_tiny import write_tiny_model  # noqa: E402

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def ref(tiny):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def url(tiny):
    from mlakit.engine import LLMEngine
    from mlakit.serve.adapter import EngineAdapter
    from mlakit.serve.app import build_app

    # a 32-token budget: prompts of more are scored over several chunked steps
    engine = LLMEngine(tiny, dtype="fp32", num_blocks=64, block_size=16, max_num_batched_tokens=32)
    server = ThreadServer(build_app(EngineAdapter(engine), "tiny"))
    try:
        yield server.url
    finally:
        server.close()


def complete(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(url: str, text: str) -> list[int]:
    return httpx.post(url + "/tokenize", json={"prompt": text}).json()["tokens"]


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny)


def ref_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_prompt_part(lp: dict, ids: list[int], ref: torch.Tensor, k: int, tok) -> None:
    """The first len(ids) entries of a legacy logprobs object against transformers."""
    n = len(ids)
    texts = [tok.decode([t]) for t in ids]
    assert lp["tokens"][:n] == texts
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][:n] == [sum(len(t) for t in texts[:i]) for i in range(n)]
    for i in range(1, n):
        row = ref[i - 1]
        assert abs(lp["token_logprobs"][i] - float(row[ids[i]])) <= ATOL, i
        top = row.topk(k)
        want = {tok.decode([t]): v for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)}
        got = lp["top_logprobs"][i]
        assert set(got) == set(want), i
        assert all(abs(got[t] - want[t]) <= ATOL for t in want), i


@pytest.mark.parametrize("k", [0, 2], ids=["k0", "k2"])
def test_echo_max_tokens_zero_scores_the_prompt(url, ref, tok, k):
    prompt = "Multi-head latent attention caches one latent per token."  # 57 tokens: two chunks
    ids = tokenize(url, prompt)
    r = complete(url, prompt=prompt, echo=True, logprobs=k, max_tokens=0)
    (choice,) = r["choices"]
    assert (choice["text"], choice["finish_reason"]) == (prompt, "length")
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    check_prompt_part(choice["logprobs"], ids, ref_logprobs(ref, ids), k, tok)
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 0


def test_echo_max_tokens_one_batched_token_prompts(url, ref, tok):
    """What lm-eval's loglikelihood sends: token-id prompts, batched, echo, logprobs 1, max_tokens 1."""
    prompts = [tokenize(url, "The cat sat on the mat"), tokenize(url, "A dog"), [65]]
    r = complete(url, prompt=prompts, echo=True, logprobs=1, max_tokens=1)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    for ids, choice in zip(prompts, r["choices"], strict=True):
        plain = complete(url, prompt=ids, logprobs=1, max_tokens=1)["choices"][0]
        assert choice["text"] == tok.decode(ids) + plain["text"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1
        check_prompt_part(lp, ids, ref_logprobs(ref, ids), 1, tok)
        assert lp["token_logprobs"][-1] == pytest.approx(plain["logprobs"]["token_logprobs"][0], abs=ATOL)
        assert lp["text_offset"][-1] == len(tok.decode(ids))


def test_echo_without_logprobs_prepends_the_prompt(url):
    plain = complete(url, prompt="echo me", max_tokens=5)["choices"][0]["text"]
    r = complete(url, prompt="echo me", max_tokens=5, echo=True, n=2)
    assert [c["text"] for c in r["choices"]] == ["echo me" + plain] * 2
    assert all(c["logprobs"] is None for c in r["choices"])
    assert r["usage"]["completion_tokens"] == 10


def test_echo_streamed_equals_whole(url):
    body = dict(prompt="stream the echo", max_tokens=4, echo=True, logprobs=1, n=2)
    whole = complete(url, **body)["choices"]
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json={"model": "tiny", "temperature": 0,
                      "stream": True, **body}, timeout=60) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(httpx.Response(200, content=line[6:]).json()["choices"][0])
    for i in (0, 1):
        mine = [c for c in chunks if c["index"] == i]
        assert "".join(c["text"] for c in mine) == whole[i]["text"]
        assert mine[0]["text"].startswith("stream the echo")
        tokens = sum((c["logprobs"]["tokens"] for c in mine), [])
        offsets = sum((c["logprobs"]["text_offset"] for c in mine), [])
        assert tokens == whole[i]["logprobs"]["tokens"]
        # the prompt's offsets; a generated token's depend on how its text arrived (as vLLM's streams)
        assert offsets[:15] == whole[i]["logprobs"]["text_offset"][:15] == list(range(15))
        lps = sum((c["logprobs"]["token_logprobs"] for c in mine), [])
        assert lps[0] is None and lps[1:] == pytest.approx(whole[i]["logprobs"]["token_logprobs"][1:])


def test_a_repeated_prompt_is_rescored_not_read_from_the_prefix_cache(url, ref, tok):
    prompt = "a shared prefix of two pages " * 2  # 58 tokens: three whole pages of 16
    ids = tokenize(url, prompt)
    complete(url, prompt=prompt, max_tokens=1)  # now in the prefix cache
    r = complete(url, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    check_prompt_part(r["choices"][0]["logprobs"], ids, ref_logprobs(ref, ids), 1, tok)
    again = complete(url, prompt=prompt, max_tokens=1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 48


@pytest.mark.parametrize(
    "prompt",
    [[72, 105], [[72, 105], [33]], ["Hi", "there"], ["Hi", [33, 33]]],
    ids=["ids", "id-lists", "strings", "mixed"],
)
def test_prompt_forms_echo(url, tok, prompt):
    r = complete(url, prompt=prompt, echo=True, max_tokens=0)
    items = [prompt] if isinstance(prompt[0], int) else prompt
    want = [p if isinstance(p, str) else tok.decode(p) for p in items]
    assert [c["text"] for c in r["choices"]] == want


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),  # vLLM: at least 1 without echo
        ({"prompt": "a", "max_tokens": -1, "echo": True}, "max_tokens"),
        ({"prompt": "a", "echo": "yes"}, "echo"),
        ({"prompt": [[]], "echo": True}, "prompt"),
    ],
    ids=["zero-without-echo", "negative", "echo-type", "empty-id-list"],
)
def test_refused(url, body, param):
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", **body})
    assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
