"""Image prompts once per group: each family's checkpoint as TRL loads it (`*ForConditionalGeneration`), its processor,
a dataset with an `image` column (TRL's vision path), against stock TRL run the same way. The vision tower encodes
each group's image once per log-prob pass, where stock encodes it once per row."""

import collections
import functools
import warnings

import numpy
import pytest
import torch
import trl
from datasets import Dataset

from rloo_efficient import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from rloo_efficient.demo.workload import build_dataset, build_model_dir, build_processing_class

from .conftest import tiny_workload
from .helpers import assert_same_run, grpo_args


# Each family with images of 8x8 and 16x8 pixels (Gemma 3: resized to 16x16), a sliding window shorter than the prompt
# where the family has one (Gemma's image blocks under the window). Qwen3.5: float32, its gated delta rule's reference
VISION = {
    "qwen2_vl": {},
    "qwen2_5_vl": {},
    "qwen3_5": dict(model_dtype="float32"),
    "qwen3_5_moe": dict(model_dtype="float32"),  # and experts (no float64), the load-balancing loss on: TRL's default
    "qwen3_vl": {},  # DeepStack: the tower's features after each of its layers added at the image tokens
    "qwen3_vl_moe": dict(model_dtype="float32"),
    "glm4v": {},  # GLM's own 3-D position index, a tower with learned positions interpolated per image
    "glm4v_moe": dict(model_dtype="float32"),
    "internvl": {},  # each image's tiles (a 16x8 image: 2 and a thumbnail), counted per row
    "gemma3_vlm": dict(sliding_window=16),
    "gemma4": dict(sliding_window=16, num_hidden_layers=6),  # a full layer's image tokens reach a later layer's keys
    "llava": {},
    "llava_next": {},
    "idefics3": {},
    "smolvlm": {},
    "mistral3": {},  # Pixtral: each image at its own size (the batch's pixels padded to the largest); Ministral 3
    "lfm2_vl": {},  # SigLIP2 NaFlex: each image's pixel mask and spatial shape; LFM2's short convolutions
}
# Trainer settings a family needs with stock TRL 1.16: Pixtral's processor returns tensors unless told otherwise, and
# TRL tokenizes its prompts unpadded (prompts of different lengths fail to stack)
SETTINGS = {"mistral3": dict(chat_template_kwargs={"return_tensors": None})}
TOLERANCES = {"float64": (1e-9, 1e-12), "float32": (1e-4, 1e-5)}
# Gemma 4's vision pooler computes in float32 whatever the model's dtype: the gradient of a group's image reaches it
# once, summed over the group's rows, where stock's k copies each pass through it (float32 rounding, ~1e-9 after a step)
POOLED_IN_FLOAT32 = {"gemma4": (1e-7, 1e-10)}


def token_reward(completion_ids, **kwargs):  # varies within every group
    return [float(sum(ids) % 17) for ids in completion_ids]


def _image_digests(pixel_values, args, kwargs) -> list[str]:
    """One digest per image the vision tower is given (Qwen: its patch rows, split by the grid)."""
    import hashlib

    if pixel_values.dim() == 2:  # Qwen's patch rows; the grid follows them
        grid = kwargs["image_grid_thw"] if "image_grid_thw" in kwargs else args[0]
        pieces = pixel_values.split(grid.prod(-1).tolist())
    else:
        pieces = pixel_values.unbind(0)
    return [hashlib.sha1(piece.detach().cpu().contiguous().numpy().tobytes()).hexdigest() for piece in pieces]


def _train(trainer_class, path, args, dataset, processor, encoded: list, reward=token_reward, before_train=None):
    """Train, recording the images the vision tower encodes in each call, in generation and in the log-prob passes."""

    class Recording(trainer_class):
        phase = None

        def _generate_single_turn(self, *args, **kwargs):
            self.phase = "generation"
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                self.phase = None

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            self.phase = "logps"
            try:
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            finally:
                self.phase = None

    trainer = Recording(model=path, reward_funcs=reward, args=args, train_dataset=dataset,
                        processing_class=processor)  # fmt: skip
    inner = trainer.model.model
    encode = inner.get_image_features

    @functools.wraps(encode)  # generate reads its signature
    def recorded(pixel_values, *args, **kwargs):
        encoded.append((trainer.phase, _image_digests(pixel_values, args, kwargs)))
        return encode(pixel_values, *args, **kwargs)

    inner.get_image_features = recorded
    if before_train is not None:
        before_train(trainer)
    trainer.train()
    return trainer


# TRL's `images` column, each prompt's list: its own image and another prompt's (of the other width). (Rows with
# and without images in one batch: stock TRL 1.16's scoring hands the processor a None image and fails)
IMAGE_COLUMNS = {
    "two": lambda images: [[images[i], images[(i + 3) % len(images)]] for i in range(len(images))],
}


def _compare_calls(stock_images: list, our_images: list, stock_chunks: bool, one_image_each: bool) -> None:
    """Each of ours' vision-tower calls against stock's same call: the same images (`stock_chunks`: a subset, a group
    with nothing scored left out), each once (`one_image_each`: a prompt's images differ), or no more often than in
    stock's call."""
    for (_, stock_call), (_, our_call) in zip(stock_images, our_images, strict=True):
        if stock_chunks:  # a group with nothing scored is left out (its images too); a chunk with nothing runs stock's
            assert set(our_call) <= set(stock_call)
            if our_call == stock_call:
                continue
        else:
            assert set(our_call) == set(stock_call)
        if one_image_each:
            assert len(our_call) == len(set(our_call))
        else:  # no image more often than in stock's call
            assert all(our_call.count(image) <= stock_call.count(image) for image in our_call)


def _compare(model_cache, tmp_path, arch, trainer="grpo", reward=None, before_stock_train=None, images=None,
             edit_config=None, stock_chunks=False, ours_only=None, once_per_pass=False, one_text=False,
             **overrides):  # fmt: skip
    """GRPO (or RLOO) with image prompts, stock against ours; `images`: an [`IMAGE_COLUMNS`] layout instead of one image
    per prompt; `one_text`: every prompt the first's text (each with its own image); `edit_config(config dict)`: the
    checkpoint's config changed on a copy; `stock_chunks`: some chunks may run stock's forward (then their images are
    stock's); `ours_only`: settings of ours alone; `once_per_pass`: every pass holds each group's prompt across its
    chunks (its images encoded once)."""
    workload = {key: overrides.pop(key) for key in ("system_prompt_length",) if key in overrides}
    cfg = tiny_workload(model_cache, arch=arch, image_size=8, num_prompts=8, **VISION[arch], **workload)
    path, dataset = build_model_dir(cfg), build_dataset(cfg)
    if images is not None:
        dataset = Dataset.from_dict({"prompt": list(dataset["prompt"]),
                                     "images": IMAGE_COLUMNS[images](list(dataset["image"]))})  # fmt: skip
    if one_text:
        dataset = Dataset.from_dict({"prompt": [dataset["prompt"][0]] * len(dataset), "image": list(dataset["image"])})
    if edit_config is not None:
        import json
        import shutil

        path = shutil.copytree(path, tmp_path / "model")
        config = json.loads((path / "config.json").read_text())
        edit_config(config)
        (path / "config.json").write_text(json.dumps(config))
        path = str(path)
    stock_class, stock_config, ours_class, ours_config, make_args = {
        "grpo": (trl.GRPOTrainer, trl.GRPOConfig, GRPOTrainer, GRPOConfig, grpo_args),
        "rloo": (trl.RLOOTrainer, trl.RLOOConfig, RLOOTrainer, RLOOConfig, grpo_args),
    }[trainer]
    settings = dict(beta=0.1, **{"max_steps": 2, **SETTINGS.get(arch, {}), **overrides})
    stock_images, our_images = [], []
    rewards = lambda: list(reward or [token_reward])  # noqa: E731 (a copy each: stock TRL loads paths in place)
    stock = _train(stock_class, path, make_args(tmp_path / "s", config_class=stock_config, **settings), dataset,
                   build_processing_class(cfg), stock_images, rewards(), before_stock_train)  # fmt: skip
    ours_args = make_args(tmp_path / "o", config_class=ours_config, **settings, **(ours_only or {}))
    ours = _train(ours_class, path, ours_args, dataset, build_processing_class(cfg), our_images, rewards())
    # The packed forward and the shared prefill ran, with the images
    fanned_out = (ours_only or {}).get("share_prompt_kv_cache") is False
    assert ours._is_vlm and ours.packed_forward_tokens > 0 and ours.shared_prefill_tokens > 0
    assert ours._switches.prompt_cache_once != fanned_out
    # Each call's images once per group, in generation and in every log-prob pass: stock's encode every row's (k = 4
    # per group), in the same calls (the same chunks of the same batches). With one image per prompt (each prompt's
    # its own), a call's distinct images once each; with several, two prompts may share one, encoded once for each
    assert {"generation", "logps"} <= {phase for phase, _ in our_images}
    held = ours.held_forward_tokens > 0
    if held:  # a group's images encoded by the call or chunk that forwards its prompt, for every later one to read
        for phase in ("generation", "logps"):
            everything = lambda calls: {image for name, call in calls if name == phase for image in call}  # noqa: E731
            assert everything(our_images) == everything(stock_images)
        assert all(len(call) == len(set(call)) for _, call in our_images)
        generation = lambda calls: [call for name, call in calls if name == "generation"]  # noqa: E731 (unchanged)
        for stock_call, our_call in zip(generation(stock_images), generation(our_images), strict=True):
            assert set(our_call) == set(stock_call)
    else:  # the same generation calls; a scoring pass's chunks may be merged (as many rows as one of stock's holds)
        phases = lambda calls: [phase for phase, _ in calls if phase != "logps"]  # noqa: E731
        assert phases(stock_images) == phases(our_images)
        merged = len(stock_images) != len(our_images)
        if merged:  # each image in no more of ours' calls than of stock's, and every one encoded
            every = lambda calls: collections.Counter(image for name, call in calls if name == "logps"  # noqa: E731
                                                      for image in set(call))  # fmt: skip
            assert set(every(our_images)) == set(every(stock_images))
            assert all(count <= every(stock_images)[image] for image, count in every(our_images).items())
            stock_images = [(name, call) for name, call in stock_images if name != "logps"]
            our_images = [(name, call) for name, call in our_images if name != "logps"]
    if once_per_pass:  # each pass (a scoring pass; training, per optimizer step) encodes a group's images once
        encodes = lambda calls: sum(len(call) for name, call in calls if name == "logps")  # noqa: E731
        assert encodes(stock_images) == ours.num_generations * encodes(our_images)  # stock: once per row
    if not held:  # call by call (held, a call's images are those of the groups whose prompts it forwards: above)
        _compare_calls(stock_images, our_images, stock_chunks, images is None)
    assert sum(len(call) for _, call in stock_images) > sum(len(call) for _, call in our_images)
    assert_same_run(stock, ours, *POOLED_IN_FLOAT32.get(arch, TOLERANCES[cfg.model_dtype]))
    return stock, ours


@pytest.mark.parametrize("arch", list(VISION))
def test_image_prompts_once_per_group_match_stock(model_cache, tmp_path, exact_head, arch):
    stock, _ = _compare(model_cache, tmp_path, arch)
    if arch == "qwen3_5_moe":  # TRL's default turned the load-balancing loss on; it was compared
        assert any("aux_loss" in entry for entry in stock.state.log_history)


# One question asked of every image: the prompts' tokens agree, their images do not (each image as many placeholder
# tokens as the others in these families, so that nothing but the pixels tells the groups apart)
@pytest.mark.parametrize("arch", ["llava", "gemma3_vlm"])
def test_prompts_of_one_text_and_other_images(model_cache, tmp_path, exact_head, arch):
    _compare(model_cache, tmp_path, arch, one_text=True)


# Mistral 3 and LFM2-VL: a row's image sizes, pixel masks and spatial shapes are its images', not the row's
@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl", "gemma3_vlm", "llava_next", "idefics3", "mistral3",
                                  "lfm2_vl"])  # fmt: skip
def test_prompts_with_two_images(model_cache, tmp_path, exact_head, arch):
    _compare(model_cache, tmp_path, arch, images="two")


@pytest.mark.parametrize("arch", ["qwen2_vl", "gemma3_vlm"])
def test_micro_batches_that_split_a_group(model_cache, tmp_path, exact_head, arch):
    """Micro-batches of 2 rows, half a group each: each holds its group's images once."""
    _compare(model_cache, tmp_path, arch, per_device_train_batch_size=2)


# One row per micro-batch, gradient accumulation filling the generation batch: each group's prompt and images forwarded
# once per scoring pass and once per optimizer step, by the first chunk holding one of its rows ([`core.tree.holds`]).
# Qwen's 3-D positions (Qwen3-VL's DeepStack), Gemma's image blocks under a window, Idefics3's images per row, hybrids
# (Qwen3.5: its recurrent states held; LFM2-VL: its convolution states, and each image's pixel mask and spatial shape),
# experts with TRL's load-balancing loss (Qwen3-VL-MoE), and RLOO in TRL's row order (`shuffle_groups=False`:
# regrouped, its logged loss, a float32 sum over micro-batches, moves by ~1e-7). (Mistral 3's Ministral 3 holds none
# here: its queries' scale changes every 16 positions, the tiny model's original length)
HELD = [("qwen2_vl", "grpo"), ("qwen3_vl", "grpo"), ("qwen3_5", "grpo"), ("gemma3_vlm", "grpo"), ("idefics3", "grpo"),
        ("llava", "grpo"), ("qwen3_vl_moe", "grpo"), ("qwen2_vl", "rloo"), ("lfm2_vl", "grpo")]  # fmt: skip


def recording_image_forwards(monkeypatch) -> list[tuple[str, int, int]]:
    """Each packed forward with images of ours: `(kind, groups, groups whose images it encodes)`, kind "source" for a
    held prompts' forward."""
    from rloo_efficient.core.forward.packing import SourceBatch
    from rloo_efficient.core.layers.vision import ImageBatch

    forwards = []
    with_images = ImageBatch.packed

    def recorded(self, packed, *args):
        kind = "source" if isinstance(packed, SourceBatch) else "chunk"
        forwards.append((kind, len(packed.first_rows), len(packed.image_rows)))
        return with_images(self, packed, *args)

    monkeypatch.setattr(ImageBatch, "packed", recorded)
    return forwards


@pytest.mark.parametrize("arch, trainer", HELD)
def test_image_prompts_held_across_micro_batches(model_cache, tmp_path, exact_head, arch, trainer):
    stock, ours = _compare(model_cache, tmp_path, arch, trainer=trainer, per_device_train_batch_size=1,
                           gradient_accumulation_steps=8, steps_per_generation=8, once_per_pass=True,
                           ours_only=dict(shuffle_groups=False) if trainer == "rloo" else None)  # fmt: skip
    assert ours.held_forward_tokens > 0
    if arch == "qwen3_vl_moe":  # TRL's default turned the load-balancing loss on; it was compared
        assert any("aux_loss" in entry for entry in stock.state.log_history)


def test_image_prompts_held_beside_prompts_forwarded_in_place(model_cache, tmp_path, exact_head, monkeypatch):
    """Five rows per micro-batch, groups of two ([AABBC][CDDEE]): a micro-batch reads one group's held prompt and
    forwards two others' whole, their images with them (and Qwen's positions of every group), the two apart although
    their prompts open with one system prompt."""
    forwards = recording_image_forwards(monkeypatch)
    _compare(model_cache, tmp_path, "qwen2_vl", num_generations=2, per_device_train_batch_size=5,
             gradient_accumulation_steps=2, steps_per_generation=2, once_per_pass=True,
             system_prompt_length=320)  # fmt: skip
    assert any(kind == "chunk" and 2 <= encoded < groups for kind, groups, encoded in forwards)


@pytest.mark.parametrize("arch", ["qwen2_vl", "gemma3_vlm"])
def test_image_prompts_held_under_trls_row_shuffle(model_cache, tmp_path, exact_head, monkeypatch, arch):
    """Two rows per micro-batch in TRL's shuffled order (`shuffle_groups=False`): a micro-batch forwards the prompts
    and images of both its rows' groups at once, each group's in its place, for the later micro-batches. The groups'
    prompts open with one system prompt, held apart per group (the images after it differ)."""
    forwards = recording_image_forwards(monkeypatch)
    _, ours = _compare(model_cache, tmp_path, arch, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                       steps_per_generation=4, ours_only=dict(shuffle_groups=False), system_prompt_length=320,
                       once_per_pass=True)  # fmt: skip
    assert ours.held_forward_tokens > 0
    assert any(kind == "source" and groups >= 2 for kind, groups, _ in forwards)


@pytest.mark.parametrize("arch, length", [("qwen2_vl", 24), ("gemma3_vlm", 48)])
def test_masked_truncated_completions(model_cache, tmp_path, exact_head, arch, length):
    """Truncated completions masked out: a group or a whole micro-batch with nothing scored leaves its images out (or
    runs stock's forward for that chunk alone, with that chunk's images)."""
    stock, _ = _compare(model_cache, tmp_path, arch, stock_chunks=True, mask_truncated_completions=True,
                        max_completion_length=length)  # fmt: skip
    lengths = [entry["completions/min_length"] for entry in stock.state.log_history if "completions/min_length" in entry]
    assert min(lengths) < length, "no completion stopped at EOS: nothing is scored"


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_5"])
def test_completions_of_different_lengths(model_cache, tmp_path, exact_head, arch):
    """Completions stopping at EOS at different lengths in one group: Qwen's positions of every row come from the
    group's first row, whose own completion may be shorter."""
    stock, _ = _compare(model_cache, tmp_path, arch, max_completion_length=48)
    lengths = [entry["completions/min_length"] for entry in stock.state.log_history if "completions/min_length" in entry]
    assert min(lengths) < 48, "no completion stopped at EOS"


@pytest.mark.parametrize("arch", ["qwen3_vl", "smolvlm", "gemma3_vlm"])
def test_static_decoding_with_image_prompts(model_cache, tmp_path, exact_head, monkeypatch, arch):
    """GRPO with image prompts and `static_decoding=True` (Qwen3-VL's multimodal rope and DeepStack; SmolVLM's features
    at the prefill alone; Gemma 3's image token types at the first step alone, its sliding window over the prompt
    fanned out), completions ending at different lengths: stock's run, every generation decoded from static buffers."""
    from rloo_efficient.core.generation import static_decode

    decoded = []
    decode = static_decode._decode
    monkeypatch.setattr(static_decode, "_decode", lambda *args: decoded.append(1) or decode(*args))
    ours = dict(static_decoding=True, **({"share_prompt_kv_cache": False} if arch == "gemma3_vlm" else {}))
    stock, _ = _compare(model_cache, tmp_path, arch, ours_only=ours, max_completion_length=48, max_steps=4)
    assert len(decoded) == 2  # four steps, a generation every two
    lengths = [entry["completions/min_length"] for entry in stock.state.log_history if "completions/min_length" in entry]
    assert min(lengths) < 48, "no completion stopped at EOS"


def test_gemma4_without_vision_attention_keeps_image_tokens_causal(model_cache, tmp_path, exact_head):
    """Gemma 4 with `use_bidirectional_attention=None` (its smaller checkpoints): stock's mask is causal, images
    included; so is ours."""
    _compare(model_cache, tmp_path, "gemma4",
             edit_config=lambda config: config["text_config"].update(use_bidirectional_attention=None))


@pytest.mark.parametrize("arch", ["qwen2_vl", "gemma3_vlm"])
def test_rloo_with_image_prompts(model_cache, tmp_path, exact_head, arch):
    _compare(model_cache, tmp_path, arch, trainer="rloo")


def test_a_prompt_ending_with_an_image_runs_stock_saying_so_once_per_path(model_cache, tmp_path):
    """A chat template that ends the prompt with its image (no generation prompt after it): the shared prefill would
    stop inside the image's tokens, and each row's copy of the prompt's last token would need the image's features.
    Stock's generation and forwards for such batches, a warning for each."""
    cfg = tiny_workload(model_cache, arch="llava", image_size=8, num_prompts=8)
    path, dataset = build_model_dir(cfg), build_dataset(cfg)
    template = ("{% for message in messages %}<|{{ message['role'] }}|>{% for part in message['content'] %}"
                "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
                "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>{% endif %}{% endfor %}"
                "{% endfor %}")  # fmt: skip

    def processor():
        built = build_processing_class(cfg)
        built.chat_template = template
        return built

    settings = dict(beta=0.1, max_steps=2)
    stock = _train(trl.GRPOTrainer, path, grpo_args(tmp_path / "s", config_class=trl.GRPOConfig, **settings), dataset,
                   processor(), [])  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = _train(GRPOTrainer, path, grpo_args(tmp_path / "o", **settings), dataset, processor(), [])
    reason = "a prompt ends with an image's token"
    for phase in ("prompt-prefix sharing is off", "shared generation prefill is off"):  # each said once
        assert len([w for w in caught if phase in str(w.message) and reason in str(w.message)]) == 1, phase
    assert ours.packed_forward_tokens == 0 and ours.shared_prefill_tokens == 0
    assert_same_run(stock, ours)


@pytest.mark.parametrize("from_tool", [True, False])
def test_images_a_tool_returned_run_stock_with_one_warning(model_cache, tmp_path, monkeypatch, from_tool):
    """
    Images a GRPO tool returns sit in the rows' completions, each row's own: that batch runs stock's forwards, with
    one warning. Stock TRL 1.16 itself fails in the turn after such a tool on every family here (the processor's
    extra fields reach `generate`), so no run is compared: TRL's `_generate` is stood in for by the tuple it returns.
    """
    cfg = tiny_workload(model_cache, arch="qwen2_vl", image_size=8, num_prompts=8)
    path, dataset = build_model_dir(cfg), build_dataset(cfg)
    trainer = GRPOTrainer(model=path, reward_funcs=token_reward, args=grpo_args(tmp_path, max_steps=1),
                          train_dataset=dataset, processing_class=build_processing_class(cfg))  # fmt: skip
    prompts = [[{"role": "user", "content": [{"type": "text", "text": "Describe."}]}]] * 4  # one group of 4
    tool_images = [[dataset[0]["image"]] if from_tool and row == 1 else [] for row in range(4)]
    # prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images
    result = ([[5, 6, 7]] * 4, [[8, 9]] * 4, None, None, None, {}, None, tool_images)
    monkeypatch.setattr(trl.GRPOTrainer, "_generate", lambda self, prompts: result)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert trainer._generate(prompts) is result
    reasons = [str(w.message) for w in caught if "a tool returned images" in str(w.message)]
    assert len(reasons) == int(from_tool)
    assert (trainer._active_rows is None) == from_tool


def test_crops_are_one_reason_whatever_the_batch(model_cache):
    """Gemma 3's pan-and-scan crops (the processor's `do_pan_and_scan`) give more pixel entries than images: stock's
    path, for a reason that reads the same for every such batch (warned about once, not once per image count)."""
    from rloo_efficient.core.layers.vision import VISION_FAMILIES, layout_reason

    cfg = tiny_workload(model_cache, arch="gemma3_vlm", image_size=8, num_prompts=8)
    processor, images = build_processing_class(cfg), build_dataset(cfg)["image"]  # 8x8, 16x8, 8x8, ...
    pixels = VISION_FAMILIES["gemma3"]["pixels"]
    crops = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=4, pan_and_scan_max_num_crops=2)

    def reason(rows, **kwargs):
        fields = processor(text=["<start_of_image>"] * len(rows), images=[[images[i]] for i in rows], **kwargs)
        return layout_reason(dict(fields), [1] * len(rows), pixels)

    assert reason([0, 1]) is None and reason([1, 3]) is None
    assert reason([0, 1], **crops) == reason([1, 3, 5], **crops) == "the pixel values are not one entry per image (crops?)"


def test_a_family_without_known_image_placement_runs_stock_saying_so_once_per_path(model_cache, tmp_path,
                                                                                    monkeypatch):  # fmt: skip
    """Image batches of a family not in the vision list: stock's generation and forwards, a warning for each naming
    why; its text-only batches would still share."""
    from rloo_efficient.core.layers import vision

    monkeypatch.delitem(vision.VISION_FAMILIES, "llava")
    cfg = tiny_workload(model_cache, arch="llava", image_size=8, num_prompts=8)
    path, dataset = build_model_dir(cfg), build_dataset(cfg)
    settings = dict(beta=0.1, max_steps=2)
    stock = _train(trl.GRPOTrainer, path, grpo_args(tmp_path / "s", config_class=trl.GRPOConfig, **settings), dataset,
                   build_processing_class(cfg), [])  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = _train(GRPOTrainer, path, grpo_args(tmp_path / "o", **settings), dataset, build_processing_class(cfg), [])
    for phase in ("prompt-prefix sharing is off", "shared generation prefill is off"):
        reasons = [str(w.message) for w in caught if phase in str(w.message)]
        assert len(reasons) == 1 and "image prompts are packed only for" in reasons[0] and "not llava" in reasons[0]
    assert ours.packed_forward_tokens == 0 and ours.shared_prefill_tokens == 0
    assert_same_run(stock, ours)


def test_a_reward_model_over_image_prompts_scores_each_group_once(model_cache, tmp_path, exact_head):
    """TRL scores image prompts with a reward model from their text (its chat template writes no image): each group's
    prompt once, the groups told apart by their images' pixels too."""
    from .helpers import build_reward_model

    reward_path = build_reward_model(tmp_path / "reward", tiny_workload(model_cache))
    stock_tokens = []

    def count(module, args, kwargs):  # the real tokens of the padded rows stock scores
        stock_tokens.append(int(kwargs["attention_mask"].sum()))

    stock, ours = _compare(model_cache, tmp_path, "qwen2_vl", reward=[reward_path, token_reward],
                           before_stock_train=lambda trainer: trainer.reward_funcs[0].register_forward_pre_hook(
                               count, with_kwargs=True))  # fmt: skip
    # Each group's prompt once (k = 4 rows per group, prompts of ~80 tokens and 8-token completions: about 1/3)
    assert 0 < ours.reward_forward_tokens < 0.5 * sum(stock_tokens)


def _processed(processor, texts, images, **template_kwargs):
    """What TRL hands `generate` for these rows: left-padded tokens and token types, the images as the processor
    returns them (`template_kwargs`: the family's `chat_template_kwargs`)."""
    from trl.data_utils import prepare_multimodal_messages

    conversations = [prepare_multimodal_messages([{"role": "user", "content": text}], images=[image])
                     for text, image in zip(texts, images, strict=True)]  # fmt: skip
    out = processor.apply_chat_template(conversation=conversations, add_generation_prompt=True, tokenize=True,
                                        return_dict=True, **template_kwargs)  # fmt: skip
    rows = out["input_ids"]
    width = max(map(len, rows))

    def left_pad(values):
        return torch.tensor([[0] * (width - len(row)) + list(row) for row in values])

    pad_id = processor.tokenizer.pad_token_id
    ids = torch.tensor([[pad_id] * (width - len(row)) + list(row) for row in rows])
    mask = left_pad([[1] * len(row) for row in rows])
    extra = {key: left_pad(value) if key in ("token_type_ids", "mm_token_type_ids") else torch.as_tensor(numpy.asarray(value))
             for key, value in out.items() if key not in ("input_ids", "attention_mask")}  # fmt: skip
    return ids, mask, extra, [list(row) for row in rows]


# Where image prompts decode through `generate`'s loop with `static_decoding`, and why (by family and whether the
# prompt is kept once): Gemma 3's sliding window over a prompt kept once; Gemma 4's layers that read another layer's
# keys (Gemma 3 and 4 prepare their own decoding inputs: generate's, but for the image token types the first step's
# mask reads, which a text token's query does not)
STATIC_ASIDE = {("gemma3_vlm", True): "sliding window over the prompt kept once",
                ("gemma4", True): "layers other than keys and values (SharedPrefixLayer)"}


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("once", [True, False])
@pytest.mark.parametrize("arch", list(VISION))
def test_generation_prefills_each_prompt_and_image_once(model_cache, monkeypatch, arch, once, static):
    """`generate` from the shared prefill with image prompts: the stock call's logits and samples, each distinct
    prompt's image encoded once; the prompt's cache kept once per prompt while decoding, or fanned out to its rows.
    Two rows with the same text and images of the same size but other pixels are two prompts (their tokens are the
    same). With `static`, decoded from static buffers (the multimodal rope's 3-D positions advanced in place), or
    through `generate`'s loop with one warning naming why."""
    from PIL import Image
    from transformers import GenerationConfig

    from rloo_efficient.core.generation import static_checks, static_decode
    from rloo_efficient.core.generation.generate import generate_with_shared_prefill
    from rloo_efficient.demo.tiny_models import model_config, model_from_config
    from rloo_efficient.demo.workload import build_tokenizer

    cfg = tiny_workload(model_cache, arch=arch, **{**VISION[arch], "sliding_window": VISION[arch].get("sliding_window")
                                                   and 8})  # fmt: skip
    dtype = getattr(torch, cfg.model_dtype)
    torch.manual_seed(0)
    model = model_from_config(cfg, model_config(cfg, build_tokenizer(cfg.vocab_size, arch)), dtype).eval()
    pixels = torch.Generator().manual_seed(3)
    one, other = (Image.fromarray(torch.randint(0, 256, (8, 16, 3), generator=pixels, dtype=torch.uint8).numpy())
                  for _ in range(2))  # fmt: skip
    texts = ["Describe the picture.", "Describe the picture.", "What colour?", "Describe the picture."]
    images = [one, other, one, one]  # rows 0 and 3 are one prompt; row 1 has row 0's tokens and other pixels
    rows, images = [0, 1, 2, 3, 1, 2], [images[i] for i in [0, 1, 2, 3, 1, 2]]
    ids, mask, extra, prompt_ids = _processed(build_processing_class(cfg), [texts[i] for i in rows], images,
                                              **SETTINGS.get(arch, {}).get("chat_template_kwargs", {}))  # fmt: skip
    assert prompt_ids[0] == prompt_ids[1] and prompt_ids[0] == prompt_ids[3]

    encoded = []
    encode = model.model.get_image_features

    @functools.wraps(encode)
    def recorded(pixel_values, *args, **kwargs):
        encoded.append(_image_digests(pixel_values, args, kwargs))
        return encode(pixel_values, *args, **kwargs)

    model.model.get_image_features = recorded
    pad = build_tokenizer(cfg.vocab_size, arch).pad_token_id
    config = GenerationConfig(max_new_tokens=12, do_sample=True, top_k=0, pad_token_id=pad, eos_token_id=None)
    kwargs = dict(generation_config=config, output_logits=True, return_dict_in_generate=True, **extra)
    torch.manual_seed(123)
    stock = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    stock_encoded, encoded[:] = list(encoded), []
    static_checks._warnings.clear()
    decoded = []
    decode = static_decode._decode
    monkeypatch.setattr(static_decode, "_decode", lambda *args: decoded.append(1) or decode(*args))
    torch.manual_seed(123)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, prefill_tokens = generate_with_shared_prefill(model, ids, mask, prompt_ids=prompt_ids,
                                                            prompt_cache_once=once, static=static,
                                                            images=[[image] for image in images], **kwargs)  # fmt: skip
    aside = [str(w.message) for w in caught if "static decoding is off" in str(w.message)]
    if static and (arch, once) in STATIC_ASIDE:
        assert len(aside) == 1 and STATIC_ASIDE[arch, once] in aside[0] and not decoded
    else:
        assert not aside and len(decoded) == static
    assert prefill_tokens == 3 * (ids.shape[1] - 1)  # three distinct prompts of six rows
    per_image = 3 if arch == "internvl" else 1  # the tower's inputs per image: itself, or InternVL's 2 tiles and thumbnail
    assert len(stock_encoded) == len(encoded) == 1 and len(stock_encoded[0]) == 6 * per_image
    # each distinct prompt's image once (rows 0, 1, 2 are the three)
    assert encoded[0] == stock_encoded[0][: 3 * per_image]
    assert torch.equal(ours.sequences, stock.sequences)
    tolerance = 1e-6 if dtype == torch.float64 else 1e-4  # generate's logits are float32
    for step, (a, b) in enumerate(zip(stock.logits, ours.logits, strict=True)):
        torch.testing.assert_close(b, a, rtol=tolerance, atol=tolerance, msg=f"step {step}")
