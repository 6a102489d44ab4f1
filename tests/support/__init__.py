"""What the tests share, one module per subject (tests/ is on sys.path, so `from support.X import ...`):

- `support.common`: assert_close that prints error and scale, tiny configs, seeded layers and inputs, an
  independent float64 MLA, cache snapshots, the tiny transformers configs (HF_TINY, HF_MOE).
- `support.cache`: the caches' tests: small configs, a tensor-storage peak meter, and the step protocol's
  tiny setup (CFG, DSA, make_cache, make_layers, step, bit-for-bit state snapshots, visible latents).
- `support.dsa`: tiny transformers DSA layers, their captured top-k, an fp64 index-score oracle.
- `support.engine`: tiny fp32 models of every family the engine serves, prompts, and transformers'
  greedy reference.
- `support.serve`: a fake LLMEngine and servers (in a thread, or `mlakit serve` in a child process).
- `support.serve_tiny`: a tiny fp32 DeepSeek-V3 folder with a byte-level tokenizer for a real server.
- `support.v4`: a tiny DeepseekV4Config, transformers' V4 layer beside mlakit's, and its cache driver.
"""
