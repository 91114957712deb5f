"""
The demo workload, built offline: each model family shrunk from its own config class ([`tiny_models`]) with its
processor ([`tiny_processors`]), and the synthetic prompts, tokenizer, reward and training setup the benchmarks,
experiments and tests run ([`workload`]). Not part of the trainers: nothing in `core/` or `trainers/` imports it.
"""
