"""
The trainer-agnostic core: every real token once, for any causal LM call.

- [`tree`]: the prefix tree of a micro-batch's rows (each run of tokens they share once, no padding), the one
  structure the packed forwards read, and [`tree_layout`], its index tensors on the device;
- [`packing`]: a batch's rows, and the packed flat sequence of a scoring or training forward over their tree;
- [`prefix_attention`]: the attention backend the packed forwards, decoding and reward scoring share: over the tree
  ([`tree_attention`]), and over a prompt cache kept once per group while decoding; on the fused kernels of
  [`attention_kernels`] (checked at first use by [`kernel_checks`]), with sliding windows and sinks
  ([`window_attention`]);
- [`recurrent`]: Gated DeltaNet, Mamba2 and short-convolution layers forked along the tree (their kernels checked by
  [`recurrent_checks`]); [`moe`]: the load-balancing loss of packed tokens; [`vision`]: images once per group;
- [`shared_generation`] and [`prefix_cache`]: each prompt prefilled once, and its keys and values kept once while
  decoding;
- [`reward_packing`]: reward models scored over the tree of their rows;
- [`families`]: which models each of these serves exactly, and why the others cannot.

Nothing here knows a trainer: [`rloo_efficient.trainers`] binds it to TRL's.
"""
