"""DiffSynth-Studio's own Wan step with ``use_gradient_checkpointing`` keeps it in stage 2.

``model_fn_wan_video`` loops over the DiT's blocks and calls DiffSynth's
``gradient_checkpoint_forward(block, ...)``, which calls
``torch.utils.checkpoint.checkpoint(create_custom_forward(block), ..., use_reentrant=False)``:
each region is one block call, checkpointed in stage 2 as that block (issue 11, item 5). Needs
``diffsynth`` (see ``tests/conformance/test_diffsynth.py``); skipped with the reason printed
where it cannot import.
"""

from __future__ import annotations

import sys

import pytest

from examples.diffsynth.steps import DIFFSYNTH, WHY_NOT

if not DIFFSYNTH:
    print(f"tests/planning/test_checkpoint_diffsynth.py skipped: {WHY_NOT}", file=sys.stderr)
    pytest.skip(WHY_NOT, allow_module_level=True)

from examples.diffsynth.steps import wan_t2v_lora_step
from tests.planning.test_checkpoint_regions import assert_checkpointed_as_eager

pytestmark = pytest.mark.slow


def test_diffsynths_wan_step_checkpoints_each_dit_block_in_stage_2():
    step, batch = wan_t2v_lora_step(seed=0)
    step.use_gradient_checkpointing = True  # train.py's --use_gradient_checkpointing
    plain, _ = wan_t2v_lora_step(seed=0)
    args = (batch["video"], batch["prompt_ids"], batch["prompt_mask"])
    split = assert_checkpointed_as_eager(step, plain, args, regions=2, exact_saved=False)
    code = split.stage2.code
    assert "torch.utils.checkpoint.checkpoint(pipe_dit_blocks_0_module, " in code
    assert "torch.utils.checkpoint.checkpoint(pipe_dit_blocks_1_module, " in code
