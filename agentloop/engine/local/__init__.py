"""The CPU reference engine: a real transformers causal LM served over SGLang's HTTP API.

Modules, one job each: `model_runner` (forward passes), `kv_cache` (the decode batch's padded KV
cache), `sampling` (params validation, sampler, logprob convention), `request` (one request's
state), `scheduler` (continuous batching worker thread, pause/abort/retract), `memory`
(release/resume with SGLang's semantics), `weights` (updates from disk or safetensors payloads),
`engine` (async facade), `server` (aiohttp endpoints + `agentloop serve`), `process`
(`LocalEngineProcess`: run the server as a subprocess for tests and the CLI).
"""
