"""lm-evaluation-harness itself (`lm_eval --model local-completions`) against a `mlakit serve` child on
127.0.0.1 serving the tiny fp32 DeepSeek-V3 folder: one multiple-choice task (echo + logprobs +
max_tokens 1 over batched token-id prompts) and one generate_until task, local JSON data, no
downloads. Its reported numbers must be the ones the engine's own outputs imply: every choice's
log-likelihood from `SamplingParams(prompt_logprobs=0)`, the accuracy from those, the exact-match
rate from greedy generations whose expected answers are known by construction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install 'lm-eval[api]==0.4.13'")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from support.serve import start_cli_server  # noqa: E402
from support.serve_tiny import write_tiny_model  # noqa: E402

from mlakit.engine import LLM, SamplingParams  # noqa: E402

QUESTIONS = [
    ("The sky is", ["blue", "green", "loud"], 0),
    ("Two plus two is", ["four", "five"], 0),
    ("Latent attention caches", ["one latent per token", "keys and values", "nothing"], 1),
    ("Paris is in", ["France", "Spain", "Peru", "Mars"], 0),
    ("Water is", ["wet", "dry"], 1),
    ("A cat says", ["meow", "woof", "moo"], 0),
]
GEN_PROMPTS = ["Q: colour of grass?\nA:", "Q: 3+4?\nA:", "Hello", "MLA", "x = ", "The end"]
MAX_GEN = 6


def yaml_task(path, **config) -> None:
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML


def write_tasks(folder, gen_answers: list[str]) -> None:
    mc = folder / "mc.jsonl"
    mc.write_text("".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    gen = folder / "gen.jsonl"
    rows = zip(GEN_PROMPTS, gen_answers, strict=True)
    gen.write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in rows))
    common = dict(dataset_path="json", test_split="test", doc_to_text="{{q}}")
    yaml_task(
        folder / "mlakit_tiny_mc.yaml",
        task="mlakit_tiny_mc",
        dataset_kwargs={"data_files": {"test": str(mc)}},
        output_type="multiple_choice",
        doc_to_choice="{{choices}}",
        doc_to_target="{{answer}}",
        metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        **common,
    )
    yaml_task(
        folder / "mlakit_tiny_gen.yaml",
        task="mlakit_tiny_gen",
        dataset_kwargs={"data_files": {"test": str(gen)}},
        output_type="generate_until",
        doc_to_target="{{a}}",
        generation_kwargs={"until": ["\n"], "max_gen_toks": MAX_GEN, "do_sample": False},
        metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        **common,
    )


def expected_loglikelihoods(llm, tok) -> list[list[float]]:
    """Each choice's log-likelihood as lm-eval scores it: the context's tokens, then " " + choice's,
    the sum of the continuation tokens' prompt log-probabilities."""
    out = []
    for q, choices, _ in QUESTIONS:
        context = tok.encode(q, add_special_tokens=False)
        whole = [tok.encode(q + " " + c, add_special_tokens=False) for c in choices]
        res = llm.generate(whole, SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)
        out.append(
            [
                sum(r.prompt_logprobs[i][ids[i]] for i in range(len(context), len(ids)))
                for r, ids in zip(res, whole, strict=True)
            ]
        )
    return out


def greedy_texts(llm, tok) -> list[str]:
    ids = [tok.encode(p, add_special_tokens=False) for p in GEN_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_GEN, stop=["\n", tok.eos_token])
    return [o.outputs[0].text for o in llm.generate(ids, params, use_tqdm=False)]


def run_lm_eval(url: str, model: str, tasks, out, env) -> dict:
    args = ",".join(
        [
            "model=tiny",
            f"base_url={url}/v1/completions",
            "tokenizer_backend=huggingface",
            f"tokenizer={model}",
            "tokenized_requests=True",
            "max_retries=1",
            "max_length=512",
        ]
    )
    # --batch_size 2: several token-id prompts per request
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", args,
           "--tasks", "mlakit_tiny_mc,mlakit_tiny_gen", "--include_path", str(tasks),
           "--output_path", str(out), "--log_samples",
           "--batch_size", "2"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    (result,) = list(out.rglob("results_*.json"))
    return json.loads(result.read_text()), out


def samples(out, task: str) -> list[dict]:
    (path,) = list(out.rglob(f"samples_{task}_*.jsonl"))
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


@pytest.mark.slow
def test_lm_eval_local_completions(tmp_path):
    from transformers import AutoTokenizer

    model = write_tiny_model(tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(model)
    llm = LLM(model, dtype="fp32")
    want_ll = expected_loglikelihoods(llm, tok)
    texts = greedy_texts(llm, tok)
    # every other expected answer is the model's own greedy text: exact match 0.5 by construction
    answers = [t if i % 2 == 0 else t + " (not this)" for i, t in enumerate(texts)]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tasks(tasks, answers)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"), HF_DATASETS_CACHE=str(tmp_path / "hf" / "datasets"),
               OPENAI_API_KEY="unused", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    t0 = time.monotonic()
    proc, url = start_cli_server(["--model", model, "--dtype", "fp32", "--served-model-name", "tiny"])
    t1 = time.monotonic()
    try:
        results, out = run_lm_eval(url, model, tasks, tmp_path / "out", env)
        print(f"server start {t1 - t0:.1f} s, lm_eval {time.monotonic() - t1:.1f} s")
    finally:
        proc.kill()  # by PID: only the server this test started
        proc.wait(10)
    mc, gen = results["results"]["mlakit_tiny_mc"], results["results"]["mlakit_tiny_gen"]

    got_ll = [[float(r[0][0]) for r in s["resps"]] for s in samples(out, "mlakit_tiny_mc")]
    for got, want in zip(got_ll, want_ll, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    best = [max(range(len(w)), key=w.__getitem__) for w in want_ll]
    acc = sum(b == a for b, (_, _, a) in zip(best, QUESTIONS, strict=True)) / len(QUESTIONS)
    print(f"lm_eval acc {mc['acc,none']}, expected {acc}; exact_match {gen['exact_match,none']}")
    assert mc["acc,none"] == pytest.approx(acc)
    got_texts = [s["filtered_resps"][0] for s in samples(out, "mlakit_tiny_gen")]
    assert got_texts == texts
    assert gen["exact_match,none"] == pytest.approx(0.5)
