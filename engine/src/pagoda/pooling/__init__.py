"""Pooling models: embeddings (``--task embed``) and relevance scores (``--task score``), without a KV cache.

:mod:`model` says what a checkpoint computes (read from its files), :mod:`encoder` and :mod:`decoder` are the
networks (BERT/XLM-R encoders; the generation engine's Llama-family decoders run without a cache), and :mod:`engine`
batches the queued inputs on one worker thread. The OpenAI routes are ``entrypoints/openai/serving_pooling.py``.
"""
