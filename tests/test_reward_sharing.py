"""The reward phase inside the group: the same rewards and trajectory as stock TRL with a reward model (each group's
shared prefix scored once), and Hydra (a reward adapter on the policy's own base) with the policy's adapter restored."""

import fnmatch
import json
import re
import string
import warnings
from pathlib import Path

import pytest
import torch
import trl
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from rloo_efficient import RLOOTrainer
from rloo_efficient.core.forward.reward import pack_reward_rows
from rloo_efficient.demo.workload import (
    SPECIAL_TOKENS,
    build_dataset,
    build_model_dir,
    build_tokenizer,
    chat_template,
    vowel_reward,
)
from rloo_efficient.trainers.hydra import HydraReward
from rloo_efficient.trainers.hydra_checks import (
    bitsandbytes_repacks_on_cpu,
    hydra_reason,
    known_init,
    loads_on_cpu,
    policy_hydra_reason,
    quantized_policy_reason,
    reward_adapter_config,
    rewrites_base,
)

from .conftest import METRICS, assert_metrics_close, per_micro_batch, run, step_metrics, tiny_workload, training_args
from .helpers import POLICY_LORA, build_reward_adapter, build_reward_model


F64_RTOL, F64_ATOL = 1e-6, 1e-7  # float64 models; TRL's fused head and the float32 reward buffer round to float32


def merging_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer that also merges every pair of lowercase letters: the last letter of a prompt and the
    first of its completion become one token, so a group's rows share fewer tokens than the prompt has."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    pairs = [(a, b) for a in string.ascii_lowercase for b in string.ascii_lowercase]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet, *(a + b for a, b in pairs)])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>", padding_side="left")  # fmt: skip
    tokenizer.chat_template = chat_template(None)
    return tokenizer


def compare(path, dataset, tmp_path, reward_funcs, run_kwargs=None, packed=True, policy=None,
            tolerance=(F64_RTOL, F64_ATOL), **overrides):  # fmt: skip
    """Stock and ours on the same run; `policy()`, when given, makes the model each of them gets (else `path`)."""
    run_kwargs = run_kwargs or {}
    policy = policy or (lambda: path)
    # A copy each: stock TRL replaces a path in the list by the model it loads
    stock = run(trl.RLOOTrainer, policy(), training_args(tmp_path / "stock", config_class=trl.RLOOConfig, **overrides),
                dataset, reward=list(reward_funcs), **run_kwargs)  # fmt: skip
    ours = run(RLOOTrainer, policy(), training_args(tmp_path / "ours", **overrides), dataset, reward=list(reward_funcs),
               **run_kwargs)  # fmt: skip
    assert list(ours._logs["completion"]) == list(stock._logs["completion"])
    keys = [*METRICS, *(f"rewards/{name}/mean" for name in stock.reward_func_names)]
    assert ours.reward_func_names == stock.reward_func_names
    for a, b in zip(stock.state.log_history, ours.state.log_history, strict=True):
        for key in keys:
            if key in a and a[key] is not None:
                assert b[key] == pytest.approx(a[key], rel=tolerance[0], abs=tolerance[1]), (key, a[key], b[key])
    assert (ours.reward_forward_tokens > 0) == packed  # the packed reward forward ran, or did not
    return stock, ours


# Every family with a sequence-classification head (Granite has none in transformers 5.23), each with a sliding window
# shorter than its texts (40-72 tokens) where it has one; the MoE families in float32 (torch._grouped_mm has no
# float64)
REWARD_FAMILIES = {
    "llama": {}, "qwen3": {}, "gemma3": dict(sliding_window=16), "mistral": dict(sliding_window=16), "phi3": {},
    "olmo2": {}, "smollm3": {}, "qwen3_moe": dict(model_dtype="float32"),
    "gpt_oss": dict(sliding_window=16, model_dtype="float32"),
    "olmo3": dict(sliding_window=16), "seed_oss": {}, "deepseek_v3": dict(model_dtype="float32"),
    "mixtral": dict(sliding_window=16, model_dtype="float32"), "qwen2_moe": dict(model_dtype="float32"),
    "exaone4": dict(sliding_window=16), "ministral3": {}, "phi4_mini": {},
    "gemma2": dict(sliding_window=16, model_dtype="float32"),  # stock's eager attention: NaN in float64 with padding
    # Hybrids (Gated DeltaNet forked after the common prefix); Qwen3.5's as its multimodal checkpoint's classifier
    "qwen3_next": dict(model_dtype="float32"), "qwen3_5": dict(model_dtype="float32"),
}  # fmt: skip


@pytest.fixture(scope="module")
def reward_models(model_cache, tmp_path_factory):
    directory = tmp_path_factory.mktemp("reward_models")
    return {arch: build_reward_model(directory / arch, tiny_workload(model_cache, arch=arch, **REWARD_FAMILIES[arch]))
            for arch in REWARD_FAMILIES}  # fmt: skip


@pytest.mark.parametrize("arch", list(REWARD_FAMILIES))
def test_a_separate_reward_model_matches_stock(workload, reward_models, tmp_path, exact_head, monkeypatch, arch):
    """float64 norms for both (`exact_head`): transformers' upcast a norm to float32, so a score of packed rows and of
    padded ones would round apart there (2e-6 relative in OLMo 3's grad_norm). `reward_forward_tokens` counts every
    packed reward forward of the run."""
    import rloo_efficient.trainers.rewards as reward_phase

    packed_tokens, pack = [], reward_phase.pack_reward_rows
    monkeypatch.setattr(reward_phase, "pack_reward_rows", lambda *args, **kwargs: packed_tokens.append(
        pack(*args, **kwargs)) or packed_tokens[-1])  # fmt: skip
    cfg, path, dataset = workload
    # float32 scores: packed and padded rows sum in different orders (~1e-7 relative), carried into the advantages and
    # grown over three optimizer steps (Gemma 2's third grad_norm: 2.2e-5 apart on the 2026-12-05 machine)
    tolerance = (1e-4, 1e-6) if REWARD_FAMILIES[arch].get("model_dtype") == "float32" else (F64_RTOL, F64_ATOL)
    stock, ours = compare(path, dataset, tmp_path, [reward_models[arch]], tolerance=tolerance)
    # Each group's prompt once: fewer tokens than stock's B padded rows
    rows = 8  # generation batch: 2 groups of 4
    assert ours.reward_forward_tokens < 0.6 * rows * (cfg.prompt_length + 8) * 2
    assert len(packed_tokens) > 1 and ours.reward_forward_tokens == sum(batch.num_tokens for batch in packed_tokens)


def test_a_rule_beside_a_model_with_eos_and_a_chat_template(model_cache, reward_models, tmp_path):
    cfg = tiny_workload(model_cache, conversational=True)
    # 48-token completions: some stop at EOS; prompts of different lengths (the workload's prompt_length_min)
    stock, ours = compare(build_model_dir(cfg), build_dataset(cfg), tmp_path, [vowel_reward, reward_models["llama"]],
                          max_completion_length=48, max_steps=2)  # fmt: skip
    lengths = [e["completions/min_length"] for e in stock.state.log_history if "completions/min_length" in e]
    assert min(lengths) < 48, "no completion stopped at EOS: the case is not exercised"


def test_tokens_merged_across_the_prompt_boundary(workload, tmp_path):
    """The reward tokenizer merges letters across the prompt/completion boundary: the shared prefix is found in the
    reward tokenization, shorter than the prompt there, and the rewards are still stock's."""
    cfg, path, dataset = workload
    tokenizer = merging_tokenizer()
    reward_cfg = tiny_workload(tmp_path, vocab_size=len(tokenizer))
    reward_path = build_reward_model(tmp_path / "merging", reward_cfg, tokenizer)
    stock, ours = compare(path, dataset, tmp_path, [reward_path])
    prompts = list(dict.fromkeys(ours._logs["prompt"]))
    prompt_tokens = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    assert any(shared < tokens for shared, tokens in zip(ours.reward_shared_prefix_lengths, prompt_tokens))


def test_pack_reward_rows_reads_each_score_where_stock_pools():
    rows = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8, 0], [3, 4], [3]]  # 0 is padding: the score is read before it
    batch = pack_reward_rows(rows, [0, 0, 0, 1, 1], 0, torch.device("cpu"), min_saved=0)
    assert batch.shared_prefix_lengths == [2, 1]
    tokens = batch.input_ids[0].tolist()
    assert [tokens[i] for i in batch.score_index.tolist()] == [8, 9, 8, 4, 3]
    positions = batch.position_ids[0].tolist()
    assert [positions[i] for i in batch.score_index.tolist()] == [3, 2, 3, 1, 0]  # each token's position in its row


def test_an_unsupported_reward_model_is_called_as_stock_calls_it(workload, tmp_path):
    cfg, path, dataset = workload
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    gpt2 = GPT2ForSequenceClassification(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2,
                                                    num_labels=1, pad_token_id=tokenizer.pad_token_id))  # fmt: skip
    gpt2.save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    reward = [str(tmp_path / "gpt2")]
    stock = run(trl.RLOOTrainer, path, training_args(tmp_path / "s", config_class=trl.RLOOConfig), dataset, reward=reward)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = run(RLOOTrainer, path, training_args(tmp_path / "o"), dataset, reward=reward)
    messages = [str(w.message) for w in caught if "reward model scores each row on its own" in str(w.message)]
    assert len(messages) == 1 and "GPT2" in messages[0]
    assert ours.reward_forward_tokens == 0
    assert_metrics_close(step_metrics(stock), step_metrics(ours), F64_RTOL, F64_ATOL, per_micro_batch(ours))


# -- Hydra: a reward adapter on the policy's own base ------------------------------------------------------------------
def policy_doors(path):
    """Every way TRL takes a LoRA policy, each as (policy factory, trainer kwargs): a path with `peft_config`, a
    model object with `peft_config`, and a PeftModel (then TRL trains its adapter against a frozen copy)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def peft_model():
        torch.manual_seed(3)  # the same LoRA initialization for stock and ours
        return get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype="auto"), LoraConfig(**POLICY_LORA))

    return {
        "path_and_peft_config": (lambda: path, {"peft_config": LoraConfig(**POLICY_LORA)}),
        "model_object_and_peft_config": (lambda: AutoModelForCausalLM.from_pretrained(path, dtype="auto"),
                                         {"peft_config": LoraConfig(**POLICY_LORA)}),
        "peft_model": (peft_model, {}),
    }  # fmt: skip


PROFILER_FILES = {"memory_report.json", "memory_steps.jsonl"}  # written by profile_memory=True, a feature of ours


def saved_files(directory) -> set[str]:
    return {str(p.relative_to(directory)) for p in Path(directory).rglob("*") if p.is_file()} - PROFILER_FILES


def pushed_files(trainer, monkeypatch) -> set[str]:
    """What `push_to_hub` uploads (the Hub stood in for: the repository named, the upload recorded)."""
    import transformers.trainer

    uploaded = []

    class Hub:
        def upload_folder(self, folder_path, ignore_patterns, **kwargs):
            skipped = lambda name: any(fnmatch.fnmatch(name, pattern) for pattern in ignore_patterns)  # noqa: E731
            uploaded.extend(name for name in saved_files(folder_path) if not skipped(name.split("/")[0]))

    monkeypatch.setattr(transformers.trainer, "hf_api", Hub)
    trainer.hub_model_id = "user/policy"
    trainer.push_to_hub(blocking=True)
    return set(uploaded)


@pytest.mark.parametrize("door", ["path_and_peft_config", "model_object_and_peft_config", "peft_model"])
def test_hydra_however_the_policy_is_passed_matches_stock_and_saves_what_stock_saves(workload, tmp_path, monkeypatch,
                                                                                     door):  # fmt: skip
    from safetensors.torch import load_file

    cfg, path, dataset = workload
    # Trained with dropout, as reward adapters often are: stock scores in eval mode, where it is the identity
    adapter = build_reward_adapter(tmp_path / "reward_adapter", path, dropout=0.1)
    policy, run_kwargs = policy_doors(path)[door]
    stock, ours = compare(path, dataset, tmp_path, [vowel_reward, adapter], run_kwargs=run_kwargs, policy=policy,
                          learning_rate=5e-2, save_strategy="steps", save_steps=2)  # fmt: skip
    assert ours._switches.prefix and ours._switches.prompt_cache_once  # the reward adapter's dropout turned nothing off
    hydra = ours.reward_funcs[1]
    assert isinstance(hydra, HydraReward) and isinstance(stock.reward_funcs[1], torch.nn.Module)
    # No second copy of the base: ours holds the policy (with its adapters and the reward's) and the score head only
    policy_model = ours.accelerator.unwrap_model(ours.model)
    assert set(policy_model.peft_config) == {*stock.accelerator.unwrap_model(stock.model).peft_config, hydra.adapter_name}
    base_parameters = sum(p.numel() for p in stock.reward_funcs[1].parameters())
    ours_parameters = sum(p.numel() for p in policy_model.parameters()) + hydra.score.weight.numel()
    stock_parameters = sum(p.numel() for p in stock.accelerator.unwrap_model(stock.model).parameters())
    assert stock_parameters + base_parameters - ours_parameters > 0.9 * base_parameters

    # The saved policy is stock's: a checkpoint, save_model and push_to_hub write the same files, the same adapter
    # config and the same trained weights; the reward adapter is in none of them
    for trainer in (stock, ours):
        trainer.save_model(str(Path(trainer.args.output_dir) / "final"))
    pushed = [pushed_files(trainer, monkeypatch) for trainer in (stock, ours)]
    assert pushed[0] == pushed[1] and "adapter_model.safetensors" in pushed[0]
    for saved in ("checkpoint-2", "final"):
        stock_dir, ours_dir = (Path(t.args.output_dir) / saved for t in (stock, ours))
        assert saved_files(ours_dir) == saved_files(stock_dir)
        for config in [p for p in saved_files(stock_dir) if p.endswith("adapter_config.json")]:
            assert json.loads((ours_dir / config).read_text()) == json.loads((stock_dir / config).read_text())
        for weights in [p for p in saved_files(stock_dir) if p.endswith("adapter_model.safetensors")]:
            a, b = load_file(stock_dir / weights), load_file(ours_dir / weights)
            assert a.keys() == b.keys()
            for key in a:
                torch.testing.assert_close(b[key], a[key], rtol=F64_RTOL, atol=F64_ATOL)
    assert policy_model.peft_config.keys() >= {hydra.adapter_name}  # still loaded after saving


@pytest.mark.parametrize("kind", ["without_score_head", "pissa", "policy_pissa", "policy_ia3"])
def test_a_reward_adapter_hydra_cannot_reproduce_is_loaded_as_stock_loads_it(workload, model_cache, tmp_path,
                                                                            exact_head, kind):  # fmt: skip
    """
    Stock loads an adapter without a score head with a freshly initialized one, drawn from the global generator at
    load time; PEFT loads a PiSSA adapter (OLoRA, CorDA, LoftQ alike) by rewriting its base layers' weights, which
    on the policy's base would rewrite the policy; a policy whose own adapter was created so (LoRA-GA too) holds a
    rewritten base, on which a reward adapter would score what stock's fresh base does not; PEFT adds no LoRA adapter
    to a policy whose adapter is of another type (IA3). Ours leaves all four to stock's loading, with one warning, and
    gets stock's rewards and training.
    """
    from peft import IA3Config, LoraConfig
    from safetensors.torch import load_file, save_file

    cfg, path, dataset = workload
    tolerance = (F64_RTOL, F64_ATOL)
    policy_lora = LoraConfig(**POLICY_LORA, init_lora_weights="pissa" if kind == "policy_pissa" else True)
    if kind == "policy_ia3":
        policy_lora = IA3Config(target_modules=["q_proj", "v_proj"], feedforward_modules=[])
    if kind in ("pissa", "policy_pissa"):
        # PEFT initializes PiSSA in float32 or half only; packed and padded rows round apart there
        cfg = tiny_workload(model_cache, model_dtype="float32")
        path, dataset, tolerance = build_model_dir(cfg), build_dataset(cfg), (1e-5, 1e-6)
    adapter = Path(build_reward_adapter(tmp_path / "reward_adapter", path))
    if kind == "without_score_head":
        weights = load_file(adapter / "adapter_model.safetensors")
        save_file({k: v for k, v in weights.items() if ".score." not in k}, adapter / "adapter_model.safetensors")
        reason = "holds no score head weights"
    elif kind == "policy_pissa":
        reason = r"the policy's adapter was created with init_lora_weights=pissa, which rewrote its base's weights"
    elif kind == "policy_ia3":
        reason = "the policy's adapter is IA3, not LoRA"
    else:
        config = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**config, "init_lora_weights": "pissa"}))
        reason = r"init_lora_weights \(pissa\) rewrites the base model's weights"
    with pytest.warns(UserWarning, match=reason):
        stock, ours = compare(path, dataset, tmp_path, [vowel_reward, str(adapter)], max_steps=2, tolerance=tolerance,
                              run_kwargs={"peft_config": policy_lora})  # fmt: skip
    # Loaded as stock loads it (its own model), not as a Hydra head on the policy, and still scored packed
    assert not isinstance(ours.reward_funcs[1], HydraReward) and isinstance(ours.reward_funcs[1], torch.nn.Module)
    assert ours.reward_forward_tokens > 0


def _peft_lora_inits() -> list:
    """Every `init_lora_weights` value the installed PEFT's `LoraConfig` names (its `pissa_niter_[number of iters]`
    placeholder as one such name)."""
    import typing

    from peft import LoraConfig

    values = [value for arg in typing.get_args(typing.get_type_hints(LoraConfig)["init_lora_weights"])
              for value in (typing.get_args(arg) or ([True, False] if arg is bool else []))]  # fmt: skip
    return [re.sub(r"\[.*\]", "2", value) if isinstance(value, str) else value for value in values]


def test_every_lora_init_peft_offers_is_classified():
    """A PEFT release that adds a LoRA init (0.22's Astra rewrites the base, its NoRA does not) fails here until
    `hydra.py` says which kind it is; until then a policy created with it is left to stock's reward loading."""
    import peft

    values = _peft_lora_inits()
    assert {True, "pissa", "olora"} <= set(values)  # the annotation was read
    unknown = [value for value in values if not known_init(value)]
    assert not unknown, f"peft {peft.__version__}: LoRA inits not classified in trainers/hydra_checks.py: {unknown}"
    policy = type("Config", (), {"peft_type": "LORA", "init_lora_weights": "a_future_init"})()
    assert "not checked against stock TRL" in policy_hydra_reason([policy])


@pytest.mark.parametrize("init", [True, False, "gaussian", "orthogonal", "mica", "eva", "nora", "pissa", "pissa_niter_2",
                                  "olora", "corda", "astra"])  # fmt: skip
def test_rewrites_base_names_the_inits_that_rewrite_the_base(init):
    """Each LoRA init the installed PEFT runs without a dataset (CorDA and Astra given the eigenvectors their
    preprocessing leaves on each layer), created on a tiny model: the base weights change exactly when
    `rewrites_base` says so. (LoftQ needs SciPy, and LoRA-GA gradients: they are named from PEFT's source.)"""
    import copy
    import types

    from peft import LoraConfig, get_peft_model

    if init not in _peft_lora_inits():
        pytest.skip(f"this PEFT has no init_lora_weights={init}")
    torch.manual_seed(0)
    # hidden 32 and 2 key/value heads of 8: rank 4 fits under every projection's width
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    before = copy.deepcopy(base.state_dict())
    rank = 4
    for module in base.modules():
        if isinstance(module, torch.nn.Linear):  # what preprocess_corda and preprocess_astra leave: orthonormal bases
            out_basis = torch.linalg.qr(torch.randn(module.out_features, rank))[0]
            in_basis = torch.linalg.qr(torch.randn(module.in_features, rank))[0]
            module.eigens = types.SimpleNamespace(V=out_basis, U_WC=out_basis, S_WC=torch.rand(rank) + 1, V_WC=in_basis)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # EVA without its config, Astra's and CorDA's notes
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                init_lora_weights=init))  # fmt: skip
    after = {key.replace(".base_layer", ""): value for key, value in model.get_base_model().state_dict().items()}
    changed = [key for key in before if not torch.equal(before[key], after[key])]
    assert bool(changed) == rewrites_base(init), changed


def test_hydra_needs_the_reward_model_quantized_as_the_policy(model_cache, tmp_path):
    """Stock loads the reward model with `model_init_kwargs`: Hydra runs where that quantizes as the policy's base is
    quantized (the same config, as an object, a user's partial dict, or a loaded model's config), not merely where
    both are; and not on a 4-bit base whose layers bitsandbytes repacks on this CPU once an inference pass runs them."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    # float32 (bitsandbytes quantizes nothing wider); hidden 64: bitsandbytes' CPU packing reads 64-wide blocks
    path = build_model_dir(tiny_workload(model_cache, model_dtype="float32", hidden_size=64, intermediate_size=128))
    directory = build_reward_adapter(tmp_path / "reward_adapter", path)
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    fp4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=nf4)

    def reason(policy, reward):
        init_kwargs = {"quantization_config": reward} if reward is not None else {}
        return hydra_reason(reward_adapter_config(directory), path, torch.float32, policy, init_kwargs, directory)

    partial = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.float32}
    assert reason(None, None) is None and reason(loaded.config.quantization_config, nf4) is None
    assert reason(nf4, partial) is None and reason(nf4, nf4.to_dict()) is None
    for policy, reward in ((nf4, fp4), (nf4, None), (None, nf4)):
        assert "not quantized alike" in reason(policy, reward)
    # What bitsandbytes does to the loaded layers in an inference pass on this CPU, as the probe says it will
    with torch.no_grad():
        loaded.eval()(torch.tensor([[3, 4, 5]]))
    repacked = [getattr(module.weight.quant_state, "packing_format_for_cpu", False) for module in loaded.modules()
                if type(module).__name__ == "Linear4bit"]  # fmt: skip
    assert repacked and set(repacked) == {bitsandbytes_repacks_on_cpu()}
    assert (quantized_policy_reason(nf4, on_cpu=True) is not None) == bitsandbytes_repacks_on_cpu()
    assert quantized_policy_reason(nf4, on_cpu=False) is None and quantized_policy_reason(None, on_cpu=True) is None
    assert quantized_policy_reason(BitsAndBytesConfig(load_in_8bit=True), on_cpu=True) is None
    # Where `from_pretrained` puts a quantized model (no accelerator here: an unmapped one stays on the CPU)
    assert loads_on_cpu(None) and loads_on_cpu("cpu") and loads_on_cpu({"": "cpu"}) and loads_on_cpu("auto")
    assert not loads_on_cpu({"": 0}) and not loads_on_cpu("cuda:0") and not loads_on_cpu({"a": "cpu", "b": 0})


def test_hydra_restores_the_policy_adapter_and_trains_nothing_of_the_reward(workload, tmp_path, monkeypatch):
    from peft import LoraConfig

    import rloo_efficient.trainers.rewards as reward_phase

    cfg, path, dataset = workload
    adapter = build_reward_adapter(tmp_path / "reward_adapter", path)
    trainer = run(RLOOTrainer, path, training_args(tmp_path / "o", max_steps=2), dataset, reward=[adapter],
                  peft_config=LoraConfig(**POLICY_LORA))  # fmt: skip
    hydra = trainer.reward_funcs[0]
    policy = hydra.policy
    reward_parameters = [p for n, p in policy.named_parameters() if f".{hydra.adapter_name}." in n]
    assert reward_parameters and all(not p.requires_grad and p.grad is None for p in reward_parameters)
    assert not hydra.score.weight.requires_grad and hydra.score.weight.grad is None
    trained = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trained and all(".default." in n for n in trained) and policy.active_adapter == "default"
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in reward_parameters}

    # Packed or padded (share_reward_prefix=False), the adapter's scores are the same
    args = (hydra, trainer.reward_processing_classes[0], ["ab", "ab", "c"], ["abcd", "abde", "cfg"])
    packed = trainer._rewards.grouped_scores(*args)
    trainer._rewards.share = False
    torch.testing.assert_close(trainer._rewards.grouped_scores(*args), packed, rtol=1e-10, atol=1e-12)
    trainer._rewards.share = True

    # A reward call, also one that raises, leaves the policy's adapter active and every flag as it was, even one the
    # user set (PEFT's set_adapter alone would make all of the policy's adapter trainable again)
    next(p for n, p in policy.named_parameters() if ".default." in n).requires_grad_(False)
    flags = {n: p.requires_grad for n, p in policy.named_parameters()}
    trainer._rewards.grouped_scores(hydra, trainer.reward_processing_classes[0], ["ab", "ab"], ["abc", "abd"])
    assert policy.active_adapter == "default"
    assert {n: p.requires_grad for n, p in policy.named_parameters()} == flags
    # Scored in eval mode, as stock's reward model is (its dropout off), train mode back afterwards
    policy.train()
    modes, scores = [], reward_phase.packed_scores
    monkeypatch.setattr(reward_phase, "packed_scores", lambda root, inner, *args: modes.append(any(
        module.training for module in inner.modules())) or scores(root, inner, *args))  # fmt: skip
    trainer._rewards.grouped_scores(hydra, trainer.reward_processing_classes[0], ["ab", "ab"], ["abc", "abd"])
    assert modes == [False] and all(module.training for module in policy.modules())
    monkeypatch.setattr(reward_phase, "packed_scores", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        trainer._rewards.grouped_scores(hydra, trainer.reward_processing_classes[0], ["ab", "ab"], ["abc", "abd"])
    assert policy.active_adapter == "default"
    assert {n: p.requires_grad for n, p in policy.named_parameters()} == flags


# Why a reward adapter is loaded as stock loads it: the warning (None: switched off, nothing to say)
OWN_MODEL = {"another_base": "is loaded as its own model.*is not the policy's",
             "another_dtype": "stock TRL would load the reward model in torch.float64",
             "switched_off": None}  # fmt: skip


@pytest.mark.parametrize("case", list(OWN_MODEL))
def test_a_reward_adapter_is_loaded_as_its_own_model(workload, model_cache, tmp_path, case):
    """On another base (same shape, other weights); where stock would load the reward model in another dtype than the
    policy's (TRL loads a policy path in float32 by default, a reward model as saved: float64 here); or with
    `hydra_reward_adapter=False`."""
    from peft import LoraConfig

    cfg, path, dataset = workload
    base = build_model_dir(tiny_workload(model_cache, workload_seed=5)) if case == "another_base" else path
    adapter = build_reward_adapter(tmp_path / "reward_adapter", base)
    settings = {"another_dtype": dict(model_init_kwargs=None), "switched_off": dict(hydra_reward_adapter=False)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = RLOOTrainer(model=path, reward_funcs=[adapter], args=training_args(tmp_path / "o",
                              **settings.get(case, {})), train_dataset=dataset, processing_class=build_tokenizer(),
                              peft_config=LoraConfig(**POLICY_LORA))  # fmt: skip
    said = [str(w.message) for w in caught if "reward" in str(w.message) and "rloo_efficient" in str(w.message)]
    if OWN_MODEL[case] is None:
        assert not said
    else:
        assert len(said) == 1 and re.search(OWN_MODEL[case], said[0]), said
    assert not isinstance(trainer.reward_funcs[0], HydraReward) and isinstance(trainer.reward_funcs[0], torch.nn.Module)


def test_hydra_with_a_given_reward_tokenizer_without_a_pad_token(workload, tmp_path):
    """Stock TRL pads a reward model's tokenizer with its EOS, given or loaded: the Hydra reward does the same."""
    from peft import LoraConfig

    cfg, path, dataset = workload
    adapter = build_reward_adapter(tmp_path / "reward_adapter", path)
    tokenizer = build_tokenizer()
    tokenizer.pad_token = None
    trainer = run(RLOOTrainer, path, training_args(tmp_path / "o", max_steps=1), dataset, reward=[adapter],
                  reward_processing_classes=[tokenizer], peft_config=LoraConfig(**POLICY_LORA))  # fmt: skip
    assert tokenizer.pad_token == tokenizer.eos_token
    assert trainer.reward_forward_tokens > 0
