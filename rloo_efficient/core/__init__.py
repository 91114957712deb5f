"""
The trainer-agnostic core: each prompt once per group, for any causal LM call.

- [`prefix_attention`]: the attention backend the packed forwards, decoding and reward scoring share, on the fused
  kernels of [`attention_kernels`] (checked at first use by [`kernel_checks`]), with sliding windows and sinks
  ([`window_attention`]);
- [`packing`]: a batch's group structure and the packed flat sequence of a scoring or training forward;
- [`shared_generation`] and [`prefix_cache`]: each prompt prefilled once, and its keys and values kept once while
  decoding;
- [`reward_packing`]: reward models scored from packed rows;
- [`families`]: which models each of these serves exactly, and why the others cannot.

Nothing here knows a trainer: [`rloo_efficient.trainers`] binds it to TRL's.
"""
