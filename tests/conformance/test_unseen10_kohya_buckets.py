"""Conformance: kohya-ss/sd-scripts' aspect-ratio buckets, a dataset whose item is a whole batch.

``train_network.py`` (SD 1.x LoRA, ``--enable_bucket``) builds its data in
``library/train_util.py``: ``BucketManager`` (with ``model_util.make_bucket_resolutions``)
assigns each image to the predefined resolution of nearest aspect ratio,
``BaseDataset.make_buckets`` cuts each bucket into ``BucketBatchIndex`` batches and shuffles them
with ``random.seed(self.seed + self.current_epoch)``, and ``BaseDataset.__getitem__(index)``
returns a *whole batch* of one bucket: ``images`` (one resolution), ``input_ids_list`` (a list
holding one ``(b, n, 77)`` tensor), ``loss_weights``, ``original_sizes_hw`` /
``crop_top_lefts`` / ``target_sizes_hw`` (``(b, 2)`` int64), ``captions``, ``flippeds``,
``custom_attributes`` (a dict per image), and ``None`` for ``latents``, ``alpha_masks`` and
``text_encoder_outputs_list``. The script's ``DataLoader`` has ``batch_size=1`` and
``collator_class``, which returns ``examples[0]``. The step is
``NetworkTrainer.process_batch`` (``train_network.py``) with the helpers it calls
(``get_noise_noisy_latents_and_timesteps``, ``get_timesteps``, ``conditional_loss``,
``SdTextEncodingStrategy.encode_tokens``), all copied from sd-scripts at commit 48d368fa
(default arguments: no noise offset, no v-parameterization, ``loss_type="l2"``, no SNR).

Copied trimmed: the dataset keeps only the code paths the defaults take (images in memory, no
latent or text-encoder-output cache, no face crop, no colour augmentation, ``flip_aug=False``,
``random_crop=False``); ``resize_image`` uses PIL for both of kohya's interpolations (cv2 is
not installed). Tiny SD 1.x pieces from ``tests.zoo`` with random weights; buckets of
resolutions divisible by 8 between 16 and 48 pixels.

What the user meets: the script's own loader (``shuffle=True``) is refused naming the sampler;
with ``shuffle=False`` the loader's items are batches of two rows for one dataset index, refused
naming the fix (pass the batches as an iterable); the iterable is cached exactly (loss and
gradients bit for bit for every batch; the default path is the module-level one: the trace
refuses the step), and ``CachedDataset.loader`` covers every sample once per epoch. Stage 2
batches by resolution alone: the unread ``captions`` list is stored per row as code points
padded to its raw batch's longest caption (its boundary spec's ``pad_dim``), so the cache's
buckets ignore that width and ``graphsplit.collate`` pads the rows of one resolution with zeros
to the batch's longest caption; stage 2 decodes them to the very captions.
"""

# ruff: noqa: SIM108, SIM201, RUF019, RUF046, RUF059 (kohya's code, as written)
from __future__ import annotations

import math
import multiprocessing
import random
import types
from typing import NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import graphsplit
from graphsplit.errors import CacheError
from tests.conformance.unseen2_data_checks import (
    assert_cache_round_trip,
    assert_epoch_covers_each_sample_once,
)
from tests.conformance.unseen_checks import stage2_top_modules
from tests.zoo import CaptionedImages, build_sd_lora_step
from tests.zoo.data import tokenize

PIL_Image = pytest.importorskip("PIL.Image")

_STEP = build_sd_lora_step(seed=0)
vae, text_encoder, unet, noise_scheduler = (
    _STEP.vae,
    _STEP.text_encoder,
    _STEP.unet,
    _STEP.scheduler,
)
PARAMS = [param for param in unet.parameters() if param.requires_grad]
MAX_TOKENS = 16  # the zoo's CLIP; kohya's 77

args = types.SimpleNamespace(  # train_network.py's defaults
    vae_batch_size=None,
    noise_offset=None,
    noise_offset_random_strength=False,
    adaptive_noise_scale=None,
    multires_noise_iterations=None,
    multires_noise_discount=0.3,
    min_timestep=None,
    max_timestep=None,
    ip_noise_gamma=None,
    ip_noise_gamma_random_strength=False,
    gradient_checkpointing=False,
    v_parameterization=False,
    loss_type="l2",
    huber_schedule="snr",
    huber_c=0.1,
    huber_scale=1.0,
    masked_loss=False,
    weighted_captions=False,
    full_fp16=False,
    min_snr_gamma=None,
    scale_v_pred_loss_like_noise_pred=False,
    v_pred_like_loss=None,
    debiased_estimation_loss=False,
)


# --- library/model_util.py and library/train_util.py: buckets ------------------------------


def make_bucket_resolutions(max_reso, min_size=256, max_size=1024, divisible=64):
    max_width, max_height = max_reso
    max_area = max_width * max_height

    resos = set()

    width = int(math.sqrt(max_area) // divisible) * divisible
    resos.add((width, width))

    width = min_size
    while width <= max_size:
        height = min(max_size, int((max_area // width) // divisible) * divisible)
        if height >= min_size:
            resos.add((width, height))
            resos.add((height, width))
        width += divisible

    resos = list(resos)
    resos.sort()
    return resos


class BucketManager:
    def __init__(self, no_upscale, max_reso, min_size, max_size, reso_steps) -> None:
        self.no_upscale = no_upscale
        if max_reso is None:
            self.max_reso = None
            self.max_area = None
        else:
            self.max_reso = max_reso
            self.max_area = max_reso[0] * max_reso[1]
        self.min_size = min_size
        self.max_size = max_size
        self.reso_steps = reso_steps

        self.resos = []
        self.reso_to_id = {}
        self.buckets = []

    def add_image(self, reso, image_or_info):
        bucket_id = self.reso_to_id[reso]
        self.buckets[bucket_id].append(image_or_info)

    def shuffle(self):
        for bucket in self.buckets:
            random.shuffle(bucket)

    def sort(self):
        sorted_resos = self.resos.copy()
        sorted_resos.sort()

        sorted_buckets = []
        sorted_reso_to_id = {}
        for i, reso in enumerate(sorted_resos):
            bucket_id = self.reso_to_id[reso]
            sorted_buckets.append(self.buckets[bucket_id])
            sorted_reso_to_id[reso] = i

        self.resos = sorted_resos
        self.buckets = sorted_buckets
        self.reso_to_id = sorted_reso_to_id

    def make_buckets(self):
        resos = make_bucket_resolutions(
            self.max_reso, self.min_size, self.max_size, self.reso_steps
        )
        self.set_predefined_resos(resos)

    def set_predefined_resos(self, resos):
        self.predefined_resos = resos.copy()
        self.predefined_resos_set = set(resos)
        self.predefined_aspect_ratios = np.array([w / h for w, h in resos])

    def add_if_new_reso(self, reso):
        if reso not in self.reso_to_id:
            bucket_id = len(self.resos)
            self.reso_to_id[reso] = bucket_id
            self.resos.append(reso)
            self.buckets.append([])

    def select_bucket(self, image_width, image_height):  # the not-no_upscale branch
        aspect_ratio = image_width / image_height
        reso = (image_width, image_height)
        if reso in self.predefined_resos_set:
            pass
        else:
            ar_errors = self.predefined_aspect_ratios - aspect_ratio
            predefined_bucket_id = np.abs(ar_errors).argmin()
            reso = self.predefined_resos[predefined_bucket_id]

        ar_reso = reso[0] / reso[1]
        if aspect_ratio > ar_reso:  # 横が長い→縦を合わせる
            scale = reso[1] / image_height
        else:
            scale = reso[0] / image_width

        resized_size = (int(image_width * scale + 0.5), int(image_height * scale + 0.5))
        self.add_if_new_reso(reso)

        ar_error = (reso[0] / reso[1]) - aspect_ratio
        return reso, resized_size, ar_error

    @staticmethod
    def get_crop_ltrb(bucket_reso, image_size):
        bucket_ar = bucket_reso[0] / bucket_reso[1]
        image_ar = image_size[0] / image_size[1]
        if bucket_ar > image_ar:
            resized_width = bucket_reso[1] * image_ar
            resized_height = bucket_reso[1]
        else:
            resized_width = bucket_reso[0]
            resized_height = bucket_reso[0] / image_ar
        crop_left = (bucket_reso[0] - resized_width) // 2
        crop_top = (bucket_reso[1] - resized_height) // 2
        crop_right = crop_left + resized_width
        crop_bottom = crop_top + resized_height
        return crop_left, crop_top, crop_right, crop_bottom


class BucketBatchIndex(NamedTuple):
    bucket_index: int
    bucket_batch_size: int
    batch_index: int


def resize_image(image, width, height, resized_width, resized_height):  # PIL for both
    box = PIL_Image.Resampling.BOX if width >= resized_width else PIL_Image.Resampling.LANCZOS
    return np.asarray(PIL_Image.fromarray(image).resize((resized_width, resized_height), box))


def trim_and_resize_if_required(random_crop, image, reso, resized_size):
    image_height, image_width = image.shape[0:2]
    original_size = (image_width, image_height)  # size before resize

    if image_width != resized_size[0] or image_height != resized_size[1]:
        image = resize_image(image, image_width, image_height, resized_size[0], resized_size[1])

    image_height, image_width = image.shape[0:2]

    if image_width > reso[0]:
        trim_size = image_width - reso[0]
        p = trim_size // 2 if not random_crop else random.randint(0, trim_size)
        image = image[:, p : p + reso[0]]
    if image_height > reso[1]:
        trim_size = image_height - reso[1]
        p = trim_size // 2 if not random_crop else random.randint(0, trim_size)
        image = image[p : p + reso[1]]

    crop_ltrb = BucketManager.get_crop_ltrb(reso, original_size)

    assert image.shape[0] == reso[1] and image.shape[1] == reso[0], (
        f"internal error, illegal trimmed size: {image.shape}, {reso}"
    )
    return image, original_size, crop_ltrb


class ImageInfo:
    def __init__(self, image_key, caption, image, is_reg=False):
        self.image_key = image_key
        self.caption = caption
        self.image = image  # HWC uint8, in memory
        self.is_reg = is_reg
        self.image_size = (image.shape[1], image.shape[0])
        self.bucket_reso = None
        self.resized_size = None
        self.num_repeats = 1


class BucketedImages(torch.utils.data.Dataset):
    """``BaseDataset``'s ``make_buckets``, ``shuffle_buckets`` and ``__getitem__`` on the
    defaults' paths (see the module docstring)."""

    def __init__(self, image_data, batch_size, seed=0):
        self.image_data = image_data
        self.batch_size = batch_size
        self.seed = seed
        self.current_epoch = 0
        self.current_step = 0
        self.prior_loss_weight = 1.0
        self.network_multiplier = 1.0
        self.flip_aug = False
        self.random_crop = False
        self.bucket_manager = None
        self.width, self.height = 32, 32
        self.min_bucket_reso, self.max_bucket_reso, self.bucket_reso_steps = 16, 48, 8
        self.make_buckets()

    def set_current_epoch(self, epoch):
        if not self.current_epoch == epoch:  # epochが切り替わったらバケツをシャッフルする
            if epoch > self.current_epoch:
                num_epochs = epoch - self.current_epoch
                for _ in range(num_epochs):
                    self.current_epoch += 1
                    self.shuffle_buckets()
            self.current_epoch = epoch

    def set_current_step(self, step):
        self.current_step = step

    def make_buckets(self):
        self.bucket_manager = BucketManager(
            False,
            (self.width, self.height),
            self.min_bucket_reso,
            self.max_bucket_reso,
            self.bucket_reso_steps,
        )
        self.bucket_manager.make_buckets()
        for image_info in self.image_data.values():
            image_width, image_height = image_info.image_size
            image_info.bucket_reso, image_info.resized_size, ar_error = (
                self.bucket_manager.select_bucket(image_width, image_height)
            )
        self.bucket_manager.sort()

        for image_info in self.image_data.values():
            for _ in range(image_info.num_repeats):
                self.bucket_manager.add_image(image_info.bucket_reso, image_info.image_key)

        self.buckets_indices = []
        for bucket_index, bucket in enumerate(self.bucket_manager.buckets):
            batch_count = int(math.ceil(len(bucket) / self.batch_size))
            for batch_index in range(batch_count):
                self.buckets_indices.append(
                    BucketBatchIndex(bucket_index, self.batch_size, batch_index)
                )

        self.shuffle_buckets()
        self._length = len(self.buckets_indices)

    def shuffle_buckets(self):
        # set random seed for this epoch
        random.seed(self.seed + self.current_epoch)

        random.shuffle(self.buckets_indices)
        self.bucket_manager.shuffle()

    def __len__(self):
        return self._length

    def __getitem__(self, index):
        bucket = self.bucket_manager.buckets[self.buckets_indices[index].bucket_index]
        bucket_batch_size = self.buckets_indices[index].bucket_batch_size
        image_index = self.buckets_indices[index].batch_index * bucket_batch_size

        loss_weights = []
        captions = []
        input_ids_list = []
        images = []
        original_sizes_hw = []
        crop_top_lefts = []
        target_sizes_hw = []
        flippeds = []
        custom_attributes = []

        for image_key in bucket[image_index : image_index + bucket_batch_size]:
            image_info = self.image_data[image_key]
            custom_attributes.append({})
            loss_weights.append(self.prior_loss_weight if image_info.is_reg else 1.0)
            flipped = self.flip_aug and random.random() < 0.5

            img, original_size, crop_ltrb = trim_and_resize_if_required(
                self.random_crop, image_info.image, image_info.bucket_reso, image_info.resized_size
            )
            if flipped:
                img = img[:, ::-1, :].copy()
            img = img[:, :, :3]
            # image_transforms: ToTensor + Normalize([0.5], [0.5])
            image = torch.from_numpy(img.astype(np.float32) / 127.5 - 1.0).permute(2, 0, 1)
            images.append(image)

            target_size = (image.shape[2], image.shape[1])
            if not flipped:
                crop_left_top = (crop_ltrb[0], crop_ltrb[1])
            else:
                crop_left_top = (target_size[0] - crop_ltrb[2], crop_ltrb[1])

            original_sizes_hw.append((int(original_size[1]), int(original_size[0])))
            crop_top_lefts.append((int(crop_left_top[1]), int(crop_left_top[0])))
            target_sizes_hw.append((int(target_size[1]), int(target_size[0])))
            flippeds.append(flipped)

            caption = image_info.caption
            # SdTokenizeStrategy.tokenize: (1, n, 77) per caption; the batch dim removed
            input_ids = [ids[0] for ids in [tokenize(caption, MAX_TOKENS)[None, None]]]
            input_ids_list.append(input_ids)
            captions.append(caption)

        example = {}
        example["custom_attributes"] = custom_attributes
        example["loss_weights"] = torch.FloatTensor(loss_weights)
        example["text_encoder_outputs_list"] = None
        example["input_ids_list"] = [torch.stack([x[0] for x in input_ids_list])]
        example["alpha_masks"] = None
        images = torch.stack(images)
        images = images.to(memory_format=torch.contiguous_format).float()
        example["images"] = images
        example["latents"] = None
        example["captions"] = captions
        example["original_sizes_hw"] = torch.stack([torch.LongTensor(x) for x in original_sizes_hw])
        example["crop_top_lefts"] = torch.stack([torch.LongTensor(x) for x in crop_top_lefts])
        example["target_sizes_hw"] = torch.stack([torch.LongTensor(x) for x in target_sizes_hw])
        example["flippeds"] = flippeds
        example["network_multipliers"] = torch.FloatTensor(
            [self.network_multiplier] * len(captions)
        )
        return example


class collator_class:  # kohya's name
    def __init__(self, epoch, step, dataset):
        self.current_epoch = epoch
        self.current_step = step
        self.dataset = dataset

    def __call__(self, examples):
        worker_info = torch.utils.data.get_worker_info()
        if worker_info is not None:
            dataset = worker_info.dataset
        else:
            dataset = self.dataset

        dataset.set_current_epoch(self.current_epoch.value)
        dataset.set_current_step(self.current_step.value)
        return examples[0]


SHAPES = [(64, 64), (60, 36)]


def photos(count_per_shape: int = 4) -> dict[str, ImageInfo]:
    """Images of two aspect ratios (W x H: 64x64 and 60x36), captions from the zoo."""
    source = CaptionedImages(length=len(SHAPES) * count_per_shape, resolution=64)
    data = {}
    for index in range(len(SHAPES) * count_per_shape):
        pixels = source[index]["pixel_values"]
        array = ((pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
        array = array.permute(1, 2, 0).numpy()
        width, height = SHAPES[index % len(SHAPES)]
        image = np.asarray(PIL_Image.fromarray(array).resize((width, height)))
        key = f"img{index:02d}"
        data[key] = ImageInfo(key, source.caption_of(index), image)
    return data


def script_loader(dataset, shuffle=True):
    """train_network.py's DataLoader (``n_workers`` 0 here)."""
    current_epoch = multiprocessing.Value("i", 0)
    current_step = multiprocessing.Value("i", 0)
    collator = collator_class(current_epoch, current_step, dataset)
    return DataLoader(dataset, batch_size=1, shuffle=shuffle, collate_fn=collator, num_workers=0)


# --- train_util.py and train_network.py: the step ----------------------------------------------


def get_timesteps(min_timestep, max_timestep, b_size, device):
    if min_timestep < max_timestep:
        timesteps = torch.randint(min_timestep, max_timestep, (b_size,), device="cpu")
    else:
        timesteps = torch.full((b_size,), max_timestep, device="cpu")
    timesteps = timesteps.long().to(device)
    return timesteps


def get_noise_noisy_latents_and_timesteps(args, noise_scheduler, latents):
    # Sample noise that we'll add to the latents
    noise = torch.randn_like(latents, device=latents.device)
    # (noise_offset, multires noise: off by default)

    # Sample a random timestep for each image
    b_size = latents.shape[0]
    min_timestep = 0 if args.min_timestep is None else args.min_timestep
    max_timestep = (
        noise_scheduler.config.num_train_timesteps
        if args.max_timestep is None
        else args.max_timestep
    )
    timesteps = get_timesteps(min_timestep, max_timestep, b_size, latents.device)

    if args.ip_noise_gamma:
        raise NotImplementedError  # off by default
    else:
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

    # This moves the alphas_cumprod back to the CPU after it is moved in noise_scheduler.add_noise
    noise_scheduler.alphas_cumprod = noise_scheduler.alphas_cumprod.cpu()

    return noise, noisy_latents, timesteps


def conditional_loss(model_pred, target, loss_type, reduction, huber_c=None):
    if loss_type == "l2":
        loss = torch.nn.functional.mse_loss(model_pred, target, reduction=reduction)
    elif loss_type == "l1":
        loss = torch.nn.functional.l1_loss(model_pred, target, reduction=reduction)
    else:
        raise NotImplementedError(f"Unsupported Loss Type: {loss_type}")
    return loss


def encode_tokens(tokenize_strategy, models, tokens):  # SdTextEncodingStrategy, clip_skip None
    text_encoder = models[0]
    tokens = tokens[0]
    sd_tokenize_strategy = tokenize_strategy

    # tokens: b,n,77
    b_size = tokens.size()[0]
    max_token_length = tokens.size()[1] * tokens.size()[2]
    model_max_length = sd_tokenize_strategy.tokenizer.model_max_length
    tokens = tokens.reshape((-1, model_max_length))  # batch_size*3, 77

    tokens = tokens.to(text_encoder.device)
    encoder_hidden_states = text_encoder(tokens)[0]

    # bs*3, 77, 768 or 1024
    encoder_hidden_states = encoder_hidden_states.reshape(
        (b_size, -1, encoder_hidden_states.shape[-1])
    )
    if max_token_length != model_max_length:
        raise NotImplementedError  # the 3x77-token merge, not taken at --max_token_length 75
    return [encoder_hidden_states]


tokenize_strategy = types.SimpleNamespace(
    tokenizer=types.SimpleNamespace(model_max_length=MAX_TOKENS)
)


def training_step(batch):
    """``NetworkTrainer.process_batch`` (SD 1.x, ``train_text_encoder=False``)."""
    with torch.no_grad():
        if "latents" in batch and batch["latents"] is not None:
            latents = batch["latents"]
        else:
            # latentに変換
            if args.vae_batch_size is None or len(batch["images"]) <= args.vae_batch_size:
                latents = vae.encode(batch["images"]).latent_dist.sample()
            else:
                chunks = [
                    batch["images"][i : i + args.vae_batch_size]
                    for i in range(0, len(batch["images"]), args.vae_batch_size)
                ]
                list_latents = []
                for chunk in chunks:
                    with torch.no_grad():
                        chunk = vae.encode(chunk).latent_dist.sample()
                        list_latents.append(chunk)
                latents = torch.cat(list_latents, dim=0)

            # NaNが含まれていれば警告を表示し0に置き換える
            if torch.any(torch.isnan(latents)):
                print("NaN found in latents, replacing with zeros")
                latents = torch.nan_to_num(latents, 0, out=latents)

        latents = latents * vae.config.scaling_factor

    text_encoder_conds = []
    text_encoder_outputs_list = batch.get("text_encoder_outputs_list", None)
    if text_encoder_outputs_list is not None:
        text_encoder_conds = text_encoder_outputs_list

    if len(text_encoder_conds) == 0 or text_encoder_conds[0] is None:
        with torch.set_grad_enabled(False):
            input_ids = [ids for ids in batch["input_ids_list"]]
            encoded_text_encoder_conds = encode_tokens(tokenize_strategy, [text_encoder], input_ids)
        if len(text_encoder_conds) == 0:
            text_encoder_conds = encoded_text_encoder_conds

    # get_noise_pred_and_target
    noise, noisy_latents, timesteps = get_noise_noisy_latents_and_timesteps(
        args, noise_scheduler, latents
    )
    with torch.set_grad_enabled(True):
        noise_pred = unet(
            noisy_latents.requires_grad_(True), timesteps, text_encoder_conds[0]
        ).sample
    target = noise
    if "custom_attributes" in batch:
        diff_output_pr_indices = []
        for i, custom_attributes in enumerate(batch["custom_attributes"]):
            if (
                "diff_output_preservation" in custom_attributes
                and custom_attributes["diff_output_preservation"]
            ):
                diff_output_pr_indices.append(i)
        assert not diff_output_pr_indices  # off by default

    loss = conditional_loss(noise_pred.float(), target.float(), args.loss_type, "none", None)
    if args.masked_loss or ("alpha_masks" in batch and batch["alpha_masks"] is not None):
        raise NotImplementedError  # off by default
    loss = loss.mean(dim=list(range(1, loss.ndim)))  # mean over all dims except batch

    loss_weights = batch["loss_weights"]  # 各sampleごとのweight
    loss = loss * loss_weights
    return loss.mean()


# --- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset():
    return BucketedImages(photos(), batch_size=2, seed=0)


@pytest.fixture(scope="module")
def split(dataset):
    first = script_loader(dataset, shuffle=False)
    return graphsplit.split(training_step, (next(iter(first)),))


def test_buckets_are_two_resolutions_of_whole_batches(dataset):
    loader = script_loader(dataset, shuffle=False)
    shapes = [tuple(batch["images"].shape) for batch in loader]
    assert len(shapes) == 4
    assert {shape[2:] for shape in shapes} == {(32, 32), (24, 40)}
    assert {shape[0] for shape in shapes} == {2}


def test_split_verifies_and_stage2_holds_only_the_lora_unet(split, dataset):
    loader = script_loader(dataset, shuffle=False)
    batches = list(loader)
    graphsplit.verify(training_step, split, (batches[0],))
    other = next(b for b in batches if b["images"].shape[2:] != batches[0]["images"].shape[2:])
    graphsplit.verify(training_step, split, (other,))
    assert stage2_top_modules(split) == {"unet"}
    assert all(name.startswith("unet.") for name in split.stage2.state_dict())


def test_the_script_s_shuffled_loader_is_refused_naming_the_sampler(split, dataset, tmp_path):
    with pytest.raises(CacheError, match="shuffles") as caught:
        graphsplit.cache(split, script_loader(dataset, shuffle=True), tmp_path / "c")
    assert "shuffle=False" in str(caught.value)


def test_an_item_that_is_a_batch_is_refused_naming_the_iterable_fix(split, dataset, tmp_path):
    with pytest.raises(CacheError) as caught:
        graphsplit.cache(split, script_loader(dataset, shuffle=False), tmp_path / "c")
    message = str(caught.value)
    assert "holds 2 rows but its sampler gave 1 dataset indices" in message
    assert "(batch for batch in loader)" in message


class Again:
    """The script's loader's batches as an iterable (the fix the refusal names), one that can
    be iterated again: the round trip reads the raw batches, then caches them."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        return (batch for batch in script_loader(self.dataset, shuffle=False))


def test_the_batches_as_an_iterable_cache_exactly(split, dataset, tmp_path):
    cached = assert_cache_round_trip(
        split, training_step, Again(dataset), tmp_path / "cache", PARAMS
    )
    assert len(cached) == 8
    stage2 = cached.loader(batch_size=2, seed=0)
    for epoch in range(2):
        assert_epoch_covers_each_sample_once(cached, stage2, epoch)


def test_stage2_batches_by_resolution_only(split, dataset, tmp_path):
    graphsplit.cache(split, Again(dataset), tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    by_resolution: dict[tuple, list[int]] = {}
    for index in range(len(cached)):
        size = tuple(cached.shapes(index)["vae_quant_conv__0__out"])
        by_resolution.setdefault(size, []).append(index)
    assert len(by_resolution) == 2
    captions = [caption for batch in Again(dataset) for caption in batch["captions"]]
    (spec,) = [spec for spec in split.plan.inputs if spec.name == "captions"]
    widths = {tuple(cached.shapes(index)["captions"]) for index in range(len(cached))}
    assert len(widths) > 1  # rows of raw batches whose longest captions differ
    for indices in by_resolution.values():
        rows = graphsplit.collate([cached[index] for index in indices])
        assert rows["loss_weights"].shape == (4,)
        assert spec.decode(rows["captions"]) == [captions[index] for index in indices]
    assert len(cached.buckets()) == 2
