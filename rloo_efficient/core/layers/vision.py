"""
Image prompts once per group: each distinct image encoded once per group, its features placed into the packed prompt
body once.

In the packed prefix tree ([`forward.packing`]) every token is gathered from stock's `(B, P + C)` batch (`source_index`).
Rows group by their prompt tokens and their images' pixels; in an image batch the rows of other groups share nothing,
and each group's prompt is one node, holding the tokens of the group's first row (`first_rows`). So the model gets the
images of each group's first row, in the order of the groups' nodes ([`select_images`]): their features fill the
nodes' placeholder tokens in order of appearance, and the vision tower sees each distinct image once per group (in
training, that one encode receives every completion's gradient). What each family adds:

- **Qwen2-VL, Qwen2.5-VL, Qwen3.5**: 3-D rotary positions, which stock computes inside the model from the padded rows
  (`get_rope_index`: an image's grid, and the text after it offset by the image's rope delta). The rows of a group
  have the same prompt, left-padded alike, and text completions, whose positions continue one per column: the same
  call on each group's first row, its completion columns all unmasked, gives the positions of every row of the group,
  gathered like the tokens ([`packed_positions`]).
- **Gemma 3, Gemma 4**: an image's tokens attend to each other both ways inside the prompt (Gemma 3 on every layer,
  Gemma 4's `use_bidirectional_attention="vision"` on its sliding layers; under a window, as stock combines them:
  (causal or same image) and within the window). The tokens' image blocks ([`token_blocks`], from stock's token
  types gathered like the tokens) go to the attention in the layout: the nodes holding images attend under them.
- **LLaVA, LLaVA-Next, Idefics3, SmolVLM, Mistral 3, LFM2-VL**: positions are the columns, as for text. Mistral 3's
  Pixtral tower reads each image at its own size (`image_sizes`: the batch's pixels are padded to the largest),
  LFM2-VL's SigLIP2 tower each image's patches under its pixel mask at its spatial shape (`pixel_attention_mask`,
  `spatial_shapes`): selected with the images.
"""

import dataclasses
import functools

import numpy as np
import torch
from torch import nn

from ..tree.radix import ranges
from .families import is_multimodal


# Per multimodal family (the checkpoint's `model_type`), how its images and their tokens differ from text:
# - "pixels": how its processor lays out `pixel_values`: "patches" (Qwen: each image's patch rows, as its grid says),
#   "images" (one entry per image) or "rows" (one per row, its images' tiles padded: Idefics3, SmolVLM);
# - "positions": "rope_index" (3-D, from the model's `get_rope_index`) or "columns";
# - "blocks": where image tokens attend to each other both ways: the token-type field, the types that count as an
#   image's (as the model's `get_block_sequence_ids_for_mask` reads them) and the layers ("all" or "sliding"); or None.
_QWEN = dict(pixels="patches", positions="rope_index", blocks=None)
_COLUMNS = dict(positions="columns", blocks=None)
VISION_FAMILIES = {
    "qwen2_vl": _QWEN,
    "qwen2_5_vl": _QWEN,
    "qwen3_5": _QWEN,
    "qwen3_5_moe": _QWEN,
    "qwen3_vl": _QWEN,  # and DeepStack: the tower's features added at the image tokens of the first layers
    "qwen3_vl_moe": _QWEN,
    "glm4v": _QWEN,  # its own position index, the same call
    "glm4v_moe": _QWEN,
    "gemma3": dict(pixels="images", positions="columns", blocks=("token_type_ids", (1,), "all")),
    # Only with use_bidirectional_attention="vision" ([`image_blocks`]); images and videos, not audio
    "gemma4": dict(pixels="images", positions="columns", blocks=("mm_token_type_ids", (1, 2), "sliding")),
    "llava": dict(pixels="images", **_COLUMNS),
    # InternVL: each image cropped to tiles (and a thumbnail), pixel values one entry per tile, TRL's `num_tiles`
    # counting each row's
    "internvl": dict(pixels="tiles", **_COLUMNS),
    "llava_next": dict(pixels="images", **_COLUMNS),
    "idefics3": dict(pixels="rows", **_COLUMNS),
    "smolvlm": dict(pixels="rows", **_COLUMNS),
    "mistral3": dict(pixels="images", **_COLUMNS),  # each image's `image_sizes`
    # Its pixel masks and spatial shapes per image; an image split into tiles (over twice the processor's token budget)
    # gives an entry per tile: stock's path
    "lfm2_vl": dict(pixels="images", **_COLUMNS),
}
# The model kwargs that carry images (what TRL passes a multimodal forward beside the tokens)
IMAGE_KWARGS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                "image_position_ids")  # fmt: skip
# Per-token multimodal fields a processor returns for text too (all zeros there: no token is an image's)
TOKEN_TYPE_FIELDS = ("token_type_ids", "mm_token_type_ids")


def vision_reason(model: nn.Module) -> str | None:
    """Why batches with images cannot be packed for `model`, or None when they can."""
    model_type = model.config.model_type
    if model_type not in VISION_FAMILIES:
        return f"image prompts are packed only for {', '.join(VISION_FAMILIES)}, not {model_type}"
    if model_type == "gemma4" and model.config.get_text_config().use_bidirectional_attention not in (None, "vision"):
        return "its attention is bidirectional everywhere"
    return None


def image_blocks(model: nn.Module) -> tuple | None:
    """`(token-type field, image types, layers)` where `model`'s image tokens attend to each other both ways, or None
    (Gemma 4 only with `use_bidirectional_attention="vision"`: else its stock mask is causal, images included)."""
    family = VISION_FAMILIES[model.config.model_type]
    if model.config.model_type == "gemma4" and model.config.get_text_config().use_bidirectional_attention != "vision":
        return None
    return family["blocks"]


def layout_reason(kwargs: dict, num_images: list[int], pixels: str) -> str | None:
    """Why the image kwargs of a batch are not laid out as the family's processor lays them out (then the batch runs
    stock's path: e.g. Gemma 3's pan-and-scan crops, an entry per crop), or None."""
    entries, total = len(kwargs["pixel_values"]), sum(num_images)  # a tensor's first dimension, or a list's length
    if pixels == "patches":
        grid = kwargs.get("image_grid_thw")
        if grid is None or len(grid) != total:
            return "the image grids do not match the images"
    elif pixels == "images" and entries != total:  # the reason names no counts: it is warned about once
        return "the pixel values are not one entry per image (crops?)"
    elif pixels == "rows" and entries != len(num_images):
        return "the pixel values are not one entry per row"
    elif pixels == "tiles":
        tiles = kwargs.get("num_tiles")
        if tiles is None or len(tiles) != len(num_images) or sum(tiles) != entries:
            return "the pixel values are not the rows' tiles"
    return None


def tiles_per_row(image_tokens: list[int], tiles: int) -> list[int]:
    """Each row's tiles (InternVL: `generate`'s inputs do not count them), from its image tokens: every tile has as
    many, `tiles` of them in all."""
    total = sum(image_tokens)
    return [count * tiles // total for count in image_tokens] if total else [0] * len(image_tokens)


def image_token_ids(model: nn.Module) -> set[int]:
    """The placeholder token ids an image's (or a video's) features replace."""
    config = model.config
    names = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
    return {value for name in names if isinstance(value := getattr(config, name, None), int)}


def image_indices(num_images: list[int], rows) -> np.ndarray:
    """The images of the ordered `rows`, in order, given each row's image count."""
    counts = np.asarray(num_images, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    return ranges((np.cumsum(counts) - counts)[rows], counts[rows])


def select_images(kwargs: dict, num_images: list[int], rows: np.ndarray, pixels: str) -> dict:
    """
    The image kwargs of the ordered `rows` of a batch that `kwargs` and `num_images` (per row) describe, laid out as
    the processor lays out a batch of just those rows, `pixels` as the family's ([`VISION_FAMILIES`], checked by
    [`layout_reason`]): Qwen's patch rows with their grids, one entry per image (with Gemma 4's patch positions,
    LLaVA-Next's and Mistral 3's sizes, LFM2-VL's pixel masks and spatial shapes), or one per row (Idefics3's tiles,
    with their pixel masks), or each row's tiles (InternVL, by `num_tiles`, TRL's count per row). Index arrays are
    built on the host; each tensor is gathered once. Empty when the rows hold no image.
    """
    rows = np.asarray(rows, dtype=np.int64)
    images = image_indices(num_images, rows)
    if images.size == 0:
        return {}

    def take(value, index):
        return value.index_select(0, torch.from_numpy(index).to(value.device))

    pixel_values, out = kwargs["pixel_values"], {}
    if pixels == "tiles":  # each row's tiles, its images' in order ([`layout_reason`] checked them)
        per_row = np.asarray(kwargs["num_tiles"], dtype=np.int64)
        out["pixel_values"] = take(pixel_values, ranges((np.cumsum(per_row) - per_row)[rows], per_row[rows]))
    elif pixels == "patches":  # each image is grid.prod() rows of pixel_values
        grid = kwargs["image_grid_thw"]
        per_image = grid.prod(-1).cpu().numpy()  # small: one entry per image (TRL reads it back too)
        first_patch = np.cumsum(per_image) - per_image
        out.update(pixel_values=take(pixel_values, ranges(first_patch[images], per_image[images])),
                   image_grid_thw=take(grid, images))  # fmt: skip
    else:
        entries = images if pixels == "images" else rows
        out["pixel_values"] = take(pixel_values, entries)
        if kwargs.get("pixel_attention_mask") is not None:  # laid out as the pixels: per row (Idefics3), per image
            out["pixel_attention_mask"] = take(kwargs["pixel_attention_mask"], entries)
    for key in ("image_position_ids", "image_sizes", "spatial_shapes"):  # per image
        if kwargs.get(key) is not None:
            out[key] = take(kwargs[key], images)
    return out


def rope_index_positions(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         kwargs: dict) -> torch.Tensor:  # fmt: skip
    """`(3, B, W)`: the 3-D positions stock's training forward computes for its padded rows (the model's own
    `get_rope_index`, with the batch's images and token types)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    positions, _ = inner.model.get_rope_index(
        input_ids, mm_token_type_ids=kwargs.get("mm_token_type_ids"), image_grid_thw=kwargs.get("image_grid_thw"),
        video_grid_thw=kwargs.get("video_grid_thw"), attention_mask=attention_mask,
    )  # fmt: skip
    return positions


def packed_positions(positions: torch.Tensor, source_index: torch.Tensor) -> torch.Tensor:
    """Stock's `(R, B, W)` positions -> `(R, 1, N)` of the packed tokens."""
    return positions.reshape(positions.shape[0], -1).index_select(1, source_index).unsqueeze(1)


def token_blocks(token_types: torch.Tensor, image_types: tuple[int, ...], source_index: torch.Tensor) -> torch.Tensor:
    """
    `(N,)`: each packed token's image block (runs of image tokens in stock's rows, numbered per row; -1 for text), from
    stock's token types `(B, W)`, `image_types` counting as an image's, gathered like the tokens.
    """
    image = functools.reduce(torch.logical_or, [token_types == kind for kind in image_types])
    starts = image & ~torch.nn.functional.pad(image, (1, 0))[:, :-1]
    blocks = torch.where(image, torch.cumsum(starts.long(), dim=1) - 1, -1)
    return blocks.view(-1).index_select(0, source_index)


@dataclasses.dataclass(frozen=True)
class ModelVision:
    """What a model's image batches need of the packed passes: why they cannot be packed (`reason`; None: they can),
    its family's layout ([`VISION_FAMILIES`], where they can) and its placeholder token ids ([`image_token_ids`])."""

    reason: str | None
    family: dict | None
    image_tokens: frozenset

    @classmethod
    def of(cls, model: nn.Module) -> "ModelVision":
        reason = vision_reason(model) if is_multimodal(model) else "the model has no vision tower"
        family = VISION_FAMILIES[model.config.model_type] if reason is None else None
        return cls(reason, family, frozenset(image_token_ids(model)))

    def batch_reason(self, kwargs: dict) -> str | None:
        """Why a batch's image kwargs (TRL's, `pixel_values` among them) cannot be packed, or None."""
        return self.reason or layout_reason(kwargs, kwargs.get("num_images") or [], self.family["pixels"])


@dataclasses.dataclass
class ImageBatch:
    """
    One packed pass's image batch: TRL's image kwargs (`kwargs`, `num_images` per row among them) for its padded
    `input_ids` and `attention_mask`, `logits_to_keep` columns of them completions, and the (unwrapped) model's vision
    ([`ModelVision`]).
    """

    model: nn.Module
    vision: ModelVision
    kwargs: dict
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int

    @property
    def rows_with_images(self) -> np.ndarray:
        counts = self.kwargs["num_images"]
        return np.asarray(counts.cpu() if isinstance(counts, torch.Tensor) else counts) > 0

    @property
    def with_positions(self) -> bool:
        """Whether the packed rows take their positions from each group's row (Qwen's 3-D positions)."""
        return self.vision.family["positions"] == "rope_index"

    def packed(self, packed, start: int) -> tuple:
        """
        The packed chunk starting at row `start` ([`forward.packing.PackedBatch`], or a held source's): the images of
        each group's first row, once, in the order of the groups' nodes, and what the family needs beside them: Qwen's
        3-D positions (the model's own `get_rope_index` on each group's first row, its completion columns unmasked:
        the rows of a group share their prompt's positions, and completions are text, one position per column), or the
        tokens' image blocks (Gemma). Returns `(packed, image kwargs)`.
        """
        model, images, input_ids, pixels = self.model, self.kwargs, self.input_ids, self.vision.family["pixels"]
        num_images, first = images["num_images"], start + packed.first_rows
        # The images of the groups whose prompt the forward holds (not those a held node holds: encoded before)
        group_images = select_images(images, num_images, start + packed.image_rows, pixels)
        if self.with_positions:  # every group's positions, its images' grids with them
            index = torch.from_numpy(first).to(input_ids.device)
            mask = self.attention_mask.index_select(0, index)
            mask[:, -self.logits_to_keep :] = 1
            grid = group_images.get("image_grid_thw")
            if len(packed.image_rows) < len(first) and images.get("image_grid_thw") is not None:
                grid = images["image_grid_thw"].index_select(
                    0, torch.from_numpy(image_indices(num_images, first)).to(input_ids.device))  # fmt: skip
            token_types = images["mm_token_type_ids"].index_select(0, index)
            positions = rope_index_positions(model, input_ids.index_select(0, index), mask,
                                             {"image_grid_thw": grid, "mm_token_type_ids": token_types})  # fmt: skip
            packed = dataclasses.replace(packed, position_ids=packed_positions(positions, packed.group_source_index))
        blocks = image_blocks(model)
        if blocks is not None and group_images:  # an image's tokens attend to each other both ways
            key, image_types, layers = blocks
            ids = token_blocks(images[key][start : start + packed.num_rows], image_types, packed.source_index)
            packed = dataclasses.replace(packed, layout=dataclasses.replace(packed.layout, token_blocks=ids,
                                                                            blocks_on=layers))  # fmt: skip
        return packed, group_images

    def of_rows(self, start: int, end: int) -> dict:
        """TRL's image kwargs for the rows `[start, end)` alone, as TRL's forward takes them for a batch of those."""
        images = self.kwargs
        out = select_images(images, images["num_images"], np.arange(start, end), self.vision.family["pixels"])
        out["num_images"] = images["num_images"][start:end]
        if images.get("num_tiles") is not None:  # InternVL's: TRL slices the tiles by them
            out["num_tiles"] = images["num_tiles"][start:end]
        for key in TOKEN_TYPE_FIELDS:
            if images.get(key) is not None:
                out[key] = images[key][start:end]
        return out
