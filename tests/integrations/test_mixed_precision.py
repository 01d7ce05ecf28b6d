"""``split_trainer`` with mixed precision (``bf16=True``), as the plain trainer trains.

``train()`` has accelerate's ``prepare_model`` wrap the student's ``forward`` in a bfloat16
autocast; ``split_trainer`` plans and caches before ``train()``, so it wraps the forward the
same way while it does (``graphsplit.integrations.trainer_loss.prepared_forward``). Without
that, a frozen module inside the student (a VLM's vision tower) was cached in float32 and the
trace's stage 2 ran the student's work without the autocast.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")


from graphsplit.integrations.trainer_loss import TrainerLoss, prepared_forward
from graphsplit.integrations.transformers import split_trainer
from tests.integrations.kd import logged_losses, make_trainer, padded_samples


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trainer(folder, **arguments):
    trainer = make_trainer(str(folder), padded_samples(8), num_train_epochs=1, **arguments)
    trainer.model.model.embed_tokens.requires_grad_(False)
    trainer.model.model.layers[0].requires_grad_(False)  # frozen work inside the forward
    return trainer


def _same_weights(one, other):
    one, other = one.model.state_dict(), other.model.state_dict()
    return one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


def test_bf16_split_trainer_trains_as_the_plain_trainer(tmp_path):
    plain = _trainer(tmp_path / "plain", bf16=True)
    assert plain.accelerator.native_amp
    plain.train()
    trainer = _trainer(tmp_path / "split", bf16=True)
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()
    assert [key for key in parts.split.boundary if "layers" in key]  # the frozen layer cached
    assert logged_losses(trainer) == logged_losses(plain)
    assert _same_weights(trainer, plain)

    fp32 = _trainer(tmp_path / "fp32")  # the autocast matters here: float32 trains otherwise
    fp32.train()
    assert logged_losses(fp32) != logged_losses(plain)


def test_the_forward_is_wrapped_while_planning_and_put_back(tmp_path):
    trainer = _trainer(tmp_path, bf16=True)
    model = trainer.model
    assert "forward" not in vars(model)
    seen = []
    model.model.register_forward_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    with prepared_forward(trainer, model):
        model(input_ids=torch.ones(1, 4, dtype=torch.long))
        assert "forward" in vars(model)
    assert "forward" not in vars(model)  # the class's forward again
    model(input_ids=torch.ones(1, 4, dtype=torch.long))
    assert seen == [True, False]
    plain = _trainer(tmp_path / "fp32")
    with prepared_forward(plain, plain.model):  # no mixed precision: nothing wrapped
        assert "forward" not in vars(plain.model)
    assert isinstance(TrainerLoss(trainer)._trainer, type(trainer))
