"""The private transformers internals rloo_efficient relies on, pinned in pyproject.toml (`transformers>=5.23,<5.26`):
if an upgrade changes one of them, this says which, before any equivalence test fails in a less legible way."""

import copy
import warnings

import pytest
import torch
import transformers
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rloo_efficient import RLOOTrainer
from rloo_efficient.core.tree.layout import NO_MASK
from rloo_efficient.demo.workload import build_dataset, build_tokenizer

from .conftest import run, tiny_workload, training_args


def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)  # fmt: skip  (never stops early)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def test_the_pin_matches_what_is_installed():
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    assert (major, minor) in ((5, 23), (5, 24), (5, 25)), "re-run the suite and move the pin in pyproject.toml"


def test_cache_layers_are_per_row_keys_and_values():
    """The shared prefill fans a DynamicCache out by batch index and the prompt cache subclasses its layer."""
    cache = DynamicCache(config=tiny().config)
    assert all(type(layer) is DynamicLayer for layer in cache.layers)
    layer = cache.layers[0]
    keys = torch.randn(2, 2, 3, 4)
    layer.update(keys, keys.clone())
    layer.batch_select_indices(torch.tensor([1, 1, 0]))
    assert layer.keys.shape == (3, 2, 3, 4) and torch.equal(layer.keys[2], keys[0]) and layer.get_seq_length() == 3


def test_a_4d_mask_is_passed_through_untouched():
    """The packed forward passes an empty 4-D placeholder so that no (L, L) mask is ever built."""
    model = tiny()
    embeds = torch.zeros(1, 7, 16)
    mask = create_causal_mask(model.config, embeds, NO_MASK, None, position_ids=torch.arange(7)[None])
    assert mask is NO_MASK


def test_attention_dispatch_reads_the_module_config_and_forwards_call_kwargs():
    """Attention modules look their function up by `self.config._attn_implementation` at call time, and the model
    call's keyword arguments reach it; a config copy changes that module only."""
    model = tiny()
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((module.layer_idx, module.num_key_value_groups, kwargs.get("probe"), kwargs.get("scaling")))
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("contract_spy", spy)
    attention = model.model.layers[0].self_attn
    proxy = copy.copy(attention.config)
    proxy._attn_implementation_internal = "contract_spy"
    attention.config = proxy
    model(input_ids=torch.tensor([[1, 2, 3]]), probe="here")
    assert seen == [(0, 2, "here", attention.scaling)] and model.config._attn_implementation == "sdpa"


def test_sliding_windows_and_sinks_reach_the_attention_function_as_assumed():
    """A sliding layer hands the attention function `sliding_window` (a query at p sees keys in (p - w, p], as the
    masks say), GPT-OSS its sinks as `s_aux`; a sliding cache layer keeps the last w - 1 positions."""
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.cache_utils import DynamicSlidingWindowLayer
    from transformers.masking_utils import sliding_window_overlay

    config = GptOssConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=2, head_dim=4,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
                          sliding_window=3, layer_types=["sliding_attention", "full_attention"],
                          max_position_embeddings=131072)  # fmt: skip
    model = GptOssForCausalLM(config)
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((module.layer_idx, kwargs.get("sliding_window"), kwargs.get("s_aux") is module.sinks))
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("contract_window_spy", spy)
    for layer in model.model.layers:
        proxy = copy.copy(layer.self_attn.config)
        proxy._attn_implementation_internal = "contract_window_spy"
        layer.self_attn.config = proxy
    model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    assert seen == [(0, 3, True), (1, None, True)]
    window = sliding_window_overlay(3)
    visible = [[bool(window(0, 0, q, k)) for k in range(6)] for q in range(6)]
    assert visible[4] == [False, False, True, True, True, True]  # keys in (4 - 3, ...]: causality applies apart
    layer = DynamicCache(config=config).layers[0]
    assert isinstance(layer, DynamicSlidingWindowLayer) and layer.is_sliding and layer.sliding_window == 3
    keys = torch.randn(1, 2, 5, 4)
    returned, _ = layer.update(keys, keys)
    assert returned.shape[-2] == 5 and layer.keys.shape[-2] == 2 and torch.equal(layer.keys, keys[:, :, -2:])


def test_the_cache_is_passed_by_the_name_the_installed_release_reads():
    """transformers 5.24 renamed `past_key_values` to `cache`; 5.23 ignores a forward's `cache=` (the cache stays
    empty) and refuses it in `generate`. A forward fills the cache passed by [`CACHE_KWARG`], and `generate`
    continues from it, without a warning."""
    import inspect
    import warnings

    from transformers import GenerationConfig

    from rloo_efficient.core.transformers_compat import CACHE_KWARG, output_cache

    model = tiny()
    assert CACHE_KWARG in inspect.signature(LlamaForCausalLM.forward).parameters
    cache = DynamicCache(config=model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        output = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{CACHE_KWARG: cache})
        assert cache.get_seq_length() == 3 and output_cache(output) is cache
        config = GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=0)
        out = model.generate(input_ids=torch.tensor([[1, 2, 3, 4]]), generation_config=config, **{CACHE_KWARG: cache})
    assert out.shape == (1, 6) and cache.get_seq_length() == 5


def test_every_file_we_rely_on_is_one_we_read(tmp_path):
    """`python -m rloo_efficient.transformers_review` finds the installed release's files among those we read, and
    names a family whose modeling code changed since."""
    import json
    from pathlib import Path

    from rloo_efficient import transformers_review

    root = Path(transformers.__file__).parent
    reviewed = json.loads(transformers_review.REVIEWED.read_text())
    lines, changed = transformers_review.review(root, reviewed)
    assert changed == 0, [line for line in lines if "CHANGED" in line]
    assert any(line.startswith("family qwen3_5: as read in") for line in lines)
    newest = max(reviewed, key=lambda release: tuple(int(part) for part in release.split(".")[:3]))
    edited = {release: dict(files) for release, files in reviewed.items()}
    for files in edited.values():  # as if the installed release had edited Qwen3.5's modeling code
        files["models/qwen3_5/modeling_qwen3_5.py"] = "0" * 64
    lines, changed = transformers_review.review(root, edited)
    assert changed == 1
    assert f"family qwen3_5: CHANGED since {newest}: models/qwen3_5/modeling_qwen3_5.py" in lines


# Decoder LMs a newer transformers adds, which rloo_efficient has not read: stock TRL's path, one warning for each path
# that turns off, naming why
NEW_FAMILIES = [
    ("MiniCPM5MoeConfig", "MiniCPM5MoeForCausalLM",
     dict(moe_intermediate_size=16, num_experts_per_tok=2, n_routed_experts=4, head_dim=8)),
    ("ErgoConfig", "ErgoForCausalLM",
     dict(first_dense_intermediate_size=32, moe_intermediate_size=16, shared_intermediate_size=16, num_experts=4,
          num_experts_per_tok=2, sliding_window=16, global_attention_every_n_layers=2, head_dim=8)),
]  # fmt: skip


@pytest.mark.parametrize("config_name, model_name, sizes", NEW_FAMILIES, ids=[name for name, _, _ in NEW_FAMILIES])
def test_a_family_we_have_not_read_runs_stocks_path_and_says_why(model_cache, tmp_path, config_name, model_name,
                                                                    sizes):  # fmt: skip
    config_class = getattr(transformers, config_name, None)
    if config_class is None:
        pytest.skip(f"{config_name} is not in transformers {transformers.__version__}")
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    # tiny: the test checks the path taken, not numbers
    config = config_class(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **sizes)  # fmt: skip
    getattr(transformers, model_name)(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    dataset = build_dataset(tiny_workload(model_cache))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = run(RLOOTrainer, str(tmp_path / "model"), training_args(tmp_path / "out", max_steps=1), dataset)
    ours = [str(w.message) for w in caught if str(w.message).startswith("rloo_efficient")]
    # once per path it turns off (the packed forwards, the shared prefill), each naming the family
    assert len(ours) == len(set(ours)) == 2 and all(config.model_type in message for message in ours), ours
    assert trainer.packed_forward_tokens == 0 and trainer.shared_prefill_tokens == 0
