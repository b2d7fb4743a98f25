"""The engine: batch scheduling, the page pool, the model runner, sampling, KV memory, CUDA
graphs and attention backend selection. Pure logic (scheduling, cache, sampling) is tested
directly; the runner runs inside executor processes."""
