"""Real engine KV stacks on CPU, built the same way for kvcore's tests and its benchmarks.

What both kvcore's tests and its benchmarks need lives here, so that neither imports the
other's helpers; both import it by name. The package sits at the repository root beside
them and is not part of the kvcore wheel (``pyproject.toml`` ships ``kvcore*`` only): it
imports from the root, which pytest puts on the import path (``pythonpath``), as ``python
-m benchmarks.<name>`` run from the root does.

* ``harness.vllm``: the environment vLLM needs on a CPU machine without network, set when
  the package is imported (so before vLLM is), and the local hub cache its model config is
  read from; ``harness.vllm.scheduler``: vLLM's real ``Scheduler`` over kvcore's elastic
  pool, its requests and a step with a stand-in model output.
* ``harness.sglang_kv``: SGLang's real KV pool and allocator, with kvcore or without.
* ``harness.hf_configs``: the small Hugging Face model files such a hub cache holds.
"""
