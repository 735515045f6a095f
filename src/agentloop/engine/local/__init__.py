"""The CPU reference engine: a real transformers causal LM served over SGLang's HTTP API.

Modules, one job each: `model_runner` (forward passes), `kv_cache` (the decode batch's padded KV
cache), `sampling` (params validation, sampler, logprob convention), `request` (one request's
state), `scheduler` (continuous batching worker thread, pause/abort/retract), `memory`
(release/resume with SGLang's semantics, its crashes reported), `weights` (updates from disk or
safetensors payloads), `engine` (async facade), `admission` (one request's fields checked with
SGLang's rules), `update_lock` (the model-update lock), `limits` (what one request may ask),
`http_common` (bodies, SGLang's error shapes), `generate_api` (`/generate`), `server` (the other
endpoints + `agentloop serve`), `process` (`LocalEngineProcess`: the server as a subprocess).

The inference core (`scheduler`, `model_runner`, `kv_cache`: ~560 lines) is of the order of
nano-vllm's `llm_engine` + `scheduler` + `model_runner` (a few hundred); the rest, over three times
as much, is SGLang's HTTP contract (validation rules and messages, response fields, streaming, pause
modes, memory tags, weight updates, request limits), which the runtime and its tests rely on.
"""
