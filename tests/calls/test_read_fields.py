"""The module-level path stores only the output fields stage 2 reads (``calls/usage.py``).

Diffusers' SDXL / SD3 scripts call their CLIP text encoders with ``output_hidden_states=True``
and read ``hidden_states[-2]`` and the pooled embedding: every other hidden state must stay out
of the cache. Stage 2 rebuilds the output with a guarded ``meta`` stand-in in each unstored
field (``calls/field_reads.py``): the structure reads as before, a shape the step reads is the
batch's own, and computing with a stand-in raises, naming the call, the field and the fix.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import graphsplit
from graphsplit.units import human_bytes
from tests.helpers import line_of, split_and_verify, tiny_llama_config

WIDTH, LAYERS, PROJECTION = 16, 3, 8


def _clip(with_projection: bool, seed: int) -> nn.Module:
    config = transformers.CLIPTextConfig(
        vocab_size=64,
        hidden_size=WIDTH,
        intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        max_position_embeddings=12,
        projection_dim=PROJECTION,
        bos_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = (
        transformers.CLIPTextModelWithProjection if with_projection else transformers.CLIPTextModel
    )
    return model(config).eval().requires_grad_(False)


def _ids(size: int, length: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (size, length), generator=torch.Generator().manual_seed(seed))


class SDXLPrompt(nn.Module):
    """SDXL's ``encode_prompt`` (train_text_to_image_lora_sdxl.py), its two CLIP encoders
    called with ``return_dict=False``, then a trainable head standing for the UNet."""

    def __init__(self) -> None:
        super().__init__()
        self.text_encoders = nn.ModuleList([_clip(False, 1), _clip(True, 2)])
        torch.manual_seed(3)
        self.head = nn.Linear(2 * WIDTH, PROJECTION)

    def forward(self, input_ids):
        prompt_embeds_list = []
        for text_encoder in self.text_encoders:
            prompt_embeds = text_encoder(input_ids, output_hidden_states=True, return_dict=False)
            pooled_prompt_embeds = prompt_embeds[0]
            prompt_embeds = prompt_embeds[-1][-2]
            bs_embed, seq_len, _ = prompt_embeds.shape
            prompt_embeds = prompt_embeds.view(bs_embed, seq_len, -1)
            prompt_embeds_list.append(prompt_embeds)
        prompt_embeds = torch.concat(prompt_embeds_list, dim=-1)
        pooled_prompt_embeds = pooled_prompt_embeds.view(bs_embed, -1)
        return (self.head(prompt_embeds).mean(1) * pooled_prompt_embeds).square().mean()


class SD3Prompt(nn.Module):
    """SD3's ``_encode_prompt_with_clip`` (train_dreambooth_lora_sd3.py): a ``ModelOutput``
    read by ``[0]`` (``text_embeds``) and ``.hidden_states[-2]``."""

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = _clip(True, 1)
        torch.manual_seed(3)
        self.head = nn.Linear(WIDTH, PROJECTION)
        self.last = False  # a flag the user flips after split (see the refusal below)

    def forward(self, input_ids):
        prompt_embeds = self.text_encoder(input_ids, output_hidden_states=True)
        pooled_prompt_embeds = prompt_embeds[0]
        prompt_embeds = prompt_embeds.hidden_states[-1 if self.last else -2]
        return (self.head(prompt_embeds).mean(1) * pooled_prompt_embeds).square().mean()


def _stored(split) -> list[str]:
    return [key for key, spec in split.boundary.items() if spec.source != "input"]


def test_sdxl_prompt_stores_only_hidden_states_minus_two_and_the_pooled_embedding():
    step = SDXLPrompt()
    split = split_and_verify(step, (_ids(3),), path="calls")
    penultimate = LAYERS - 1  # hidden_states holds the embeddings and each layer's output
    assert _stored(split) == [
        f"text_encoders_0__0__2__{penultimate}",  # CLIP-L: [0] is overwritten, never read
        "text_encoders_1__0__0",  # CLIP-G's text_embeds, the pooled embedding
        f"text_encoders_1__0__2__{penultimate}",
    ]
    fields = 2 + (LAYERS + 1)  # [0], [1] and the hidden states, per encoder
    assert len(split.plan.not_stored) == 2 * fields - 3
    other = _ids(2, seed=5)
    assert all(c.ok for c in graphsplit.verify(step, split, (other,)))
    report = split.report()
    stored = sum(spec.bytes_per_sample for spec in split.boundary.values())
    unread = sum(spec.bytes_per_sample for spec in split.plan.not_stored.values())
    assert unread > 3 * stored  # the hidden states not read, the last hidden states, CLIP-L's
    assert (
        f"not stored (stage 2 never reads them): 9 output fields, {human_bytes(unread)} per "
        f"sample; storing every field would take {human_bytes(stored + unread)} per sample"
    ) in report
    assert "stores 2 of its 6 output fields; not stored, stage 2 never computes with them: " in (
        report
    )


def test_sd3_prompt_stores_two_fields_and_its_cache_trains_bit_for_bit(tmp_path):
    step = SD3Prompt()
    split = split_and_verify(step, (_ids(2),), path="calls")
    assert _stored(split) == ["text_encoder__0__text_embeds", "text_encoder__0__hidden_states__2"]
    report = split.report()
    assert "not stored (stage 2 never reads them): 4 output fields, " in report
    rows = _ids(4, seed=7)
    loader = torch.utils.data.DataLoader([{"input_ids": row} for row in rows], batch_size=2)
    graphsplit.cache(split, loader, tmp_path / "cache")
    cached = graphsplit.CachedDataset(tmp_path / "cache")
    reference = copy.deepcopy(step)
    for first in (0, 2):
        batch = torch.utils.data.default_collate([cached[first], cached[first + 1]])
        loss = split.stage2(**batch)
        expected = reference(rows[first : first + 2])
        loss.backward()
        expected.backward()
        assert torch.equal(loss, expected)
        for (name, param), other in zip(step.head.named_parameters(), reference.head.parameters()):
            assert torch.equal(param.grad, other.grad), name
        for module in (step, reference):  # a training step: the next batch sees new weights
            with torch.no_grad():
                for param in module.head.parameters():
                    param -= 0.1 * param.grad
                    param.grad = None


class Distills(nn.Module):
    """A distillation step (TRL's GKD / a KD trainer): the teacher's ``.logits`` only."""

    def __init__(self, **teacher_kwargs) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.teacher = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
        self.teacher.requires_grad_(False)
        self.student = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64))
        self.teacher_kwargs = teacher_kwargs

    def forward(self, input_ids):
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids, **self.teacher_kwargs).logits
        student = torch.log_softmax(self.student(input_ids), -1)
        return torch.nn.functional.kl_div(
            student, torch.log_softmax(teacher_logits, -1), log_target=True, reduction="batchmean"
        )


@pytest.mark.parametrize(
    "teacher_kwargs",
    [{"output_hidden_states": True, "use_cache": False}, {"output_hidden_states": True}],
    ids=["hidden-states", "hidden-states-and-cache"],
)
def test_a_teacher_read_for_its_logits_stores_its_logits_only(teacher_kwargs):
    step = Distills(**teacher_kwargs)
    split = split_and_verify(step, (_ids(2, 6),), path="calls")
    assert _stored(split) == ["teacher__0__logits"]
    assert all(c.ok for c in graphsplit.verify(step, split, (_ids(3, 5, seed=4),)))


class ReadsALengthOnly(SD3Prompt):
    """The step reads only the sequence length of ``last_hidden_state``."""

    def forward(self, input_ids):
        output = self.text_encoder(input_ids, output_hidden_states=True)
        tokens = output.last_hidden_state.shape[1]
        embeds = output.hidden_states[-2]
        return (self.head(embeds).sum(1) / tokens * output.text_embeds).square().mean()


def test_a_field_read_for_its_shape_only_is_a_placeholder_with_the_batch_shape():
    step = ReadsALengthOnly()
    split = split_and_verify(step, (_ids(2),), path="calls")
    assert _stored(split) == [
        "text_encoder__0__text_embeds",
        "text_encoder__0__last_hidden_state__shape",
        "text_encoder__0__hidden_states__2",
    ]
    assert split.boundary["text_encoder__0__last_hidden_state__shape"].bytes_per_sample == 3 * 8
    for other in (_ids(3, 5, seed=1), _ids(1, 9, seed=2)):  # other batch sizes and lengths
        assert all(c.ok for c in graphsplit.verify(step, split, (other,)))


def test_computing_with_a_field_the_plan_did_not_store_is_refused_naming_it():
    step = SD3Prompt()
    split = graphsplit.split(step, (_ids(2),), path="calls")
    step.last = True  # now the step reads hidden_states[-1], which no probe read
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage2(**split.stage1(_ids(2)))
    message = str(caught.value)
    assert (
        "the step reads the values of text_encoder call 0's hidden_states__3 (linear()), "
        "which the module-level plan does not store: the example batch's step never read it"
    ) in message
    assert "split with an example batch whose step reads the same fields" in message
    assert line_of(SD3Prompt, "return (self.head(prompt_embeds)") in message


class ReadsAShapeLater(SD3Prompt):
    def forward(self, input_ids):
        output = self.text_encoder(input_ids, output_hidden_states=True)
        if self.last:
            assert output.last_hidden_state.shape[1] == input_ids.shape[1]
        embeds = output.hidden_states[-2]
        return (self.head(embeds).mean(1) * output.text_embeds).square().mean()


def test_reading_the_shape_of_a_field_whose_shape_is_not_stored_is_refused():
    step = ReadsAShapeLater()
    split = graphsplit.split(step, (_ids(2),), path="calls")
    step.last = True
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage2(**split.stage1(_ids(2)))
    assert ("the step reads the shape of text_encoder call 0's last_hidden_state (.shape)") in str(
        caught.value
    )


def test_a_batch_whose_samples_had_different_shapes_of_a_shape_read_field_is_refused():
    split = graphsplit.split(ReadsALengthOnly(), (_ids(2),), path="calls")
    batch = split.stage1(_ids(2))
    batch["text_encoder__0__last_hidden_state__shape"][1, 1] = 5  # a sample of another length
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage2(**batch)
    assert (
        "the samples of this batch had text_encoder call 0's last_hidden_state of different "
        "shapes ([(1, 5, 16), (1, 7, 16)])"
    ) in str(caught.value)


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


class ReadsOneLaterOne(nn.Module):
    """The encoder's first output is read only by ``post``, itself cached (a VAE's encoder
    read by its ``quant_conv``); its second by the step, which writes it in place."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = TwoOutputs().requires_grad_(False)
        self.post = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        hidden, aux = self.encoder(x)
        aux.mul_(2)  # not idempotent: stage 2 must write into a copy of the cached field
        return self.head(self.post(hidden) + aux).square().mean()


def test_a_field_only_a_later_cached_call_reads_is_not_stored_and_a_written_one_is_copied():
    step = ReadsOneLaterOne()
    x = torch.randn(3, 4)
    split = split_and_verify(step, (x,), path="calls")
    assert _stored(split) == ["encoder__0__1", "post__0__out"]
    assert list(split.plan.not_stored) == ["encoder__0__0"]
    assert split.plan.cached[("encoder", 0)].copied == ("1",)
    boundary = split.stage1(x)
    kept = boundary["encoder__0__1"].clone()
    for _ in range(2):  # a second epoch reads the cached field as stage 1 wrote it
        assert torch.equal(split.stage2(**boundary), step(x))
        assert torch.equal(boundary["encoder__0__1"], kept)


def test_a_shape_stored_for_a_field_crosses_the_cache_on_disk(tmp_path):
    step = ReadsALengthOnly()
    split = graphsplit.split(step, (_ids(2),), path="calls")
    rows = _ids(4, 5, seed=9)  # another length than the example's
    loader = torch.utils.data.DataLoader([{"input_ids": row} for row in rows], batch_size=2)
    graphsplit.cache(split, loader, tmp_path / "cache")
    cached = graphsplit.CachedDataset(tmp_path / "cache")
    assert cached[0]["text_encoder__0__last_hidden_state__shape"].tolist() == [1, 5, WIDTH]
    for first in (0, 2):
        batch = torch.utils.data.default_collate([cached[first], cached[first + 1]])
        assert torch.equal(split.stage2(**batch), step(rows[first : first + 2]))


class DistillsFromALayer(Distills):
    """Reads ``.logits`` and ``.hidden_states`` by name (the output holds a ``DynamicCache``,
    so only the fields read by name are kept), then one hidden state of them."""

    def forward(self, input_ids):
        with torch.no_grad():
            output = self.teacher(input_ids, output_hidden_states=True)
        student = self.student(input_ids)
        return (student - output.logits).square().mean() + output.hidden_states[1].mean()


def test_a_teacher_output_kept_in_part_by_name_stores_only_the_hidden_state_read():
    step = DistillsFromALayer()
    split = split_and_verify(step, (_ids(2, 6),), path="calls")
    assert _stored(split) == ["teacher__0__logits", "teacher__0__hidden_states__1"]
    assert set(split.plan.not_stored) == {
        "teacher__0__hidden_states__0",
        "teacher__0__hidden_states__2",
    }
    assert all(c.ok for c in graphsplit.verify(step, split, (_ids(3, 5, seed=4),)))
