"""
The trainer-agnostic core: every real token once, for any causal LM call. Its folders, each importing only those
above it in this list:

- [`tree`]: the batch's rows, the prefix tree over them, its device layout, and the prompts held across micro-batches;
- [`attention`]: the attention backend over the tree and while decoding, its kernels and their first-use checks,
  windows and sinks, and the held state's banked gradients;
- [`layers`]: recurrent layers, MoE routers and vision towers over the tree, the families served, installing it all;
- [`forward`]: the packed log-prob, training and reward forwards, and scopes of micro-batches holding prompts;
- [`generation`]: `generate` with each prompt prefilled once (as its tree), its cache once per group, tool turns.

[`transformers_compat`] names what changed between the transformers releases we support. Nothing here knows a
trainer: [`rloo_efficient.trainers`] binds it to TRL's.
"""
