"""The engine's worker: everything that touches tensors. The model runner (one forward path),
models and loaders, the sampler, sparse decode, CUDA graphs, batch buffers, device choice, and
the worker side of the KV connector (kv_worker.py)."""
