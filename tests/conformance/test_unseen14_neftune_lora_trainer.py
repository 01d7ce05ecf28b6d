"""Conformance: NEFTune (``neftune_noise_alpha=5``) on a PEFT LoRA causal LM, Trainer and by hand.

Upstream: huggingface/transformers ``src/transformers/integrations/neftune.py`` and
``src/transformers/trainer.py``. ``TrainingArguments(neftune_noise_alpha=5)`` makes
``Trainer.train()`` call ``activate_neftune(self.model, self.neftune_noise_alpha,
self.accelerator)`` as training starts (after the model is wrapped, before the first batch):
on a PEFT model that takes ``unwrapped_model.base_model.model.get_input_embeddings()`` (the
token embedding, frozen under LoRA), sets its ``neftune_noise_alpha`` and registers
``neftune_post_forward_hook`` as its forward hook, which in training mode returns::

    dims = torch.tensor(output.size(1) * output.size(2))
    mag_norm = module.neftune_noise_alpha / torch.sqrt(dims)
    output = output + torch.zeros_like(output).uniform_(-mag_norm, mag_norm)

so every step draws new uniform noise on the frozen embedding's output. The loss is the stock
``Trainer.compute_loss`` (no label smoother, no ``compute_loss_func``): ``outputs =
model(**inputs)``, ``loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]``
(copied below as the step). The LoRA is PEFT's documented one (``LoraConfig(r=4,
lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")``); the batches are
``run_clm.py``'s fixed blocks (``labels`` a copy of ``input_ids``) through
``default_data_collator``. TRL's ``SFTTrainer`` takes the same ``neftune_noise_alpha`` from
``TrainingArguments`` and leaves the hook to ``Trainer.train()``.

What must hold: the noise is never frozen into the cache (the frozen embedding's clean output
may be, the hook then runs on it in stage 2 and draws new noise every step, as unsplit), the
loss and every LoRA gradient bit for bit against the unsplit step under the same seed, on the
example and on a batch of another size; a cache written through the disk trains stage 2
exactly, twice over with different seeds (two epochs, two noises).

Two ways in:

- by hand: the loop body split with ``graphsplit.split`` after the hook is registered as
  ``activate_neftune`` registers it (verbatim). Passes: the whole-step trace refuses (a
  tensor value read in ``LlamaModel.forward`` at its ``self.embed_tokens(input_ids)`` line,
  where the hook runs), the module-level path caches ``embed_tokens``' forward (the clean
  embedding) and runs the hook on the answer in stage 2.
- ``split_trainer`` (caching first, and caching while training): trains as the plain NEFTune
  Trainer, losses, grad norms and weights bit for bit. It used to be a silent wrong result:
  ``split_trainer`` planned before ``train()`` attached the hook, so the trace cached the
  clean embeddings and the split run trained without NEFTune; it now plans with the hook on.

Tiny config: Llama 32 wide, 2 layers, 2 heads (1 KV head), 64 tokens, blocks of 8.
"""

from __future__ import annotations

import pytest
import torch

import graphsplit

pytest.importorskip("transformers")
pytest.importorskip("peft")

from accelerate.state import AcceleratorState
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
    default_data_collator,
)
from transformers.integrations.neftune import neftune_post_forward_hook

from graphsplit.integrations.transformers import split_trainer
from tests.conformance.unseen2_data_checks import (
    assert_cache_round_trip,
    assert_same_step,
)
from tests.conformance.unseen_checks import loss_and_grads
from tests.helpers import assert_stage1_holds_no_trainable, tiny_llama_config

VOCAB = 64
block_size = 8
NEFTUNE_NOISE_ALPHA = 5


@pytest.fixture(autouse=True)
def _one_thread_and_fresh_accelerate_state():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.set_num_threads(threads)


def _lora_model():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB))
    peft_config = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, peft_config)
    with torch.no_grad():  # LoRA B starts at zero; move it so the adapters' gradients all flow
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return model


def _train_dataset(size: int = 16, seed: int = 0) -> Dataset:
    """``run_clm.py``'s ``group_texts`` output: blocks of ``block_size`` tokens, labels a copy."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (size, block_size), generator=generator).tolist()
    return Dataset.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": [[1] * block_size] * size,
            "labels": [list(row) for row in input_ids],
        }
    )


def _batch(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    rows = _train_dataset(size, seed)
    return default_data_collator([rows[i] for i in range(size)])


def activate_neftune_by_hand(unwrapped_model, neftune_noise_alpha):
    """``transformers.integrations.neftune.activate_neftune``'s body for a PEFT model."""
    embeddings = unwrapped_model.base_model.model.get_input_embeddings()
    embeddings.neftune_noise_alpha = neftune_noise_alpha
    hook_handle = embeddings.register_forward_hook(neftune_post_forward_hook)
    return hook_handle


_BUILT: dict[str, tuple] = {}


def _by_hand():
    if "hand" not in _BUILT:
        model = _lora_model()
        model.train()  # Trainer.train() -> model.train() before the loop
        activate_neftune_by_hand(model, NEFTUNE_NOISE_ALPHA)

        def compute_loss(inputs):  # Trainer.compute_loss, its plain branch
            outputs = model(**inputs)
            # We don't use .loss here since the model may return tuples instead of ModelOutput.
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
            return loss

        split = graphsplit.split(compute_loss, (_batch(4),))
        params = [p for p in model.parameters() if p.requires_grad]
        _BUILT["hand"] = (model, compute_loss, split, params)
    return _BUILT["hand"]


def test_neftune_by_hand_verifies_on_the_example_and_another_size():
    _model, step, split, _params = _by_hand()
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(4), _batch(3, seed=1)]):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_neftune_noise_is_not_cached_and_the_embedding_is():
    """Stage 1 draws nothing: its outputs are the same under two seeds, and the embedding it
    caches is the clean lookup (no noise); stage 2 holds no embedding weight, and runs the
    hook on the cached lookup: a new noise under each seed, each the unsplit step's."""
    model, step, split, params = _by_hand()
    batch = _batch(4)
    torch.manual_seed(0)
    first = split.stage1(**batch)
    torch.manual_seed(1)
    second = split.stage1(**batch)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first), (
        "stage 1 output moves with the seed"
    )
    embeds = [k for k in first if "embed_tokens" in k]
    assert len(embeds) == 1, list(first)
    embedding = model.base_model.model.get_input_embeddings()
    with torch.no_grad():
        assert torch.equal(first[embeds[0]], embedding.weight[batch["input_ids"]])
    held = [name for name, _ in split.stage2.named_parameters()]
    assert not [name for name in held if "embed_tokens" in name], held
    # two epochs over the same cached batch: two noises, each as the unsplit step draws it
    losses = []
    for seed in (0, 1):
        assert_same_step(lambda: step(batch), lambda: split.stage2(**first), params, seed)
        losses.append(loss_and_grads(lambda: split.stage2(**first), params, seed)[0])
    assert not torch.equal(losses[0], losses[1]), "the same noise in both epochs"


def test_neftune_by_hand_cache_round_trip(tmp_path):
    _model, step, split, params = _by_hand()
    loader = [_batch(4, seed=2), _batch(4, seed=3), _batch(2, seed=4)]
    assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)


def _trainer(output_dir: str, neftune_noise_alpha) -> Trainer:
    training_args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_train_epochs=2,
        learning_rate=1e-2,
        logging_steps=1,
        seed=3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        neftune_noise_alpha=neftune_noise_alpha,
    )
    return Trainer(
        model=_lora_model(),
        args=training_args,
        train_dataset=_train_dataset(),
        data_collator=default_data_collator,
    )


def _logged(trainer, *keys):
    return [tuple(e[k] for k in keys) for e in trainer.state.log_history if "loss" in e]


@pytest.mark.parametrize("live", [False, True], ids=["cached-first", "cache-while-training"])
def test_split_trainer_with_neftune_trains_as_the_plain_trainer(tmp_path, live):
    """It used to train without NEFTune, silently: split_trainer planned before train()
    attached the hook, so the whole-step trace cached the clean embeddings and the frozen work
    after them, and stage 2 never called the embedding module. split_trainer now plans with
    the hook attached as train() will (trainer_loss.neftune_as_train) and removes it again."""
    plain = _trainer(str(tmp_path / "plain"), NEFTUNE_NOISE_ALPHA)
    plain.train()
    trainer = _trainer(str(tmp_path / "split"), NEFTUNE_NOISE_ALPHA)
    parts = split_trainer(trainer, str(tmp_path / "cache"), cache_while_training=live)
    embeddings = trainer.model.base_model.model.get_input_embeddings()
    assert not embeddings._forward_hooks  # train() attaches its own, once
    assert not hasattr(embeddings, "neftune_noise_alpha")
    assert parts.split.path == "calls"  # the hook runs on the cached embedding in stage 2
    trainer.train()
    assert len(_logged(trainer, "loss")) == len(_logged(plain, "loss")) == 8
    assert _logged(trainer, "loss", "grad_norm") == _logged(plain, "loss", "grad_norm")
    one, other = plain.model.state_dict(), trainer.model.state_dict()
    assert all(torch.equal(one[k], other[k]) for k in one)
    if not live:
        assert parts.cached is not None and len(parts.cached) == len(trainer.train_dataset)
