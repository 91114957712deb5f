"""
Each multimodal family's processor, built offline around the workload's byte tokenizer ([`build_processor`]): the
family's image processor on PIL (no torchvision here: transformers exports the video processors, Pixtral's processor
and LFM2-VL's image processor only with it), sized for the tiny vision towers of [`demo.tiny_models`].
"""

import types


LLAVA_TILE = 8  # LLaVA's tiny CLIP tower: 8x8 images in patches of 2 (16 tokens); LLaVA-Next's tiles of that size
LLAVA_PINPOINTS = [[8, 8], [8, 16], [16, 8], [16, 16]]


def build_processor(cfg, tokenizer):
    """A multimodal family's processor: `tokenizer` (the workload's, with the family's image tokens) and the family's
    image processor (the PIL one: no torchvision here). Qwen's processors demand a video processor, which transformers
    exports only with torchvision: the test processor accepts none."""
    import transformers

    template = dict(chat_template=tokenizer.chat_template)
    if cfg.arch == "gemma3_vlm":  # 16x16 images: 16 patches of 4, pooled to 4 tokens
        return transformers.Gemma3Processor(image_processor=transformers.Gemma3ImageProcessorPil(
            size={"height": 16, "width": 16}), tokenizer=tokenizer, image_seq_length=4, **template)  # fmt: skip
    if cfg.arch in ("qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe"):
        processor = _without_video({"qwen2_vl": transformers.Qwen2VLProcessor,
                                    "qwen2_5_vl": transformers.Qwen2_5_VLProcessor}.get(cfg.arch,
                                                                                        transformers.Qwen3VLProcessor))
        # The tiny tower's patches of 2, merged 2x2 (an 8x8 image: a grid of 4x4 patches, 4 tokens; 148x148: 1369
        # tokens, what a 1024x1024 screenshot gives the real tower), small images kept, up to 4M pixels
        image_processor = transformers.Qwen2VLImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=2,
                                                                size={"shortest_edge": 16, "longest_edge": 1 << 22})
        return processor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None, **template)
    if cfg.arch in ("glm4v", "glm4v_moe"):  # the tiny tower's patches of 2, merged 2x2, as Qwen's above
        image_processor = transformers.Glm4vImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=2,
                                                              size={"shortest_edge": 16, "longest_edge": 1 << 22})
        return _without_video(transformers.Glm4vProcessor)(image_processor=image_processor, tokenizer=tokenizer,
                                                          video_processor=None, **template)  # fmt: skip
    if cfg.arch == "internvl":  # each image cropped to tiles of 8 (a 16x8 image: 2 and a thumbnail), 4 tokens a tile
        image_processor = transformers.GotOcr2ImageProcessorPil(size={"height": 8, "width": 8}, crop_to_patches=True,
                                                                min_patches=1, max_patches=4)  # fmt: skip
        return _without_video(transformers.InternVLProcessor)(image_processor=image_processor, tokenizer=tokenizer,
                                                             video_processor=None, image_seq_length=4, **template)
    if cfg.arch in ("llava", "llava_next"):  # CLS dropped ("default"): (8 / 2)^2 = 16 tokens per image or tile
        size = dict(size={"shortest_edge": LLAVA_TILE}, crop_size={"height": LLAVA_TILE, "width": LLAVA_TILE})
        if cfg.arch == "llava":
            image_processor, processor = transformers.CLIPImageProcessorPil(**size), transformers.LlavaProcessor
        else:
            image_processor = transformers.LlavaNextImageProcessorPil(**size, image_grid_pinpoints=LLAVA_PINPOINTS)
            processor = transformers.LlavaNextProcessor
        return processor(image_processor=image_processor, tokenizer=tokenizer, patch_size=2,
                         vision_feature_select_strategy="default", num_additional_image_tokens=1, **template)
    if cfg.arch in ("idefics3", "smolvlm"):  # tiles of 8 pixels (4 tokens each) and the whole image, at most 16 a side
        size = dict(size={"longest_edge": 16}, max_image_size={"longest_edge": 8})
        if cfg.arch == "idefics3":
            return transformers.Idefics3Processor(image_processor=transformers.Idefics3ImageProcessorPil(**size),
                                                  tokenizer=tokenizer, image_seq_len=4, **template)  # fmt: skip
        processor = _without_video(transformers.SmolVLMProcessor)(
            image_processor=transformers.SmolVLMImageProcessorPil(**size), tokenizer=tokenizer, video_processor=None,
            image_seq_len=4, **template)  # fmt: skip
        # Its apply_chat_template reads the video sampling defaults even for images (SmolVLM's: 64 frames at 1 fps)
        processor.video_processor = types.SimpleNamespace(num_frames=64, fps=1)
        return processor
    if cfg.arch == "mistral3":  # Pixtral's sizes: at most 16 pixels a side, in multiples of a merged patch (4)
        return _pixtral_processor()(image_processor=transformers.PixtralImageProcessorPil(size={"longest_edge": 16}),
                                    tokenizer=tokenizer, patch_size=2, spatial_merge_size=2, **template)  # fmt: skip
    if cfg.arch == "lfm2_vl":
        return transformers.Lfm2VlProcessor(image_processor=lfm2_vl_image_processor(), tokenizer=tokenizer,
                                            **template)  # fmt: skip
    from transformers.models.gemma4 import feature_extraction_gemma4, image_processing_pil_gemma4

    return _without_video(transformers.Gemma4Processor)(
        feature_extractor=feature_extraction_gemma4.Gemma4AudioFeatureExtractor(),
        image_processor=image_processing_pil_gemma4.Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2,
                                                                            max_soft_tokens=70),
        tokenizer=tokenizer, video_processor=None, image_seq_length=4, **template,
    )  # fmt: skip


def _without_video(processor_class):
    """`processor_class` accepting `video_processor=None`: `ProcessorMixin` type-checks every part against
    `VideoProcessorMixin`, which transformers exports only with torchvision."""

    class Processor(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return type(None)
            return super().check_argument_for_proper_class(argument_name, argument)

    Processor.__name__ = Processor.__qualname__ = processor_class.__name__
    return Processor


def _pixtral_processor():
    """transformers' `PixtralProcessor` (Mistral 3's). Its export requires torchvision, and its module imports the
    torchvision image processor for one helper it reads only to count a serving request's tokens
    (`_get_num_multimodal_tokens`): the module is imported as without PIL, which skips that import alone."""
    import importlib
    import sys
    from unittest import mock

    name = "transformers.models.pixtral.processing_pixtral"
    if name not in sys.modules:
        with mock.patch("transformers.utils.is_vision_available", return_value=False):
            importlib.import_module(name)
    return sys.modules[name].PixtralProcessor


def lfm2_vl_image_processor():
    """
    LFM2-VL's image processor on PIL (transformers has only a torchvision one), as the tiny tower's: patches of 2, 2x2
    of them one token, 4 to 8 tokens an image. Each image is resized as `Lfm2VlImageProcessor.smart_resize` sizes it
    (sides in multiples of 4: the 8x8 and 16x8 test images keep theirs, whose pixel values are then the real one's),
    cut into patches and padded to 32 of them (`pixel_values`, `pixel_attention_mask`, `spatial_shapes`: one entry per
    image). Images are not split into tiles (`do_image_splitting=False`; the real processor splits only an image over
    twice its token budget).
    """
    import math

    import numpy as np
    from transformers import Siglip2ImageProcessorPil
    from transformers.image_processing_utils import BatchFeature
    from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, SizeDict
    from transformers.models.siglip2.image_processing_pil_siglip2 import convert_image_to_patches, pad_along_first_dim
    from transformers.processing_utils import ImagesKwargs

    class Lfm2VlImageProcessorKwargs(ImagesKwargs, total=False):  # what Lfm2VlProcessor and TRL pass
        downsample_factor: int
        do_image_splitting: bool
        min_tiles: int
        max_tiles: int
        use_thumbnail: bool
        min_image_tokens: int
        max_image_tokens: int
        encoder_patch_size: int
        tile_size: int
        max_pixels_tolerance: float
        return_row_col_info: bool

    class Lfm2VlImageProcessorPil(Siglip2ImageProcessorPil):
        valid_kwargs = Lfm2VlImageProcessorKwargs
        image_mean, image_std = IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD
        downsample_factor, encoder_patch_size, min_image_tokens, max_image_tokens = 2, 2, 4, 8
        do_image_splitting, min_tiles, max_tiles, use_thumbnail, tile_size = False, 1, 1, True, 8
        max_pixels_tolerance, return_row_col_info = 2.0, False

        def _preprocess(self, images, resample, do_rescale, rescale_factor, do_normalize, image_mean, image_std,
                        return_tensors, downsample_factor, encoder_patch_size, min_image_tokens, max_image_tokens,
                        return_row_col_info=False, **kwargs):  # fmt: skip
            factor, patch = downsample_factor, encoder_patch_size
            total, max_patches = patch * factor, max_image_tokens * factor**2
            low, high = (tokens * patch**2 * factor**2 for tokens in (min_image_tokens, max_image_tokens))
            data = {"pixel_values": [], "pixel_attention_mask": [], "spatial_shapes": [], "image_sizes": []}
            for image in images:  # (C, H, W)
                height, width = image.shape[-2:]
                # Lfm2VlImageProcessor.smart_resize (transformers 5.24)
                h_bar, w_bar = (max(total, round(side / total) * total) for side in (height, width))
                if h_bar * w_bar > high:
                    beta = math.sqrt(height * width / high)
                    h_bar, w_bar = (max(total, math.floor(side / beta / total) * total) for side in (height, width))
                elif h_bar * w_bar < low:
                    beta = math.sqrt(low / (height * width))
                    h_bar, w_bar = (math.ceil(side * beta / total) * total for side in (height, width))
                if (h_bar, w_bar) != (height, width):  # PIL's bilinear, where the real one resizes with torchvision's
                    image = self.resize(image=image, size=SizeDict(height=h_bar, width=w_bar), resample=resample)
                if do_rescale and do_normalize:  # fused as the torchvision backend fuses them: the same float32 values
                    image = self.normalize(image.astype(np.float32), [m * (1.0 / rescale_factor) for m in image_mean],
                                           [s * (1.0 / rescale_factor) for s in image_std])  # fmt: skip
                elif do_rescale:
                    image = self.rescale(image, rescale_factor)
                elif do_normalize:
                    image = self.normalize(image, image_mean, image_std)
                patches, mask = pad_along_first_dim(convert_image_to_patches(image, patch), max_patches)
                data["pixel_values"].append(patches)
                data["pixel_attention_mask"].append(mask)
                data["spatial_shapes"].append((h_bar // patch, w_bar // patch))
                data["image_sizes"].append([h_bar, w_bar])
            if return_row_col_info:  # one tile each
                data.update(image_rows=[1] * len(images), image_cols=[1] * len(images))
            else:
                del data["image_sizes"]
            return BatchFeature(data=data, tensor_type=return_tensors)

    return Lfm2VlImageProcessorPil()
